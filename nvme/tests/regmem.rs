//! Memory the application owns, registered with a queue pair: an mmapped memfd region
//! written from and read into (one buffer and vectored) on `emu`, `null` and `uring` (a
//! temporary file: O_DIRECT, through the page cache, and made inline), unregistering
//! refused while a command uses the region and allowed after, and bad regions refused
//! clearly.

use std::io::{IoSlice, IoSliceMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypoll_nvme::{
    Command, Controller, DeviceConfig, MemoryRegion, QueuePair, RegionError, RegisterError, Status,
    SubmitError, UnregisterError, UringConfig, UringController, REGIONS_MAX, REGION_ALIGN_BYTES,
};

const TIMEOUT: Duration = Duration::from_secs(10);
const PAGE: usize = REGION_ALIGN_BYTES;

/// An mmapped memfd: memory the application allocated, as a front end serving a guest's
/// memory would hold it. Unmapped on drop (after the queue pair that used it, by the tests'
/// order of declaration and explicit drops).
struct Memfd {
    ptr: *mut u8,
    len_bytes: usize,
}

impl Memfd {
    fn new(len_bytes: usize) -> Memfd {
        // SAFETY: memfd_create takes a NUL-terminated name and flags; it touches no memory.
        let fd = unsafe { libc::memfd_create(c"hypoll-regmem".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` is the memfd just created and owned here.
        assert_eq!(unsafe { libc::ftruncate(fd, len_bytes as libc::off_t) }, 0);
        // SAFETY: a new shared mapping of our own memfd at an address the kernel chooses.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap of the memfd");
        // SAFETY: the mapping holds the file open; the descriptor is ours to close.
        unsafe { libc::close(fd) };
        Memfd {
            ptr: ptr.cast(),
            len_bytes,
        }
    }

    fn at(&self, offset: usize) -> *mut u8 {
        assert!(offset <= self.len_bytes);
        self.ptr.wrapping_add(offset)
    }

    /// The bytes at `offset`. Only while no command uses them. Hands out `&mut` from `&self`
    /// as a mapping shared with a device does: each caller takes a range no other live
    /// reference covers.
    #[allow(clippy::mut_from_ref)]
    fn slice(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset + len <= self.len_bytes);
        // SAFETY: inside the mapping; the tests touch a range only while no command is
        // outstanding on it, and hold no other reference to it meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.at(offset), len) }
    }
}

impl Drop for Memfd {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer registered with any queue pair.
        unsafe { libc::munmap(self.ptr.cast(), self.len_bytes) };
    }
}

fn open(device: &str) -> Arc<dyn Controller> {
    device
        .parse::<DeviceConfig>()
        .expect("device string parses")
        .open()
        .expect("device opens")
}

/// Reaps until the completion of `tag` comes, for up to 10 s.
fn wait(qp: &mut dyn QueuePair, tag: u64) -> Status {
    let deadline = Instant::now() + TIMEOUT;
    let mut seen = None;
    while seen.is_none() {
        qp.process_completions(8, &mut |c| {
            assert_eq!(c.tag, tag, "one command at a time");
            seen = Some(c.status);
        });
        assert!(Instant::now() < deadline, "no completion within 10 s");
    }
    seen.expect("loop ends on a completion")
}

fn fill(buf: &mut [u8], seed: u8) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

/// Registers a memfd region, writes from it and reads into it with one buffer and with
/// segments, and checks the bytes; `qp` moves data unless `moves_data` is false (`null`).
fn round_trips_through_a_registered_memfd(qp: &mut dyn QueuePair, moves_data: bool) {
    let lba = qp.namespace().lba_size_bytes as usize;
    let mem = Memfd::new(64 * PAGE);
    // SAFETY: `mem` stays mapped until after `qp` is done with it: unregistered below.
    let region = unsafe { qp.register_memory(mem.ptr, mem.len_bytes) }.expect("register");
    assert_eq!((region.ptr(), region.len_bytes()), (mem.ptr, mem.len_bytes));

    // One buffer: two pages out of the region, back into another part of it.
    let n = 2 * PAGE;
    fill(mem.slice(0, n), 7);
    let nlb = (n / lba) as u32;
    let write = Command::write(8, nlb, &mem.slice(0, n)[..]);
    // SAFETY: the region's pages stay valid and untouched until `wait` reaps the command.
    unsafe { qp.submit(&write, 1) }.expect("write from the region");
    assert_eq!(wait(qp, 1), Status::SUCCESS);
    let read = Command::read(8, nlb, mem.slice(16 * PAGE, n));
    // SAFETY: as above.
    unsafe { qp.submit(&read, 2) }.expect("read into the region");
    assert_eq!(wait(qp, 2), Status::SUCCESS);
    if moves_data {
        assert_eq!(mem.slice(16 * PAGE, n), mem.slice(0, n));
    }

    // Vectored: two segments a block each, from scattered pages, gathered back elsewhere.
    fill(mem.slice(32 * PAGE, PAGE), 1);
    fill(mem.slice(40 * PAGE, PAGE), 2);
    let segs = [
        IoSlice::new(&mem.slice(32 * PAGE, PAGE)[..lba]),
        IoSlice::new(&mem.slice(40 * PAGE, PAGE)[..lba]),
    ];
    let writev = Command::writev(100, 2, &segs);
    // SAFETY: as above.
    unsafe { qp.submit(&writev, 3) }.expect("writev from the region");
    assert_eq!(wait(qp, 3), Status::SUCCESS);
    let mut segs = [
        IoSliceMut::new(&mut mem.slice(48 * PAGE, PAGE)[..lba]),
        IoSliceMut::new(&mut mem.slice(56 * PAGE, PAGE)[..lba]),
    ];
    let readv = Command::readv(100, 2, &mut segs);
    // SAFETY: as above.
    unsafe { qp.submit(&readv, 4) }.expect("readv into the region");
    assert_eq!(wait(qp, 4), Status::SUCCESS);
    if moves_data {
        assert_eq!(mem.slice(48 * PAGE, lba), mem.slice(32 * PAGE, lba));
        assert_eq!(mem.slice(56 * PAGE, lba), mem.slice(40 * PAGE, lba));
    }

    in_use_regions_cannot_be_unregistered(qp, &mem, region);
}

/// With a command outstanding in the region, unregistering is refused and the region stays
/// usable; once the completion is reaped it succeeds, and the handle is stale after.
fn in_use_regions_cannot_be_unregistered(
    qp: &mut dyn QueuePair,
    mem: &Memfd,
    region: MemoryRegion,
) {
    let lba = qp.namespace().lba_size_bytes as usize;
    let write = Command::write(0, 1, &mem.slice(0, lba)[..]);
    // SAFETY: as in the round trip: reaped by `wait` below, before `mem` goes.
    unsafe { qp.submit(&write, 5) }.expect("write from the region");
    assert_eq!(
        qp.unregister_memory(region),
        Err(UnregisterError::InUse { commands: 1 }),
        "the device may still read the region"
    );
    assert_eq!(wait(qp, 5), Status::SUCCESS);
    assert_eq!(qp.unregister_memory(region), Ok(()));
    assert_eq!(
        qp.unregister_memory(region),
        Err(UnregisterError::Unknown),
        "a handle is good for one unregistration"
    );
}

/// Zero length, a start or length off the page, overlapping regions, one region too many,
/// and a buffer across a region's edge: each refused with its own error.
fn bad_input_is_refused_clearly(qp: &mut dyn QueuePair) {
    let lba = qp.namespace().lba_size_bytes as usize;
    let mem = Memfd::new((REGIONS_MAX + 8) * PAGE);
    // SAFETY: (every registration here) `mem` outlives the queue pair's use of it; every
    // region is unregistered before the test returns.
    unsafe {
        assert!(matches!(
            qp.register_memory(mem.ptr, 0),
            Err(RegisterError::Empty)
        ));
        assert!(matches!(
            qp.register_memory(mem.at(64), PAGE),
            Err(RegisterError::Misaligned { .. })
        ));
        assert!(matches!(
            qp.register_memory(mem.ptr, PAGE + 512),
            Err(RegisterError::Misaligned { .. })
        ));
    }
    // SAFETY: as above.
    let first = unsafe { qp.register_memory(mem.ptr, 4 * PAGE) }.expect("register");
    // SAFETY: as above.
    let overlap = unsafe { qp.register_memory(mem.at(2 * PAGE), 4 * PAGE) };
    assert!(
        matches!(overlap, Err(RegisterError::Overlaps { .. })),
        "{overlap:?}"
    );

    // A write whose buffer starts in the region and runs past it.
    let across = Command::write(
        0,
        (2 * PAGE / lba) as u32,
        &mem.slice(3 * PAGE, 2 * PAGE)[..],
    );
    // SAFETY: refused before reaching the device.
    let refused = unsafe { qp.submit(&across, 9) };
    assert!(
        matches!(
            refused,
            Err(SubmitError::Region(RegionError::Straddles { .. }))
        ),
        "{refused:?}"
    );
    assert_eq!(qp.outstanding(), 0);

    // Fill the table: one page each after the first region's four.
    let mut all = vec![first];
    for i in 1..REGIONS_MAX {
        // SAFETY: as above.
        let r = unsafe { qp.register_memory(mem.at((3 + i) * PAGE), PAGE) }.expect("room left");
        all.push(r);
    }
    // SAFETY: as above.
    let too_many = unsafe { qp.register_memory(mem.at((REGIONS_MAX + 4) * PAGE), PAGE) };
    assert!(
        matches!(too_many, Err(RegisterError::TooMany { max: REGIONS_MAX })),
        "{too_many:?}"
    );
    for r in all {
        assert_eq!(qp.unregister_memory(r), Ok(()));
    }
    // Every slot free again.
    // SAFETY: as above.
    let again = unsafe { qp.register_memory(mem.ptr, mem.len_bytes) }.expect("register");
    assert_eq!(qp.unregister_memory(again), Ok(()));
}

#[test]
fn emu_reads_and_writes_registered_memory_and_refuses_to_unregister_it_in_use() {
    let ctrl = open("emu:optane,size=64M");
    let mut qp = ctrl.create_queue_pair(8).expect("queue pair");
    round_trips_through_a_registered_memfd(&mut *qp, true);
    bad_input_is_refused_clearly(&mut *qp);
}

#[test]
fn null_keeps_the_same_bookkeeping() {
    let ctrl = open("null");
    let mut qp = ctrl.create_queue_pair(8).expect("queue pair");
    round_trips_through_a_registered_memfd(&mut *qp, false);
    bad_input_is_refused_clearly(&mut *qp);
}

fn uring_file(blocks: usize) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir");
    let path = dir.path().join("disk.img");
    // Written, not sparse: reading a hole never reaches the device.
    std::fs::write(&path, vec![0x5au8; blocks * 4096]).expect("write data file");
    (dir, path)
}

#[test]
fn uring_reads_and_writes_registered_memory_and_refuses_to_unregister_it_in_use() {
    let (_dir, path) = uring_file(256);
    let ctrl = UringController::open(&UringConfig::new(&path)).expect("open (O_DIRECT)");
    let mut qp = ctrl.queue_pair(8).expect("queue pair");
    // Whether the region became a fixed buffer depends on the kernel (sparse tables, 5.19)
    // and the memlock limit; the bytes must be right either way, and a fixed region must
    // carry the one-buffer I/O.
    let mem = Memfd::new(4 * PAGE);
    // SAFETY: `mem` stays mapped until after it is unregistered below.
    let region = unsafe { qp.register_memory(mem.ptr, mem.len_bytes) }.expect("register");
    let fixed = qp.region_is_fixed(&region);
    let before = qp.fixed_ios();
    fill(mem.slice(0, PAGE), 3);
    let write = Command::write(1, 1, &mem.slice(0, PAGE)[..]);
    // SAFETY: reaped by `wait` before the region goes.
    unsafe { qp.submit(&write, 1) }.expect("write");
    assert_eq!(wait(&mut qp, 1), Status::SUCCESS);
    let read = Command::read(1, 1, mem.slice(PAGE, PAGE));
    // SAFETY: as above.
    unsafe { qp.submit(&read, 2) }.expect("read");
    assert_eq!(wait(&mut qp, 2), Status::SUCCESS);
    assert_eq!(mem.slice(PAGE, PAGE), mem.slice(0, PAGE));
    assert_eq!(qp.fixed_ios() - before, if fixed { 2 } else { 0 });
    eprintln!("uring: the region registered as a fixed buffer: {fixed}");
    assert_eq!(qp.unregister_memory(region), Ok(()));

    round_trips_through_a_registered_memfd(&mut qp, true);
    bad_input_is_refused_clearly(&mut qp);
}

#[test]
fn uring_in_the_page_cache_too() {
    let (_dir, path) = uring_file(256);
    let mut cfg = UringConfig::new(&path);
    cfg.set("direct", "0").expect("key");
    let ctrl = UringController::open(&cfg).expect("open");
    let mut qp = ctrl.queue_pair(8).expect("queue pair");
    round_trips_through_a_registered_memfd(&mut qp, true);
}

/// Reads and writes made by the queue pair's own thread (`inline=on`) use the region until
/// their completion is delivered, as those in the kernel do.
#[test]
fn uring_inline_too() {
    let (_dir, path) = uring_file(256);
    let mut cfg = UringConfig::new(&path);
    cfg.set("direct", "0").expect("key");
    cfg.set("inline", "on").expect("key");
    let ctrl = UringController::open(&cfg).expect("open");
    assert!(ctrl.describe().contains("inline=on"), "{}", ctrl.describe());
    let mut qp = ctrl.queue_pair(8).expect("queue pair");
    round_trips_through_a_registered_memfd(&mut qp, true);
}
