//! Timeout recovery: what the reactor does about I/O a device does not complete in time.
//!
//! An I/O past its timeout is aborted; if the abort does not complete it in time (or the
//! device cannot abort), its queue pair is reset; if the reset does not complete it in time
//! (or the device cannot reset), the I/O is abandoned: its callback runs with
//! [`IoFailure::Abandoned`] and its slot and buffer stay quarantined until the device
//! completes it after all or the queue pair is deleted. An I/O still waiting for a slot at
//! its timeout never reached the device: it fails as timed out.
//!
//! One scan does every step that is due, in named parts: `expire_waiters`, `scan_in_flight`,
//! `reset_escalated`, then the callbacks (`fail_expired`, `abandon_collected`).

use super::{Reactor, DEVICES_MAX};
use crate::io::{DeviceId, IoDone, IoFailure};

/// Where an outstanding I/O stands in timeout recovery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Recovery {
    /// Within its timeout.
    InTime,
    /// Timed out; an abort was sent (or the device cannot abort): escalate at the deadline.
    Aborting { deadline_ns: u64 },
    /// Its queue pair was reset: the device owes its completion by the deadline.
    /// `timed_out`: it had reached its own timeout (the reset was for it or another).
    Resetting { deadline_ns: u64, timed_out: bool },
    /// Failed locally with `IoFailure::Abandoned`; its buffer stays here (quarantined)
    /// until a late completion or the queue pair's deletion.
    Abandoned,
}

impl Recovery {
    /// Whether the I/O reached its timeout: an abort or reset status then becomes
    /// `IoFailure::TimedOut`.
    pub(super) fn timed_out(self) -> bool {
        matches!(
            self,
            Recovery::Aborting { .. }
                | Recovery::Resetting {
                    timed_out: true,
                    ..
                }
        )
    }
}

/// What one recovery scan carries from one part to the next.
struct Scan {
    /// The scan's one timestamp.
    now_ns: u64,
    /// When the next step is due, of those the scan has seen; `u64::MAX`: none.
    next_due_ns: u64,
    /// Steps taken on the device side (aborts, resets); the callbacks count their own.
    steps: usize,
    /// Devices done with: no timeout, or their first I/O within its timeout seen (the
    /// rest of theirs are younger). One bit per device index.
    settled: u64,
    /// Devices whose queue pair is to be reset, one bit each.
    escalate: u64,
}

// One bit per device in `Scan`'s sets.
const _: () = assert!(DEVICES_MAX <= u64::BITS as usize);

/// Device `d`'s bit in a `Scan` set.
fn bit(d: usize) -> u64 {
    1u64 << d
}

impl<S> Reactor<S> {
    /// Runs timeout recovery if a step is due (one comparison when none is). Returns the
    /// steps taken.
    pub(super) fn check_timeouts(&mut self, state: &mut S) -> usize {
        if self.now_ns < self.recovery_due_ns {
            return 0;
        }
        self.recover(state)
    }

    /// When the next timeout recovery step of any device is due.
    pub(super) fn recovery_due_ns(&self) -> Option<u64> {
        Some(self.recovery_due_ns).filter(|&t| t != u64::MAX)
    }

    /// One recovery scan, oldest I/O first (the reactor's submission order, which is
    /// timeout order on each device): fails waiters past their timeout, aborts I/Os past
    /// theirs, resets a queue pair when an abort did not complete its I/O in time (or the
    /// device cannot abort), and abandons what a reset did not complete in time (or what
    /// timed out on a device that cannot reset). Sets when the next step is due.
    fn recover(&mut self, state: &mut S) -> usize {
        // The scan's scratch lists are empty between scans (preallocated, never grown).
        debug_assert!(self.to_abandon.is_empty() && self.expired.is_empty());
        debug_assert!(self.abandoned_hold());
        let mut scan = Scan {
            now_ns: self.now_ns,
            next_due_ns: u64::MAX,
            steps: 0,
            settled: 0,
            escalate: 0,
        };
        self.to_abandon.clear();
        self.expire_waiters(&mut scan);
        self.scan_in_flight(&mut scan);
        self.reset_escalated(&mut scan);
        // Every deadline the scan kept is still ahead (or now, for a zero abort or reset
        // timeout).
        debug_assert!(scan.next_due_ns >= scan.now_ns);
        self.recovery_due_ns = scan.next_due_ns;
        // Callbacks last: they may submit (which only lowers `recovery_due_ns`).
        let steps = scan.steps + self.fail_expired(state) + self.abandon_collected(state);
        debug_assert!(self.recovery_due_ns <= scan.next_due_ns);
        debug_assert!(self.to_abandon.is_empty() && self.expired.is_empty());
        debug_assert!(self.abandoned_hold());
        steps
    }

