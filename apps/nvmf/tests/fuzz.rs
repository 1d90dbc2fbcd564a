//! Fuzzing the NVMe/TCP session: proptest mutates the seed conversations of
//! `apps/nvmf/fuzz-corpus/` (and makes up streams of its own) and feeds them to a
//! [`Session`] in random chunks, answering the I/O it hands out a few steps later. Whatever
//! the bytes, the session must not panic; must consume only what it was given, one whole PDU
//! per event; must say the same whether the stream comes whole or in pieces; must send only
//! PDUs a host can parse, a termination request only last and only when it ends the
//! session; must answer only commands it was sent, each once; must hand out only I/O that is
//! in range, within the transfer limit and not a write to a read-only namespace; and must
//! keep commands, held bytes and controllers within their limits (`fuzz/driver.rs`).
//!
//! The suite runs `HYPOLL_FUZZ_CASES` cases per property (default 1000). A long run:
//!
//! ```sh
//! HYPOLL_FUZZ_CASES=1000000 cargo test --release -p hypoll-nvmf --test fuzz
//! ```
//!
//! A failure is shrunk and saved in `tests/fuzz.proptest-regressions`, which replays it
//! first on every later run; commit that file with the fix.

use std::path::Path;

use hypoll_frontend::fuzz::Grammar;
use hypoll_nvme::fabrics::CNTLID_DYNAMIC;
use hypoll_nvme::spec::SubmissionEntry;
use hypoll_nvme::tcp::SglDescriptor;
use hypoll_nvmf::client::Host;
use hypoll_nvmf::{Close, IoOp, Session, Step};
use proptest::prelude::*;

#[path = "fuzz/corpus.rs"]
mod corpus;
#[path = "fuzz/driver.rs"]
mod driver;

use driver::{drive, Transcript, NQN};

/// Cases per property when `HYPOLL_FUZZ_CASES` is not set.
const CASES_DEFAULT: u32 = 1000;
/// Longest stream a case feeds.
const STREAM_BYTES_MAX: usize = 48 << 10;

fn cases() -> u32 {
    std::env::var("HYPOLL_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CASES_DEFAULT)
}

fn corpus_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus")
}

/// The seed corpus, read once per test process.
fn corpus() -> &'static [Vec<u8>] {
    static CORPUS: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    CORPUS.get_or_init(|| {
        let mut files: Vec<_> = std::fs::read_dir(corpus_dir())
            .expect("the corpus is checked in")
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "bin"))
            .collect();
        files.sort();
        assert!(files.len() >= 10, "the corpus is checked in");
        files.iter().map(|p| std::fs::read(p).unwrap()).collect()
    })
}

/// How this protocol's seeds are mutated: its fields are little-endian, and these values
/// sit on its boundaries (PDU and header lengths, sector and page sizes, limits).
const GRAMMAR: Grammar = Grammar {
    boundaries: &[
        0,
        1,
        8,
        24,
        72,
        511,
        512,
        4095,
        4096,
        4097,
        16384,
        0xffff,
        0x7fff_ffff,
        u32::MAX,
    ],
    big_endian: false,
    delete_bytes_max: 128,
    stream_bytes_max: STREAM_BYTES_MAX,
};

