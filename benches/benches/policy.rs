//! Cost of the policy crate's hot path: recording one completion and one decision.
//!
//! Both run once per I/O on a reactor, so both must stay far below the 50 ns a policy's
//! work per I/O may cost (docs/policies.md, Cost). Run:
//! `cargo bench -p hypoll-benches --bench policy`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use hypoll_policy::{
    build, Bucket, BucketStats, DeviceStats, Direction, InFlight, Observation, OvershootStats,
    PollContext, PollPolicy, Slept, Snapshot,
};

/// Latencies to cycle through, so the histogram counters touched vary as in a real run.
const LATENCIES: usize = 1024;
const WINDOW_NS: u64 = hypoll_policy::DEFAULT_WINDOW_MS * 1_000_000;

fn latencies_ns() -> Vec<u64> {
    // Around 9 us, spread over several sub-buckets and a few powers of two.
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    (0..LATENCIES)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            6_000 + state % 12_000
        })
        .collect()
}

fn record(c: &mut Criterion) {
    let device = DeviceStats::new();
    let mut stats = device.recorder(0);
    let bucket = Bucket::new(Direction::Read, 4096).unwrap();
    let latencies_ns = latencies_ns();
    let mut next = 0;
    c.bench_function("stats/record one completion", |b| {
        b.iter(|| {
            next = (next + 1) % LATENCIES;
            stats.record(black_box(bucket), black_box(latencies_ns[next]));
        })
    });
    c.bench_function("stats/tick within a window", |b| {
        b.iter(|| stats.tick(black_box(WINDOW_NS / 2)))
    });
    let mut now_ns = WINDOW_NS;
    c.bench_function("stats/publish one window (16 busy buckets)", |b| {
        b.iter(|| {
            for bucket in Bucket::all() {
                stats.record(bucket, 9001);
            }
            now_ns += WINDOW_NS;
            stats.tick(black_box(now_ns))
        })
    });
}

/// A bucket's published statistics over 1000 completions: mean, then [min, p50, p90, p99,
/// max].
fn published(mean_ns: u64, [min_ns, p50_ns, p90_ns, p99_ns, max_ns]: [u64; 5]) -> BucketStats {
    BucketStats {
        count: 1000,
        mean_ns,
        min_ns,
        max_ns,
        p50_ns,
        p90_ns,
        p99_ns,
        window: 7,
    }
}

/// The context of a decision for the oldest I/O, of `bucket`, submitted at `submit_ns`.
fn context<'a>(
    snapshot: &'a Snapshot,
    overshoot: &'a OvershootStats,
    bucket: Option<Bucket>,
    outstanding: usize,
    submit_ns: u64,
    now_ns: u64,
) -> PollContext<'a> {
    PollContext {
        now_ns,
        outstanding,
        oldest: InFlight {
            bucket,
            submit_ns,
            slept: false,
        },
        stats: snapshot,
        overshoot,
        interrupts: true,
        oracle_deadline_ns: None,
    }
}

fn decide(c: &mut Criterion) {
    let bucket = Bucket::new(Direction::Read, 4096);
    let stats = published(9001, [8000, 8900, 11_000, 20_000, 30_000]);
    let snapshot = Snapshot::EMPTY.with_bucket(bucket.unwrap(), stats);
    let overshoot = OvershootStats::new();
    let ctx = context(&snapshot, &overshoot, bucket, 1, 0, 1_000);
    for spec in [
        "classic",
        "hybrid",
        "hybrid-min:adjust=2000",
        "uring-hybrid",
    ] {
        // Through the registry's `Box<dyn PollPolicy>`, as a reactor holds it.
        let mut policy = build(spec).unwrap();
        policy.on_completion(&Observation {
            bucket,
            submit_ns: 0,
            latency_ns: 9001,
            slept: None,
            idle_polls: 0,
            censored: false,
            after_interrupt: false,
        });
        c.bench_function(&format!("decide ({spec})"), |b| {
            b.iter(|| policy.decide(black_box(&ctx)))
        });
    }
    let mut policy = build("uring-hybrid").unwrap();
    let seen = Observation {
        bucket,
        submit_ns: 0,
        latency_ns: 9001,
        slept: Some(Slept {
            requested_ns: 4000,
            actual_ns: 4600,
        }),
        idle_polls: 12,
        censored: false,
        after_interrupt: false,
    };
    c.bench_function("on_completion (uring-hybrid)", |b| {
        b.iter(|| policy.on_completion(black_box(&seen)))
    });
}

