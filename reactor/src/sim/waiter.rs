//! The virtual waiter: how a simulated reactor sleeps, waits for an interrupt and parks on
//! a virtual clock. A wait does not move the clock every simulated reactor shares (the
//! others run on meanwhile, as on their own cores): it computes when the reactor wakes and
//! returns that time, and the reactor stays asleep, not turned, until the clock gets there
//! ([`VirtualWaiter::asleep`]). A message (a submission from the simulation, or a closure
//! sent through the reactor's handle) wakes a parked or interrupt-waiting reactor as the
//! mailbox's eventfd would, an interrupt's latency later; a timed sleep it does not end. A
//! block with nothing due lasts at most `wait_ns_max`, as if a stray event ended it.
//!
//! The machine's costs are parameters drawn per seed, so the policies that measure them
//! (the timer's overshoot, the CPU a sleep costs) calibrate against something that differs
//! from seed to seed, as it differs from machine to machine. What the waiter saw is counted
//! ([`WaitsSeen`]) for the checks to compare with the reactor's own counters, and hashed
//! into the run's trace.

use hypoll_nvme::{QueuePair, VirtualClock};

use super::draw::Rng;

/// The costs of waiting on the simulated machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitCosts {
    /// Every timed wake-up is late by this much, plus up to as much again (drawn per wait).
    pub overshoot_ns: u64,
    /// CPU a sleep or block costs the thread.
    pub sleep_cpu_ns: u64,
    /// From a completion to the wake-up its interrupt causes.
    pub interrupt_ns: u64,
    /// Longest one block lasts with nothing due (see the module's note).
    pub wait_ns_max: u64,
    /// Whether emulated devices have an interrupt line (else the reactor polls them, as an
    /// IOPOLL ring).
    pub interrupts: bool,
}

impl WaitCosts {
    /// Draws a machine: overshoot from none to the tens of microseconds seen on VMs.
    pub(super) fn draw(rng: &mut Rng) -> WaitCosts {
        WaitCosts {
            overshoot_ns: [0, 1_000, 4_000, 26_000, 60_000][rng.below(5) as usize],
            sleep_cpu_ns: [0, 500, 2_000, 10_000][rng.below(4) as usize],
            interrupt_ns: [500, 5_000, 20_000][rng.below(3) as usize],
            wait_ns_max: [20_000, 100_000, 500_000][rng.below(3) as usize],
            interrupts: rng.pct(70),
        }
    }

    /// The longest any one wait lasts past what it asked for: a simulated reactor may act
    /// this much later than a due deadline.
    pub(super) fn late_ns_max(&self) -> u64 {
        2 * self.overshoot_ns + self.interrupt_ns
    }
}

/// How many waits of each kind the waiter carried out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WaitsSeen {
    /// Timed sleeps that could not end early.
    pub sleeps: u64,
    /// Of those, the pieces that were not an I/O's sleep: a long sleep's bounded piece on a
    /// device without interrupts, or a sleep cut short at the next timer or timeout.
    pub sleep_pieces: u64,
    /// Blocks on the device interrupts (with or without a deadline).
    pub interrupt_blocks: u64,
    /// Of those, how many ended before their deadline (or had none).
    pub interrupt_blocks_early: u64,
    /// Parks: blocks with no I/O to wait for.
    pub parks: u64,
    /// The longest timed sleep asked for (ns past the decision).
    pub sleep_ns_max: u64,
}

impl WaitsSeen {
    pub(super) fn add(&mut self, o: &WaitsSeen) {
        self.sleeps += o.sleeps;
        self.sleep_pieces += o.sleep_pieces;
        self.interrupt_blocks += o.interrupt_blocks;
        self.interrupt_blocks_early += o.interrupt_blocks_early;
        self.parks += o.parks;
        self.sleep_ns_max = self.sleep_ns_max.max(o.sleep_ns_max);
    }
}

/// How a reactor waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WaitKind {
    /// A timed sleep: nothing ends it before its deadline.
    Sleep,
    /// A block (a park or an interrupt wait): a message, a timer or an interrupt ends it.
    Block,
}

/// A reactor's last wait, as its waiter carried it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LastWait {
    pub(crate) kind: WaitKind,
    /// When it began: the idle turn's time.
    pub(crate) from_ns: u64,
    /// When it ended (a message may have brought that forward).
    pub(crate) woke_ns: u64,
}

/// What a block waits for, as the reactor computed it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Block {
    pub(crate) now_ns: u64,
    /// The wait's own deadline (a sleep on the interrupts).
    pub(crate) until_ns: Option<u64>,
    /// The reactor's next timer or timeout.
    pub(crate) timer_ns: Option<u64>,
    /// The first completion of a device whose interrupt is armed.
    pub(crate) interrupt_ns: Option<u64>,
    /// Whether it waits for I/O (an interrupt wait) or parks.
    pub(crate) for_io: bool,
}

/// Sleeps and blocks in virtual time (see the module's note).
pub struct VirtualWaiter {
    clock: VirtualClock,
    costs: WaitCosts,
    rng: Rng,
    cpu_ns: u64,
    seen: WaitsSeen,
    trace: u64,
    /// The last wait; the reactor is asleep while the clock is before its `woke_ns`.
    last: Option<LastWait>,
}

