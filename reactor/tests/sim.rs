//! The seeded fault simulation (see `hypoll_reactor::sim` and docs/operations.md): a fixed
//! budget of seeds with faults on, plus every seed that once found a bug.
//! `hypoll sim --seeds N` runs more; `hypoll sim --seed N` replays one.

use hypoll_reactor::sim::{policies, run, run_threaded, MailSeen, SimConfig, SimReport, WaitsSeen};

/// Seeds the suite runs every time: enough to see every fault, few enough for a debug build
/// on a small shared machine.
const SEED_BUDGET: u64 = 200;

/// Seeds that once found a bug, with what they found. They run with the budget.
const REGRESSION_SEEDS: &[(u64, &str)] = &[
    // The simulation's own hang check must count only the I/Os a reactor accepted: the
    // model records every I/O before submitting it, refused ones (QueueFull) included.
    // Seed 6 (depth 2, no wait queue) has thousands of refusals.
    (6, "the simulation's hang check counted refused I/Os"),
];

/// Sums of what the runs did, to check the faults really happened.
#[derive(Debug, Default)]
struct Totals {
    ios: u64,
    io_errors: u64,
    queue_full: u64,
    io_timeouts: u64,
    aborts: u64,
    resets: u64,
    abandoned: u64,
    late_completions: u64,
    controller_resets: u64,
    reads_checked: u64,
}

impl Totals {
    fn add(&mut self, r: &SimReport) {
        self.ios += r.ios;
        self.io_errors += r.io_errors;
        self.queue_full += r.queue_full;
        self.io_timeouts += r.io_timeouts;
        self.aborts += r.aborts;
        self.resets += r.resets;
        self.abandoned += r.abandoned;
        self.late_completions += r.late_completions;
        self.controller_resets += r.controller_resets;
        self.reads_checked += r.reads_checked;
    }
}

#[test]
fn every_io_is_accounted_for_and_every_block_reads_back_as_the_model_allows() {
    let cfg = SimConfig::default();
    let mut totals = Totals::default();
    let seeds = (0..SEED_BUDGET).chain(REGRESSION_SEEDS.iter().map(|&(seed, _)| seed));
    for seed in seeds {
        let report = run(seed, &cfg).unwrap_or_else(|failure| panic!("{failure}"));
        totals.add(&report);
    }
    // Every failure path was taken, many times: the budget tests recovery, not luck.
    let t = &totals;
    for (what, n) in [
        ("media errors and aborts", t.io_errors),
        ("full queues", t.queue_full),
        ("timeouts", t.io_timeouts),
        ("aborts", t.aborts),
        ("queue-pair resets", t.resets),
        ("abandoned I/Os", t.abandoned),
        ("late completions", t.late_completions),
        ("controller resets", t.controller_resets),
        ("reads checked", t.reads_checked),
    ] {
        assert!(n >= 50, "only {n} {what} in the budget: {totals:?}");
    }
}

#[test]
fn a_seed_replays_the_same_run() {
    let cfg = SimConfig::default();
    for seed in [1, 7, 99] {
        assert_eq!(run(seed, &cfg), run(seed, &cfg), "seed {seed}");
    }
}

/// Seeds that once found a bug under one policy, with what they found. They run with the
/// per-policy budget.
const POLICY_REGRESSION_SEEDS: &[(u64, &str, &str)] = &[
    // A timed sleep ran its course past a timer due in it (late by the rest of the sleep,
    // up to the long-sleep bound); a block was armed for the timer, a sleep was not. Found
    // by the messages' timers once the hybrid policies slept in the simulation.
    (8, "hybrid", "a timed sleep ran past a due timer"),
    (0, "uring-hybrid", "a timed sleep ran past a due timer"),
    (16, "interrupt", "a timed sleep ran past a due timer"),
];

