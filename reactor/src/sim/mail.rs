//! Messages and timers in the deterministic run. The simulation posts closures to the
//! reactors through their handles, as another thread would (the mailbox, then the wake-up
//! the eventfd would give a blocked reactor), in bursts at virtual times drawn from the
//! seed, most of them while the reactor is parked, waiting for an interrupt or sleeping;
//! some bursts are longer than one turn runs ([`MESSAGE_BATCH`]) or than the mailbox holds.
//! A message may arm a one-shot or periodic timer on its reactor, or cancel one.
//!
//! What it checks, besides that each message runs exactly once, in the order sent, and a
//! refused one never; that a one-shot timer runs exactly once and a cancelled one not
//! after; that a periodic one runs once per period it did not miss, never early:
//! - every turn runs what is due: the oldest [`MESSAGE_BATCH`] messages queued before it (so
//!   each message within `1 + k / MESSAGE_BATCH` turns, `k` the messages ahead of it), and
//!   every timer due by the turn's time;
//! - a reactor that waits wakes for them in time ([`WakeBounds`]): any wait ends at the
//!   next timer, late by an overshoot (a block is armed for it, a timed sleep ends no later);
//!   a block (a park or an interrupt wait) ends an interrupt's latency after a message
//!   arrives; a timed sleep, which no message ends, lasts at most the long-sleep bound past
//!   its start, late by an overshoot.
//!
//! Together: each message and due timer runs within its wake bound of virtual time plus
//! the turns the simulation gives other reactors meanwhile (the reactor is not asleep
//! then: it waits for its core, which the checks leave out as the simulation's own).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use super::draw::{mix, Rng};
use super::waiter::WaitKind;
use crate::reactor::{Reactor, ReactorHandle, ReactorTuning, SendError, MESSAGE_BATCH};
use crate::timer::TimerId;

/// How big a burst of messages is: mostly a few, sometimes more than a turn runs, now and
/// then more than the simulation's mailbox holds (`MAILBOX_CAPACITY`).
const BURSTS: [usize; 9] = [1, 1, 1, 2, 4, 8, 16, MESSAGE_BATCH + 1, 70];
/// The simulation's mailbox capacity per reactor.
pub(super) const MAILBOX_CAPACITY: usize = 64;
/// How far ahead a message arms a timer: due at once, within a device's latency, around
/// and past the long-sleep bound.
const TIMER_DELAYS_NS: [u64; 7] = [0, 1_000, 10_000, 50_000, 200_000, 1_000_000, 3_000_000];
/// Most ticks of a periodic timer before it cancels itself.
const TICKS_MAX: u64 = 4;

/// How late a waiting reactor may wake for what is due (virtual ns; see the module's note).
#[derive(Clone, Copy, Debug)]
pub(super) struct WakeBounds {
    /// A timer that fell due during a wait of either kind: the wake-up's overshoot.
    pub(super) timer_ns: u64,
    /// A message that came during a block: the eventfd's wake-up, an interrupt's latency.
    pub(super) block_message_ns: u64,
    /// A message that came during a timed sleep: the rest of the sleep, at most the
    /// long-sleep bound, and its overshoot.
    pub(super) sleep_message_ns: u64,
}

impl WakeBounds {
    pub(super) fn new(costs: &super::WaitCosts, tuning: &ReactorTuning) -> WakeBounds {
        // The virtual waiter wakes a timed wait late by an overshoot of up to twice its base.
        let overshoot_ns_max = 2 * costs.overshoot_ns;
        WakeBounds {
            timer_ns: overshoot_ns_max,
            block_message_ns: costs.interrupt_ns,
            sleep_message_ns: tuning.long_sleep_ns + overshoot_ns_max,
        }
    }
}

/// What the messages and timers of a run did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MailSeen {
    /// Messages the mailboxes took, and ran.
    pub messages: u64,
    /// Messages refused by a full mailbox (none ran).
    pub refused: u64,
    /// Of those taken, how many came while their reactor was blocked (parked or waiting
    /// for an interrupt), and while it was in a timed sleep.
    pub to_blocked: u64,
    pub to_sleeping: u64,
    /// Timers armed (one-shot and periodic), their runs, and timers cancelled.
    pub timers: u64,
    pub timer_runs: u64,
    pub cancels: u64,
    /// Of the runs, how many followed a wait that was still on when they fell due.
    pub woken: u64,
    /// The latest a reactor woke for one of them, past when it fell due (virtual ns).
    pub wake_late_ns_max: u64,
}

