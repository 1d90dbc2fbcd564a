//! Fuzzing the virtqueue request walker: proptest writes random rings and descriptor
//! tables into a fake guest's memory (two regions with a hole between them), mutates the
//! seed scenarios of `apps/vhost/fuzz-corpus/`, and walks and parses every request the
//! avail ring offers. Whatever the guest wrote, the walker must not panic, must stop within
//! the queue's size, and may only hand on a request whose every buffer lies inside guest
//! memory (checked against the regions directly, not through vm-memory), goes the way the
//! request needs, and keeps every limit; a refusal's status byte lies in guest memory. The
//! walk goes through the back end's host pointers (`HostMemory`, as the rings use it) and
//! through vm-memory's checked accessors, and the two must come to the same answer; so must
//! the walk through a ring's view (`RingView`: the table resolved once, the last region
//! remembered from one chain to the next).
//!
//! The suite runs `HYPOLL_FUZZ_CASES` cases per property (default 2000). A long run:
//!
//! ```sh
//! HYPOLL_FUZZ_CASES=2000000 cargo test --release -p hypoll-vhost --test fuzz
//! ```
//!
//! A failure is shrunk and saved in `tests/fuzz.proptest-regressions`, which replays it first
//! on every later run; commit that file with the fix.

use std::path::Path;

use std::sync::Arc;

use hypoll_vhost::host::{HostMemory, RingView};
use hypoll_vhost::testkit::*;
use hypoll_vhost::{parse, walk_chain, Buffer, ChainLimits, Geometry, Op, ParseError};
use proptest::prelude::*;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Cases per property when `HYPOLL_FUZZ_CASES` is not set.
const CASES_DEFAULT: u32 = 2000;
/// Where a scenario's avail and used rings go.
const AVAIL: u64 = 0x800;
const USED: u64 = 0xa00;
/// Bytes of a seed's fixed part: head, queue size, flags, avail index.
const SEED_HEAD_BYTES: usize = 8;

fn cases() -> u32 {
    std::env::var("HYPOLL_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CASES_DEFAULT)
}

fn geometry(read_only: bool) -> Geometry {
    Geometry {
        capacity_sectors: 4096,
        block_bytes: 512,
        read_only,
        discard: !read_only,
        write_zeroes: !read_only,
        seg_max: 8,
        size_max: 4096,
        request_bytes_max: 8 * 4096,
        range_sectors_max: 1024,
        num_queues: 1,
    }
}

/// Whether `len` bytes at `addr` lie inside the fake guest's memory, by its layout alone.
fn inside(addr: u64, len: u64) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    end <= LOW_END || (addr >= HIGH_START && end <= HIGH_END)
}

/// A scenario: what the guest wrote (memory chunks), the ring's parameters, and the export.
#[derive(Clone, Debug)]
struct Scenario {
    queue_size: u16,
    avail_idx: u16,
    indirect: bool,
    read_only: bool,
    chunks: Vec<(u32, Vec<u8>)>,
}

impl Scenario {
    /// A seed file: `queue_size u16, avail_idx u16, flags u8, 3 zero bytes`, then chunks of
    /// `gpa u32, len u16, bytes`. Anything malformed past the head is ignored.
    fn from_seed(bytes: &[u8]) -> Scenario {
        let mut head = [0u8; SEED_HEAD_BYTES];
        let n = bytes.len().min(SEED_HEAD_BYTES);
        head[..n].copy_from_slice(&bytes[..n]);
        let mut chunks = Vec::new();
        let mut rest = bytes.get(SEED_HEAD_BYTES..).unwrap_or(&[]);
        while rest.len() >= 6 {
            let gpa = u32::from_le_bytes(rest[0..4].try_into().unwrap());
            let len = usize::from(u16::from_le_bytes(rest[4..6].try_into().unwrap()));
            let data = &rest[6..];
            let take = len.min(data.len());
            chunks.push((gpa, data[..take].to_vec()));
            rest = &data[take..];
        }
        Scenario {
            queue_size: u16::from_le_bytes([head[0], head[1]]),
            avail_idx: u16::from_le_bytes([head[2], head[3]]),
            indirect: head[4] & 1 != 0,
            read_only: head[4] & 2 != 0,
            chunks,
        }
    }

