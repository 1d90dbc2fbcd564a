//! The session's access rules: STARTTLS under each TLS mode, the refusals before TLS when
//! it is required, and read-only exports.

use super::*;

fn tls_session(tls: TlsMode, out: &mut Vec<u8>) -> Session {
    let s = Session::with_tls(exports(), Limits::default(), tls, out);
    out.clear();
    s
}

fn starttls() -> Vec<u8> {
    option(OPT_STARTTLS, &[])
}

#[test]
fn under_require_only_starttls_and_abort_are_answered_before_tls() {
    let mut out = Vec::new();
    let mut s = tls_session(TlsMode::Require, &mut out);
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE);
    input.extend(option(OPT_LIST, &[]));
    input.extend(info_or_go(OPT_INFO, "mem", &[]));
    input.extend(info_or_go(OPT_GO, "mem", &[INFO_BLOCK_SIZE]));
    input.extend(option(OPT_STRUCTURED_REPLY, &[]));
    input.extend(option(0xdead, b"xyz"));
    let (steps, used) = run(&mut s, &input, &mut out);
    assert_eq!(used, input.len());
    assert!(steps.iter().all(|s| *s == Step::Negotiating), "{steps:?}");
    let replies = option_replies(&out);
    let asked = [OPT_LIST, OPT_INFO, OPT_GO, OPT_STRUCTURED_REPLY, 0xdead];
    assert_eq!(replies.len(), asked.len(), "one refusal each, nothing else");
    for (reply, option) in replies.iter().zip(asked) {
        assert_eq!((reply.0, reply.1), (option, REP_ERR_TLS_REQD));
    }
    assert_eq!(s.export(), None);
    assert!(!s.tls_started());

    // STARTTLS is accepted; after it every option is answered as usual.
    out.clear();
    let (steps, _) = run(&mut s, &starttls(), &mut out);
    assert_eq!(steps, [Step::StartTls]);
    assert_eq!(option_replies(&out), [(OPT_STARTTLS, REP_ACK, vec![])]);
    assert!(s.tls_started());
    out.clear();
    let mut input = option(OPT_LIST, &[]);
    input.extend(starttls());
    input.extend(handshake_go("mem")[4..].to_vec());
    let (steps, _) = run(&mut s, &input, &mut out);
    assert_eq!(steps.last(), Some(&Step::Ready { export: 0 }));
    let replies = option_replies(&out);
    assert!(
        replies.iter().all(|r| r.1 != REP_ERR_TLS_REQD),
        "never after TLS"
    );
    let again = replies.iter().find(|r| r.0 == OPT_STARTTLS).unwrap();
    assert_eq!(again.1, REP_ERR_INVALID, "TLS cannot start twice");
}

#[test]
fn under_require_abort_acks_and_export_name_closes() {
    let mut out = Vec::new();
    let mut s = tls_session(TlsMode::Require, &mut out);
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE);
    input.extend(option(OPT_ABORT, &[]));
    let (steps, _) = run(&mut s, &input, &mut out);
    assert_eq!(steps.last(), Some(&Step::Close(Close::Abort)));
    assert_eq!(option_replies(&out), [(OPT_ABORT, REP_ACK, vec![])]);

    // EXPORT_NAME has no error reply: the connection closes, having said nothing.
    let mut s = tls_session(TlsMode::Require, &mut out);
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    input.extend(option(OPT_EXPORT_NAME, b"mem"));
    let (steps, _) = run(&mut s, &input, &mut out);
    assert!(matches!(
        steps.last(),
        Some(Step::Close(Close::Protocol(_)))
    ));
    assert!(out.is_empty(), "no export size or flags before TLS");
    assert_eq!(s.export(), None);
}

#[test]
fn starttls_stops_at_its_own_bytes_so_the_caller_sees_what_follows() {
    let mut out = Vec::new();
    let mut s = tls_session(TlsMode::On, &mut out);
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE);
    input.extend(starttls());
    let starttls_end = input.len();
    // Injected after STARTTLS, in the same packet: the session must hand control back
    // before it, so the caller can refuse to take it as if it came under TLS.
    input.extend(info_or_go(OPT_GO, "mem", &[]));
    let (used, _) = s.step(&input, &mut out);
    assert_eq!(used, 4);
    let (used, step) = s.step(&input[4..], &mut out);
    assert_eq!(step, Step::StartTls);
    assert_eq!(4 + used, starttls_end);
    assert_eq!(option_replies(&out), [(OPT_STARTTLS, REP_ACK, vec![])]);
}

#[test]
fn starttls_is_refused_without_tls_or_with_data_and_on_allows_plaintext() {
    let mut out = Vec::new();
    let mut s = tls_session(TlsMode::Off, &mut out);
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE);
    input.extend(starttls());
    let (steps, _) = run(&mut s, &input, &mut out);
    assert_eq!(steps.last(), Some(&Step::Negotiating));
    assert_eq!(option_replies(&out)[0].1, REP_ERR_UNSUP);
    assert!(!s.tls_started());

    let mut s = tls_session(TlsMode::On, &mut out);
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE);
    input.extend(option(OPT_STARTTLS, b"x"));
    let (steps, _) = run(&mut s, &input, &mut out);
    assert_eq!(steps.last(), Some(&Step::Negotiating));
    assert_eq!(option_replies(&out)[0].1, REP_ERR_INVALID);
    assert!(!s.tls_started());

    // With TLS on but not required, a client may go on in plaintext.
    let mut s = tls_session(TlsMode::On, &mut out);
    let (steps, _) = run(&mut s, &handshake_go("mem"), &mut out);
    assert_eq!(steps.last(), Some(&Step::Ready { export: 0 }));
}

