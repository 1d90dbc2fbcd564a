use std::sync::{Arc, Mutex};

use hypoll_policy::{Bucket, Direction, InFlight, OvershootStats, Snapshot};

use super::*;

/// What a [`Recorder`] was told.
#[derive(Default)]
struct Heard {
    decisions: u32,
    completions: Vec<u64>,
    sleeps: u32,
    /// The mean latency of 4 KiB reads in the statistics each decision was shown.
    means_ns: Vec<u64>,
}

/// A policy that answers `answer` and writes down what it is told.
struct Recorder {
    answer: Decision,
    heard: Arc<Mutex<Heard>>,
}

impl PollPolicy for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }

    fn decide(&mut self, ctx: &PollContext<'_>) -> Decision {
        let mut heard = self.heard.lock().unwrap();
        heard.decisions += 1;
        heard.means_ns.push(ctx.stats.bucket(READ_4K).mean_ns);
        self.answer
    }

    fn on_completion(&mut self, seen: &Observation) {
        self.heard.lock().unwrap().completions.push(seen.submit_ns);
    }

    fn on_sleep(&mut self, _slept: &Slept, _cpu_ns: Option<u64>) {
        self.heard.lock().unwrap().sleeps += 1;
    }
}

const SEGMENT_NS: u64 = 1_000;
const READ_4K: Bucket = match Bucket::new(Direction::Read, 4096) {
    Some(bucket) => bucket,
    None => unreachable!(),
};

fn pair() -> (Alternating, [Arc<Mutex<Heard>>; 2]) {
    let heard = [Arc::default(), Arc::default()];
    let answers = [Decision::Spin, Decision::WaitInterrupt];
    let sides = [0, 1].map(|i| -> Box<dyn PollPolicy> {
        Box::new(Recorder {
            answer: answers[i],
            heard: Arc::clone(&heard[i]),
        })
    });
    (
        Alternating::new(sides, Duration::from_nanos(SEGMENT_NS)),
        heard,
    )
}

fn decide(policy: &mut Alternating, submit_ns: u64, now_ns: u64) -> Decision {
    let (stats, overshoot) = (Snapshot::EMPTY, OvershootStats::new());
    policy.decide(&PollContext {
        now_ns,
        outstanding: 1,
        oldest: InFlight {
            bucket: None,
            submit_ns,
            slept: false,
        },
        stats: &stats,
        overshoot: &overshoot,
        interrupts: true,
        oracle_deadline_ns: None,
    })
}

fn completion(submit_ns: u64) -> Observation {
    Observation {
        bucket: None,
        submit_ns,
        latency_ns: 10,
        slept: None,
        idle_polls: 0,
        censored: false,
        after_interrupt: false,
    }
}

#[test]
fn each_policy_is_shown_statistics_of_its_own_turns_only() {
    // The reactor's statistics mix both sides' I/Os; each side must see only its own, as
    // it would running alone: here side 0's reads take 100 us and side 1's 10 ms.
    let (mut policy, heard) = pair();
    let segment_ns = 1_000_000;
    policy.segment_ns = segment_ns;
    let mut submit_ns = 0;
    while submit_ns < 400 * segment_ns {
        let latency_ns = if side_of(submit_ns, segment_ns) == 0 {
            100_000
        } else {
            10_000_000
        };
        policy.on_completion(&Observation {
            bucket: Some(READ_4K),
            latency_ns,
            ..completion(submit_ns)
        });
        submit_ns += 100_000;
    }
    decide(&mut policy, 400 * segment_ns, 400 * segment_ns);
    decide(&mut policy, 401 * segment_ns, 401 * segment_ns);
    drop(policy);
    let [a, b] = heard.map(|h| Arc::try_unwrap(h).ok().unwrap().into_inner().unwrap());
    assert_eq!(a.means_ns, [100_000]);
    assert_eq!(b.means_ns, [10_000_000]);
}