/// `adaptive` after a warm-up: calibrated (sleeps measured) and with its reservoirs full.
fn warmed_adaptive(bucket: Option<Bucket>, latencies_ns: &[u64]) -> Box<dyn PollPolicy> {
    let mut policy = build("adaptive").unwrap();
    for (i, &latency_ns) in latencies_ns.iter().enumerate() {
        policy.on_completion(&Observation {
            bucket,
            submit_ns: i as u64 * 100_000,
            latency_ns,
            slept: None,
            idle_polls: 10,
            censored: false,
            after_interrupt: false,
        });
    }
    for _ in 0..64 {
        let slept = Slept {
            requested_ns: 2_000,
            actual_ns: 9_000,
        };
        policy.on_sleep(&slept, Some(9_000));
    }
    policy
}

/// The adaptive policy's per-I/O costs: the decision it makes for every poll of an I/O it
/// already decided for (the spin path), the one for a new I/O (its plan, cached between
/// refreshes of the samples), and learning a completion, polled or hidden by a sleep.
fn adaptive(c: &mut Criterion) {
    let bucket = Bucket::new(Direction::Read, 4096);
    let latencies_ns = latencies_ns();
    let stats = published(12_000, [6_000, 12_000, 16_800, 17_900, 18_000]);
    let snapshot = Snapshot::EMPTY.with_bucket(bucket.unwrap(), stats);
    let overshoot = OvershootStats::new();
    let ctx = |outstanding: usize, submit_ns: u64, now_ns: u64| {
        context(
            &snapshot,
            &overshoot,
            bucket,
            outstanding,
            submit_ns,
            now_ns,
        )
    };
    let mut policy = warmed_adaptive(bucket, &latencies_ns);
    let settled = ctx(1, 1_000_000_000, 1_000_003_000);
    policy.decide(&settled);
    c.bench_function("decide (adaptive, an I/O already decided for)", |b| {
        b.iter(|| policy.decide(black_box(&settled)))
    });
    for outstanding in [1, 32] {
        let mut policy = warmed_adaptive(bucket, &latencies_ns);
        let mut submit_ns = 2_000_000_000;
        c.bench_function(
            &format!("decide (adaptive, a new I/O, {outstanding} outstanding)"),
            |b| {
                b.iter(|| {
                    submit_ns += 10_000;
                    policy.decide(black_box(&ctx(outstanding, submit_ns, submit_ns + 1_000)))
                })
            },
        );
    }
    // Under load on a device that looks saturated (a 48 us mean against a 6 us floor): the
    // batch trial is asked for the batch's length.
    let saturated = Snapshot::EMPTY.with_bucket(
        bucket.unwrap(),
        published(48_000, [6_000, 45_000, 60_000, 80_000, 120_000]),
    );
    let mut policy = warmed_adaptive(bucket, &latencies_ns);
    let mut submit_ns = 2_000_000_000;
    c.bench_function(
        "decide (adaptive, a new I/O, 32 outstanding, saturated)",
        |b| {
            b.iter(|| {
                submit_ns += 10_000;
                let ctx = context(
                    &saturated,
                    &overshoot,
                    bucket,
                    32,
                    submit_ns,
                    submit_ns + 1_000,
                );
                policy.decide(black_box(&ctx))
            })
        },
    );
    let mut policy = warmed_adaptive(bucket, &latencies_ns);
    let mut next = 0;
    c.bench_function("on_completion (adaptive, polled)", |b| {
        b.iter(|| {
            next = (next + 1) % LATENCIES;
            policy.on_completion(black_box(&Observation {
                bucket,
                submit_ns: next as u64,
                latency_ns: latencies_ns[next],
                slept: None,
                idle_polls: 10,
                censored: false,
                after_interrupt: false,
            }))
        })
    });
    c.bench_function("on_completion (adaptive, hidden by its sleep)", |b| {
        b.iter(|| {
            next = (next + 1) % LATENCIES;
            policy.on_completion(black_box(&Observation {
                bucket,
                submit_ns: next as u64,
                latency_ns: latencies_ns[next] + 4_000,
                slept: Some(Slept {
                    requested_ns: 6_000,
                    actual_ns: 9_000,
                }),
                idle_polls: 0,
                censored: true,
                after_interrupt: false,
            }))
        })
    });
}

criterion_group!(benches, record, decide, adaptive);
criterion_main!(benches);
