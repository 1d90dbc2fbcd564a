//! No heap allocation per I/O in steady state: a counting global allocator watches the
//! whole process while tasks on a reactor read from `null` at queue depth 1 and 128, once
//! their executor, slabs and queues have grown to what the load needs.
//!
//! One test in this binary, so no other test thread allocates meanwhile; the test thread
//! only sleeps and reads atomics while it measures.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{serial, start};
use hypoll_async::SpawnExt;
use hypoll_reactor::{Device, DeviceId, DeviceOptions, IoBuf};

/// Counts allocations (and reallocations), then hands them to the system allocator.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method forwards to `System` with the caller's own arguments, so `System`'s
// guarantees are ours; counting touches only an atomic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded as it came (see the impl).
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded as it came (see the impl).
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded as it came (see the impl).
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as it came (see the impl).
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Waits (sleeping, which does not allocate) until `count` reaches `target`.
fn wait_until(count: &AtomicU64, target: u64) {
    let start = Instant::now();
    while count.load(Ordering::Relaxed) < target {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the load stalled"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Allocations while `qd` tasks, each awaiting one read at a time, do `measured` reads
/// after `warm` reads.
fn allocations_per_io(qd: u64, warm: u64, measured: u64) -> (u64, u64) {
    let device = Device::open("null").unwrap();
    let set = start(1, Some((device, DeviceOptions::new(128))));
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    for t in 0..qd {
        let (done, stop) = (done.clone(), stop.clone());
        // The join handle is dropped: the task runs on, detached.
        let _detached = set.handles()[0]
            .spawn(move |io| async move {
                let mut buf = IoBuf::zeroed(4096);
                let mut slba = t * 8;
                while !stop.load(Ordering::Relaxed) {
                    buf = io.read(DeviceId::FIRST, slba, 8, buf).await.unwrap();
                    slba = (slba + 8 * 128) % (1 << 20);
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
            .unwrap();
    }
    wait_until(&done, warm);
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    let from = done.load(Ordering::Relaxed);
    wait_until(&done, from + measured);
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - before;
    let ios = done.load(Ordering::Relaxed) - from;
    stop.store(true, Ordering::Relaxed);
    assert!(set.shutdown().panics.is_empty());
    (allocations, ios)
}

#[test]
fn steady_state_io_allocates_nothing_at_depth_1_and_128() {
    let _serial = serial();
    // The allocator is the one counting: starting a reactor allocates.
    let at_start = ALLOCATIONS.load(Ordering::Relaxed);
    drop(start(1, None));
    assert!(ALLOCATIONS.load(Ordering::Relaxed) > at_start);
    for qd in [1, 128] {
        let (allocations, ios) = allocations_per_io(qd, 50_000, 200_000);
        assert!(ios >= 200_000);
        assert_eq!(
            allocations, 0,
            "QD {qd}: {allocations} allocations over {ios} I/Os"
        );
    }
}