#[test]
fn each_call_goes_to_the_policy_whose_segment_the_io_was_submitted_in() {
    let (mut policy, heard) = pair();
    assert_eq!(policy.name(), "recorder|recorder");
    // Decided in a later segment, for an I/O submitted in an earlier one: the earlier
    // segment's policy decides.
    assert_eq!(decide(&mut policy, 999, 1_500), Decision::Spin);
    assert_eq!(decide(&mut policy, 1_000, 1_000), Decision::WaitInterrupt);
    assert_eq!(decide(&mut policy, 3_999, 4_100), Decision::WaitInterrupt);
    assert_eq!(decide(&mut policy, 4_000, 4_000), Decision::Spin);
    // A sleep is told to the policy that asked for it last.
    policy.on_sleep(
        &Slept {
            requested_ns: 5,
            actual_ns: 9,
        },
        None,
    );
    for submit_ns in [0, 999, 1_000, 1_999, 2_000, 5_500] {
        policy.on_completion(&completion(submit_ns));
    }
    drop(policy);
    let [a, b] = heard.map(|h| Arc::try_unwrap(h).ok().unwrap().into_inner().unwrap());
    assert_eq!((a.decisions, b.decisions), (2, 2));
    assert_eq!((a.sleeps, b.sleeps), (1, 0));
    assert_eq!(a.completions, [0, 999, 2_000]);
    assert_eq!(b.completions, [1_000, 1_999, 5_500]);
}

fn counters(sleeps: u64, overshoot_ns: u64) -> Counters {
    Counters {
        sleeps,
        overshoot_ns,
        ..Counters::default()
    }
}

#[test]
fn a_tally_counts_each_io_on_the_side_and_in_the_segment_it_was_submitted_in() {
    let mut tally = Tally::new(
        Duration::from_nanos(SEGMENT_NS),
        Duration::from_nanos(3_000),
        1 << 40,
    );
    assert_eq!(tally.open(100, 50, counters(0, 0)), 1_000);
    tally.record(150, true, 40);
    tally.record(600, true, 60);
    tally.record(700, false, 10);
    // The cut comes 5 ns late; an I/O submitted before it completes after it.
    assert_eq!(tally.cut(1_005, 850, counters(3, 30)), 2_000);
    tally.record(900, true, 200);
    tally.record(1_010, true, 20);
    // Submitted between the boundary and the late cut: in the segment of its time.
    tally.record(1_002, true, 7);
    // A cut a whole segment late opens the segment of its time, and ends with it.
    assert_eq!(tally.cut(3_500, 1_000, counters(4, 70)), 4_000);
    tally.record(3_600, true, 30);
    // Submitted in a segment neither open nor just closed: on its side only.
    tally.record(50, true, 1);
    tally.close(3_800, 1_100, counters(6, 90));

    let seg = |index, ios, latency_sum_ns, wall_ns, cpu_ns| Segment {
        index,
        ios,
        latency_sum_ns,
        wall_ns,
        cpu_ns,
    };
    assert_eq!(
        tally.segments,
        [
            seg(0, 3, 300, 905, 800),
            seg(1, 2, 27, 2_495, 150),
            seg(3, 1, 30, 300, 100)
        ]
    );
    let [a, b] = &tally.sides;
    assert_eq!((a.ios, a.errors, a.wall_ns, a.cpu_ns), (5, 1, 905, 800));
    assert_eq!((b.ios, b.errors, b.wall_ns, b.cpu_ns), (3, 0, 2_795, 250));
    assert_eq!((a.sleeps, a.overshoot_ns), (3, 30));
    assert_eq!((b.sleeps, b.overshoot_ns), (3, 60));
    assert_eq!(a.latency.len(), 4);
    assert_eq!(b.latency.len(), 3);
}

#[test]
fn a_tally_keeps_no_more_segments_than_its_run_holds() {
    let mut tally = Tally::new(
        Duration::from_nanos(SEGMENT_NS),
        Duration::from_nanos(2_000),
        1 << 40,
    );
    let room = tally.segments.capacity();
    let mut at = tally.open(0, 0, Counters::default());
    for _ in 0..100 {
        at = tally.cut(at, 0, Counters::default());
    }
    assert!(
        tally.segments.len() <= room,
        "{} > {room}",
        tally.segments.len()
    );
    assert_eq!(tally.segments.capacity(), room);
}

#[test]
fn merging_sums_the_reactors_segments_by_time() {
    let seg = |index, ios| Segment {
        index,
        ios,
        latency_sum_ns: ios * 10,
        wall_ns: 100,
        cpu_ns: 50,
    };
    let merged = merge([seg(2, 1), seg(1, 2), seg(2, 3)]);
    assert_eq!(
        merged,
        [
            seg(1, 2),
            Segment {
                index: 2,
                ios: 4,
                latency_sum_ns: 40,
                wall_ns: 200,
                cpu_ns: 100
            }
        ]
    );
}

