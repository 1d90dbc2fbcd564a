//! The checks after a run: every accepted I/O ran its callback exactly once, and every
//! block reads back as the model allows.

use std::time::Duration;

use hypoll_nvme::{Clock, Command, EmuController, IoBuf, QueuePair, Status};

use super::model::Shared;
use super::waiter::WaitsSeen;
use super::LBA_BYTES;
use crate::reactor::ReactorTuning;
use crate::stats::Counters;

/// Attempts at reading a block back in the final check before giving up.
const FINAL_READ_ATTEMPTS: u32 = 1_000;

/// Checks that every accepted I/O ran its callback exactly once, and that the reactors
/// counted as many completions (`counted`).
pub(super) fn check_accounting(model: &Shared, counted: u64) -> Result<(), String> {
    let m = model.lock();
    let mut accepted = 0u64;
    for (n, op) in m.ops.iter().enumerate() {
        let expected = u32::from(op.accepted);
        accepted += u64::from(op.accepted);
        if op.callbacks != expected {
            return Err(format!(
                "I/O {n} ({:?} of {} blocks at {} on reactor {}, accepted: {}) ran its \
                 callback {} times",
                op.op, op.nlb, op.slba, op.reactor, op.accepted, op.callbacks
            ));
        }
    }
    if counted != accepted {
        return Err(format!(
            "the reactors counted {counted} completions for {accepted} accepted I/Os"
        ));
    }
    Ok(())
}

/// Checks a reactor's counters against what its virtual waiter carried out, and that no
/// timed sleep outlasted the long-sleep bound.
pub(super) fn check_waits(
    c: &Counters,
    w: &WaitsSeen,
    tuning: &ReactorTuning,
) -> Result<(), String> {
    // A block on the interrupts that ran to its deadline was a sleep (the I/O's one), one
    // that ended early an interrupt wait; a sleep's pieces are neither.
    let sleeps = w.sleeps - w.sleep_pieces + (w.interrupt_blocks - w.interrupt_blocks_early);
    let agree = [
        ("parks", c.parks, w.parks),
        (
            "interrupt waits",
            c.interrupt_waits,
            w.interrupt_blocks_early,
        ),
        ("sleeps", c.sleeps, sleeps),
    ];
    for (what, counted, seen) in agree {
        if counted != seen {
            return Err(format!(
                "the reactor counted {counted} {what}, its waiter saw {seen} ({w:?})"
            ));
        }
    }
    if w.sleep_ns_max > tuning.long_sleep_ns {
        return Err(format!(
            "a timed sleep of {} ns, past the long-sleep bound of {} ns",
            w.sleep_ns_max, tuning.long_sleep_ns
        ));
    }
    Ok(())
}

/// Reads every block back through a fresh queue pair (faults still on: errors and lost
/// commands are retried, lost ones after a reset) and checks it against the model.
pub(super) fn final_check(
    ctrl: &EmuController,
    clock: &Clock,
    blocks: u64,
    model: &Shared,
) -> Result<(), String> {
    let mut qp = ctrl
        .queue_pair(1)
        .map_err(|e| format!("final check: {e}"))?;
    // Waits until the emulated command's deadline (virtual or real time).
    let wait_until = |deadline_ns: u64| match clock {
        Clock::Virtual(v) => v.advance_to(deadline_ns),
        Clock::Monotonic => {
            let now_ns = hypoll_nvme::monotonic_ns();
            std::thread::sleep(Duration::from_nanos(deadline_ns.saturating_sub(now_ns)));
        }
    };
    for lba in 0..blocks {
        let mut attempts = 0;
        let data = loop {
            attempts += 1;
            if attempts > FINAL_READ_ATTEMPTS {
                return Err(format!(
                    "final check: block {lba} did not read back in {FINAL_READ_ATTEMPTS} tries"
                ));
            }
            let mut buf = IoBuf::zeroed(LBA_BYTES);
            // SAFETY: `buf` is neither touched nor dropped until this command's completion
            // is reaped below: a lost command is completed by the reset before we leave.
            let submitted = unsafe { qp.submit(&Command::read(lba, 1, &mut buf), 0) };
            if submitted.is_err() {
                continue;
            }
            let mut status = None;
            while status.is_none() {
                qp.process_completions(1, &mut |c| status = Some(c.status));
                if status.is_some() {
                    break;
                }
                match qp.oracle_next_deadline_ns() {
                    Some(deadline_ns) => wait_until(deadline_ns),
                    // Lost: a reset completes it.
                    None => {
                        qp.reset();
                    }
                }
            }
            match status {
                Some(Status::SUCCESS) => break buf,
                _ => continue,
            }
        };
        let mut m = model.lock();
        let tick = m.bump();
        m.check_read(lba, &data, tick, tick, "final read-back");
        if let Some(e) = m.errors.first() {
            return Err(e.clone());
        }
    }
    Ok(())
}