    /// Takes the waiters past their timeout out of their wait queues, into `expired`: they
    /// never reached the device, and fail as timed out. Settles the devices without a
    /// timeout.
    fn expire_waiters(&mut self, scan: &mut Scan) {
        let Reactor {
            devices,
            expired,
            waiters,
            ..
        } = self;
        for (d, dev) in devices.iter_mut().enumerate() {
            let Some(timeout_ns) = dev.io_timeout_ns else {
                scan.settled |= bit(d);
                continue;
            };
            while let Some(w) = dev.waiting.front() {
                let due_ns = w.accepted_ns.saturating_add(timeout_ns);
                if scan.now_ns < due_ns {
                    scan.next_due_ns = scan.next_due_ns.min(due_ns);
                    break;
                }
                expired.extend(dev.waiting.pop_front().map(|w| (d, w)));
                *waiters -= 1;
            }
        }
        debug_assert!(self.wait_queues_hold());
    }

    /// Walks the I/Os in flight, oldest first, until every device is settled: one past its
    /// timeout is aborted (or, where the device cannot abort, its device marked for a
    /// reset); an overdue abort marks its device for a reset; an overdue reset has the I/O
    /// collected for abandoning.
    fn scan_in_flight(&mut self, scan: &mut Scan) {
        let core = self.core;
        let Reactor {
            devices,
            slots,
            order,
            counters,
            to_abandon,
            ..
        } = self;
        let now_ns = scan.now_ns;
        let all = if devices.len() == u64::BITS as usize {
            u64::MAX
        } else {
            bit(devices.len()) - 1
        };
        let mut i = 0;
        while i < order.len() && scan.settled != all {
            let (key, seq) = order[i];
            let live = slots
                .get_mut(key)
                .filter(|s| s.seq == seq && s.recovery != Recovery::Abandoned);
            let Some(slot) = live else {
                if i == 0 {
                    order.pop_front();
                } else {
                    i += 1;
                }
                continue;
            };
            i += 1;
            let d = slot.device as usize;
            if scan.settled & bit(d) != 0 {
                continue;
            }
            let dev = &mut devices[d];
            match slot.recovery {
                Recovery::InTime => {
                    let timeout_ns = dev.io_timeout_ns.expect("unsettled devices time out");
                    let due_ns = slot.accepted_ns.saturating_add(timeout_ns);
                    if now_ns < due_ns {
                        // This device's later I/Os are younger.
                        scan.settled |= bit(d);
                        scan.next_due_ns = scan.next_due_ns.min(due_ns);
                        continue;
                    }
                    counters.io_timeouts += 1;
                    scan.steps += 1;
                    let abort = dev.qp.abort(key as u64);
                    tracing::warn!(
                        core,
                        device = d,
                        tag = key,
                        waited_ns = now_ns.saturating_sub(slot.accepted_ns),
                        abort = ?abort,
                        "I/O timed out; aborting it"
                    );
                    match abort {
                        Ok(()) => {
                            counters.aborts += 1;
                            let deadline_ns = now_ns.saturating_add(dev.abort_timeout_ns);
                            slot.recovery = Recovery::Aborting { deadline_ns };
                            scan.next_due_ns = scan.next_due_ns.min(deadline_ns);
                        }
                        Err(_) => {
                            slot.recovery = Recovery::Aborting {
                                deadline_ns: now_ns,
                            };
                            scan.escalate |= bit(d);
                        }
                    }
                }
                Recovery::Aborting { deadline_ns } => {
                    if now_ns >= deadline_ns {
                        scan.escalate |= bit(d);
                    } else {
                        scan.next_due_ns = scan.next_due_ns.min(deadline_ns);
                    }
                }
                Recovery::Resetting { deadline_ns, .. } => {
                    if now_ns >= deadline_ns {
                        to_abandon.push(key);
                    } else {
                        scan.next_due_ns = scan.next_due_ns.min(deadline_ns);
                    }
                }
                Recovery::Abandoned => unreachable!("filtered above"),
            }
        }
    }