impl VirtualWaiter {
    pub(crate) fn new(clock: VirtualClock, costs: WaitCosts, seed: u64) -> VirtualWaiter {
        VirtualWaiter {
            clock,
            costs,
            rng: Rng(seed),
            cpu_ns: 0,
            seen: WaitsSeen::default(),
            trace: 0,
            last: None,
        }
    }

    pub(crate) fn clock(&self) -> &VirtualClock {
        &self.clock
    }

    pub(crate) fn costs(&self) -> &WaitCosts {
        &self.costs
    }

    pub fn seen(&self) -> WaitsSeen {
        self.seen
    }

    /// A hash of every wait: kind, start, deadline and wake-up.
    pub fn trace(&self) -> u64 {
        self.trace
    }

    /// The thread's CPU time: only what waits cost (the rest of a simulated reactor's work
    /// takes no virtual time).
    pub(crate) fn cpu_ns(&self) -> u64 {
        self.cpu_ns
    }

    fn overshoot_ns(&mut self) -> u64 {
        let base = self.costs.overshoot_ns;
        base + self.rng.below(base + 1)
    }

    fn record(&mut self, kind: u64, from_ns: u64, until_ns: u64, woke_ns: u64) {
        for v in [kind, from_ns, until_ns, woke_ns] {
            self.trace = super::draw::mix(self.trace, v);
        }
    }

    /// Whether the reactor is still waiting at `now_ns` (the simulation does not turn it).
    pub(crate) fn asleep(&self, now_ns: u64) -> bool {
        self.waiting(now_ns).is_some()
    }

    /// The wait the reactor is in at `now_ns`, if any.
    pub(crate) fn waiting(&self, now_ns: u64) -> Option<WaitKind> {
        self.last.filter(|w| now_ns < w.woke_ns).map(|w| w.kind)
    }

    /// The reactor's last wait (it may still be in it).
    pub(crate) fn last_wait(&self) -> Option<LastWait> {
        self.last
    }

    /// A message arrived at `now_ns`: a block ends an interrupt's latency later, as the
    /// mailbox's eventfd would end it (the reactor already took its wake-up time as
    /// predicted: only the next turn comes earlier). A timed sleep runs its course.
    pub(crate) fn deliver_message(&mut self, now_ns: u64) {
        let Some(w) = self.last.as_mut() else {
            return;
        };
        if w.kind == WaitKind::Block && now_ns < w.woke_ns {
            let woke_ns = w.woke_ns.min(now_ns + self.costs.interrupt_ns);
            if woke_ns < w.woke_ns {
                w.woke_ns = woke_ns;
                self.record(4, now_ns, 0, woke_ns);
            }
        }
    }

    /// A timed sleep until `until_ns` that nothing ends early; `piece`: not an I/O's sleep,
    /// a piece of one (see [`WaitsSeen::sleep_pieces`]). Returns when it wakes.
    pub(crate) fn sleep_until(&mut self, now_ns: u64, until_ns: u64, piece: bool) -> u64 {
        let woke_ns = until_ns.max(now_ns) + self.overshoot_ns();
        self.seen.sleeps += 1;
        self.seen.sleep_pieces += u64::from(piece);
        self.seen.sleep_ns_max = self.seen.sleep_ns_max.max(until_ns.saturating_sub(now_ns));
        self.cpu_ns += self.costs.sleep_cpu_ns;
        self.record(1, now_ns, until_ns, woke_ns);
        self.last = Some(LastWait {
            kind: WaitKind::Sleep,
            from_ns: now_ns,
            woke_ns,
        });
        woke_ns
    }

    /// Blocks until the first of: the wait's deadline or the next timer (each late by an
    /// overshoot), the armed interrupt (late by the interrupt's latency), or `wait_ns_max`.
    /// Returns when it wakes.
    pub(crate) fn block(&mut self, b: Block) -> u64 {
        let timed = b.until_ns.into_iter().chain(b.timer_ns).min();
        let timed_ns = timed.map(|t| t.max(b.now_ns) + self.overshoot_ns());
        let interrupt_ns = b
            .interrupt_ns
            .map(|t| t.max(b.now_ns) + self.costs.interrupt_ns);
        let bound_ns = b.now_ns + self.costs.wait_ns_max;
        let woke_ns = [timed_ns, interrupt_ns, Some(bound_ns)]
            .into_iter()
            .flatten()
            .min()
            .expect("the bound is always there");
        if b.for_io {
            self.seen.interrupt_blocks += 1;
            let early = b.until_ns.is_none_or(|u| woke_ns < u);
            self.seen.interrupt_blocks_early += u64::from(early);
        } else {
            self.seen.parks += 1;
        }
        self.cpu_ns += self.costs.sleep_cpu_ns;
        let kind = 2 + u64::from(b.for_io);
        self.record(kind, b.now_ns, b.until_ns.unwrap_or(u64::MAX), woke_ns);
        self.last = Some(LastWait {
            kind: WaitKind::Block,
            from_ns: b.now_ns,
            woke_ns,
        });
        woke_ns
    }
}

/// When the emulated device behind `qp` completes its next command, if it is one (the
/// simulation's stand-in for its interrupt line): `Some(None)` when nothing is due.
pub(crate) fn emulated_deadline_ns(qp: &(dyn QueuePair + 'static)) -> Option<Option<u64>> {
    let emu = hypoll_nvme::EmuQueuePair::downcast(qp).or_else(|| super::limited::inner(qp))?;
    Some(emu.oracle_next_deadline_ns())
}
