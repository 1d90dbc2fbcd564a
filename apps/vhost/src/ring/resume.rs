//! Starting a ring after a back end that died: what its inflight area says is still owed
//! runs first, in the order it was taken, then the avail ring from where the guest's used
//! index shows the predecessor stopped (`inflight.rs` keeps the area).

use std::num::Wrapping;

use super::Vring;
use crate::shard::VhostState;

impl<S: VhostState> Vring<S> {
    /// Reads what a predecessor left in the inflight area, once the ring is mapped: the
    /// ring resumes from the guest's used index, with the heads still marked to run first.
    pub(super) fn recover(&mut self) {
        let Some(q) = self.inflight.as_mut() else {
            self.recovered = true;
            return;
        };
        let Some(used) = self.queue.guest_used_idx() else {
            return;
        };
        self.recovered = true;
        let recovery = q.recover(used);
        if !recovery.resubmit.is_empty() {
            // An operator's event, as a reactor's own recovery steps are: a back end died
            // with the guest's requests in flight.
            tracing::warn!(
                export = %self.export.name,
                requests = recovery.resubmit.len(),
                "resubmitting the requests a previous back end left in flight"
            );
        }
        self.queue.resume(recovery.next_avail, used);
        debug_assert!(recovery.resubmit.len() <= self.slots.len());
        self.resubmit.clear();
        self.resubmit.extend(recovery.resubmit.iter().rev());
    }

    /// The next head to serve: one a predecessor left first, then the avail ring's (up to
    /// `avail`). Returns it and whether it is a resubmission.
    pub(super) fn next_head(&mut self, avail: Wrapping<u16>) -> Option<(u16, bool)> {
        if let Some(head) = self.resubmit.pop() {
            return Some((head, true));
        }
        if Wrapping(self.queue.next_avail()) == avail {
            return None;
        }
        let head = self.queue.pop()?;
        if let Some(q) = self.inflight.as_mut() {
            q.take(head);
        }
        Some((head, false))
    }
}