impl MailSeen {
    pub fn add(&mut self, o: &MailSeen) {
        self.messages += o.messages;
        self.refused += o.refused;
        self.to_blocked += o.to_blocked;
        self.to_sleeping += o.to_sleeping;
        self.timers += o.timers;
        self.timer_runs += o.timer_runs;
        self.cancels += o.cancels;
        self.woken += o.woken;
        self.wake_late_ns_max = self.wake_late_ns_max.max(o.wake_late_ns_max);
    }
}

/// What a message does besides being counted.
#[derive(Clone, Copy, Debug)]
enum Action {
    Nothing,
    /// Arms a timer `delay_ns` ahead; periodic with that period when `ticks > 0`.
    Arm {
        delay_ns: u64,
        ticks: u64,
    },
    /// Cancels one of its reactor's timers (live or not), picked by this number.
    Cancel(u64),
}

struct Posted {
    reactor: usize,
    sent_ns: u64,
    runs: u32,
    refused: bool,
}

struct Armed {
    reactor: usize,
    /// When it is due next (a periodic one moves on at each tick).
    due_ns: u64,
    period_ns: u64,
    /// Ticks left before a periodic timer cancels itself.
    ticks_left: u64,
    runs: u64,
    id: Option<TimerId>,
    /// Armed and neither run (one-shot), finished (periodic) nor cancelled.
    live: bool,
}

/// The log the closures write and the simulation reads (one thread: the lock is never
/// contended, it only makes the closures `Send`).
struct Log {
    posted: Vec<Posted>,
    /// Per reactor, its messages not yet run, oldest first.
    queued: Vec<VecDeque<usize>>,
    armed: Vec<Armed>,
    bounds: WakeBounds,
    seen: MailSeen,
    errors: Vec<String>,
    trace: u64,
}

type Shared = Arc<parking_lot::Mutex<Log>>;

/// The messages and timers of one run.
pub(super) struct Mail {
    log: Shared,
    rng: Rng,
    /// Messages each reactor is still to be sent.
    left: Vec<usize>,
}

impl Mail {
    pub(super) fn new(seed: u64, reactors: usize, per_reactor: usize, bounds: WakeBounds) -> Mail {
        let log = Log {
            posted: Vec::new(),
            queued: vec![VecDeque::new(); reactors],
            armed: Vec::new(),
            bounds,
            seen: MailSeen::default(),
            errors: Vec::new(),
            trace: 0,
        };
        Mail {
            log: Arc::new(parking_lot::Mutex::new(log)),
            // A stream of its own: the I/O workload draws what it drew without messages.
            rng: Rng(mix(seed, 0x6d61_696c)),
            left: vec![per_reactor; reactors],
        }
    }

    /// Maybe posts a burst to reactor `i` at `now_ns`, more likely while it waits.
    pub(super) fn maybe_post(
        &mut self,
        i: usize,
        now_ns: u64,
        r: &mut Reactor,
        handle: &ReactorHandle,
    ) {
        if self.left[i] == 0 {
            return;
        }
        let waiting = r.virtual_waiter().and_then(|w| w.waiting(now_ns));
        if !self.rng.pct(if waiting.is_some() { 10 } else { 1 }) {
            return;
        }
        let burst = BURSTS[self.rng.below(BURSTS.len() as u64) as usize].min(self.left[i]);
        for _ in 0..burst {
            self.left[i] -= 1;
            let action = match self.rng.below(100) {
                0..=29 => Action::Arm {
                    delay_ns: TIMER_DELAYS_NS[self.rng.below(7) as usize],
                    ticks: 0,
                },
                30..=34 => Action::Arm {
                    delay_ns: TIMER_DELAYS_NS[1 + self.rng.below(6) as usize],
                    ticks: 1 + self.rng.below(TICKS_MAX),
                },
                35..=44 => Action::Cancel(self.rng.next()),
                _ => Action::Nothing,
            };
            let n = {
                let mut log = self.log.lock();
                log.posted.push(Posted {
                    reactor: i,
                    sent_ns: now_ns,
                    runs: 0,
                    refused: false,
                });
                log.posted.len() - 1
            };
            let log = self.log.clone();
            match handle.send(move |r, _| on_message(r, &log, n, action)) {
                Ok(()) => {
                    let mut log = self.log.lock();
                    log.queued[i].push_back(n);
                    log.seen.messages += 1;
                    match waiting {
                        Some(WaitKind::Block) => log.seen.to_blocked += 1,
                        Some(WaitKind::Sleep) => log.seen.to_sleeping += 1,
                        None => {}
                    }
                    log.trace = mix(mix(log.trace, n as u64), now_ns);
                }
                Err(SendError::Full) => {
                    let mut log = self.log.lock();
                    log.posted[n].refused = true;
                    log.seen.refused += 1;
                }
                Err(SendError::Stopped) => {
                    self.log
                        .lock()
                        .errors
                        .push(format!("reactor {i} refused a message as stopped"));
                }
            }
            // What the eventfd does for a blocked reactor: it wakes.
            r.sim_deliver();
        }
    }

