//! Tests of the statistics: buckets, windows and their publication, overshoot.

use std::sync::Arc;

use super::*;
use proptest::prelude::*;

const WINDOW_NS: u64 = DEFAULT_WINDOW_MS * NS_PER_MS;

fn bucket(direction: Direction, bytes: u64) -> Bucket {
    Bucket::new(direction, bytes).unwrap()
}

#[test]
fn buckets_are_direction_plus_twice_the_size_class() {
    use Direction::{Read, Write};
    for (direction, bytes, index) in [
        (Read, 512, 0),
        (Write, 512, 1),
        (Read, 1023, 0), // one sector
        (Read, 1024, 2),
        (Write, 2048, 5),
        (Read, 4096, 6),
        (Write, 4096, 7),
        (Read, 8191, 6),
        (Read, 32 * 1024, 12),
        (Read, 64 * 1024, 14),
        (Write, 64 * 1024, 15),
        (Read, 1 << 20, 14), // clamped to the last class
        (Write, u64::MAX, 15),
    ] {
        let b = bucket(direction, bytes);
        assert_eq!(b.index(), index, "{direction:?} {bytes}");
        assert_eq!(b.direction(), direction);
    }
    assert_eq!(Bucket::new(Read, 511), None);
    assert_eq!(Bucket::new(Write, 0), None); // flush
    assert_eq!(Bucket::all().count(), BUCKETS);
    assert_eq!(Bucket::from_index(BUCKETS), None);
    assert_eq!(bucket(Read, 4096).bytes_min(), 4096);
    assert_eq!(bucket(Read, 4096).to_string(), "read 4KiB");
    assert_eq!(bucket(Write, 512).to_string(), "write 512B");
    assert_eq!(bucket(Write, 1 << 20).to_string(), "write 64KiB+");
}

#[test]
fn a_window_is_published_at_its_end_not_before() {
    let device = DeviceStats::new();
    let mut recorder = device.recorder(5);
    let read_4k = bucket(Direction::Read, 4096);
    for latency_ns in [8000, 9000, 10_003] {
        recorder.record(read_4k, latency_ns);
    }
    assert!(!recorder.tick(WINDOW_NS - 1));
    assert!(!recorder.snapshot().bucket(read_4k).has_samples());
    assert!(!device.snapshot().bucket(read_4k).has_samples());

    assert!(recorder.tick(WINDOW_NS));
    let stats = *recorder.snapshot().bucket(read_4k);
    // Hand-computed: mean (8000 + 9000 + 10003) / 3 = 9001, min 8000, max 10003.
    assert_eq!(
        (
            stats.count,
            stats.mean_ns,
            stats.min_ns,
            stats.max_ns,
            stats.window
        ),
        (3, 9001, 8000, 10_003, 0)
    );
    assert!(stats.p50_ns.abs_diff(9000) <= 9000 / 32, "{stats:?}");
    assert_eq!(stats.p99_ns, 10_003); // clamped to the max
    assert_eq!(device.snapshot(), *recorder.snapshot());
    assert_eq!(recorder.snapshot().generation(), 1);
    // The other buckets are untouched.
    let others = recorder.snapshot().iter().filter(|(b, _)| *b != read_4k);
    assert!(others.into_iter().all(|(_, s)| *s == BucketStats::EMPTY));
}

#[test]
fn the_mean_rounds_down_like_blk_stat() {
    let device = DeviceStats::new();
    let mut recorder = device.recorder(0);
    let b = bucket(Direction::Write, 512);
    recorder.record(b, 1);
    recorder.record(b, 2);
    recorder.tick(WINDOW_NS);
    assert_eq!(recorder.snapshot().bucket(b).mean_ns, 1);
}

