//! Fuzzing the NBD handshake and request parser: proptest mutates the seed streams of
//! `apps/nbd/fuzz-corpus/` (and makes up streams of its own) and feeds them to a [`Session`] in
//! random chunks. Whatever the bytes, the session must not panic, must consume only what it
//! was given and at least one byte per event, must say the same things whether the stream
//! comes whole or in pieces, and must only ever hand out requests that are in range,
//! aligned and within the limits, and well-formed replies. When TLS is required, nothing but
//! a refusal, STARTTLS's acceptance or ABORT's is answered before TLS starts, and no request
//! is taken; a read-only export never hands out a write; an export restricted to named
//! clients is never chosen by a client not named.
//!
//! The suite runs `HYPOLL_FUZZ_CASES` cases per property (default 2000). A long run:
//!
//! ```sh
//! HYPOLL_FUZZ_CASES=2000000 cargo test --release -p hypoll-nbd --test fuzz
//! ```
//!
//! A failure is shrunk and saved in `tests/fuzz.proptest-regressions`, which replays it first
//! on every later run; commit that file with the fix.

use std::path::Path;
use std::sync::Arc;

use hypoll_frontend::fuzz::Grammar;
use hypoll_nbd::proto::*;
use hypoll_nbd::session::{Close, ExportInfo, Limits, Op, Session, Step, TlsMode};
use proptest::prelude::*;

/// Cases per property when `HYPOLL_FUZZ_CASES` is not set.
const CASES_DEFAULT: u32 = 2000;
/// Longest stream a case feeds.
const STREAM_BYTES_MAX: usize = 16 << 10;

fn cases() -> u32 {
    std::env::var("HYPOLL_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CASES_DEFAULT)
}

/// The seed corpus, read once per test process.
fn corpus() -> &'static [Vec<u8>] {
    static CORPUS: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    CORPUS.get_or_init(read_corpus)
}

fn read_corpus() -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .collect();
    files.sort();
    assert!(files.len() >= 10, "the corpus is checked in");
    files.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

/// Small limits, so the fuzzer reaches them.
fn limits() -> Limits {
    Limits {
        request_bytes_max: 8192,
        option_bytes_max: 512,
        options_max: 16,
    }
}

fn exports() -> Arc<[ExportInfo]> {
    let all = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_SEND_TRIM
        | TFLAG_SEND_WRITE_ZEROES
        | TFLAG_CAN_MULTI_CONN;
    vec![
        ExportInfo {
            name: "mem".into(),
            description: "fuzz".into(),
            size_bytes: 1 << 20,
            flags: all,
            block_bytes: 512,
            preferred_bytes: 4096,
            restricted: false,
        },
        ExportInfo {
            name: "ro".into(),
            description: String::new(),
            size_bytes: 1 << 20,
            flags: TFLAG_HAS_FLAGS | TFLAG_READ_ONLY | TFLAG_SEND_FLUSH,
            block_bytes: 512,
            preferred_bytes: 4096,
            restricted: false,
        },
        ExportInfo {
            name: "secret".into(),
            description: String::new(),
            size_bytes: 1 << 20,
            flags: all,
            block_bytes: 512,
            preferred_bytes: 4096,
            restricted: true,
        },
        ExportInfo {
            name: "big".into(),
            description: String::new(),
            size_bytes: u64::MAX - 4095,
            flags: TFLAG_HAS_FLAGS,
            block_bytes: 4096,
            preferred_bytes: 4096,
            restricted: false,
        },
    ]
    .into()
}

/// How this protocol's seeds are mutated: its fields are big-endian, and these values sit
/// on its boundaries (sizes, limits, the request magic).
const GRAMMAR: Grammar = Grammar {
    boundaries: &[
        0,
        1,
        511,
        512,
        4096,
        8192,
        8193,
        0x7fff_ffff,
        0x8000_0000,
        u32::MAX,
        REQUEST_MAGIC,
    ],
    big_endian: true,
    delete_bytes_max: 64,
    stream_bytes_max: STREAM_BYTES_MAX,
};

