//! Waiting inside the ring: a reactor whose only device with commands outstanding is this
//! queue pair blocks in `io_uring_enter(GETEVENTS)` itself, rather than arming the ring's
//! eventfd and blocking in epoll. One system call then submits what is pending, runs the
//! deferred task work, posts the completions and waits for them, where the epoll route
//! takes an enter to submit, a read to clear the eventfd, the epoll wait, and an enter to
//! post the completions after it.
//!
//! The entries a reactor's callbacks push after a poll are left for that wait as well:
//! while the queue pair may be waited in, `process_completions` holds back entries it finds
//! pending (the reactor's idle path is about to hand them over, with its wait, or with
//! [`UringQueuePair::submit_held`] before it spins or sleeps), and submits them on the next
//! call if they are still there, so a reactor kept busy by other work delays them by one
//! turn at most. A turn that reaps a batch and refills it then costs the one enter that
//! submits and waits, not an enter to submit followed by another to wait.
//!
//! The reactor must still wake for its mailbox: the ring polls the reactor's wake eventfd
//! (`IORING_OP_POLL_ADD`, one shot, user data [`WAKE_USER_DATA`]), so a signal ends the
//! wait as a completion would. The poll stays armed between waits and costs nothing until
//! the eventfd is signalled. Once it has fired it is armed again on the next wait, after
//! [`UringQueuePair::prepare_ring_wait`] has cleared the eventfd: the caller clears it
//! before its last look at the mailbox, and the poll, armed after that look, finds any
//! signal sent since at once (a poll is armed level-triggered), so none is lost. Timers and
//! timeouts end the wait through the enter's own timeout.

use std::any::Any;
use std::os::fd::AsRawFd;

use io_uring::{opcode, types};

use super::{entered, transient, unentered, UringQueuePair};
use crate::qpair::QueuePair;
use crate::sys::EventFd;
use crate::uring::CompletionMode;

/// User data of the poll of the waker's eventfd: never a slot index, nor an abort's.
pub(super) const WAKE_USER_DATA: u64 = u64::MAX - 1;

/// The poll of the waker's eventfd.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum WakePoll {
    /// Never armed, or its completion was reaped: it is armed on the next wait.
    #[default]
    Unarmed,
    /// Armed on the waker's eventfd (this raw fd): a signal posts its completion.
    Armed(i32),
    /// Its completion was reaped: the eventfd was signalled and must be cleared before the
    /// poll is armed again, or the new poll would fire at once.
    Fired,
}

/// How a wait inside the ring ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingWake {
    /// Something was ready before the wait (a completion in the ring or made locally, a
    /// command to resubmit): it did not block.
    Ready,
    /// A completion was posted, the waker's eventfd was signalled, or a signal interrupted
    /// the wait.
    Woken,
    /// The deadline passed first.
    Deadline,
}

