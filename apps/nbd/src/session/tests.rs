use super::*;
use crate::client::*;

fn exports() -> Arc<[ExportInfo]> {
    vec![
        ExportInfo {
            name: "mem".into(),
            description: "RAM".into(),
            size_bytes: 1 << 20,
            flags: TFLAG_HAS_FLAGS
                | TFLAG_SEND_FLUSH
                | TFLAG_SEND_FUA
                | TFLAG_SEND_TRIM
                | TFLAG_SEND_WRITE_ZEROES,
            block_bytes: 512,
            preferred_bytes: 4096,
            restricted: false,
        },
        ExportInfo {
            name: "ro".into(),
            description: String::new(),
            size_bytes: 4096,
            flags: TFLAG_HAS_FLAGS,
            block_bytes: 4096,
            preferred_bytes: 4096,
            restricted: false,
        },
    ]
    .into()
}

/// Feeds `input` whole and collects every step until the session needs more or closes.
fn run(s: &mut Session, input: &[u8], out: &mut Vec<u8>) -> (Vec<Step>, usize) {
    let mut at = 0;
    let mut steps = Vec::new();
    loop {
        let (n, step) = s.step(&input[at..], out);
        at += n;
        match step {
            Step::NeedMore => return (steps, at),
            Step::Close(_) => {
                steps.push(step);
                return (steps, at);
            }
            other => steps.push(other),
        }
    }
}

fn new_session(out: &mut Vec<u8>) -> Session {
    Session::new(exports(), Limits::default(), out)
}

/// Splits a stream of option replies into (option, reply type, data).
fn option_replies(mut b: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
    let mut v = Vec::new();
    while !b.is_empty() {
        assert_eq!(be_u64(b), OPT_REPLY_MAGIC);
        let len = be_u32(&b[16..]) as usize;
        v.push((be_u32(&b[8..]), be_u32(&b[12..]), b[20..20 + len].to_vec()));
        b = &b[20 + len..];
    }
    v
}

#[test]
fn greeting_is_fixed_newstyle_without_zeroes() {
    let mut out = Vec::new();
    let _ = new_session(&mut out);
    assert_eq!(out.len(), GREETING_BYTES);
    assert_eq!(be_u64(&out), NBD_MAGIC);
    assert_eq!(be_u64(&out[8..]), IHAVEOPT);
    assert_eq!(be_u16(&out[16..]), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
}

#[test]
fn go_replies_block_size_then_export_then_ack() {
    let mut out = Vec::new();
    let mut s = new_session(&mut out);
    out.clear();
    let (steps, used) = run(&mut s, &handshake_go("mem"), &mut out);
    assert_eq!(used, handshake_go("mem").len());
    assert_eq!(steps.last(), Some(&Step::Ready { export: 0 }));
    let replies = option_replies(&out);
    assert_eq!(replies.len(), 3);
    assert_eq!(replies[0].1, REP_INFO);
    assert_eq!(be_u16(&replies[0].2), INFO_BLOCK_SIZE);
    assert_eq!(be_u32(&replies[0].2[2..]), 512);
    assert_eq!(be_u32(&replies[0].2[10..]), REQUEST_BYTES_MAX_DEFAULT);
    assert_eq!(be_u16(&replies[1].2), INFO_EXPORT);
    assert_eq!(be_u64(&replies[1].2[2..]), 1 << 20);
    assert_eq!(replies[2], (OPT_GO, REP_ACK, vec![]));
    assert_eq!(s.export(), Some(0));
}

#[test]
fn list_names_every_export_and_info_does_not_end_the_handshake() {
    let mut out = Vec::new();
    let mut s = new_session(&mut out);
    out.clear();
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE);
    input.extend(option(OPT_LIST, &[]));
    input.extend(info_or_go(OPT_INFO, "ro", &[INFO_NAME, INFO_DESCRIPTION]));
    input.extend(info_or_go(OPT_INFO, "nope", &[]));
    let (steps, used) = run(&mut s, &input, &mut out);
    assert_eq!(used, input.len());
    assert!(steps.iter().all(|s| *s == Step::Negotiating));
    let replies = option_replies(&out);
    let servers: Vec<_> = replies.iter().filter(|r| r.1 == REP_SERVER).collect();
    assert_eq!(servers.len(), 2);
    assert_eq!(&servers[0].2[4..7], b"mem");
    assert_eq!(&servers[0].2[7..], b"RAM");
    assert_eq!(&servers[1].2[4..], b"ro");
    let infos: Vec<_> = replies
        .iter()
        .filter(|r| r.0 == OPT_INFO && r.1 == REP_INFO)
        .collect();
    assert_eq!(be_u16(&infos[0].2), INFO_NAME);
    assert_eq!(&infos[0].2[2..], b"ro");
    assert_eq!(be_u16(&infos[2].2), INFO_EXPORT);
    assert_eq!(replies.last().unwrap().1, REP_ERR_UNKNOWN);
    assert_eq!(s.export(), None);
}