/// Everything a session said, with the bytes it consumed for each event.
#[derive(Debug, PartialEq)]
struct Transcript {
    events: Vec<(usize, Step)>,
    out: Vec<u8>,
    consumed: usize,
}

fn tls_mode() -> impl Strategy<Value = TlsMode> {
    prop_oneof![
        Just(TlsMode::Off),
        Just(TlsMode::On),
        Just(TlsMode::Require)
    ]
}

/// [`drive_with`] without TLS.
fn drive(stream: &[u8], cuts: &[usize]) -> Transcript {
    drive_with(stream, cuts, TlsMode::Off)
}

/// Feeds `stream` in pieces of the given sizes (cycled), as a server would after each read,
/// and checks the invariants of every step.
fn drive_with(stream: &[u8], cuts: &[usize], tls: TlsMode) -> Transcript {
    let exports = exports();
    let limits = limits();
    let mut out = Vec::new();
    let mut session = Session::with_tls(exports.clone(), limits, tls, &mut out);
    assert_eq!(out.len(), GREETING_BYTES);
    let mut t = Transcript {
        events: Vec::new(),
        out: Vec::new(),
        consumed: 0,
    };
    let mut available = 0;
    let mut cut = 0;
    let mut closed = false;
    while !closed && available < stream.len() {
        let piece = cuts
            .get(cut % cuts.len().max(1))
            .copied()
            .unwrap_or(7)
            .max(1);
        cut += 1;
        available = (available + piece).min(stream.len());
        // Run the session until it needs more of what has arrived.
        loop {
            let input = &stream[t.consumed..available];
            let out_before = out.len();
            let phase_export = session.export();
            let (used, step) = session.step(input, &mut out);
            assert!(used <= input.len(), "consumed {used} of {}", input.len());
            match &step {
                Step::NeedMore => {
                    assert_eq!(used, 0);
                    assert_eq!(out.len(), out_before, "no output without progress");
                    break;
                }
                Step::Close(_) => {
                    closed = true;
                }
                other => assert!(used > 0, "{other:?} consumed nothing"),
            }
            check_step(
                &step,
                &stream[t.consumed..t.consumed + used],
                phase_export,
                &exports,
            );
            check_output(&out[out_before..], &step, phase_export);
            check_tls(tls, &session, &step, &out[out_before..], phase_export);
            t.consumed += used;
            t.events.push((used, step));
            if closed {
                break;
            }
            assert!(t.events.len() <= stream.len() + 1, "bounded work");
        }
    }
    if closed {
        // A closed session stays closed.
        let (used, step) = session.step(&stream[t.consumed..], &mut out);
        assert_eq!(used, 0);
        assert!(matches!(step, Step::Close(_)));
    }
    t.out = out;
    t
}

fn check_step(step: &Step, bytes: &[u8], export: Option<usize>, exports: &[ExportInfo]) {
    match step {
        Step::Request(r) => {
            let e = &exports[export.expect("requests only in transmission")];
            if r.op == Op::Flush {
                assert_eq!((r.offset, r.length), (0, 0));
                return;
            }
            assert!(r.length > 0);
            assert!(r.offset + u64::from(r.length) <= e.size_bytes);
            assert_eq!(r.offset % u64::from(e.block_bytes), 0);
            assert_eq!(r.length % e.block_bytes, 0);
            if matches!(r.op, Op::Read | Op::Write) {
                assert!(r.length <= limits().request_bytes_max);
            }
            if e.flags & TFLAG_READ_ONLY != 0 {
                assert!(
                    matches!(r.op, Op::Read | Op::Flush),
                    "{r:?} on a read-only export"
                );
            }
            if r.op == Op::Write {
                assert_eq!(r.payload.len(), r.length as usize);
                assert_eq!(r.payload.end, bytes.len());
            } else {
                assert!(r.payload.is_empty());
            }
        }
        Step::Ready { export } => {
            assert!(*export < exports.len());
            assert!(!exports[*export].restricted, "a restricted export chosen");
        }
        Step::StartTls => assert_eq!(bytes.len(), OPTION_HEADER_BYTES, "STARTTLS alone"),
        Step::Refused { error, .. } => {
            assert!([EINVAL, ENOSPC, EPERM].contains(error));
            let e = &exports[export.expect("refusals only in transmission")];
            assert_eq!(
                *error == EPERM,
                e.flags & TFLAG_READ_ONLY != 0 && {
                    let kind = u16::from_be_bytes([bytes[6], bytes[7]]);
                    [CMD_WRITE, CMD_TRIM, CMD_WRITE_ZEROES].contains(&kind)
                }
            );
        }
        Step::Close(Close::Protocol(why)) => assert!(!why.contains('\n'), "one log line"),
        _ => {}
    }
}