impl UringQueuePair {
    /// `qp` as a `uring` queue pair, if it is one.
    pub fn downcast_mut<'q>(qp: &'q mut (dyn QueuePair + 'static)) -> Option<&'q mut Self> {
        (qp as &mut dyn Any).downcast_mut()
    }

    /// Whether a reactor may wait inside this queue pair's ring ([`Self::wait_in_ring`]):
    /// in interrupt mode, with one ring, unless the device string said `wait=epoll`. Polled
    /// modes have no interrupt to wait for, and a side ring's completions would not end a
    /// wait on the main one.
    pub fn can_wait_in_ring(&self) -> bool {
        self.ring_wait && self.mode == CompletionMode::Interrupt && self.side.is_none()
    }

    /// Call before the waker's last look for work of its own, ahead of every
    /// [`Self::wait_in_ring`]: clears `wake` if the ring's poll of it fired since the last
    /// wait (the signal it carried is the caller's to find in that look). Costs nothing
    /// otherwise.
    pub fn prepare_ring_wait(&mut self, wake: &EventFd) {
        if self.wake_poll == WakePoll::Fired {
            wake.drain();
            self.wake_poll = WakePoll::Unarmed;
        }
    }

    /// Hands every pending entry to the kernel, held back or not: for a reactor about to spin
    /// or sleep rather than wait in the ring.
    pub fn submit_held(&mut self) {
        if self.unsubmitted > 0 {
            self.flush();
        }
        self.held = false;
    }

    /// `process_completions`' submission: entries pending for the first time are held for
    /// the reactor's wait while the ring may be waited in; otherwise, or on the next call,
    /// they are entered.
    ///
    /// A ring with a submission thread holds nothing back: its thread takes the entries
    /// without an enter while awake, so holding would save nothing and, while it sleeps,
    /// would leave it asleep for a turn.
    pub(super) fn flush_unless_held(&mut self) {
        if self.unsubmitted > 0 && !self.held && !self.sqpoll && self.can_wait_in_ring() {
            self.held = true;
            return;
        }
        self.flush();
        self.held = false;
    }

    /// Whether deferred task work waits for an enter (tests).
    #[cfg(test)]
    pub(crate) fn task_work_pending(&mut self) -> bool {
        self.defer_taskrun && self.ring.submission().taskrun()
    }

    /// Whether completions wait in the main ring's completion queue (tests).
    #[cfg(test)]
    pub(crate) fn completions_posted(&mut self) -> bool {
        !self.ring.completion().is_empty()
    }

    /// Whether the main ring's submission thread has gone to sleep and waits for an enter
    /// to wake it (tests).
    #[cfg(test)]
    pub(crate) fn submission_thread_asleep(&mut self) -> bool {
        self.sqpoll && self.ring.submission().need_wakeup()
    }

    /// The thread id of the main ring's submission thread, as the ring's fdinfo gives it
    /// (tests).
    #[cfg(test)]
    pub(crate) fn submission_thread_tid(&self) -> Option<u32> {
        let fdinfo =
            std::fs::read_to_string(format!("/proc/self/fdinfo/{}", self.ring.as_raw_fd())).ok()?;
        let tid = fdinfo.lines().find_map(|l| l.strip_prefix("SqThread:"))?;
        tid.trim().parse().ok()
    }

    /// Whether the main ring was made with a submission thread (tests).
    #[cfg(test)]
    pub(crate) fn has_submission_thread(&self) -> bool {
        self.ring.params().is_setup_sqpoll()
    }

    /// Entries pushed and not yet entered (tests).
    #[cfg(test)]
    pub(crate) fn unsubmitted(&self) -> usize {
        self.unsubmitted
    }

    /// Submits every pending entry and blocks in the ring until a completion is posted,
    /// `wake` is signalled, or `deadline_ns` (on the `CLOCK_MONOTONIC` clock) passes. The
    /// caller called [`Self::prepare_ring_wait`] before its last look at what would
    /// signal `wake`. The completions are then in the ring, for the next
    /// `process_completions`.
    pub fn wait_in_ring(&mut self, wake: &EventFd, deadline_ns: Option<u64>) -> RingWake {
        debug_assert!(self.can_wait_in_ring());
        debug_assert_ne!(self.wake_poll, WakePoll::Fired, "prepare_ring_wait first");
        // Work the kernel would not signal: completions made here, Write Zeroes to step.
        if !self.local.is_empty() || !self.retry_zeroes.is_empty() {
            return RingWake::Ready;
        }
        let wake_fd = wake.as_fd().as_raw_fd();
        if self.wake_poll == WakePoll::Unarmed {
            let poll = opcode::PollAdd::new(types::Fd(wake_fd), libc::POLLIN as u32)
                .build()
                .user_data(WAKE_USER_DATA);
            // SAFETY: a poll carries no buffer; the eventfd it names is the waker's, and
            // the kernel holds its own reference to the file while it polls.
            if !unsafe { self.push(&poll, false) } {
                // The submission queue is full even after entering it: the next wait tries
                // again; the completions of what fills it end this one.
                return self.enter_and_wait(deadline_ns);
            }
            self.wake_poll = WakePoll::Armed(wake_fd);
        }
        debug_assert!(
            matches!(self.wake_poll, WakePoll::Armed(fd) if fd == wake_fd),
            "a queue pair's ring wakes for one waker's eventfd"
        );
        self.enter_and_wait(deadline_ns)
    }

    /// One `io_uring_enter`: submit what is pending, wait for one completion, no later than
    /// `deadline_ns`.
    fn enter_and_wait(&mut self, deadline_ns: Option<u64>) -> RingWake {
        self.held = false;
        if !self.ring.completion().is_empty() {
            // The kernel would return at once; submit without waiting.
            self.flush();
            return RingWake::Ready;
        }
        let result = match deadline_ns {
            Some(deadline_ns) => {
                let now_ns = crate::sys::monotonic_ns();
                if deadline_ns <= now_ns {
                    self.flush();
                    return RingWake::Deadline;
                }
                let ts =
                    types::Timespec::from(std::time::Duration::from_nanos(deadline_ns - now_ns));
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(1, &args)
            }
            None => self.ring.submitter().submit_and_wait(1),
        };
        // An enter that submitted returns the count it submitted, not the wait's outcome
        // (a timeout included): the ring says what ended the wait.
        match result {
            Ok(n) => entered(&self.ring, &mut self.unsubmitted, n),
            Err(e) if e.raw_os_error() == Some(libc::ETIME) || transient(&e) => {
                self.unsubmitted = unentered(&mut self.ring);
            }
            Err(e) => panic!("io_uring_enter (wait) failed on a valid ring: {e}"),
        }
        let timed_out =
            deadline_ns.is_some_and(|deadline_ns| crate::sys::monotonic_ns() >= deadline_ns);
        if timed_out && self.ring.completion().is_empty() {
            RingWake::Deadline
        } else {
            RingWake::Woken
        }
    }
}