    fn to_seed(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&self.queue_size.to_le_bytes());
        out.extend_from_slice(&self.avail_idx.to_le_bytes());
        out.push(u8::from(self.indirect) | u8::from(self.read_only) << 1);
        out.extend_from_slice(&[0; 3]);
        for (gpa, data) in &self.chunks {
            out.extend_from_slice(&gpa.to_le_bytes());
            out.extend_from_slice(&(data.len() as u16).to_le_bytes());
            out.extend_from_slice(data);
        }
        out
    }

    /// Writes the chunks into fresh guest memory (each clipped to it).
    fn memory(&self) -> GuestMemoryMmap {
        let mem = guest();
        for (gpa, data) in &self.chunks {
            for (i, b) in data.iter().enumerate() {
                let _ = mem.write_obj(*b, GuestAddress(u64::from(*gpa) + i as u64));
            }
        }
        mem
    }
}

/// Walks and parses every request the scenario's avail ring offers, checking each.
fn run(s: &Scenario) -> Result<(), TestCaseError> {
    let mem = s.memory();
    let Ok(mut queue) = Queue::new(256) else {
        unreachable!("256 is a valid queue size");
    };
    // A queue size that is not a power of two up to 256 is refused by the queue itself.
    if queue.try_set_size(s.queue_size).is_err() {
        return Ok(());
    }
    queue
        .try_set_desc_table_address(GuestAddress(TABLE))
        .unwrap();
    queue
        .try_set_avail_ring_address(GuestAddress(AVAIL))
        .unwrap();
    queue.try_set_used_ring_address(GuestAddress(USED)).unwrap();
    queue.set_ready(true);
    mem.write_obj(s.avail_idx.to_le(), GuestAddress(AVAIL + 2))
        .unwrap();
    let limits = ChainLimits {
        queue_size: s.queue_size,
        indirect: s.indirect,
    };
    let g = geometry(s.read_only);
    let host = Arc::new(HostMemory::new(Arc::new(mem.clone())));
    // As a ring reads: its table resolved once, one view (and the region it remembers) for
    // every chain the ring offers.
    let table = host.span(TABLE, 16 * u64::from(s.queue_size), 16);
    prop_assert!(
        table.is_some(),
        "a table of up to 256 entries lies in the first region"
    );
    let view = RingView::new(&host, TABLE, table.as_ref());
    let mut chain_view: Vec<Buffer> = Vec::with_capacity(usize::from(s.queue_size));
    let mut chain: Vec<Buffer> = Vec::with_capacity(usize::from(s.queue_size));
    let mut chain_vm: Vec<Buffer> = Vec::with_capacity(usize::from(s.queue_size));
    // An avail index more than a queue ahead is the ring's own malformation.
    let Ok(heads) = queue.iter(&mem) else {
        prop_assert!(s.avail_idx > s.queue_size);
        return Ok(());
    };
    let heads: Vec<u16> = heads.map(|c| c.head_index()).collect();
    prop_assert!(heads.len() <= usize::from(s.queue_size));
    for head in heads {
        let walked = walk_chain(host.as_ref(), GuestAddress(TABLE), limits, head, &mut chain);
        let walked_vm = walk_chain(&mem, GuestAddress(TABLE), limits, head, &mut chain_vm);
        let walked_view = walk_chain(&view, GuestAddress(TABLE), limits, head, &mut chain_view);
        prop_assert_eq!(walked, walked_vm, "host pointers and vm-memory walk alike");
        prop_assert_eq!(walked_view, walked_vm, "and the ring's view");
        prop_assert_eq!(&chain, &chain_vm);
        prop_assert_eq!(&chain_view, &chain_vm);
        prop_assert!(
            chain.len() <= usize::from(s.queue_size),
            "the walk is bounded"
        );
        prop_assert_eq!(
            chain.capacity(),
            usize::from(s.queue_size),
            "and never grew"
        );
        if walked.is_err() {
            continue;
        }
        prop_assert!(!chain.is_empty());
        let parsed = parse(host.as_ref(), &chain, &g);
        prop_assert_eq!(&parsed, &parse(&mem, &chain, &g), "and parse alike");
        prop_assert_eq!(
            &parsed,
            &parse(&view, &chain, &g),
            "through the ring's view too"
        );
        match parsed {
            Ok(req) => check_request(&req, &chain, &g)?,
            Err(ParseError::Refused { status, error }) => {
                prop_assert!(inside(status.0, 1), "{error}: status outside memory");
                let last = chain.last().unwrap();
                prop_assert!(last.writable && status.0 == last.addr + u64::from(last.len) - 1);
            }
            Err(ParseError::Chain(_)) => {}
        }
    }
    Ok(())
}