fn read_only_exports() -> Arc<[ExportInfo]> {
    vec![ExportInfo {
        name: "ro".into(),
        description: String::new(),
        size_bytes: 1 << 20,
        flags: TFLAG_HAS_FLAGS | TFLAG_READ_ONLY | TFLAG_SEND_FLUSH,
        block_bytes: 512,
        preferred_bytes: 4096,
        restricted: false,
    }]
    .into()
}

#[test]
fn a_read_only_export_refuses_writes_trims_and_zeroes_with_eperm_and_serves_the_rest() {
    let mut out = Vec::new();
    let mut s = Session::new(read_only_exports(), Limits::default(), &mut out);
    out.clear();
    let (steps, _) = run(&mut s, &handshake_go("ro"), &mut out);
    assert_eq!(steps.last(), Some(&Step::Ready { export: 0 }));
    let flags = option_replies(&out)
        .iter()
        .find(|r| r.1 == REP_INFO && be_u16(&r.2) == INFO_EXPORT)
        .map(|r| be_u16(&r.2[10..]))
        .unwrap();
    assert_ne!(flags & TFLAG_READ_ONLY, 0, "the client is told");

    let mut input = request(CMD_WRITE, 0, 1, 0, 512);
    input.extend([0xaa; 512]);
    // Even with flags the export does not offer, or out of range: EPERM first.
    input.extend(request(CMD_WRITE, CMD_FLAG_FUA, 2, 1 << 30, 512));
    input.extend([0xbb; 512]);
    input.extend(request(CMD_TRIM, 0, 3, 0, 4096));
    input.extend(request(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 4, 0, 4096));
    input.extend(request(CMD_READ, 0, 5, 0, 4096));
    input.extend(request(CMD_FLUSH, 0, 6, 0, 0));
    out.clear();
    let (steps, used) = run(&mut s, &input, &mut out);
    assert_eq!(
        used,
        input.len(),
        "each write's payload is consumed with it"
    );
    let refused: Vec<(u64, u32)> = steps
        .iter()
        .filter_map(|s| match s {
            Step::Refused { cookie, error, .. } => Some((*cookie, *error)),
            _ => None,
        })
        .collect();
    assert_eq!(refused, [(1, EPERM), (2, EPERM), (3, EPERM), (4, EPERM)]);
    let mut replies = Vec::new();
    for cookie in 1..=4 {
        replies.extend(simple_reply(cookie, EPERM));
    }
    assert_eq!(out, replies);
    let served: Vec<Op> = steps
        .iter()
        .filter_map(|s| match s {
            Step::Request(r) => Some(r.op),
            _ => None,
        })
        .collect();
    assert_eq!(served, [Op::Read, Op::Flush]);
}

fn restricted_exports() -> Arc<[ExportInfo]> {
    let export = |name: &str, restricted| ExportInfo {
        name: name.into(),
        description: String::new(),
        size_bytes: 1 << 20,
        flags: TFLAG_HAS_FLAGS,
        block_bytes: 512,
        preferred_bytes: 4096,
        restricted,
    };
    vec![export("secret", true), export("open", false)].into()
}

#[test]
fn a_restricted_export_is_hidden_and_refused_until_the_client_is_allowed() {
    let mut out = Vec::new();
    let mut s = Session::new(restricted_exports(), Limits::default(), &mut out);
    out.clear();
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE);
    input.extend(option(OPT_LIST, &[]));
    input.extend(info_or_go(OPT_INFO, "secret", &[]));
    // The default export is the first, restricted one: refused too.
    input.extend(info_or_go(OPT_GO, "", &[]));
    let (steps, _) = run(&mut s, &input, &mut out);
    assert!(steps.iter().all(|s| *s == Step::Negotiating), "{steps:?}");
    let replies = option_replies(&out);
    let listed: Vec<&[u8]> = replies
        .iter()
        .filter(|r| r.1 == REP_SERVER)
        .map(|r| &r.2[4..])
        .collect();
    assert_eq!(listed, [b"open"], "the restricted export is not listed");
    let refusals: Vec<(u32, u32)> = replies.iter().skip(2).map(|r| (r.0, r.1)).collect();
    assert_eq!(
        refusals,
        [(OPT_INFO, REP_ERR_POLICY), (OPT_GO, REP_ERR_POLICY)]
    );

    // EXPORT_NAME on it closes; on the open one, it works.
    let mut s = Session::new(restricted_exports(), Limits::default(), &mut out);
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    input.extend(option(OPT_EXPORT_NAME, b"secret"));
    let (steps, _) = run(&mut s, &input, &mut out);
    assert!(matches!(
        steps.last(),
        Some(Step::Close(Close::Protocol(_)))
    ));

    // Allowed (the caller named the client), it is listed and served.
    let mut s = Session::new(restricted_exports(), Limits::default(), &mut out);
    s.allow(|i| i == 0);
    out.clear();
    let (steps, _) = run(&mut s, &handshake_go("secret"), &mut out);
    assert_eq!(steps.last(), Some(&Step::Ready { export: 0 }));
    // An allowance never closes an unrestricted export.
    let mut s = Session::new(restricted_exports(), Limits::default(), &mut out);
    s.allow(|_| false);
    let (steps, _) = run(&mut s, &handshake_go("open"), &mut out);
    assert_eq!(steps.last(), Some(&Step::Ready { export: 1 }));
}
