//! `adaptive` under load: waiting on the interrupt, and the batches a trial keeps or refuses.

use super::*;

/// 9 us of service seen once, then a 48 us mean under load (39 us of queueing), with
/// learnt samples of 20 us, calibrated.
fn saturated(p: &mut Adaptive) {
    observe(p, 9_000, false);
    for _ in 0..ADAPTIVE_RESERVOIR {
        observe(p, 20_000, false);
    }
    calibrate(p, 5_000, 7_000);
}

#[test]
fn a_saturated_device_with_an_interrupt_waits_on_it_at_every_decision() {
    let mut p = Adaptive::default();
    saturated(&mut p);
    // The trial's first arm waits on the interrupt, renewed after every wake-up for the
    // same oldest I/O (a completion of another ended the wait).
    for now_ns in [40_000, 45_000, 50_000] {
        let d = decide_published_on(&mut p, 0, now_ns, 32, 48_000, true);
        assert_eq!(d, Decision::WaitInterrupt, "at {now_ns}");
    }
    // The same device seen without its interrupt line batches instead (a held interrupt
    // is no answer there).
    let d = decide_published_on(&mut p, 1, 60_000, 32, 48_000, false);
    assert!(matches!(d, Decision::Sleep(_) | Decision::Spin), "{d:?}");
    // At one outstanding I/O it is not queueing: no wait under load.
    let d = decide_published_on(&mut p, 2, 80_000, 1, 48_000, true);
    assert_ne!(d, Decision::WaitInterrupt);
}

#[test]
fn a_saturated_device_is_slept_through_in_batches() {
    let mut p = Adaptive::default();
    // The learnt samples say 20 us (under load they mix polled completions and stand-ins,
    // in a proportion the sleeps set): the batch follows the published mean, which
    // Little's law pins. A device without an interrupt: the batch ladder alone.
    saturated(&mut p);
    let median_ov = p.overshoot_plan_ns().unwrap();
    match decide_published_on(&mut p, 0, 40_000, 32, 48_000, false) {
        Decision::Sleep(d) => {
            let expected = (39_000.0 * ADAPTIVE_BATCH_FRACTION) as u64 - median_ov;
            assert_eq!(d.as_nanos() as u64, expected);
        }
        other => panic!("expected a batch sleep, got {other:?}"),
    }
    // The same latencies at one outstanding I/O are not queueing: no batching.
    let d = decide_published_on(&mut p, 1, 40_000, 1, 48_000, false);
    assert!(
        !matches!(d, Decision::Sleep(x) if x.as_nanos() > 20_000),
        "{d:?}"
    );
}

#[test]
fn batching_lasts_through_a_long_saturated_run() {
    let mut p = Adaptive::default();
    observe(&mut p, 9_000, false);
    for _ in 0..ADAPTIVE_RESERVOIR {
        observe(&mut p, 48_000, false);
    }
    calibrate(&mut p, 5_000, 7_000);
    // A minute of decisions at depth 32, on a device without an interrupt: the floor must
    // not drift up to the mean.
    for i in 1..=600u64 {
        let submit_ns = i * 100_000_000;
        decide_published_on(&mut p, submit_ns, submit_ns + 40_000, 32, 48_000, false);
    }
    // (Two seconds later, so that the batch trial starts afresh, in a batching arm.)
    let submit_ns = 62_000_000_000;
    let last = decide_published_on(&mut p, submit_ns, submit_ns + 40_000, 32, 48_000, false);
    assert!(
        matches!(last, Decision::Sleep(d) if d.as_nanos() > 20_000),
        "{last:?}"
    );
}

/// Runs `ios` I/Os at depth 4 on a device without an interrupt (the batch ladder alone)
/// whose published mean is 88 us, one decided for
/// every 20 us: an I/O given one of the `batches` (sleep lengths) is seen
/// `batched_latency_ns` after submission, any other at 88 us. Returns how many were
/// batched.
fn run_at_depth_4(
    p: &mut Adaptive,
    ios: u64,
    batches: &[Decision],
    batched_latency_ns: u64,
) -> u64 {
    let mut batched = 0;
    for i in 0..ios {
        let submit_ns = 1_000_000 + i * 20_000;
        let d = decide_published_on(p, submit_ns, submit_ns + 10_000, 4, 88_000, false);
        let batch = batches.contains(&d);
        batched += u64::from(batch);
        let latency_ns = if batch { batched_latency_ns } else { 88_000 };
        // Outstanding while another I/O was decided for: only the trial learns from it.
        p.on_completion(&Observation {
            bucket: Some(READ_4K),
            submit_ns,
            latency_ns,
            slept: None,
            idle_polls: 1,
            censored: true,
            after_interrupt: false,
        });
    }
    batched
}

/// A device whose fastest read took 30 us and most 70-90 us: at a published mean of 88
/// us it looks saturated (58 us of "queueing" against a 30 us floor). Returns the batch
/// sleeps it may get, longest first: 3/4 of the queueing time, 3/8, 3/16.
fn wide_unqueued(p: &mut Adaptive) -> Vec<Decision> {
    observe(p, 30_000, false);
    nand_like(p);
    calibrate(p, 5_000, 7_000);
    let median_ov_ns = p.overshoot_plan_ns().unwrap();
    [0.75, 0.375, 0.1875]
        .iter()
        .map(|f| Decision::sleep_ns((58_000.0 * f) as u64 - median_ov_ns))
        .collect()
}

#[test]
fn batches_that_make_a_wide_device_late_are_tried_then_refused() {
    let mut p = Adaptive::default();
    let batches = wide_unqueued(&mut p);
    // 800 ms: a trial of each batch length (16 arms of 11 ms: 128 mean latencies), and
    // more. Batching leaves units idle: its I/Os are seen 30 % late.
    let batched = run_at_depth_4(&mut p, 40_000, &batches, 115_000);
    assert_eq!(p.batch_trial.trials, 3);
    assert_eq!(p.batch_trial.held_fraction(), None);
    // It batched in each trial's batching arms (8 of 11 ms, 563 I/Os each), then no more.
    assert!((12_000..15_000).contains(&batched), "{batched}");
    let after = run_at_depth_4(&mut p, 1_000, &batches, 115_000);
    assert_eq!(after, 0);
}

#[test]
fn batching_that_costs_no_latency_is_kept() {
    let mut p = Adaptive::default();
    let batches = wide_unqueued(&mut p);
    // A saturated device: the same latency whether the reactor batches or not.
    run_at_depth_4(&mut p, 20_000, &batches, 88_000);
    assert_eq!(p.batch_trial.trials, 1);
    assert_eq!(p.batch_trial.held_fraction(), Some(ADAPTIVE_BATCH_FRACTION));
    // The length found holds: every I/O is batched, for 3/4 of the queueing time.
    assert_eq!(run_at_depth_4(&mut p, 1_000, &batches[..1], 88_000), 1_000);
}