/// A command capsule made of random fields, with its data pointer one of the kinds a host
/// sends (or anything), and maybe in-capsule data.
fn random_command() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![
            Just(0x00u8),
            Just(0x01),
            Just(0x02),
            Just(0x08),
            Just(0x09),
            Just(0x7f),
            any::<u8>()
        ],
        any::<u16>(),
        prop_oneof![Just(1u32), Just(2), any::<u32>()],
        (any::<u64>(), any::<u32>(), any::<u32>()),
        prop_oneof![Just(0u8), Just(1), Just(2), any::<u8>()],
        any::<u32>(),
        0usize..5000,
    )
        .prop_map(
            |(opcode, cid, nsid, (slba, cdw12, cdw10), sgl, sgl_len, data_len)| {
                let mut sqe = SubmissionEntry {
                    opcode,
                    cid: cid % 24,
                    nsid,
                    cdw10,
                    cdw12: cdw12 & 0xc200_003f,
                    ..Default::default()
                };
                sqe.set_slba(slba % 4200);
                if opcode == 0x7f {
                    sqe.cdw10 = cdw10 & 0xff;
                }
                let len = if sgl_len % 3 == 0 {
                    sgl_len
                } else {
                    (sqe.block_count()) * 512
                };
                let (desc, data) = match sgl {
                    0 => (SglDescriptor::transport(len), 0),
                    1 => (SglDescriptor::in_capsule(len), len.min(4200) as usize),
                    2 => (SglDescriptor::in_capsule(data_len as u32), data_len),
                    b => (
                        SglDescriptor {
                            address: 0,
                            length: len,
                            identifier: b,
                        },
                        0,
                    ),
                };
                desc.store(&mut sqe);
                Host::default().command(&sqe, &vec![0x3c; data])
            },
        )
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
        cuts in prop::collection::vec(1usize..700, 1..8),
    ) {
        let stream = GRAMMAR.mutate(corpus(), seed, &mutations);
        let pieces = drive(&stream, &cuts);
        // Whole or in pieces, the session says the same.
        let whole = drive(&stream, &[stream.len().max(1)]);
        prop_assert_eq!(pieces, whole);
    }

    #[test]
    fn random_commands_on_an_io_queue_keep_every_invariant(
        commands in prop::collection::vec(random_command(), 0..24),
        data in prop::collection::vec((any::<u16>(), any::<u16>(), any::<u32>(), 1usize..5000, any::<bool>()), 0..6),
        cuts in prop::collection::vec(1usize..300, 1..6),
    ) {
        let h = Host::default();
        let mut stream = h.ic_req(0);
        stream.extend(h.connect(1, 1, 15, 0, 1, NQN));
        for c in commands {
            stream.extend(c);
        }
        // Data PDUs with guessed tags: most are refused, fatally, as they must be.
        for (cid, ttag, offset, len, last) in data {
            stream.extend(h.h2c_data(cid % 24, ttag % 4, offset % 16384, &vec![1; len], last));
        }
        let pieces = drive(&stream, &cuts);
        let whole = drive(&stream, &[stream.len().max(1)]);
        prop_assert_eq!(pieces, whole);
    }

    #[test]
    fn random_bytes_never_panic(
        stream in prop::collection::vec(any::<u8>(), 0..2048),
        cuts in prop::collection::vec(1usize..64, 1..4),
    ) {
        drive(&stream, &cuts);
    }
}

#[test]
fn the_corpus_is_what_its_generator_makes() {
    let dir = corpus_dir();
    let write = std::env::var_os("HYPOLL_WRITE_CORPUS").is_some();
    for (name, bytes) in corpus::seeds() {
        let path = dir.join(name);
        if write {
            std::fs::write(&path, &bytes).unwrap();
        }
        let file = std::fs::read(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            file == bytes,
            "{name} differs from what tests/fuzz/corpus.rs makes: rerun with HYPOLL_WRITE_CORPUS=1"
        );
    }
}

fn steps(t: &Transcript) -> Vec<Step> {
    t.events.iter().map(|(_, s)| s.clone()).collect()
}

#[test]
fn every_seed_runs_to_its_intended_end() {
    for (name, bytes) in corpus::seeds() {
        let t = drive(&bytes, &[bytes.len()]);
        if name != "bad_pdus.bin" {
            assert_eq!(t.consumed, bytes.len(), "{name}: every byte taken");
        }
        let s = steps(&t);
        let ended = s.last().cloned();
        match name {
            "bad_pdus.bin" => {
                assert!(
                    matches!(ended, Some(Step::Close(Close::Fatal { .. }))),
                    "{name}"
                )
            }
            "io_no_sq_flow_control.bin" => {
                assert_eq!(ended, Some(Step::Close(Close::Disconnect)))
            }
            _ => assert!(!matches!(ended, Some(Step::Close(_))), "{name}: {ended:?}"),
        }
        if name.starts_with("io_r2t_write") {
            let ops: Vec<_> = s
                .iter()
                .filter_map(|s| match s {
                    Step::Io(c) => Some(std::mem::discriminant(&c.op)),
                    Step::WriteData { last: true, .. } => None,
                    _ => None,
                })
                .collect();
            assert_eq!(ops.len(), 3, "{name}: write, deallocate, read");
            let writes = s
                .iter()
                .filter(|s| matches!(s, Step::WriteData { .. }))
                .count();
            assert_eq!(writes, 3, "{name}: three H2CData pieces");
        }
        if name.starts_with("io_read_write") {
            let n = s.iter().filter(|s| matches!(s, Step::Io(_))).count();
            assert_eq!(
                n, 6,
                "{name}: read, write, flush, write zeroes, deallocate, read"
            );
            assert!(s
                .iter()
                .any(|s| matches!(s, Step::Io(c) if matches!(c.op, IoOp::Deallocate { .. }))));
        }
    }
}

#[test]
fn an_io_queue_joins_the_anchor_controller() {
    // The driver's anchor makes controller 1, which the I/O seeds name.
    let t = driver::target();
    let _a = driver::anchor(&t);
    let h = Host::default();
    let mut s = Session::new(t.clone());
    let mut out = Vec::new();
    s.step(&h.ic_req(0), 0, &mut out);
    let (_, step) = s.step(&h.connect(1, 1, 15, 0, 1, NQN), 0, &mut out);
    assert_eq!(step, Step::Handled);
    assert_eq!(s.queue(), Some((1, 1)));
    let _ = CNTLID_DYNAMIC;
}
