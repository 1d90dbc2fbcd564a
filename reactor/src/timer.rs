//! One-shot and periodic timers in a heap, checked once per loop turn.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use slab::Slab;

use crate::reactor::Reactor;

/// Stale heap entries tolerated beyond twice the live timers before a rebuild.
const STALE_SLACK: usize = 64;

/// Identifies a timer for [`Reactor::cancel_timer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TimerId {
    key: usize,
    generation: u64,
}

type Once<S> = Box<dyn FnOnce(&mut Reactor<S>, &mut S)>;
type Every<S> = Box<dyn FnMut(&mut Reactor<S>, &mut S)>;

pub(crate) enum TimerFn<S> {
    Once(Once<S>),
    Every(Every<S>),
}

struct Entry<S> {
    generation: u64,
    deadline_ns: u64,
    period_ns: u64,
    /// Taken out while the callback runs.
    callback: Option<TimerFn<S>>,
}

/// Timers of one reactor. The heap may hold stale entries for cancelled or re-armed timers;
/// they are skipped by their generation when they surface.
pub(crate) struct Timers<S> {
    entries: Slab<Entry<S>>,
    heap: BinaryHeap<Reverse<(u64, usize, u64)>>,
    next_generation: u64,
    /// Heap entries of cancelled timers not yet popped.
    stale: usize,
}

// Not derived: a derived `Default` would ask `S: Default`.
impl<S> Default for Timers<S> {
    fn default() -> Self {
        Timers {
            entries: Slab::new(),
            heap: BinaryHeap::new(),
            next_generation: 0,
            stale: 0,
        }
    }
}

impl<S> Timers<S> {
    pub fn add(&mut self, deadline_ns: u64, period_ns: u64, callback: TimerFn<S>) -> TimerId {
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
                let armed = e.callback.is_some();
                self.entries.remove(id.key);
                if armed {
                    // Its heap entry stays until it surfaces, or until a rebuild.
                    self.stale += 1;
                    if self.stale > 2 * self.entries.len() + STALE_SLACK {
                        self.rebuild();
                    }
                }
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
            self.stale = self.stale.saturating_sub(1);
        }
        None
    }

    /// Drops every stale heap entry: cancelling many long timers (I/O timeouts) must not
    /// grow the heap without bound.
    fn rebuild(&mut self) {
        let entries = &self.entries;
        self.heap
            .retain(|&Reverse((deadline_ns, key, generation))| {
                entries
                    .get(key)
                    .is_some_and(|e| e.generation == generation && e.deadline_ns == deadline_ns)
            });
        self.stale = 0;
    }

    fn is_live(&self, key: usize, generation: u64, deadline_ns: u64) -> bool {
        self.entries
            .get(key)
            .is_some_and(|e| e.generation == generation && e.deadline_ns == deadline_ns)
    }

    /// Takes the next timer due at `now_ns`, leaving periodic ones in place to be re-armed
    /// by [`Timers::finish`].
    pub fn pop_due(&mut self, now_ns: u64) -> Option<(TimerId, TimerFn<S>)> {
        loop {
            let &Reverse((deadline_ns, key, generation)) = self.heap.peek()?;
            if !self.is_live(key, generation, deadline_ns) {
                self.heap.pop();
                self.stale = self.stale.saturating_sub(1);
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
    pub fn finish(&mut self, id: TimerId, callback: TimerFn<S>, now_ns: u64) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn once() -> TimerFn<()> {
        TimerFn::Once(Box::new(|_, _| {}))
    }

    #[test]
    fn due_timers_come_out_in_deadline_order_and_cancelled_ones_never() {
        let mut t = Timers::<()>::default();
        let c = t.add(30, 0, once());
        t.add(10, 0, once());
        t.add(20, 0, once());
        assert!(t.cancel(c));
        assert!(!t.cancel(c), "cancelling twice");
        assert_eq!(t.next_deadline_ns(), Some(10));
        assert!(t.pop_due(5).is_none());
        let order: Vec<u64> =
            std::iter::from_fn(|| t.pop_due(100).map(|(id, _)| id.key as u64)).collect();
        assert_eq!(order.len(), 2);
        assert_eq!(t.next_deadline_ns(), None);
    }

    #[test]
    fn cancelling_many_timers_does_not_grow_the_heap() {
        let mut t = Timers::<()>::default();
        t.add(1, 0, once());
        for i in 0..100_000u64 {
            let id = t.add(1_000_000 + i, 0, once());
            t.cancel(id);
        }
        assert!(
            t.heap.len() <= 2 * t.entries.len() + STALE_SLACK + 1,
            "{}",
            t.heap.len()
        );
    }

    #[test]
    fn periodic_timers_skip_missed_periods() {
        let mut t = Timers::<()>::default();
        let id = t.add(10, 10, TimerFn::Every(Box::new(|_, _| {})));
        let (due, f) = t.pop_due(55).unwrap();
        assert_eq!(due, id);
        t.finish(due, f, 55);
        assert_eq!(
            t.next_deadline_ns(),
            Some(65),
            "next = now + period after a long stall"
        );
        let (due, f) = t.pop_due(65).unwrap();
        t.finish(due, f, 66);
        assert_eq!(t.next_deadline_ns(), Some(75), "on cadence when on time");
        assert!(t.cancel(id));
        assert_eq!(t.next_deadline_ns(), None);
    }
}
