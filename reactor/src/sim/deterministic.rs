//! The deterministic runner: N reactors stepped by hand on one thread and one virtual
//! clock, in an order drawn from the seed, so a seed replays its run exactly.

use std::sync::Arc;
use std::time::Duration;

use hypoll_nvme::{Clock, EmuConfig, EmuController, VirtualClock};

use super::check::check_waits;
use super::check::{check_accounting, final_check};
use super::config::{SimConfig, SimFailure, SimReport};
use super::draw::{mix, recovery_mode, Rng};
use super::limited::device_for;
use super::mail::{Mail, WakeBounds, MAILBOX_CAPACITY};
use super::model::{Model, Shared};
use super::waiter::{VirtualWaiter, WaitCosts};
use super::workload::{submit_random, SubmitOutcome};
use super::LBA_BYTES;
use crate::io::{DeviceId, DeviceOptions};
use crate::reactor::{mailbox, Reactor, ReactorTuning};

/// Most steps one run takes before it is declared hung.
const STEPS_MAX: u64 = 10_000_000;
/// How often (in steps) the run looks for an I/O that waited too long.
const HANG_CHECK_EVERY_STEPS: u64 = 1_024;

/// Runs one seeded simulation. `Ok` with what it did, or the first thing it found wrong.
pub fn run(seed: u64, cfg: &SimConfig) -> Result<SimReport, SimFailure> {
    let mut rng = Rng(seed);
    // The seed draws the device (nand's 400 us tail outlives the 300 us timeout: pending
    // commands get aborted too), the namespace size (so how often I/Os overlap), the depth,
    // the step, the fault rates and how the device answers recovery.
    let profile = ["dram", "optane", "nand"][rng.below(3) as usize];
    // 4096 blocks span two of the memory store's 1 MiB chunks (see `submit_random`).
    let blocks = [32u64, 64, 128, 256, 4096][rng.below(5) as usize];
    let depth = [1usize, 2, 8, 16, 32][rng.below(5) as usize];
    let wait_queue = [0usize, 4, 32][rng.below(3) as usize];
    let step_ns_max = [1_000u64, 4_000, 16_000][rng.below(3) as usize];
    let factor = [0.5, 1.0, 2.0, 4.0][rng.below(4) as usize];
    let (abort, reset, recovery) = recovery_mode(&mut rng);
    // Half the runs attach a second queue pair on the same controller to every reactor,
    // with its own recovery support: per-device timeouts and recovery side by side.
    let second = rng.pct(50).then(|| recovery_mode(&mut rng));
    // The machine's costs of waiting: what the policies that calibrate measure.
    let costs = WaitCosts::draw(&mut rng);
    // A third of the runs bend the profile's latencies into shapes that stress a policy's
    // statistics: none at all, a second (every I/O times out), two modes, a heavy tail, a
    // device that stops answering (every command lost).
    let latencies = match rng.below(15) {
        0 => ",read_us=0,write_us=0",
        1 => ",read_us=1000000,write_us=1000000",
        2 => ",tail_pct=50,tail_us=250",
        3 => ",jitter=3,tail_pct=5,tail_us=5000",
        4 => ",lost_pct=50",
        _ => "",
    };
    // The devices' statistics windows: the policies that sleep (hybrid and its kin, fixed)
    // wait for the first window's statistics, and a run lasts a few tens of milliseconds of
    // virtual time, less than the default window. Drawn from a stream of its own, so the
    // draws above and below stay what they were.
    let window_ms = [1u64, 2, 5, 100][Rng(mix(seed, 0x7769_6e64)).below(4) as usize];
    let tuning = ReactorTuning::default();
    let spec = format!(
        "emu:{profile},size={},seed={},err_pct={},lost_pct={},stuck_pct={},reset_pct={},\
         queues={}{latencies}",
        blocks * LBA_BYTES as u64,
        rng.next(),
        cfg.err_pct * factor,
        cfg.lost_pct * factor,
        cfg.stuck_pct,
        cfg.reset_pct * factor,
        2 * cfg.reactors + 1
    );
    let second_text = second.map_or(String::new(), |(_, _, r)| format!(" second={r}"));
    let shape = format!(
        "{spec} depth={depth} wait_queue={wait_queue} step<={step_ns_max}ns \
         recovery={recovery}{second_text} window={window_ms}ms reactors={} policy={} \
         {costs:?}",
        cfg.reactors, cfg.policy
    );
    let fail = |message: String| SimFailure {
        seed,
        policy: cfg.policy.clone(),
        message: format!("{message} [{shape}]"),
    };
    let emu_cfg: EmuConfig = match spec.parse::<hypoll_nvme::DeviceConfig>() {
        Ok(hypoll_nvme::DeviceConfig::Emu(c)) => c,
        other => return Err(fail(format!("bad device string {spec}: {other:?}"))),
    };
    let vclock = VirtualClock::new(1_000_000_000);
    let ctrl = EmuController::with_clock(emu_cfg, Clock::Virtual(vclock.clone()))
        .map_err(|e| fail(format!("{spec}: {e}")))?;
    let with_window = |device: crate::io::Device| {
        device
            .with_window_ms(window_ms)
            .map_err(|e| fail(format!("window {window_ms} ms: {e}")))
    };
    let mut devices = vec![with_window(device_for(&ctrl, abort, reset))?];
    if let Some((abort, reset, _)) = second {
        devices.push(with_window(device_for(&ctrl, abort, reset))?);
    }
    let options = DeviceOptions::new(depth)
        .with_io_timeout(Some(cfg.io_timeout))
        .with_abort_timeout(cfg.abort_timeout)
        .with_reset_timeout(cfg.reset_timeout)
        .with_wait_queue(wait_queue);
    let ns = |d: Duration| d.as_nanos() as u64;

    let clock = Clock::Virtual(vclock.clone());
    // How late a reactor may notice that something is due: the turns it takes (a reactor
    // is turned about once every `reactors` steps; allow 64 of those), late by the machine's
    // costs. Every wait ends at the next timeout: a block is armed for it, a timed sleep is
    // cut short there.
    let late_ns_max = 64 * cfg.reactors as u64 * step_ns_max + costs.late_ns_max();
    let model: Shared = Arc::new(parking_lot::Mutex::new(Model {
        history: vec![Vec::new(); blocks as usize],
        // Timeouts, each noticed late at most by `late_ns_max`.
        latency_ns_bound: ns(cfg.io_timeout)
            + ns(cfg.abort_timeout)
            + ns(cfg.reset_timeout)
            + 3 * late_ns_max,
        ..Model::default()
    }));

    // The reactors: built by hand (not on threads), on the virtual clock.
    let mut reactors = Vec::with_capacity(cfg.reactors);
    let mut receivers = Vec::new();
    let mut handles = Vec::new();
    for i in 0..cfg.reactors {
        let (handle, rx) =
            mailbox(i, i, MAILBOX_CAPACITY).map_err(|e| fail(format!("mailbox: {e}")))?;
        handles.push(handle);
        receivers.push(rx);
    }
    let handles: Arc<[_]> = handles.into();
    for (i, rx) in receivers.into_iter().enumerate() {
        let policy = hypoll_policy::build(&cfg.policy).map_err(|e| fail(e.to_string()))?;
        let mut r = Reactor::new(i, rx, handles.clone(), policy, tuning.clone())
            .map_err(|e| fail(format!("reactor: {e}")))?;
        r.simulate(VirtualWaiter::new(vclock.clone(), costs, rng.next()));
        for device in &devices {
            r.attach_with(device, options)
                .map_err(|e| fail(e.to_string()))?;
        }
        reactors.push(r);
    }

    // Messages and timers (see `mail`): their own stream of draws from the seed.
    let bounds = WakeBounds::new(&costs, &tuning);
    let mut mail = Mail::new(seed, cfg.reactors, cfg.messages_per_reactor, bounds);
    let mut left: Vec<usize> = vec![cfg.ios_per_reactor; cfg.reactors];
    let mut queue_full = 0u64;
    let mut steps = 0u64;
    let mut trace = 0u64;
    loop {
        steps += 1;
        if steps > STEPS_MAX {
            let outstanding: Vec<usize> = reactors.iter().map(|r| r.outstanding()).collect();
            return Err(fail(format!(
                "hung: {STEPS_MAX} steps and I/O still outstanding per reactor: \
                 {outstanding:?}"
            )));
        }
        if steps.is_multiple_of(HANG_CHECK_EVERY_STEPS) {
            let m = model.lock();
            let now_ns = vclock.now_ns();
            let stuck = m.ops.iter().enumerate().find(|(_, op)| {
                op.accepted && op.callbacks == 0 && now_ns - op.start_ns > 2 * m.latency_ns_bound
            });
            if let Some((n, op)) = stuck {
                return Err(fail(format!(
                    "hung: I/O {n} ({:?} of {} blocks at {} on reactor {}) has waited {} ns \
                     for its callback; the timeouts promise at most {} ns",
                    op.op,
                    op.nlb,
                    op.slba,
                    op.reactor,
                    now_ns - op.start_ns,
                    m.latency_ns_bound
                )));
            }
        }
        let all_issued = left.iter().all(|&n| n == 0);
        if all_issued && reactors.iter().all(|r| r.outstanding() == 0) && mail.done() {
            break;
        }
        let i = rng.below(cfg.reactors as u64) as usize;
        trace = mix(mix(trace, i as u64), vclock.now_ns());
        mail.maybe_post(i, vclock.now_ns(), &mut reactors[i], &handles[i]);
        if left[i] > 0 && rng.pct(45) {
            // A submission comes to a reactor as a message would: it ends a park or an
            // interrupt wait, but waits for a timed sleep to end.
            if !reactors[i].sim_deliver() {
                vclock.advance_by(rng.below(step_ns_max + 1));
                continue;
            }
            let device = DeviceId::from_index(rng.below(devices.len() as u64) as u16);
            let r = &mut reactors[i];
            match submit_random(r, i, device, &mut rng, blocks, &model, &clock, None) {
                Ok(()) => left[i] -= 1,
                Err(SubmitOutcome::QueueFull) => {
                    queue_full += 1;
                    // Every slot quarantined (a device that cannot reset lost them all):
                    // this reactor cannot do more I/O; stop asking.
                    if reactors[i].outstanding() == 0 {
                        left[i] -= 1;
                    }
                }
                Err(SubmitOutcome::Quarantined) => {
                    queue_full += 1;
                    left[i] -= 1;
                }
                Err(SubmitOutcome::Bug(message)) => return Err(fail(message)),
            }
        } else if !reactors[i].sim_asleep() {
            let queued = mail.queued(i);
            let work = reactors[i].sim_step(&mut ());
            trace = mix(trace, work as u64);
            mail.after_turn(i, queued, vclock.now_ns()).map_err(fail)?;
        }
        vclock.advance_by(rng.below(step_ns_max + 1));
        if let Some(e) = model.lock().errors.first() {
            return Err(fail(e.clone()));
        }
        if let Some(e) = mail.error() {
            return Err(fail(e));
        }
    }

    // Accounting: every accepted I/O ran its callback exactly once, and the reactors
    // counted as many completions.
    let mut report = SimReport {
        seed,
        policy: cfg.policy.clone(),
        shape: shape.clone(),
        queue_full,
        controller_resets: ctrl.resets(),
        ..SimReport::default()
    };
    for r in &reactors {
        report.add(r.counters());
        let waiter = r.virtual_waiter().expect("a simulated reactor");
        check_waits(r.counters(), &waiter.seen(), &tuning)
            .map_err(|e| fail(format!("reactor {}: {e}", r.index())))?;
        let seen = waiter.seen();
        report.waits.add(&seen);
        trace = mix(trace, waiter.trace());
    }
    mail.final_check().map_err(fail)?;
    report.mail = mail.seen();
    report.trace_hash = mix(trace, mail.trace());
    check_accounting(&model, report.ios).map_err(fail)?;
    {
        let m = model.lock();
        report.reads_checked = m.reads_checked;
        report.latency_ns_max = m.latency_ns_max;
        if m.latency_ns_max > m.latency_ns_bound {
            return Err(fail(format!(
                "an I/O waited {} ns for its callback; the timeouts promise at most {} ns",
                m.latency_ns_max, m.latency_ns_bound
            )));
        }
    }

    // Deleting the queue pairs ends the windows of abandoned writes: nothing changes the
    // blocks after this but the final reads.
    drop(reactors);
    final_check(&ctrl, &clock, blocks, &model).map_err(fail)?;
    Ok(report)
}