    /// Resets the queue pair of every device marked for it. The device then owes each of
    /// its outstanding commands a completion, by the reset timeout; where the reset fails,
    /// the timed-out I/Os whose abort is overdue (or could not be sent) are collected for
    /// abandoning, and the others are left be.
    fn reset_escalated(&mut self, scan: &mut Scan) {
        let core = self.core;
        let Reactor {
            devices,
            slots,
            order,
            counters,
            to_abandon,
            ..
        } = self;
        let now_ns = scan.now_ns;
        for (d, dev) in devices.iter_mut().enumerate() {
            if scan.escalate & bit(d) == 0 {
                continue;
            }
            scan.steps += 1;
            counters.resets += 1;
            let reset = dev.qp.reset();
            if reset.is_err() {
                counters.reset_failures += 1;
            }
            tracing::warn!(
                core,
                device = d,
                outstanding = dev.qp.outstanding(),
                reset = ?reset,
                "an abort did not complete a timed-out I/O in time; resetting the queue pair"
            );
            let deadline_ns = now_ns.saturating_add(dev.reset_timeout_ns);
            for &(key, seq) in order.iter() {
                let Some(slot) = slots.get_mut(key).filter(|s| {
                    s.seq == seq && s.device as usize == d && s.recovery != Recovery::Abandoned
                }) else {
                    continue;
                };
                match (&reset, slot.recovery) {
                    // The device owes every outstanding command a completion.
                    (Ok(()), Recovery::InTime | Recovery::Aborting { .. }) => {
                        let timed_out = slot.recovery.timed_out();
                        slot.recovery = Recovery::Resetting {
                            deadline_ns,
                            timed_out,
                        };
                        scan.next_due_ns = scan.next_due_ns.min(deadline_ns);
                    }
                    // No reset: give up on the timed-out I/Os whose abort is overdue (or
                    // could not be sent); leave the others be.
                    (Err(_), Recovery::Aborting { deadline_ns }) if deadline_ns <= now_ns => {
                        to_abandon.push(key)
                    }
                    _ => {}
                }
            }
        }
    }

    /// Runs the callbacks of the waiters `expire_waiters` took out, as timed out. Returns
    /// how many.
    fn fail_expired(&mut self, state: &mut S) -> usize {
        let mut expired = std::mem::take(&mut self.expired);
        let failed = expired.len();
        self.counters.io_timeouts += failed as u64;
        for (d, w) in expired.drain(..) {
            self.fail_waiter(state, d, w, IoFailure::TimedOut);
        }
        self.expired = expired;
        failed
    }

    /// Abandons every I/O the scan collected. Returns how many.
    fn abandon_collected(&mut self, state: &mut S) -> usize {
        let mut abandon = std::mem::take(&mut self.to_abandon);
        for &key in &abandon {
            self.abandon(state, key);
        }
        let abandoned = abandon.len();
        abandon.clear();
        self.to_abandon = abandon;
        abandoned
    }

    /// Fails one I/O locally with `IoFailure::Abandoned`, keeping its slot (and buffer) in
    /// quarantine: the device may still use the buffer until it completes the command or
    /// the queue pair is deleted.
    fn abandon(&mut self, state: &mut S, key: usize) {
        let slot = &mut self.slots[key];
        if slot.recovery == Recovery::Abandoned {
            return;
        }
        slot.recovery = Recovery::Abandoned;
        let callback = slot.callback.take().expect("not abandoned before");
        let done = IoDone {
            device: DeviceId(slot.device),
            result: Err(IoFailure::Abandoned),
            buf: None,
            user: slot.user,
            latency_ns: self.now_ns.saturating_sub(slot.accepted_ns),
        };
        tracing::error!(
            core = self.core,
            device = slot.device,
            tag = key,
            waited_ns = done.latency_ns,
            "I/O abandoned: the device neither completed, aborted nor reset it in time; its \
             buffer stays quarantined until the device completes it or shutdown"
        );
        self.devices[slot.device as usize].abandoned += 1;
        self.abandoned += 1;
        self.counters.abandoned_ios += 1;
        self.counters.ios += 1;
        self.counters.io_errors += 1;
        debug_assert!(self.abandoned_hold());
        callback(self, state, done);
    }
}
