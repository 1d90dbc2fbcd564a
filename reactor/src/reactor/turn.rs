//! The loop: turn after turn until stopped (messages, timers, pollers, completions, waiters,
//! timeouts), handing a turn that found nothing to the idle path (`idle`), and the drain at
//! shutdown.

use std::sync::atomic::Ordering;

use hypoll_nvme::{Completion, Status};
use hypoll_policy::Observation;

use super::{
    ExitReport, IoSlot, Reactor, Recovery, WakeState, COMPLETION_BATCH, MESSAGE_BATCH,
    SHUTDOWN_POLL,
};
use crate::io::{DeviceId, IoDone, IoFailure};
use crate::timer::{TimerFn, Timers};

impl<S> Reactor<S> {
    /// Runs until stopped, then drains or fails outstanding I/O. Returns the exit report.
    /// The loop of a [`ReactorSet`](crate::ReactorSet) thread: `poll` and `idle` (the step
    /// API) are the same pieces, less this loop's single clock read per turn.
    pub(crate) fn run(&mut self, state: &mut S) -> ExitReport {
        let mut turn_start_ns = self.clock.now_ns();
        while !self.me().wake.stop.load(Ordering::Acquire) {
            let work = self.step(state, turn_start_ns);
            if work == 0 {
                self.when_idle();
            }
            // One clock read per turn: this turn's end is the next one's start. A turn that
            // did work is busy; one that found none (its spin, sleep or park included) idle.
            let next_ns = self.clock.now_ns();
            let elapsed_ns = next_ns.saturating_sub(turn_start_ns);
            if work > 0 {
                self.counters.busy_ns += elapsed_ns;
            } else {
                self.counters.idle_ns += elapsed_ns;
            }
            turn_start_ns = next_ns;
        }
        self.stop_and_drain(state)
    }

    /// One loop turn at the clock's current time, for a simulation that steps reactors by
    /// hand (it never spins, sleeps or parks). Returns the work done.
    #[cfg(test)]
    pub(crate) fn sim_turn(&mut self, state: &mut S) -> usize {
        self.now_ns = self.clock.now_ns();
        self.turn(state)
    }

    /// One loop turn: messages, timers, pollers, completions, timeouts. Returns the work
    /// done.
    pub(super) fn turn(&mut self, state: &mut S) -> usize {
        debug_assert!(self.in_flight_within_depths());
        debug_assert!(self.abandoned_hold());
        debug_assert!(self.wait_queues_hold());
        self.counters.polls += 1;
        let mut work = self.run_messages(state, MESSAGE_BATCH);
        work += self.run_timers(state);
        work += self.run_pollers(state);
        work += self.reap(state);
        work += self.start_waiters(state);
        work += self.check_timeouts(state);
        for dev in &mut self.devices {
            dev.recorder.tick(self.now_ns);
        }
        if work == 0 {
            self.counters.idle_polls += 1;
        }
        debug_assert!(self.in_flight_within_depths());
        debug_assert!(self.abandoned_hold());
        debug_assert!(self.wait_queues_hold());
        work
    }

    fn run_messages(&mut self, state: &mut S, max: usize) -> usize {
        let mut ran = 0;
        while ran < max {
            let Ok(message) = self.mailbox.try_recv() else {
                break;
            };
            message(self, state);
            ran += 1;
        }
        self.counters.messages += ran as u64;
        ran
    }

    fn run_timers(&mut self, state: &mut S) -> usize {
        let mut ran = 0;
        while let Some((id, callback)) = self.timers.pop_due(self.now_ns) {
            match callback {
                TimerFn::Once(f) => f(self, state),
                TimerFn::Every(mut f) => {
                    f(self, state);
                    self.timers.finish(id, TimerFn::Every(f), self.now_ns);
                }
            }
            ran += 1;
        }
        self.counters.timers += ran as u64;
        ran
    }

