//! One-shot and periodic timers in a heap, checked once per loop turn.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use slab::Slab;

use crate::reactor::Reactor;

/// Identifies a timer for [`Reactor::cancel_timer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TimerId {
    key: usize,
    generation: u64,
}

pub(crate) enum TimerFn {
    Once(Box<dyn FnOnce(&mut Reactor)>),
    Every(Box<dyn FnMut(&mut Reactor)>),
}

struct Entry {
    generation: u64,
    deadline_ns: u64,
    period_ns: u64,
    /// Taken out while the callback runs.
    callback: Option<TimerFn>,
}

/// Timers of one reactor. The heap may hold stale entries for cancelled or re-armed timers;
/// they are skipped by their generation when they surface.
#[derive(Default)]
pub(crate) struct Timers {
    entries: Slab<Entry>,
    heap: BinaryHeap<Reverse<(u64, usize, u64)>>,
    next_generation: u64,
}

impl Timers {
    pub fn add(&mut self, deadline_ns: u64, period_ns: u64, callback: TimerFn) -> TimerId {
        self.next_generation += 1;
        let generation = self.next_generation;
        let key = self.entries.insert(Entry {
            generation,
            deadline_ns,
            period_ns,
            callback: Some(callback),
        });
        self.heap.push(Reverse((deadline_ns, key, generation)));
        TimerId { key, generation }
    }

    /// Returns whether the timer was still live.
    pub fn cancel(&mut self, id: TimerId) -> bool {
        match self.entries.get(id.key) {
            Some(e) if e.generation == id.generation => {
                self.entries.remove(id.key);
                true
            }
            _ => false,
        }
    }

    /// The earliest live deadline.
    pub fn next_deadline_ns(&mut self) -> Option<u64> {
        while let Some(&Reverse((deadline_ns, key, generation))) = self.heap.peek() {
            if self.is_live(key, generation, deadline_ns) {
                return Some(deadline_ns);
            }
            self.heap.pop();
        }
        None
    }

    fn is_live(&self, key: usize, generation: u64, deadline_ns: u64) -> bool {
        self.entries
            .get(key)
            .is_some_and(|e| e.generation == generation && e.deadline_ns == deadline_ns)
    }

    /// Takes the next timer due at `now_ns`, leaving periodic ones in place to be re-armed
    /// by [`Timers::finish`].
    pub fn pop_due(&mut self, now_ns: u64) -> Option<(TimerId, TimerFn)> {
        loop {
            let &Reverse((deadline_ns, key, generation)) = self.heap.peek()?;
            if !self.is_live(key, generation, deadline_ns) {
                self.heap.pop();
                continue;
            }
            if deadline_ns > now_ns {
                return None;
            }
            self.heap.pop();
            let entry = &mut self.entries[key];
            let callback = entry.callback.take().expect("a due timer has its callback");
            if matches!(callback, TimerFn::Once(_)) {
                self.entries.remove(key);
            }
            return Some((TimerId { key, generation }, callback));
        }
    }

    /// Re-arms a periodic timer after its callback ran (unless it was cancelled meanwhile).
    /// Missed periods are skipped, not run in a burst.
    pub fn finish(&mut self, id: TimerId, callback: TimerFn, now_ns: u64) {
        if let Some(entry) = self.entries.get_mut(id.key) {
            if entry.generation == id.generation {
                let mut next = entry.deadline_ns + entry.period_ns;
                if next <= now_ns {
                    next = now_ns + entry.period_ns;
                }
                entry.deadline_ns = next;
                entry.callback = Some(callback);
                self.heap.push(Reverse((next, id.key, id.generation)));
            }
        }
    }
}