/// `count` whole segments from index 0: side 0's mean latency drifts by `drift` a segment
/// (a factor), side 1's is `ratio` times what side 0's would be; CPU 100 % against `cpu1`.
fn drifting(count: u64, ratio: f64, drift: f64, cpu1_pct: u64) -> Vec<Segment> {
    (0..count)
        .map(|index| {
            let side0_mean = 10_000.0 * drift.powi(index as i32);
            let mean = if index % 2 == 1 {
                side0_mean * ratio
            } else {
                side0_mean
            };
            let ios = 1_000;
            Segment {
                index,
                ios,
                latency_sum_ns: (mean * ios as f64).round() as u64,
                wall_ns: SEGMENT_NS,
                cpu_ns: if index % 2 == 1 {
                    SEGMENT_NS * cpu1_pct / 100
                } else {
                    SEGMENT_NS
                },
            }
        })
        .collect()
}

#[test]
fn the_comparison_finds_the_ratio_through_a_drift_that_moves_the_totals() {
    let segments = drifting(81, 1.02, 1.05, 70);
    let p = paired(&segments, SEGMENT_NS, 1).expect("comparisons");
    assert_eq!(p.comparisons, 40);
    assert!((p.latency_ratio - 1.02).abs() < 1e-6, "{p:?}");
    assert!((p.cpu_points + 30.0).abs() < 1e-9, "{p:?}");
    // Five whole batches of 8: a standard error, and none where nothing scatters.
    assert!(p.latency_log_se.unwrap() < 1e-6, "{p:?}");
    assert!(p.cpu_points_se.unwrap() < 1e-9, "{p:?}");
    // The totals, as two separate runs would see them, are moved by the drift.
    let total = |side: u64| {
        let s = segments.iter().filter(|s| s.index % 2 == side);
        let (sum, ios) = s.fold((0, 0), |(l, n), s| (l + s.latency_sum_ns, n + s.ios));
        sum as f64 / ios as f64
    };
    assert!((total(1) / total(0) - 1.02).abs() > 0.005);
}

#[test]
fn short_or_empty_segments_and_gaps_take_no_part() {
    let mut segments = drifting(9, 1.05, 1.0, 50);
    // Index 1: a half-length segment; index 5: no I/O completed; index 6 is missing.
    segments[1].wall_ns = SEGMENT_NS / 2 - 1;
    segments[5].ios = 0;
    segments.remove(6);
    let p = paired(&segments, SEGMENT_NS, 1).expect("index 3 still compares");
    assert_eq!(p.comparisons, 1);
    assert!((p.latency_ratio - 1.05).abs() < 1e-6);
    assert_eq!((p.latency_log_se, p.cpu_points_se), (None, None));
    assert_eq!(paired(&segments[..2], SEGMENT_NS, 1), None);
}

#[test]
fn the_standard_error_comes_from_batches_of_consecutive_comparisons() {
    // Five batches of 8 whose means are 1, 3, 1, 3, 1; a 41st value (3) in no batch.
    let values: Vec<f64> = (0..41)
        .map(|i| if (i / 8) % 2 == 1 { 3.0 } else { 1.0 })
        .collect();
    let (mean, se) = mean_and_batch_se(&values);
    assert!((mean - 75.0 / 41.0).abs() < 1e-12, "{mean}");
    // Batch means' variance (n - 1): 4.8 / 4 = 1.2; over 5 batches: sqrt(0.24).
    assert!((se.unwrap() - 0.24f64.sqrt()).abs() < 1e-12, "{se:?}");
    // Four whole batches are too few.
    assert_eq!(mean_and_batch_se(&values[..39]).1, None);
}

#[test]
fn segments_of_several_reactors_are_whole_by_their_summed_time() {
    // Two reactors: merged segments hold twice the wall time. Both reactors' last segment
    // was cut short: together less than half of two whole ones, more than half of one.
    let mut one = drifting(5, 1.05, 1.0, 50);
    one[4].wall_ns = SEGMENT_NS * 3 / 10;
    let other = one.clone();
    let merged = merge(one.into_iter().chain(other));
    assert_eq!(merged[1].wall_ns, 2 * SEGMENT_NS);
    let p = paired(&merged, SEGMENT_NS, 2).expect("index 1 compares");
    assert_eq!(p.comparisons, 1, "index 3 has a short neighbour: {p:?}");
    assert!((p.latency_ratio - 1.05).abs() < 1e-3, "{p:?}");
    // Counted as one reactor's, every merged segment would pass as whole.
    assert_eq!(paired(&merged, SEGMENT_NS, 1).unwrap().comparisons, 2);
}