fn check_request(
    req: &hypoll_vhost::Request,
    chain: &[Buffer],
    g: &Geometry,
) -> Result<(), TestCaseError> {
    let last = chain.last().unwrap();
    prop_assert!(last.writable && last.len == 1 && inside(last.addr, 1));
    prop_assert_eq!(req.status.0, last.addr);
    let header = chain[0];
    prop_assert!(!header.writable && header.len == 16 && inside(header.addr, 16));
    let data = &chain[req.data.clone()];
    for b in data {
        prop_assert!(
            inside(b.addr, u64::from(b.len)),
            "{b:?} handed on outside memory"
        );
        prop_assert!(b.len > 0 && b.len <= g.size_max);
    }
    prop_assert!(req
        .sector
        .checked_add(req.sectors)
        .is_some_and(|e| e <= g.capacity_sectors));
    let bytes: u64 = data.iter().map(|b| u64::from(b.len)).sum();
    match req.op {
        Op::Read | Op::Write => {
            let write = req.op == Op::Write;
            prop_assert!(!(write && g.read_only));
            prop_assert!(data.iter().all(|b| b.writable != write), "direction");
            prop_assert!(data.len() <= g.seg_max as usize);
            prop_assert!(bytes > 0 && bytes <= u64::from(g.request_bytes_max));
            prop_assert_eq!(bytes, req.sectors * 512);
            prop_assert_eq!(u64::from(req.written_bytes), if write { 0 } else { bytes });
        }
        Op::GetId => {
            prop_assert!(data.len() == 1 && data[0].writable);
            prop_assert!(req.written_bytes <= 20 && req.written_bytes <= data[0].len);
        }
        Op::Flush | Op::Discard | Op::WriteZeroes { .. } => {
            prop_assert!(req.data.is_empty() && req.written_bytes == 0);
            prop_assert!(req.op == Op::Flush || !g.read_only);
        }
    }
    Ok(())
}

/// The seed corpus, read once per test process.
fn corpus() -> &'static [Vec<u8>] {
    static CORPUS: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    CORPUS.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "bin"))
            .collect();
        files.sort();
        assert!(files.len() >= 8, "the corpus is checked in");
        files.iter().map(|p| std::fs::read(p).unwrap()).collect()
    })
}

/// Guest addresses a fuzzer should favour: region edges, the hole, the tables, wrap-around.
fn addr() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => Just(HEADER),
        4 => (0u64..8).prop_map(|i| DATA + i * 512),
        2 => Just(STATUS),
        2 => 0u64..LOW_END,
        1 => HIGH_START..HIGH_END,
        1 => prop::sample::select(vec![
            LOW_END - 1, LOW_END - 16, LOW_END, HIGH_START - 1, HIGH_START,
            HIGH_END - 1, HIGH_END, u64::MAX, u64::MAX - 15, 0x2000, 0x2010,
        ]),
        1 => any::<u64>(),
    ]
}

fn len() -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => prop::sample::select(vec![0u32, 1, 2, 15, 16, 17, 20, 32, 512, 4096, 4097, 8192]),
        2 => 0u32..9000,
        1 => any::<u32>(),
    ]
}

/// One random descriptor: (addr, len, flags, next).
fn descriptor(queue_size: u16) -> impl Strategy<Value = (u64, u32, u16, u16)> {
    (addr(), len(), 0u16..8, 0..queue_size.saturating_add(2))
}