    fn run_pollers(&mut self, state: &mut S) -> usize {
        if self.pollers.is_empty() {
            return 0;
        }
        let mut pollers = std::mem::take(&mut self.pollers);
        let mut work = 0;
        for (id, poller) in pollers.iter_mut() {
            if self.removed_pollers.contains(id) {
                continue;
            }
            let did = poller.poll(self, state);
            if did > 0 {
                work += did;
                // Submissions after this poller's work are stamped with a fresh time.
                self.now_ns = self.clock.now_ns();
            }
        }
        // Pollers added during the turn were pushed onto the (taken) list: keep them.
        pollers.append(&mut self.pollers);
        if !self.removed_pollers.is_empty() {
            let removed = std::mem::take(&mut self.removed_pollers);
            pollers.retain(|(id, _)| !removed.contains(id));
        }
        self.pollers = pollers;
        work
    }

    /// Reaps every queue pair, then runs the callbacks: completions are collected first so a
    /// callback that submits or frees never re-enters a poll.
    fn reap(&mut self, state: &mut S) -> usize {
        let mut reaped = 0;
        let completions = &mut self.completions;
        for (i, dev) in self.devices.iter_mut().enumerate() {
            if dev.qp.outstanding() == 0 {
                continue;
            }
            reaped += dev
                .qp
                .process_completions(COMPLETION_BATCH, &mut |c| completions.push((i as u16, c)));
        }
        if reaped == 0 {
            return 0;
        }
        // One timestamp for the whole batch.
        self.now_ns = self.clock.now_ns();
        let mut batch = std::mem::take(&mut self.completions);
        self.in_batch = true;
        self.batch_left = batch.len();
        for (dev, completion) in batch.drain(..) {
            self.batch_left -= 1;
            self.complete(state, dev, completion);
        }
        self.in_batch = false;
        self.completions = batch;
        for i in 0..self.after_batch.len() {
            if let Some(after) = self.after_batch[i].take() {
                after(self, state);
            }
        }
        // The batch is done: every reaped I/O gave its slot back.
        debug_assert!(self.in_flight_within_depths());
        debug_assert!(self.abandoned_hold());
        reaped
    }

    fn complete(&mut self, state: &mut S, dev: u16, completion: Completion) {
        let slot = self
            .slots
            .try_remove(completion.tag as usize)
            .unwrap_or_else(|| {
                panic!(
                    "reactor {}: completion for tag {} that is not outstanding",
                    self.core, completion.tag
                )
            });
        assert_eq!(
            slot.device, dev,
            "reactor {}: device {dev} completed tag {} of device {}",
            self.core, completion.tag, slot.device
        );
        if slot.recovery == Recovery::Abandoned {
            // Its callback ran when it was abandoned: the device is done with the buffer
            // now, so it leaves quarantine (dropped with `slot`).
            self.abandoned -= 1;
            self.devices[dev as usize].abandoned -= 1;
            self.counters.late_completions += 1;
            tracing::info!(
                core = self.core,
                device = dev,
                tag = completion.tag,
                status = %completion.status,
                "late completion of an abandoned I/O: its buffer leaves quarantine"
            );
            return;
        }
        let latency_ns = self.now_ns.saturating_sub(slot.submit_ns);
        let ok = completion.status.is_success();
        if ok {
            if let Some(bucket) = slot.bucket {
                self.devices[dev as usize]
                    .recorder
                    .record(bucket, latency_ns);
            }
        } else {
            self.counters.io_errors += 1;
        }
        self.counters.ios += 1;
        let censored = self.wake_this_turn.after_wait() && slot.submit_ns <= self.slept_from_ns;
        self.policy.on_completion(&Observation {
            bucket: slot.bucket,
            submit_ns: slot.submit_ns,
            latency_ns,
            slept: slot.slept,
            idle_polls: self.counters.idle_polls - slot.idle_polls_at_submit,
            censored,
            after_interrupt: censored && self.wake_this_turn == WakeState::AfterInterrupt,
        });
        let result = if ok {
            Ok(())
        } else if slot.recovery.timed_out()
            && matches!(
                completion.status,
                Status::ABORT_REQUESTED | Status::ABORTED_SQ_DELETION
            )
        {
            Err(IoFailure::TimedOut)
        } else {
            Err(IoFailure::Device(completion.status))
        };
        let done = IoDone {
            device: DeviceId(dev),
            result,
            buf: slot.buf,
            user: slot.user,
            latency_ns: self.now_ns.saturating_sub(slot.accepted_ns),
        };
        let callback = slot
            .callback
            .expect("only abandoned I/Os have run their callback");
        callback(self, state, done);
    }

