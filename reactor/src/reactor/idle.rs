//! The idle path: what a turn that found no work does. With I/O outstanding the reactor asks
//! its policy, then spins, sleeps (then polls), or blocks on the device interrupts; with
//! none it spins a while (as long as the policy decides once front ends report requests:
//! `arrivals`) and then parks in epoll until a message, a timer, a poller's fd or a timeout
//! wakes it. How the last wait ended is the wake state the next turn's
//! completions report to the policy.

use std::sync::atomic::Ordering;
use std::time::Duration;

use hypoll_nvme::{EmuQueuePair, UringQueuePair};
use hypoll_policy::{Decision, InFlight, PollContext, Slept};

use super::wait::Waiter;
use super::{Reactor, Recovery, SLEEP_CPU_SAMPLE_EVERY, TOKEN_MAILBOX};

/// Whether a turn comes right after the reactor waited, and how that wait ended. Completions
/// reaped in such a turn may have been ready any time during the wait: the policy sees them
/// as censored (`Observation::censored`), and, after an interrupt, as signalled
/// (`Observation::after_interrupt`). An interrupt wake without a wait cannot be written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum WakeState {
    /// No wait before this turn.
    #[default]
    Awake,
    /// The reactor slept or blocked before this turn: a timed sleep, a park, or an
    /// interrupt wait that lasted until its deadline.
    AfterWait,
    /// It blocked on the device interrupts and the wait ended before its deadline (or had
    /// none).
    AfterInterrupt,
}

impl WakeState {
    /// Whether the turn follows a wait of either kind.
    pub(super) fn after_wait(self) -> bool {
        self != WakeState::Awake
    }
}

impl<S> Reactor<S> {
    /// Nothing had work this turn.
    pub(super) fn when_idle(&mut self) {
        // The turn began with no wait ahead of the next one; this is its only idle step.
        debug_assert_eq!(self.wake_next_turn, WakeState::Awake);
        // Abandoned I/Os are not waited for: their completions may never come. (Nor are
        // I/Os waiting for a slot when nothing live is outstanding: every slot is
        // quarantined; their timeout wakes a parked reactor.)
        if self.live() == 0 {
            self.idle_without_io();
        } else {
            self.ask_policy();
        }
        // A wait, if any, counts from this turn's timestamp.
        debug_assert!(self.wake_next_turn == WakeState::Awake || self.slept_from_ns == self.now_ns);
    }

    /// No I/O to wait for: spin for the idle stretch's spin (the policy's decision once front
    /// ends report requests, `idle_spin_ns` before), then park.
    fn idle_without_io(&mut self) {
        let since = match self.idle_since_ns {
            Some(since) => since,
            None => {
                self.idle_spin_ns = self.decide_idle_spin_ns();
                self.idle_since_ns = Some(self.now_ns);
                self.now_ns
            }
        };
        if self.now_ns - since >= self.idle_spin_ns {
            self.park(false, None);
        } else {
            std::hint::spin_loop();
        }
    }