/// A scenario made up whole: a random table (and an indirect table at 0x2000), header,
/// ranges, ring.
fn made_up() -> impl Strategy<Value = Scenario> {
    prop::sample::select(vec![1u16, 2, 4, 8, 16, 3, 0]).prop_flat_map(|q| {
        let size = q.max(1);
        (
            Just(q),
            prop::collection::vec(descriptor(size), usize::from(size)),
            prop::collection::vec(descriptor(size), 0..6),
            prop::collection::vec(0..size.saturating_add(1), usize::from(size)),
            0u16..size.saturating_add(3),
            prop::sample::select(vec![0u32, 1, 4, 8, 11, 13, 2, 99]),
            prop_oneof![Just(0u64), Just(8), Just(4095), Just(4096), any::<u64>()],
            any::<[u8; 16]>(),
            any::<(bool, bool)>(),
        )
            .prop_map(
                |(q, table, indirect, ring, avail_idx, kind, sector, range, (ind, ro))| {
                    let mut chunks = Vec::new();
                    let mut put_table = |at: u32, descs: &[(u64, u32, u16, u16)]| {
                        let mut bytes = Vec::new();
                        for &(a, l, f, n) in descs {
                            bytes.extend_from_slice(&a.to_le_bytes());
                            bytes.extend_from_slice(&l.to_le_bytes());
                            bytes.extend_from_slice(&f.to_le_bytes());
                            bytes.extend_from_slice(&n.to_le_bytes());
                        }
                        chunks.push((at, bytes));
                    };
                    put_table(TABLE as u32, &table);
                    put_table(0x2000, &indirect);
                    let mut ring_bytes = Vec::new();
                    for h in ring {
                        ring_bytes.extend_from_slice(&h.to_le_bytes());
                    }
                    chunks.push((AVAIL as u32 + 4, ring_bytes));
                    let mut header = kind.to_le_bytes().to_vec();
                    header.extend_from_slice(&[0; 4]);
                    header.extend_from_slice(&sector.to_le_bytes());
                    chunks.push((HEADER as u32, header));
                    chunks.push((DATA as u32, range.to_vec()));
                    Scenario {
                        queue_size: q,
                        avail_idx,
                        indirect: ind,
                        read_only: ro,
                        chunks,
                    }
                },
            )
    })
}