#[test]
fn export_name_pads_with_zeroes_unless_the_client_declines() {
    for (flags, pad) in [
        (FLAG_C_FIXED_NEWSTYLE, EXPORT_NAME_PAD_BYTES),
        (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES, 0),
    ] {
        let mut out = Vec::new();
        let mut s = new_session(&mut out);
        out.clear();
        let mut input = client_flags(flags);
        input.extend(option(OPT_EXPORT_NAME, b""));
        let (steps, _) = run(&mut s, &input, &mut out);
        assert_eq!(
            steps.last(),
            Some(&Step::Ready { export: 0 }),
            "default export"
        );
        assert_eq!(out.len(), 10 + pad);
        assert_eq!(be_u64(&out), 1 << 20);
    }
}

#[test]
fn unknown_options_get_unsup_and_bad_ones_close() {
    let mut out = Vec::new();
    let mut s = new_session(&mut out);
    out.clear();
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE);
    input.extend(option(OPT_STRUCTURED_REPLY, &[]));
    input.extend(option(0xdead, b"xyz"));
    input.extend(option(OPT_GO, &[0, 0, 0, 9]));
    let (steps, _) = run(&mut s, &input, &mut out);
    assert_eq!(steps.len(), 4);
    let kinds: Vec<u32> = option_replies(&out).iter().map(|r| r.1).collect();
    assert_eq!(kinds, [REP_ERR_UNSUP, REP_ERR_UNSUP, REP_ERR_INVALID]);

    // A wrong magic closes.
    let mut bad = option(OPT_LIST, &[]);
    bad[0] ^= 1;
    let (steps, _) = run(&mut s, &bad, &mut out);
    assert!(matches!(
        steps.last(),
        Some(Step::Close(Close::Protocol(_)))
    ));
    assert!(s.is_closed());

    // Unknown client flags close; so does an over-long option.
    let mut s = new_session(&mut out);
    let (steps, _) = run(&mut s, &client_flags(1 << 7), &mut out);
    assert!(matches!(steps[0], Step::Close(Close::Protocol(_))));
    let mut s = new_session(&mut out);
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE);
    input.extend(option(OPT_LIST, &[]));
    input.truncate(input.len() - 4);
    input.extend((OPTION_BYTES_MAX_DEFAULT + 1).to_be_bytes());
    let (steps, _) = run(&mut s, &input, &mut out);
    assert!(matches!(
        steps.last(),
        Some(Step::Close(Close::Protocol(_)))
    ));
}

#[test]
fn abort_acks_and_closes() {
    let mut out = Vec::new();
    let mut s = new_session(&mut out);
    out.clear();
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE);
    input.extend(option(OPT_ABORT, &[]));
    let (steps, _) = run(&mut s, &input, &mut out);
    assert_eq!(steps.last(), Some(&Step::Close(Close::Abort)));
    assert_eq!(option_replies(&out), [(OPT_ABORT, REP_ACK, vec![])]);
}

#[test]
fn too_many_options_close() {
    let mut out = Vec::new();
    let mut s = new_session(&mut out);
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE);
    for _ in 0..=OPTIONS_MAX_DEFAULT {
        input.extend(option(OPT_LIST, &[]));
    }
    let (steps, _) = run(&mut s, &input, &mut out);
    assert_eq!(steps.len(), OPTIONS_MAX_DEFAULT as usize + 2);
    assert!(matches!(
        steps.last(),
        Some(Step::Close(Close::Protocol(_)))
    ));
}

fn ready(export: &str) -> Session {
    let mut out = Vec::new();
    let mut s = new_session(&mut out);
    let (steps, _) = run(&mut s, &handshake_go(export), &mut out);
    assert!(matches!(steps.last(), Some(Step::Ready { .. })));
    s
}

#[test]
fn fua_is_accepted_on_every_command_and_ignored_where_nothing_is_written() {
    // The protocol: once SEND_FUA is advertised the server MUST accept FUA on all commands
    // (qemu's old client set it on every flush).
    let mut s = ready("mem");
    let mut out = Vec::new();
    for (kind, op, length, fua) in [
        (CMD_READ, Op::Read, 4096, false),
        (CMD_FLUSH, Op::Flush, 0, false),
        (CMD_TRIM, Op::Trim, 4096, true),
    ] {
        let input = request(kind, CMD_FLAG_FUA, 9, 0, length);
        let (n, step) = s.step(&input, &mut out);
        assert_eq!(n, input.len());
        let Step::Request(r) = step else {
            panic!("{kind}: {step:?}")
        };
        assert_eq!((r.op, r.fua), (op, fua), "{kind}");
        assert!(out.is_empty(), "{kind}: refused");
    }
}