    pub(super) fn publish(&mut self) {
        self.last_publish_ns = self.now_ns;
        self.me().stats.publish(
            &self.counters,
            self.start_ns,
            self.now_ns,
            self.outstanding() as u64,
            false,
        );
    }

    /// Stops: runs what is queued, stops timers and pollers, lets outstanding I/O complete
    /// for up to the shutdown timeout, then deletes the queue pairs and fails the rest.
    pub(super) fn stop_and_drain(&mut self, state: &mut S) -> ExitReport {
        self.stopping = true;
        while self.run_messages(state, MESSAGE_BATCH) > 0 {}
        self.pollers.clear();
        self.timers = Timers::default();
        // I/Os still waiting for a slot never reached a device: they fail now.
        self.now_ns = self.clock.now_ns();
        let mut waiting_failed = 0;
        for d in 0..self.devices.len() {
            while let Some(w) = self.devices[d].waiting.pop_front() {
                self.waiters -= 1;
                waiting_failed += 1;
                self.fail_waiter(state, d, w, IoFailure::Shutdown);
            }
        }
        let ios_before = self.counters.ios;
        let deadline_ns = self.clock.now_ns() + self.tuning.shutdown_timeout.as_nanos() as u64;
        while self.live() > 0 && self.clock.now_ns() < deadline_ns {
            self.now_ns = self.clock.now_ns();
            if self.reap(state) + self.check_timeouts(state) == 0 {
                // Stopping is not latency-critical: poll every `SHUTDOWN_POLL` rather than spin.
                let until_ns = self.now_ns + SHUTDOWN_POLL.as_nanos() as u64;
                self.wait_shutdown_poll(until_ns);
            }
        }
        let drained_ios = self.counters.ios - ios_before;
        // Delete the queue pairs first: after this no device touches an I/O buffer.
        self.devices.clear();
        // Abandoned I/Os already ran their callbacks: their buffers leave quarantine here.
        let failed: Vec<IoSlot<S>> = self
            .slots
            .drain()
            .filter(|s| s.recovery != Recovery::Abandoned)
            .collect();
        self.abandoned = 0;
        let failed_ios = failed.len() as u64 + waiting_failed;
        if failed_ios > 0 {
            tracing::warn!(
                core = self.core,
                failed_ios,
                shutdown_timeout_ms = self.tuning.shutdown_timeout.as_millis() as u64,
                "reactor stopping: I/O still outstanding fails with Shutdown"
            );
        }
        self.now_ns = self.clock.now_ns();
        for slot in failed {
            let callback = slot.callback.expect("not abandoned");
            let done = IoDone {
                device: DeviceId(slot.device),
                result: Err(IoFailure::Shutdown),
                buf: slot.buf,
                user: slot.user,
                latency_ns: self.now_ns.saturating_sub(slot.accepted_ns),
            };
            self.counters.ios += 1;
            self.counters.io_errors += 1;
            callback(self, state, done);
        }
        // Nothing is left for a device to touch, nor a callback to run.
        debug_assert!(self.slots.is_empty() && self.abandoned == 0 && self.waiters == 0);
        self.publish();
        ExitReport {
            core: self.core,
            drained_ios,
            failed_ios,
            stats: self.me().stats(),
            output: (),
        }
    }
}