#[test]
fn a_bucket_without_samples_keeps_its_last_published_value() {
    let device = DeviceStats::new();
    let mut recorder = device.recorder(0);
    let (read, write) = (
        bucket(Direction::Read, 4096),
        bucket(Direction::Write, 4096),
    );
    recorder.record(read, 9001);
    recorder.record(write, 20_000);
    recorder.tick(WINDOW_NS);
    let first_read = *recorder.snapshot().bucket(read);

    // Window 1: only writes.
    recorder.record(write, 30_000);
    assert!(recorder.tick(2 * WINDOW_NS));
    assert_eq!(*recorder.snapshot().bucket(read), first_read);
    assert_eq!(recorder.snapshot().bucket(write).mean_ns, 30_000);
    assert_eq!(recorder.snapshot().bucket(write).window, 1);

    // Window 2: nothing at all. Nothing changes, not even the generation.
    let before = recorder.snapshot().clone();
    assert!(!recorder.tick(3 * WINDOW_NS));
    assert_eq!(*recorder.snapshot(), before);
    // Windows 3 to 9 skipped (an idle reactor): still nothing changes.
    assert!(!recorder.tick(10 * WINDOW_NS + 7));
    assert_eq!(*recorder.snapshot(), before);
    // Window 10 has a read again.
    recorder.record(read, 7000);
    assert!(recorder.tick(11 * WINDOW_NS));
    let read_stats = recorder.snapshot().bucket(read);
    assert_eq!((read_stats.mean_ns, read_stats.window), (7000, 10));
    assert_eq!(recorder.snapshot().bucket(write).mean_ns, 30_000);
}

#[test]
fn windows_are_aligned_and_configurable() {
    assert_eq!(
        DeviceStats::with_window_ms(0).unwrap_err(),
        StatsConfigError::WindowOutOfRange { window_ms: 0 }
    );
    assert!(DeviceStats::with_window_ms(WINDOW_MS_MAX + 1).is_err());
    let device = DeviceStats::with_window_ms(10).unwrap();
    assert_eq!(device.window_ns(), 10 * NS_PER_MS);
    // A recorder made at 25 ms records window 2, which ends at 30 ms.
    let mut recorder = device.recorder(25 * NS_PER_MS);
    let b = bucket(Direction::Read, 512);
    recorder.record(b, 100);
    assert!(!recorder.tick(30 * NS_PER_MS - 1));
    assert!(recorder.tick(30 * NS_PER_MS));
    assert_eq!(recorder.snapshot().bucket(b).window, 2);
}

#[test]
fn a_window_is_published_when_every_recorder_has_handed_it_in() {
    let device = DeviceStats::new();
    let (mut a, mut b) = (device.recorder(0), device.recorder(0));
    let read = bucket(Direction::Read, 4096);
    a.record(read, 1000);
    b.record(read, 3000);
    b.record(read, 5000);

    // `a` crosses first: nothing is published yet.
    assert!(!a.tick(WINDOW_NS + 10));
    assert!(!a.snapshot().bucket(read).has_samples());
    assert!(!a.tick(WINDOW_NS + 20));
    // `b` crosses: the merged window is published...
    assert!(b.tick(WINDOW_NS + 30));
    let merged = *b.snapshot().bucket(read);
    assert_eq!(
        (merged.count, merged.mean_ns, merged.min_ns, merged.max_ns),
        (3, 3000, 1000, 5000)
    );
    // ...and `a`, which was waiting for it, picks it up at its next tick.
    assert!(a.tick(WINDOW_NS + 40));
    assert_eq!(a.snapshot(), b.snapshot());
    assert!(!a.tick(WINDOW_NS + 50));
}