#[test]
fn requests_parse_with_their_payload_only_once_it_is_whole() {
    let mut s = ready("mem");
    let mut out = Vec::new();
    let mut input = request(CMD_WRITE, CMD_FLAG_FUA, 7, 4096, 1024);
    input.extend(vec![0xab; 1024]);
    for cut in [0, 27, 28, 500, 1051] {
        assert_eq!(
            s.step(&input[..cut], &mut out),
            (0, Step::NeedMore),
            "{cut}"
        );
    }
    let (n, step) = s.step(&input, &mut out);
    assert_eq!(n, 28 + 1024);
    let Step::Request(r) = step else {
        panic!("{step:?}")
    };
    assert_eq!(
        (r.op, r.cookie, r.offset, r.length, r.fua),
        (Op::Write, 7, 4096, 1024, true)
    );
    assert!(input[r.payload].iter().all(|&b| b == 0xab));
    assert!(out.is_empty());
    assert!(!r.no_hole);
    let (_, step) = s.step(
        &request(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 10, 0, 4096),
        &mut out,
    );
    assert!(matches!(
        step,
        Step::Request(Request {
            op: Op::WriteZeroes,
            no_hole: true,
            ..
        })
    ));
    let (_, step) = s.step(&request(CMD_FLUSH, 0, 8, 0, 0), &mut out);
    assert!(matches!(step, Step::Request(Request { op: Op::Flush, .. })));
    let (_, step) = s.step(&request(CMD_DISC, 0, 9, 0, 0), &mut out);
    assert_eq!(step, Step::Close(Close::Disconnect));
}

#[test]
fn bad_requests_get_the_right_error_and_consume_their_payload() {
    let cases: &[(u16, u16, u64, u32, u32)] = &[
        (CMD_READ, 0, (1 << 20) - 512, 1024, EINVAL),
        (CMD_WRITE, 0, (1 << 20) - 512, 1024, ENOSPC),
        (CMD_WRITE, 0, u64::MAX - 100, 512, ENOSPC),
        (CMD_TRIM, 0, 1 << 20, 512, ENOSPC),
        (CMD_READ, 0, 100, 512, EINVAL),
        (CMD_WRITE, 0, 0, 100, EINVAL),
        (CMD_READ, 0, 0, 0, EINVAL),
        (CMD_READ, 0, 0, REQUEST_BYTES_MAX_DEFAULT + 512, EINVAL),
        (CMD_READ, CMD_FLAG_NO_HOLE, 0, 512, EINVAL),
        (CMD_WRITE, 1 << 4, 0, 512, EINVAL),
        (5, 0, 0, 512, EINVAL),
        (7, 0, 0, 512, EINVAL),
        (999, 0, 0, 512, EINVAL),
    ];
    let mut s = ready("mem");
    for (i, &(kind, flags, offset, length, error)) in cases.iter().enumerate() {
        let mut out = Vec::new();
        let mut input = request(kind, flags, i as u64, offset, length);
        if kind == CMD_WRITE {
            input.extend(vec![1u8; length as usize]);
        }
        input.extend(request(CMD_FLUSH, 0, 1000, 0, 0));
        let (n, step) = s.step(&input, &mut out);
        assert!(
            matches!(step, Step::Refused { cookie, error: e, .. } if cookie == i as u64 && e == error),
            "case {i}: {step:?}"
        );
        assert_eq!(out, simple_reply(i as u64, error), "case {i}");
        // The stream stays in step: the next request parses.
        let (_, next) = s.step(&input[n..], &mut out);
        assert!(
            matches!(next, Step::Request(Request { cookie: 1000, .. })),
            "case {i}"
        );
    }
}

#[test]
fn commands_not_advertised_are_refused_and_oversized_writes_close() {
    let mut s = ready("ro");
    let mut out = Vec::new();
    for kind in [CMD_FLUSH, CMD_TRIM, CMD_WRITE_ZEROES] {
        let (_, step) = s.step(&request(kind, 0, 1, 0, 4096), &mut out);
        assert!(
            matches!(step, Step::Refused { error: EINVAL, .. }),
            "{step:?}"
        );
    }
    let mut input = request(CMD_WRITE, CMD_FLAG_FUA, 2, 0, 4096);
    input.extend([0u8; 4096]);
    let (_, step) = s.step(&input, &mut out);
    assert!(
        matches!(step, Step::Refused { error: EINVAL, .. }),
        "{step:?}"
    );
    let big = request(CMD_WRITE, 0, 3, 0, REQUEST_BYTES_MAX_DEFAULT + 4096);
    let (_, step) = s.step(&big, &mut out);
    assert!(matches!(step, Step::Close(Close::Protocol(_))));
    let mut s = ready("ro");
    let mut bad = request(CMD_READ, 0, 4, 0, 4096);
    bad[0] = 0;
    let (_, step) = s.step(&bad, &mut out);
    assert!(matches!(step, Step::Close(Close::Protocol(_))));
}

/// TLS negotiation and read-only exports.
mod access;