    /// Messages queued for reactor `i`, before a turn.
    pub(super) fn queued(&self, i: usize) -> usize {
        self.log.lock().queued[i].len()
    }

    /// After a turn of reactor `i` at `now_ns` that found `queued` messages waiting: it ran
    /// the oldest [`MESSAGE_BATCH`] of them and every timer due.
    pub(super) fn after_turn(&self, i: usize, queued: usize, now_ns: u64) -> Result<(), String> {
        let log = self.log.lock();
        let left = log.queued[i].len();
        if left != queued.saturating_sub(MESSAGE_BATCH) {
            return Err(format!(
                "reactor {i}: a turn found {queued} messages and left {left} (a turn runs up \
                 to {MESSAGE_BATCH})"
            ));
        }
        let overdue = log
            .armed
            .iter()
            .enumerate()
            .find(|(_, t)| t.reactor == i && t.live && t.due_ns <= now_ns);
        if let Some((k, t)) = overdue {
            return Err(format!(
                "reactor {i}: a turn at {now_ns} ns left timer {k} due at {} ns",
                t.due_ns
            ));
        }
        Ok(())
    }

    /// The first thing a closure found wrong.
    pub(super) fn error(&self) -> Option<String> {
        self.log.lock().errors.first().cloned()
    }

    /// Whether every message has been sent and run, and every timer has run or been
    /// cancelled.
    pub(super) fn done(&self) -> bool {
        let log = self.log.lock();
        self.left.iter().all(|&n| n == 0)
            && log.queued.iter().all(VecDeque::is_empty)
            && log.armed.iter().all(|t| !t.live)
    }

    /// After the run: each message taken ran once, each refused one never.
    pub(super) fn final_check(&self) -> Result<(), String> {
        let log = self.log.lock();
        if let Some(e) = log.errors.first() {
            return Err(e.clone());
        }
        for (n, p) in log.posted.iter().enumerate() {
            let expected = u32::from(!p.refused);
            if p.runs != expected {
                return Err(format!(
                    "message {n} to reactor {} (sent at {} ns, refused: {}) ran {} times",
                    p.reactor, p.sent_ns, p.refused, p.runs
                ));
            }
        }
        if let Some(k) = log.armed.iter().position(|t| t.live) {
            return Err(format!("timer {k} is still armed after the run"));
        }
        Ok(())
    }

    pub(super) fn seen(&self) -> MailSeen {
        self.log.lock().seen
    }

    /// A hash of every message sent and run, and every timer's runs and cancels.
    pub(super) fn trace(&self) -> u64 {
        self.log.lock().trace
    }
}

/// How late reactor `r` woke for something due at `due_ns`: the part of its last wait
/// after that, if the wait was still on then; checked against the wait's bound.
fn woke_for(r: &Reactor, log: &mut Log, due_ns: u64, message: bool, what: &str) {
    let Some(w) = r.virtual_waiter().and_then(|v| v.last_wait()) else {
        return;
    };
    if due_ns >= w.woke_ns {
        return;
    }
    let late_ns = w.woke_ns - due_ns.max(w.from_ns);
    let bound_ns = match (w.kind, message) {
        (_, false) => log.bounds.timer_ns,
        (WaitKind::Block, true) => log.bounds.block_message_ns,
        (WaitKind::Sleep, true) => log.bounds.sleep_message_ns,
    };
    log.seen.woken += 1;
    log.seen.wake_late_ns_max = log.seen.wake_late_ns_max.max(late_ns);
    if late_ns > bound_ns {
        log.errors.push(format!(
            "reactor {}: {what}, due at {due_ns} ns, came during a {:?} from {} ns that ended \
             at {} ns: {late_ns} ns late, past the bound of {bound_ns} ns",
            r.index(),
            w.kind,
            w.from_ns,
            w.woke_ns
        ));
    }
}