/// Under `Require`, before TLS: no export is chosen and every option reply is a refusal
/// for want of TLS or the acceptance of STARTTLS or ABORT (or STARTTLS's refusal of data);
/// after it, no such refusal. Without TLS, TLS never starts.
fn check_tls(
    tls: TlsMode,
    session: &Session,
    step: &Step,
    mut out: &[u8],
    export_before: Option<usize>,
) {
    if tls == TlsMode::Off {
        assert_ne!(*step, Step::StartTls);
        assert!(!session.tls_started());
    }
    if export_before.is_some() {
        return;
    }
    let started = session.tls_started() && *step != Step::StartTls;
    if tls == TlsMode::Require && !started {
        assert!(
            !matches!(step, Step::Ready { .. } | Step::Request(_)),
            "{step:?} before TLS"
        );
    }
    while out.len() >= 20 {
        let option = u32::from_be_bytes(out[8..12].try_into().unwrap());
        let reply = u32::from_be_bytes(out[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(out[16..20].try_into().unwrap()) as usize;
        if tls == TlsMode::Require && !started {
            let allowed = reply == REP_ERR_TLS_REQD
                || (option == OPT_ABORT && reply == REP_ACK)
                || (option == OPT_STARTTLS && [REP_ACK, REP_ERR_INVALID].contains(&reply));
            assert!(allowed, "option {option} answered {reply:#x} before TLS");
        }
        if started || tls != TlsMode::Require {
            assert_ne!(reply, REP_ERR_TLS_REQD, "a TLS refusal when none is due");
        }
        out = &out[(20 + len).min(out.len())..];
    }
}

/// The bytes a step appended must be whole, well-formed replies of its phase.
fn check_output(mut out: &[u8], step: &Step, export_before: Option<usize>) {
    if export_before.is_some() {
        match step {
            Step::Refused { cookie, error, .. } => {
                assert_eq!(out, simple_reply(*cookie, *error));
            }
            _ => assert!(out.is_empty(), "{step:?} replied {out:?}"),
        }
        return;
    }
    if let Step::Ready { .. } = step {
        if out.len() == 10 || out.len() == 10 + EXPORT_NAME_PAD_BYTES {
            // EXPORT_NAME's reply: size, flags, maybe zeroes.
            if out.len() > 10 {
                assert!(out[10..].iter().all(|&b| b == 0));
            }
            return;
        }
    }
    while !out.is_empty() {
        assert!(out.len() >= 20, "a truncated option reply");
        assert_eq!(
            u64::from_be_bytes(out[..8].try_into().unwrap()),
            OPT_REPLY_MAGIC
        );
        let len = u32::from_be_bytes(out[16..20].try_into().unwrap()) as usize;
        assert!(out.len() >= 20 + len, "a reply longer than what was sent");
        out = &out[20 + len..];
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 4096,
        ..ProptestConfig::default()
    })]

    #[test]
    fn mutated_corpus_streams_keep_every_invariant(
        seed in any::<usize>(),
        mutations in prop::collection::vec(GRAMMAR.mutation(), 0..8),
        cuts in prop::collection::vec(1usize..600, 1..8),
        tls in tls_mode(),
    ) {
        let stream = GRAMMAR.mutate(corpus(), seed, &mutations);
        let pieces = drive_with(&stream, &cuts, tls);
        // Whole or in pieces, the session says the same.
        let whole = drive_with(&stream, &[stream.len().max(1)], tls);
        prop_assert_eq!(pieces, whole);
    }

    #[test]
    fn random_streams_after_a_valid_handshake_keep_every_invariant(
        export in prop_oneof![Just("mem"), Just("big"), Just("ro"), Just("")],
        body in prop::collection::vec(any::<u8>(), 0..4096),
        headers in prop::collection::vec(
            (0u16..10, any::<u16>(), any::<u64>(), any::<u64>(), any::<u32>()), 0..16),
        cuts in prop::collection::vec(1usize..300, 1..6),
    ) {
        let mut stream = hypoll_nbd::client::handshake_go(export);
        for (kind, flags, cookie, offset, length) in headers {
            let length = length % 16384;
            let offset = offset % (2 << 20);
            stream.extend(hypoll_nbd::client::request(kind, flags & 0x1f, cookie, offset, length));
            if kind == CMD_WRITE {
                stream.extend(std::iter::repeat_n(0x5a, length as usize));
            }
        }
        stream.extend(body);
        let pieces = drive(&stream, &cuts);
        let whole = drive(&stream, &[stream.len().max(1)]);
        prop_assert_eq!(pieces, whole);
    }

    #[test]
    fn random_bytes_never_panic(
        stream in prop::collection::vec(any::<u8>(), 0..2048),
        cuts in prop::collection::vec(1usize..64, 1..4),
        tls in tls_mode(),
    ) {
        drive_with(&stream, &cuts, tls);
    }
}