    /// I/O in flight: the policy decides, from the oldest I/O and its device's statistics,
    /// whether to spin, sleep, or wait for an interrupt.
    fn ask_policy(&mut self) {
        self.idle_since_ns = None;
        let key = self.oldest().expect("outstanding I/O has an oldest");
        let slot = &self.slots[key];
        let dev = &self.devices[slot.device as usize];
        let interrupts = self.interrupts_armable();
        let ctx = PollContext {
            now_ns: self.now_ns,
            outstanding: self.live(),
            oldest: InFlight {
                bucket: slot.bucket,
                submit_ns: slot.submit_ns,
                slept: slot.slept.is_some(),
            },
            stats: dev.recorder.snapshot(),
            overshoot: dev.recorder.overshoot(),
            interrupts,
            oracle_deadline_ns: if dev.oracle {
                EmuQueuePair::downcast(&*dev.qp).and_then(EmuQueuePair::oracle_next_deadline_ns)
            } else {
                None
            },
        };
        match self.policy.decide(&ctx) {
            Decision::Spin => {
                self.submit_held();
                std::hint::spin_loop();
            }
            Decision::Sleep(duration) => self.sleep_for(key, duration, false),
            Decision::SleepInterruptible(duration) => self.sleep_for(key, duration, true),
            Decision::WaitInterrupt => {
                if interrupts {
                    self.counters.interrupt_waits += 1;
                    self.park(true, None);
                    self.woke_by_interrupt();
                } else {
                    // Nothing could end a wait (a device has no interrupt line): poll
                    // instead, and say so.
                    self.wait_spun();
                    self.submit_held();
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// Counts a `WaitInterrupt` carried out as a spin, and logs the first of this reactor's:
    /// a policy [`PollContext::interrupts`] told there is no interrupt should not ask.
    fn wait_spun(&mut self) {
        self.counters.interrupt_waits_spun += 1;
        if self.counters.interrupt_waits_spun == 1 {
            let device = self
                .devices
                .iter()
                .position(|d| !d.has_irq && d.qp.outstanding() > 0);
            tracing::warn!(
                core = self.core,
                policy = self.policy.name(),
                device,
                "the policy asked to wait for an interrupt, but a device with I/O outstanding \
                 has none (polled completions, or virtual time): the reactor spins instead, and \
                 counts each such wait as interrupt_waits_spun"
            );
        }
    }

    /// The oldest outstanding I/O's slot key.
    fn oldest(&mut self) -> Option<usize> {
        while let Some(&(key, seq)) = self.order.front() {
            if self
                .slots
                .get(key)
                .is_some_and(|s| s.seq == seq && s.recovery != Recovery::Abandoned)
            {
                return Some(key);
            }
            self.order.pop_front();
        }
        None
    }

    /// Hands the kernel what `uring` queue pairs held back for a wait inside their ring
    /// (`UringQueuePair::submit_held`): the reactor spins or sleeps instead. A wait in epoll
    /// submits them as it arms the interrupts.
    fn submit_held(&mut self) {
        for dev in &mut self.devices {
            if let Some(qp) = UringQueuePair::downcast_mut(&mut *dev.qp) {
                qp.submit_held();
            }
        }
    }

    /// Whether every device with I/O outstanding has an interrupt line to block on.
    fn interrupts_armable(&self) -> bool {
        self.devices
            .iter()
            .all(|d| d.has_irq || d.qp.outstanding() == 0)
    }

    /// Readies every interrupt line before the reactor blocks. Devices with commands
    /// outstanding are armed, so that a completion wakes it (abandoned commands included:
    /// their slots come back when they complete). Idle ones are disarmed: a line left
    /// readable by completions that were polled for (an io_uring eventfd counts every
    /// completion, armed or not) is in the reactor's epoll set, and would end every park at
    /// once, leaving an idle reactor spinning.
    fn arm_interrupts(&mut self) {
        for dev in &mut self.devices {
            if !dev.has_irq {
                continue;
            }
            if dev.qp.outstanding() > 0 {
                dev.qp.arm_interrupt();
            } else {
                dev.qp.disarm_interrupt();
            }
        }
    }

    /// Sleeps for the I/O in `key`, once, until `duration` after the decision's timestamp,
    /// and records how far the wake-up overshot. An `interruptible` sleep, and any sleep past
    /// [`ReactorTuning::long_sleep_ns`](super::ReactorTuning::long_sleep_ns), blocks on the device interrupts as well: a
    /// completion ends it early, and then it is an interrupt wait, not the I/O's one sleep
    /// (the policy decides again). Without interrupt lines an interruptible sleep is a timed
    /// one, and a long sleep lasts `long_sleep_ns`, after which the policy decides again. A
    /// timed sleep ends at the next timer or timeout if that comes first (a block is armed
    /// for them): then too the policy decides again.
    fn sleep_for(&mut self, key: usize, duration: Duration, interruptible: bool) {
        // It sleeps for a live I/O: the oldest, one the device still owes.
        debug_assert!(self
            .slots
            .get(key)
            .is_some_and(|slot| slot.recovery != Recovery::Abandoned));
        let requested_ns = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let decided_ns = self.now_ns;
        let long = requested_ns > self.tuning.long_sleep_ns;
        let on_interrupts = (interruptible || long) && self.interrupts_armable();
        let until_ns = decided_ns.saturating_add(requested_ns);
        if !on_interrupts {
            self.submit_held();
            // Only its end wakes a timed sleep: it ends no later than the next timer or
            // timeout (they would run late by the rest of it), nor past the long-sleep bound.
            // Cut short, it is a piece, not the I/O's sleep: the reactor polls, runs what is
            // due, and the policy decides again.
            let bound_ns = long.then(|| decided_ns.saturating_add(self.tuning.long_sleep_ns));
            let end_ns = [bound_ns, self.next_due_ns()].into_iter().flatten().min();
            if let Some(end_ns) = end_ns.filter(|&end_ns| end_ns < until_ns) {
                self.sleep_until(end_ns, true);
                debug_assert_eq!(self.wake_next_turn, WakeState::AfterWait);
                return;
            }
        }
        // Measure what a sleep costs the thread in CPU, from the OS, on a sample of sleeps:
        // the reading itself is a syscall.
        let sample_cpu = self.counters.sleeps.is_multiple_of(SLEEP_CPU_SAMPLE_EVERY);
        let cpu_before_ns = if sample_cpu {
            self.thread_cpu_ns()
        } else {
            None
        };
        let woke_ns = if on_interrupts {
            self.park(true, Some(until_ns))
        } else {
            self.sleep_until(until_ns, false)
        };
        let actual_ns = woke_ns.saturating_sub(decided_ns);
        if actual_ns < requested_ns && on_interrupts {
            // A completion (or a message) ended it: an interrupt wait.
            self.counters.interrupt_waits += 1;
            self.woke_by_interrupt();
            debug_assert_eq!(self.wake_next_turn, WakeState::AfterInterrupt);
            return;
        }
        let cpu_ns =
            cpu_before_ns.and_then(|before| Some(self.thread_cpu_ns()?.saturating_sub(before)));
        let slept = Slept {
            requested_ns,
            actual_ns,
        };
        let slot = &mut self.slots[key];
        slot.slept = Some(slept);
        let dev = slot.device as usize;
        self.devices[dev]
            .recorder
            .record_sleep(requested_ns, actual_ns);
        self.counters.sleeps += 1;
        self.counters.slept_ns += requested_ns;
        self.counters.overshoot_ns += slept.overshoot_ns();
        self.policy.on_sleep(&slept, cpu_ns);
        // A sleep that ran its course: the I/O's one sleep, and the next turn's censoring.
        debug_assert_eq!(self.wake_next_turn, WakeState::AfterWait);
    }

    /// When the reactor must next be awake for work of its own: its next timer, or its next
    /// timeout or recovery step (a lost command never interrupts, and an I/O waiting behind
    /// quarantined slots has nothing else to wake it).
    fn next_due_ns(&mut self) -> Option<u64> {
        let next_timer_ns = self.timers.next_deadline_ns();
        match self.recovery_due_ns() {
            Some(due_ns) => Some(next_timer_ns.map_or(due_ns, |t| t.min(due_ns))),
            None => next_timer_ns,
        }
    }

    /// Blocks in epoll on the mailbox, the next timer, pollers' fds and (when `for_io`) the
    /// device interrupts, which it arms; with `until_ns`, no later than then. Or, when one
    /// `uring` device is all it waits for, inside that device's ring (`park_in_ring`).
    /// Returns when it woke.
    fn park(&mut self, for_io: bool, until_ns: Option<u64>) -> u64 {
        if for_io {
            if let Some(dev) = self.ring_waiter() {
                return self.park_in_ring(dev, until_ns);
            }
        }
        self.arm_interrupts();
        let next_timer_ns = self.next_due_ns();
        if next_timer_ns != self.timer_fd_armed_ns {
            let armed = match next_timer_ns {
                Some(deadline_ns) => self.timer_fd.arm_at(deadline_ns),
                None => self.timer_fd.disarm(),
            };
            armed.expect("reactor: setting its own timerfd failed");
            self.timer_fd_armed_ns = next_timer_ns;
        }
        if !for_io {
            self.counters.parks += 1;
            self.publish_parked(true);
        }
        self.waited_from(self.now_ns);
        let wake = &self.handles[self.index].wake;
        wake.parked.store(true, Ordering::SeqCst);
        // Pairs with the fence in `ReactorHandle::send`.
        std::sync::atomic::fence(Ordering::SeqCst);
        let blocks = self.mailbox.is_empty() && !wake.stop.load(Ordering::SeqCst);
        // Every poller arms its signal (each must, whatever the others found), and work one
        // finds on its second look ends the wait before it starts.
        let mut found = false;
        for (_, poller) in self.pollers.iter_mut() {
            found |= poller.before_block();
        }
        let blocks = blocks && !found;
        // A simulated reactor does not block the thread: it learns when it wakes, and is
        // not turned before (nothing sends to it meanwhile but the simulation, which
        // delivers through the waiter, not the eventfd).
        let mut woke_ns = None;
        let mailbox_signalled = blocks
            && match self.block_virtually(for_io, until_ns) {
                Some(at_ns) => {
                    woke_ns = Some(at_ns);
                    false
                }
                None => self.block_in_epoll(until_ns),
            };
        let woke_ns = woke_ns.unwrap_or_else(|| self.clock.now_ns());
        let wake = &self.handles[self.index].wake;
        wake.parked.store(false, Ordering::SeqCst);
        if mailbox_signalled {
            wake.eventfd.drain();
        }
        if self.timer_fd_armed_ns.is_some_and(|t| t <= woke_ns) {
            // It fired: a fired timerfd stays readable until set again.
            self.timer_fd_armed_ns = None;
            self.timer_fd
                .disarm()
                .expect("reactor: disarming its own timerfd failed");
        }
        if !for_io {
            self.publish_parked(false);
        }
        // Awake again, and senders know it; the next turn comes after a wait.
        debug_assert!(!self.me().wake.parked.load(Ordering::Relaxed));
        debug_assert_eq!(self.wake_next_turn, WakeState::AfterWait);
        woke_ns
    }

    /// The device whose ring the reactor can wait in instead of epoll: the only one with
    /// commands outstanding, a `uring` queue pair in interrupt mode, on a real waiter, with
    /// no poller that has a wake fd (the ring polls the mailbox's eventfd only).
    fn ring_waiter(&mut self) -> Option<usize> {
        if !matches!(self.waiter, Waiter::Real)
            || self.pollers.iter().any(|(_, p)| p.wake_fd().is_some())
        {
            return None;
        }
        let mut busy = self
            .devices
            .iter()
            .enumerate()
            .filter(|(_, d)| d.qp.outstanding() > 0);
        let (dev, _) = busy.next()?;
        if busy.next().is_some() {
            return None;
        }
        UringQueuePair::downcast_mut(&mut *self.devices[dev].qp)
            .is_some_and(|qp| qp.can_wait_in_ring())
            .then_some(dev)
    }

    /// Blocks inside device `dev`'s ring (one `io_uring_enter` that submits, runs the
    /// kernel's deferred work and waits) until a completion, a message, the next timer or
    /// timeout, or `until_ns`. The ring polls the mailbox's eventfd; timers end the wait
    /// through the enter's own timeout, so the timerfd is left as it is. Returns when it
    /// woke.
    fn park_in_ring(&mut self, dev: usize, until_ns: Option<u64>) -> u64 {
        let deadline_ns = [until_ns, self.next_due_ns()].into_iter().flatten().min();
        self.waited_from(self.now_ns);
        let qp = UringQueuePair::downcast_mut(&mut *self.devices[dev].qp)
            .expect("ring_waiter chose a uring queue pair");
        let wake = &self.handles[self.index].wake;
        // Before the last look at the mailbox: a signal the ring's poll carried is cleared
        // here, and one sent after it is found by the poll, armed again in the wait.
        qp.prepare_ring_wait(&wake.eventfd);
        wake.parked.store(true, Ordering::SeqCst);
        // Pairs with the fence in `ReactorHandle::send`.
        std::sync::atomic::fence(Ordering::SeqCst);
        let mut blocks = self.mailbox.is_empty() && !wake.stop.load(Ordering::SeqCst);
        for (_, poller) in self.pollers.iter_mut() {
            blocks &= !poller.before_block();
        }
        if blocks {
            qp.wait_in_ring(&wake.eventfd, deadline_ns);
        }
        let woke_ns = self.clock.now_ns();
        wake.parked.store(false, Ordering::SeqCst);
        self.counters.ring_waits += 1;
        debug_assert_eq!(self.wake_next_turn, WakeState::AfterWait);
        woke_ns
    }

    /// Waits in epoll on everything `park` armed, until `until_ns` at the latest if it
    /// comes before the timerfd. Returns whether the mailbox signalled.
    fn block_in_epoll(&mut self, until_ns: Option<u64>) -> bool {
        // A deadline before the timerfd's is epoll's own timeout: no timerfd to set for a
        // short sleep, nor to disarm after it.
        let timeout = until_ns
            .filter(|&u| self.timer_fd_armed_ns.is_none_or(|t| u < t))
            .map(|u| Duration::from_nanos(u.saturating_sub(self.clock.now_ns())));
        match self.epoll.wait(timeout) {
            Ok(mut tokens) => tokens.any(|t| t == TOKEN_MAILBOX),
            Err(e) => panic!("reactor {}: epoll_wait failed: {e}", self.core),
        }
    }

    /// Publishes before parking (readers then count the parked time as idle, up to now) and
    /// after waking.
    fn publish_parked(&mut self, parked: bool) {
        let now_ns = self.clock.now_ns();
        self.last_publish_ns = now_ns;
        self.me().stats.publish(
            &self.counters,
            self.start_ns,
            now_ns,
            self.outstanding() as u64,
            parked,
        );
    }

    /// The reactor waits (sleeps or blocks) from `from_ns`: the next turn comes after a
    /// wait. At most one wait per idle turn, from the turn's own timestamp.
    pub(super) fn waited_from(&mut self, from_ns: u64) {
        debug_assert_eq!(self.wake_next_turn, WakeState::Awake);
        debug_assert_eq!(from_ns, self.now_ns);
        self.slept_from_ns = from_ns;
        self.wake_next_turn = WakeState::AfterWait;
    }

    /// The wait that just ended was on the device interrupts and ended early: only a park
    /// ends that way.
    fn woke_by_interrupt(&mut self) {
        debug_assert_eq!(self.wake_next_turn, WakeState::AfterWait);
        self.wake_next_turn = WakeState::AfterInterrupt;
    }
}

#[cfg(test)]
mod tests;