/// A seed, mutated: bytes overwritten, flipped, cut or spliced.
fn mutated() -> impl Strategy<Value = Scenario> {
    let n = corpus().len();
    (
        0..n,
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 0..12),
    )
        .prop_map(|(i, edits)| {
            let mut bytes = corpus()[i].clone();
            for (at, value, how) in edits {
                if bytes.is_empty() {
                    break;
                }
                let at = at.index(bytes.len());
                match how {
                    0 => bytes[at] = value,
                    1 => bytes[at] ^= 1 << (value % 8),
                    _ => bytes.truncate(at.max(SEED_HEAD_BYTES)),
                }
            }
            Scenario::from_seed(&bytes)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn made_up_rings_never_hand_on_memory_outside_the_guest(s in made_up()) {
        run(&s)?;
    }

    #[test]
    fn mutated_seeds_never_hand_on_memory_outside_the_guest(s in mutated()) {
        run(&s)?;
    }
}

#[test]
fn every_seed_walks_as_its_readme_says() {
    // Each seed's name says what its first request must come to.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus");
    for (name, want) in seeds() {
        let bytes = std::fs::read(dir.join(format!("{name}.bin"))).unwrap();
        let s = Scenario::from_seed(&bytes);
        assert_eq!(bytes, s.to_seed(), "{name}: the seed format round-trips");
        let mem = s.memory();
        let mut chain = Vec::with_capacity(usize::from(s.queue_size));
        let limits = ChainLimits {
            queue_size: s.queue_size,
            indirect: s.indirect,
        };
        let head: u16 = mem.read_obj(GuestAddress(AVAIL + 4)).unwrap();
        let got = walk_chain(&mem, GuestAddress(TABLE), limits, head, &mut chain)
            .map_err(ParseError::Chain)
            .and_then(|()| parse(&mem, &chain, &geometry(s.read_only)));
        let got = match got {
            Ok(r) => format!("{:?}", r.op),
            Err(ParseError::Refused { error, .. }) => format!("refused: {error:?}"),
            Err(ParseError::Chain(e)) => format!("broken: {e:?}"),
        };
        assert!(got.starts_with(want), "{name}: {got}, wanted {want}");
        run(&s).unwrap();
    }
}

/// The corpus, by name, with what the first request of each comes to.
fn seeds() -> Vec<(&'static str, &'static str)> {
    vec![
        ("read", "Read"),
        ("write_two_regions", "Write"),
        ("flush", "Flush"),
        ("get_id", "GetId"),
        ("discard", "Discard"),
        ("write_zeroes_unmap", "WriteZeroes"),
        ("indirect_read", "Read"),
        ("loop", "broken: TooLong"),
        ("outside_memory", "refused: BufferOutsideMemory"),
        ("wrong_direction", "refused: WrongDirection"),
        ("header_size", "refused: HeaderSize"),
        ("past_capacity", "refused: PastCapacity"),
        ("unknown_type", "refused: Unsupported"),
        ("read_only_write", "refused: ReadOnly"),
    ]
}

/// Writes the corpus (`cargo test -p hypoll-vhost --test fuzz -- --ignored write_corpus`).
#[test]
#[ignore]
fn write_corpus() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus");
    let desc = |a: u64, l: u32, f: u16, n: u16| {
        let mut b = a.to_le_bytes().to_vec();
        b.extend_from_slice(&l.to_le_bytes());
        b.extend_from_slice(&f.to_le_bytes());
        b.extend_from_slice(&n.to_le_bytes());
        b
    };
    let chain = |bufs: &[(u64, u32, bool)]| -> Vec<u8> {
        bufs.iter()
            .enumerate()
            .flat_map(|(i, &(a, l, w))| {
                let last = i + 1 == bufs.len();
                let f = if w { WRITE } else { 0 } | if last { 0 } else { NEXT };
                desc(a, l, f, i as u16 + 1)
            })
            .collect()
    };
    let header = |kind: u32, sector: u64| {
        let mut h = kind.to_le_bytes().to_vec();
        h.extend_from_slice(&[0; 4]);
        h.extend_from_slice(&sector.to_le_bytes());
        h
    };
    let range = |sector: u64, n: u32, flags: u32| {
        let mut r = sector.to_le_bytes().to_vec();
        r.extend_from_slice(&n.to_le_bytes());
        r.extend_from_slice(&flags.to_le_bytes());
        r
    };
    let ring = (AVAIL as u32 + 4, vec![0u8, 0]);
    let scenario = |table: Vec<u8>, more: Vec<(u32, Vec<u8>)>, indirect, read_only| {
        let mut chunks = vec![(TABLE as u32, table), ring.clone()];
        chunks.extend(more);
        Scenario {
            queue_size: 16,
            avail_idx: 1,
            indirect,
            read_only,
            chunks,
        }
    };
    let h = HEADER as u32;
    let io = |kind, sector, data: &[(u64, u32, bool)], read_only| {
        let mut bufs = vec![(HEADER, 16, false)];
        bufs.extend_from_slice(data);
        bufs.push((STATUS, 1, true));
        scenario(
            chain(&bufs),
            vec![(h, header(kind, sector))],
            false,
            read_only,
        )
    };
    let ranged = |kind, r: Vec<u8>| {
        let bufs = [(HEADER, 16, false), (DATA, 16, false), (STATUS, 1, true)];
        scenario(
            chain(&bufs),
            vec![(h, header(kind, 0)), (DATA as u32, r)],
            false,
            false,
        )
    };
    let mut out: Vec<(&str, Scenario)> = vec![
        (
            "read",
            io(0, 8, &[(DATA, 4096, true), (DATA + 4096, 512, true)], false),
        ),
        (
            "write_two_regions",
            io(
                1,
                0,
                &[(DATA, 512, false), (HIGH_START, 1024, false)],
                false,
            ),
        ),
        ("flush", io(4, 0, &[], false)),
        ("get_id", io(8, 0, &[(DATA, 20, true)], false)),
        ("discard", ranged(11, range(64, 16, 0))),
        ("write_zeroes_unmap", ranged(13, range(8, 8, 1))),
        (
            "outside_memory",
            io(0, 0, &[(LOW_END - 256, 512, true)], false),
        ),
        ("wrong_direction", io(0, 0, &[(DATA, 512, false)], false)),
        ("past_capacity", io(0, 4095, &[(DATA, 1024, true)], false)),
        ("unknown_type", io(99, 0, &[], false)),
        ("read_only_write", io(1, 0, &[(DATA, 512, false)], true)),
    ];
    let indirect_table = chain(&[(HEADER, 16, false), (DATA, 512, true), (STATUS, 1, true)]);
    out.push((
        "indirect_read",
        scenario(
            desc(0x2000, 48, INDIRECT, 0),
            vec![(h, header(0, 0)), (0x2000, indirect_table)],
            true,
            false,
        ),
    ));
    let looping: Vec<u8> = (0..3u16)
        .flat_map(|i| desc(HEADER, 16, NEXT, (i + 1) % 3))
        .collect();
    out.push((
        "loop",
        scenario(looping, vec![(h, header(0, 0))], false, false),
    ));
    let short_header = chain(&[(HEADER, 8, false), (STATUS, 1, true)]);
    out.push((
        "header_size",
        scenario(short_header, vec![(h, header(4, 0))], false, false),
    ));
    for (name, s) in out {
        std::fs::write(dir.join(format!("{name}.bin")), s.to_seed()).unwrap();
    }
}