#[test]
fn every_policy_regression_seed_passes() {
    for &(seed, policy, found) in POLICY_REGRESSION_SEEDS {
        let cfg = SimConfig {
            policy: policy.to_owned(),
            ..SimConfig::default()
        };
        if let Err(failure) = run(seed, &cfg) {
            panic!("{failure} (once found: {found})");
        }
    }
}

/// Seeds per policy the suite runs with every built-in policy deciding how the reactors
/// wait (the suite's time: docs/operations.md; `hypoll sim --seeds 100000` runs more).
const POLICY_SEED_BUDGET: u64 = 25;

#[test]
fn every_policy_waits_in_virtual_time_and_keeps_every_io() {
    let mut waits = WaitsSeen::default();
    let mut mail = MailSeen::default();
    for policy in policies() {
        let cfg = SimConfig {
            policy: policy.clone(),
            ios_per_reactor: 150,
            ..SimConfig::default()
        };
        let mut io_waits = 0;
        for seed in 1_000..1_000 + POLICY_SEED_BUDGET {
            let report = run(seed, &cfg).unwrap_or_else(|failure| panic!("{failure}"));
            assert!(report.ios > 0, "{report:?}");
            waits.sleeps += report.waits.sleeps;
            waits.interrupt_blocks += report.waits.interrupt_blocks;
            waits.parks += report.waits.parks;
            io_waits += report.waits.sleeps + report.waits.interrupt_blocks;
            mail.add(&report.mail);
        }
        // Every policy but the one that always spins waited for I/O: none ran as `classic`
        // for want of statistics (the sleeping ones wait for a first window of them).
        if policy != "classic" {
            assert!(
                io_waits >= 50,
                "{policy}: {io_waits} sleeps and interrupt waits"
            );
        }
    }
    // The idle path ran: every kind of wait, many times.
    assert!(waits.sleeps >= 100, "{waits:?}");
    assert!(waits.interrupt_blocks >= 100, "{waits:?}");
    assert!(waits.parks >= 100, "{waits:?}");
    // Messages and timers woke waiting reactors (each run checked that every one ran
    // exactly once, in time): messages came in bursts to blocked and to sleeping
    // reactors, mailboxes filled, timers ran and were cancelled.
    for (what, n) in [
        ("messages to blocked reactors", mail.to_blocked),
        ("messages to sleeping reactors", mail.to_sleeping),
        ("messages refused by a full mailbox", mail.refused),
        ("timer runs", mail.timer_runs),
        ("timers cancelled", mail.cancels),
        ("wake-ups for a message or timer", mail.woken),
    ] {
        assert!(n >= 100, "only {n} {what}: {mail:?}");
    }
}

#[test]
fn a_seed_replays_the_same_trace_under_every_policy() {
    for policy in policies() {
        let cfg = SimConfig {
            policy: policy.clone(),
            ios_per_reactor: 100,
            ..SimConfig::default()
        };
        for seed in [3, 42] {
            let first = run(seed, &cfg).unwrap_or_else(|failure| panic!("{failure}"));
            let again = run(seed, &cfg).unwrap_or_else(|failure| panic!("{failure}"));
            assert_ne!(first.trace_hash, 0);
            assert_eq!(first.trace_hash, again.trace_hash, "{policy} seed {seed}");
            assert_eq!(first, again, "{policy} seed {seed}");
        }
    }
}

/// Seeds of the threaded variant the suite runs every time.
const THREADED_SEED_BUDGET: u64 = 8;

/// The same workload and checks on real reactor threads and the real clock, under each
/// wait policy: what the hand-stepped run cannot show (cross-thread controller resets,
/// parking with lost commands outstanding).
#[test]
fn threaded_reactors_keep_every_io_and_every_block_too() {
    let cfg = SimConfig {
        ios_per_reactor: 200,
        ..SimConfig::default()
    };
    for seed in 0..THREADED_SEED_BUDGET {
        let report = run_threaded(seed, &cfg).unwrap_or_else(|failure| panic!("{failure}"));
        assert!(report.ios > 0, "{report:?}");
    }
}