fn on_message(r: &mut Reactor, shared: &Shared, n: usize, action: Action) {
    let i = r.index();
    let now_ns = r.now_ns();
    let mut log = shared.lock();
    log.posted[n].runs += 1;
    if log.posted[n].runs > 1 {
        log.errors.push(format!("message {n} ran a second time"));
        return;
    }
    let front = log.queued[i].pop_front();
    if front != Some(n) {
        log.errors.push(format!(
            "reactor {i} ran message {n} while {front:?} was the oldest queued"
        ));
    }
    let sent_ns = log.posted[n].sent_ns;
    woke_for(r, &mut log, sent_ns, true, &format!("message {n}"));
    log.trace = mix(mix(log.trace, n as u64), now_ns);
    match action {
        Action::Nothing => {}
        Action::Arm { delay_ns, ticks } => {
            let k = log.armed.len();
            log.armed.push(Armed {
                reactor: i,
                // As the reactor times it: from the turn's timestamp.
                due_ns: now_ns + delay_ns,
                period_ns: if ticks > 0 { delay_ns } else { 0 },
                ticks_left: ticks,
                runs: 0,
                id: None,
                live: true,
            });
            log.seen.timers += 1;
            drop(log);
            let tick = shared.clone();
            let delay = Duration::from_nanos(delay_ns);
            let id = if ticks > 0 {
                r.every(delay, move |r, _| on_timer(r, &tick, k))
            } else {
                r.after(delay, move |r, _| on_timer(r, &tick, k))
            };
            shared.lock().armed[k].id = Some(id);
        }
        Action::Cancel(pick) => {
            let mine: Vec<usize> = (0..log.armed.len())
                .filter(|&k| log.armed[k].reactor == i)
                .collect();
            if mine.is_empty() {
                return;
            }
            let k = mine[(pick % mine.len() as u64) as usize];
            let live = log.armed[k].live;
            let id = log.armed[k].id.expect("set once armed");
            drop(log);
            let cancelled = r.cancel_timer(id);
            let mut log = shared.lock();
            if cancelled != live {
                log.errors.push(format!(
                    "reactor {i}: cancelling timer {k} (live: {live}) returned {cancelled}"
                ));
            }
            log.armed[k].live = false;
            log.seen.cancels += u64::from(cancelled);
            log.trace = mix(log.trace, k as u64);
        }
    }
}

fn on_timer(r: &mut Reactor, shared: &Shared, k: usize) {
    let now_ns = r.now_ns();
    let mut log = shared.lock();
    let t = &log.armed[k];
    let (due_ns, live) = (t.due_ns, t.live);
    if !live {
        log.errors.push(format!(
            "timer {k} ran at {now_ns} ns after it was cancelled or finished"
        ));
        return;
    }
    if now_ns < due_ns {
        log.errors.push(format!(
            "timer {k} ran at {now_ns} ns, before it was due at {due_ns} ns"
        ));
    }
    woke_for(r, &mut log, due_ns, false, &format!("timer {k}"));
    log.seen.timer_runs += 1;
    log.trace = mix(mix(log.trace, k as u64), now_ns);
    let t = &mut log.armed[k];
    t.runs += 1;
    if t.period_ns == 0 {
        t.live = false;
        return;
    }
    t.ticks_left -= 1;
    if t.ticks_left > 0 {
        // The next period, or a period from now if that one is missed already.
        let next_ns = t.due_ns + t.period_ns;
        t.due_ns = if next_ns > now_ns {
            next_ns
        } else {
            now_ns + t.period_ns
        };
        return;
    }
    t.live = false;
    let id = t.id.expect("set once armed");
    drop(log);
    if !r.cancel_timer(id) {
        shared.lock().errors.push(format!(
            "timer {k} could not cancel itself from its own tick"
        ));
    }
}
