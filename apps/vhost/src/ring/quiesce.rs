//! A ring that lets what it took finish before something changes under it: a new memory
//! map (taken only once the old one's requests are answered), a hold (the front end's
//! message that replaces or removes memory waits until every ring has answered all it took;
//! `control.rs`), and the stop (take nothing more, answer what was taken, publish the base).
//!
//! None of these drops a request: a ring waits as long as the device takes, and says so in
//! the log once it has waited [`QUIESCE_LOG_NS`].

use std::sync::atomic::Ordering;
use std::time::Duration;

use hypoll_reactor::Reactor;

use super::{Vring, FAILED};
use crate::shard::VhostState;

/// How long a ring waits for its requests under an old memory map, or under a hold, before
/// it logs that it still waits (and goes on waiting: nothing is dropped). A device that
/// takes this long for one request is failing or far overloaded.
pub const QUIESCE_LOG_NS: u64 = 1_000_000_000;

impl<S: VhostState> Vring<S> {
    /// Gives back a request refused for room at the device, never submitted: the next take
    /// reads it off the avail ring again (a head a predecessor left goes back to the
    /// resubmissions, and stays marked in the inflight area).
    pub(super) fn give_back_waiting(&mut self) {
        let Some((slot, _, resubmitted)) = self.waiting.take() else {
            return;
        };
        self.free.push(slot);
        let head = self.slots[usize::from(slot)].head;
        if resubmitted {
            self.resubmit.push(head);
        } else {
            // It was the last head taken: the ring stopped taking there.
            self.queue
                .set_next_avail(self.queue.next_avail().wrapping_sub(1));
            if let Some(q) = self.inflight.as_mut() {
                q.untake(head);
            }
        }
    }

    /// Under hold `epoch`: once nothing the ring took is in flight, tells the control (once
    /// per hold).
    pub(super) fn hold(&mut self, r: &mut Reactor<S>, epoch: u64) {
        if self.in_flight() > 0 {
            self.note_quiescing(r);
            return;
        }
        self.quiesced();
        if self.quiet_told != epoch {
            self.quiet_told = epoch;
            self.shared.quiet.store(epoch, Ordering::Release);
            (self.tell_control)();
        }
    }

    /// The ring waits for requests in flight before it may go on: logs it, once, when the
    /// wait passes [`QUIESCE_LOG_NS`].
    pub(super) fn note_quiescing(&mut self, r: &mut Reactor<S>) {
        let now_ns = r.now_ns();
        let since_ns = match self.quiescing_since_ns {
            Some(since_ns) => since_ns,
            None => {
                self.quiescing_since_ns = Some(now_ns);
                // A reactor parked until the device answers is woken then, to log.
                r.after(Duration::from_nanos(QUIESCE_LOG_NS), |_, _| {});
                now_ns
            }
        };
        if !self.quiesce_logged && now_ns.saturating_sub(since_ns) >= QUIESCE_LOG_NS {
            self.quiesce_logged = true;
            tracing::warn!(
                export = %self.export.name,
                requests = self.in_flight(),
                waited_ms = (now_ns - since_ns) / 1_000_000,
                "a memory map change waits for the device to answer the guest's requests \
                 in flight (still waiting: none is dropped)"
            );
        }
    }

    /// Nothing the ring took is in flight any more.
    pub(super) fn quiesced(&mut self) {
        if self.quiesce_logged {
            tracing::info!(
                export = %self.export.name,
                "the requests a memory map change waited for are answered"
            );
        }
        self.quiescing_since_ns = None;
        self.quiesce_logged = false;
    }

    /// Stops once nothing is in flight: publishes the base, tells the control, ends.
    pub(super) fn finish_stop(&mut self, r: &mut Reactor<S>, state: &mut S) -> usize {
        // Never submitted: taken again after a restart.
        self.give_back_waiting();
        if self.in_flight() > 0 {
            return 0;
        }
        let base = if self.broken {
            FAILED
        } else {
            u32::from(self.queue.next_avail())
        };
        self.shared.base.store(base, Ordering::Release);
        (self.tell_control)();
        state.vhost().end_ring(r, self.inbox, self.space);
        1
    }
}