#[test]
fn a_silent_recorder_delays_publication_by_one_window_only() {
    let device = DeviceStats::new();
    let (mut a, mut silent) = (device.recorder(0), device.recorder(0));
    let read = bucket(Direction::Read, 4096);
    a.record(read, 1000);
    assert!(!a.tick(WINDOW_NS)); // hands in window 0; `silent` never does
    a.record(read, 2000);
    // `a` hands in window 1: window 0 is published as it is, window 1 waits.
    assert!(a.tick(2 * WINDOW_NS));
    let stats = *a.snapshot().bucket(read);
    assert_eq!((stats.count, stats.mean_ns, stats.window), (1, 1000, 0));

    // `silent` wakes with samples from window 0: they are late and count in window 1,
    // and it has finished window 1 too, so window 1 is published.
    silent.record(read, 4000);
    assert!(silent.tick(2 * WINDOW_NS + 5));
    let stats = *silent.snapshot().bucket(read);
    assert_eq!((stats.count, stats.mean_ns, stats.window), (2, 3000, 1));
    assert!(a.tick(2 * WINDOW_NS + 6));
    assert_eq!(a.snapshot(), silent.snapshot());
}

#[test]
fn the_last_recorder_to_leave_publishes_the_rest() {
    let device = DeviceStats::new();
    let (mut a, mut b) = (device.recorder(0), device.recorder(0));
    let read = bucket(Direction::Read, 4096);
    a.record(read, 1000);
    a.tick(WINDOW_NS); // handed in, waits for `b`
    drop(a); // leaves: `b` alone decides now
    b.record(read, 3000);
    assert!(b.tick(WINDOW_NS + 1));
    assert_eq!(b.snapshot().bucket(read).mean_ns, 2000);
    b.record(read, 8000); // window 1, never ended
    drop(b);
    let stats = *device.snapshot().bucket(read);
    assert_eq!((stats.count, stats.mean_ns), (1, 8000));
    // A newcomer starts from the published statistics.
    let c = device.recorder(5 * WINDOW_NS);
    assert_eq!(c.snapshot().bucket(read).mean_ns, 8000);
}

#[test]
fn overshoot_is_kept_as_a_distribution() {
    let mut overshoot = OvershootStats::new();
    assert_eq!((overshoot.count(), overshoot.mean_ns()), (0, None));
    assert_eq!(overshoot.record(5000, 5700), 700);
    assert_eq!(overshoot.record(5000, 4000), 0); // early: counted as 0
    assert_eq!(overshoot.record(2000, 4300), 2300);
    assert_eq!(overshoot.record(1000, 1000), 0);
    assert_eq!(overshoot.count(), 4);
    assert_eq!(overshoot.early_wakeups(), 1);
    // Overshoots 0, 0, 700, 2300: mean 750, min 0, max 2300, p50 0 (rank 2), p99 2300.
    assert_eq!(overshoot.mean_ns(), Some(750));
    assert_eq!(
        (overshoot.min_ns(), overshoot.max_ns()),
        (Some(0), Some(2300))
    );
    let summary = overshoot.summary().unwrap();
    assert_eq!((summary.p50_ns, summary.p99_ns), (0, 2300));
    assert!(summary.p90_ns == 2300, "{summary:?}");
    overshoot.clear();
    assert_eq!((overshoot.count(), overshoot.early_wakeups()), (0, 0));
}

#[test]
fn a_recorder_keeps_its_reactors_overshoot() {
    let device = DeviceStats::new();
    let (mut a, b) = (device.recorder(0), device.recorder(0));
    assert_eq!(a.record_sleep(4501, 9800), 5299);
    assert_eq!(a.overshoot().max_ns(), Some(5299));
    assert_eq!(b.overshoot().count(), 0); // per reactor
    a.tick(WINDOW_NS); // windows do not touch it
    assert_eq!(a.overshoot().count(), 1);
    a.overshoot_mut().clear();
    assert_eq!(a.overshoot().count(), 0);
}

#[test]
fn recorders_and_devices_can_move_to_their_reactor_threads() {
    fn send<T: Send>() {}
    send::<StatsRecorder>();
    send::<Arc<DeviceStats>>();
    send::<Box<dyn crate::PollPolicy>>();
}