#[test]
fn every_seed_runs_to_its_intended_end() {
    let seeds = corpus();
    for (i, s) in seeds.iter().enumerate() {
        let t = drive(s, &[s.len().max(1)]);
        assert!(!t.events.is_empty(), "seed {i} does nothing");
    }
    // The I/O seed reaches every operation.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus");
    let io = std::fs::read(dir.join("go_then_io.bin")).unwrap();
    let t = drive(&io, &[io.len()]);
    let ops: Vec<Op> = t
        .events
        .iter()
        .filter_map(|(_, s)| match s {
            Step::Request(r) => Some(r.op),
            _ => None,
        })
        .collect();
    assert_eq!(
        ops,
        [
            Op::Write,
            Op::Read,
            Op::Flush,
            Op::WriteZeroes,
            Op::Trim,
            Op::Write
        ]
    );
    assert!(matches!(
        t.events.last(),
        Some((_, Step::Close(Close::Disconnect)))
    ));
}

#[test]
fn the_tls_and_read_only_seeds_reach_their_intended_ends() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus");
    let seed = |name: &str| std::fs::read(dir.join(name)).unwrap();
    let steps = |t: &Transcript| t.events.iter().map(|(_, s)| s.clone()).collect::<Vec<_>>();

    // STARTTLS first: under every mode but off, TLS starts and then the I/O runs.
    let s = seed("starttls_then_go.bin");
    for tls in [TlsMode::On, TlsMode::Require] {
        let t = steps(&drive_with(&s, &[s.len()], tls));
        assert_eq!(t[1], Step::StartTls, "{tls}");
        assert_eq!(t[2], Step::Ready { export: 0 }, "{tls}");
        assert_eq!(t.last(), Some(&Step::Close(Close::Disconnect)), "{tls}");
    }

    // Everything before STARTTLS refused under require; EXPORT_NAME then ends the handshake.
    let s = seed("tls_required_options.bin");
    let t = drive_with(&s, &[s.len()], TlsMode::Require);
    let events = steps(&t);
    let start = events.iter().position(|s| *s == Step::StartTls).unwrap();
    assert_eq!(
        start, 6,
        "flags, four refusals, STARTTLS with data, then STARTTLS"
    );
    assert_eq!(events[start + 3], Step::Ready { export: 1 });

    // Every write to the read-only export refused with EPERM, the read and flush served.
    let s = seed("read_only_writes.bin");
    let t = steps(&drive(&s, &[s.len()]));
    let refused = t
        .iter()
        .filter(|s| matches!(s, Step::Refused { error: EPERM, .. }))
        .count();
    assert_eq!(refused, 4);
    let served: Vec<Op> = t
        .iter()
        .filter_map(|s| match s {
            Step::Request(r) => Some(r.op),
            _ => None,
        })
        .collect();
    assert_eq!(served, [Op::Read, Op::Flush]);
}