#[test]
fn leaving_after_a_silent_window_loses_nothing() {
    let device = DeviceStats::new();
    let (mut a, mut b) = (device.recorder(0), device.recorder(0));
    let read = bucket(Direction::Read, 4096);
    a.record(read, 1000);
    a.tick(2 * WINDOW_NS + 1); // finished windows 0 and 1; `b` is silent in window 0
    b.record(read, 2000);
    b.tick(2 * WINDOW_NS + 2); // window 0 and (with `a`) window 1 are published
    a.record(read, 3000);
    drop(a);
    b.record(read, 4000);
    drop(b);
    assert_eq!(device.lock().published_samples, 4);
    assert_eq!(device.lock().recorders, [None, None]);
}

#[derive(Clone, Debug)]
enum Step {
    Record(usize, u64),
    Tick(usize),
    Advance(u64),
    Replace(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0usize..3, 1u64..100_000).prop_map(|(who, ns)| Step::Record(who, ns)),
        (0usize..3).prop_map(Step::Tick),
        (0..3 * WINDOW_NS).prop_map(Step::Advance),
        (0usize..3).prop_map(Step::Replace),
    ]
}

proptest! {
    /// Whatever reactors record, however they tick, fall silent, leave and join, every
    /// sample is published exactly once, and a reactor that ticks after everyone has
    /// finished a window sees that window.
    #[test]
    fn no_sample_is_lost_or_counted_twice(steps in prop::collection::vec(step(), 1..120)) {
        let device = DeviceStats::with_window_ms(DEFAULT_WINDOW_MS).unwrap();
        let mut now_ns = 0;
        let mut recorders: Vec<_> = (0..3).map(|_| device.recorder(now_ns)).collect();
        let mut recorded = 0;
        let b = bucket(Direction::Write, 4096);
        for step in steps {
            match step {
                Step::Record(who, ns) => {
                    recorders[who].record(b, ns);
                    recorded += 1;
                }
                Step::Tick(who) => {
                    recorders[who].tick(now_ns);
                }
                Step::Advance(ns) => now_ns += ns,
                Step::Replace(who) => recorders[who] = device.recorder(now_ns),
            }
        }
        // Everyone moves on by a window: everything recorded so far is published.
        now_ns += WINDOW_NS;
        for recorder in &mut recorders {
            recorder.tick(now_ns);
        }
        prop_assert_eq!(device.lock().published_samples, recorded);
        let published = device.snapshot();
        for recorder in &mut recorders {
            recorder.tick(now_ns);
            prop_assert_eq!(recorder.snapshot(), &published);
        }
    }

    /// Whatever the samples and however they are spread over recorders, one window's
    /// publication has the exact count, sum-derived mean, min and max of all of them.
    #[test]
    fn publication_merges_every_recorder_exactly(
        samples in prop::collection::vec((0usize..3, 0u64..10_000_000), 1..200),
    ) {
        let device = DeviceStats::new();
        let mut recorders: Vec<_> = (0..3).map(|_| device.recorder(0)).collect();
        let b = bucket(Direction::Read, 4096);
        for &(who, latency_ns) in &samples {
            recorders[who].record(b, latency_ns);
        }
        for (i, recorder) in recorders.iter_mut().enumerate() {
            recorder.tick(WINDOW_NS + i as u64);
        }
        let values: Vec<u64> = samples.iter().map(|&(_, v)| v).collect();
        let stats = *device.snapshot().bucket(b);
        prop_assert_eq!(stats.count, values.len() as u64);
        prop_assert_eq!(stats.mean_ns, values.iter().sum::<u64>() / values.len() as u64);
        prop_assert_eq!(stats.min_ns, *values.iter().min().unwrap());
        prop_assert_eq!(stats.max_ns, *values.iter().max().unwrap());
        for recorder in &mut recorders {
            recorder.tick(WINDOW_NS + 10);
            prop_assert_eq!(recorder.snapshot().bucket(b), &stats);
        }
    }
}
