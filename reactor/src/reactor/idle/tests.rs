//! How the idle path carries out a policy's decision on a device that cannot interrupt: the
//! emulator on a virtual clock has no interrupt line (unless a virtual waiter gives it one),
//! as an IOPOLL ring has none.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use hypoll_nvme::{IoBuf, VirtualClock};
use hypoll_policy::{Decision, PollContext, PollPolicy};

use super::super::tests::{emu, reactor};
use super::super::{mailbox, Reactor, ReactorTuning};
use crate::io::Device;
use crate::sim::waiter::{LastWait, WaitKind};
use crate::sim::{VirtualWaiter, WaitCosts};

/// A policy that asks to wait for the interrupt whatever it is told.
struct AlwaysWait;

impl PollPolicy for AlwaysWait {
    fn name(&self) -> &str {
        "always-wait"
    }

    fn decide(&mut self, _ctx: &PollContext<'_>) -> Decision {
        Decision::WaitInterrupt
    }
}

/// A read outstanding on an emulated device on `clock`, then one idle step of `r`.
fn one_idle_step_with_a_read_outstanding(r: &mut Reactor, clock: &VirtualClock) {
    let device = Device::new(Arc::new(emu("emu:nand,size=1M", clock)));
    let dev = r.attach(&device, 4).unwrap();
    r.read(dev, 0, 8, IoBuf::zeroed(4096), |_, _, _| {})
        .unwrap();
    assert_eq!(
        r.sim_turn(&mut ()),
        0,
        "nothing completes before the clock moves"
    );
    r.when_idle();
}

#[test]
fn a_wait_for_an_interrupt_that_cannot_come_is_counted_as_spun() {
    let clock = VirtualClock::new(1_000_000_000);
    let (handle, rx) = mailbox(0, 0, 16).unwrap();
    let mut r = Reactor::new(
        0,
        rx,
        Arc::new([handle]),
        Box::new(AlwaysWait),
        ReactorTuning::default(),
    )
    .unwrap();
    r.set_clock(hypoll_nvme::Clock::Virtual(clock.clone()));
    one_idle_step_with_a_read_outstanding(&mut r, &clock);
    assert_eq!(r.counters.interrupt_waits, 0);
    assert_eq!(r.counters.interrupt_waits_spun, 1);
}

#[test]
fn the_interrupt_policy_is_told_there_is_no_interrupt_and_does_not_ask_to_wait() {
    let clock = VirtualClock::new(1_000_000_000);
    let mut r = reactor(&clock, "interrupt");
    one_idle_step_with_a_read_outstanding(&mut r, &clock);
    assert_eq!(r.counters.interrupt_waits_spun, 0);
}

/// A policy that asks for one timed sleep of `sleep_ns` per I/O, then spins.
struct SleepOnce {
    sleep_ns: u64,
}

impl PollPolicy for SleepOnce {
    fn name(&self) -> &str {
        "sleep-once"
    }

    fn decide(&mut self, ctx: &PollContext<'_>) -> Decision {
        if ctx.oldest.slept {
            Decision::Spin
        } else {
            Decision::sleep_ns(self.sleep_ns)
        }
    }
}

/// A reactor under `SleepOnce` on a virtual waiter with exact timers, with a timer `timer`
/// ahead if any, after one idle step with a read outstanding: its last wait, its counted
/// sleeps and when the timer ran (turned once more when the wait ends).
fn a_timed_sleep(sleep_ns: u64, timer: Option<Duration>) -> (LastWait, u64, Option<u64>) {
    let clock = VirtualClock::new(1_000_000_000);
    let (handle, rx) = mailbox(0, 0, 16).unwrap();
    let policy = Box::new(SleepOnce { sleep_ns });
    let mut r = Reactor::new(0, rx, Arc::new([handle]), policy, ReactorTuning::default()).unwrap();
    let costs = WaitCosts {
        overshoot_ns: 0,
        sleep_cpu_ns: 0,
        interrupt_ns: 0,
        wait_ns_max: 1_000_000,
        interrupts: false,
    };
    r.simulate(VirtualWaiter::new(clock.clone(), costs, 1));
    let fired = Rc::new(Cell::new(None));
    if let Some(delay) = timer {
        let fired = fired.clone();
        r.after(delay, move |r, _| fired.set(Some(r.now_ns())));
    }
    one_idle_step_with_a_read_outstanding(&mut r, &clock);
    let wait = r.virtual_waiter().unwrap().last_wait().unwrap();
    assert_eq!(wait.kind, WaitKind::Sleep);
    clock.advance_to(wait.woke_ns);
    r.sim_turn(&mut ());
    (wait, r.counters.sleeps, fired.get())
}

#[test]
fn a_timed_sleep_ends_at_the_next_timer() {
    // Nothing due: the sleep runs its course, the I/O's one sleep.
    let (wait, sleeps, _) = a_timed_sleep(500_000, None);
    assert_eq!(wait.woke_ns - wait.from_ns, 500_000);
    assert_eq!(sleeps, 1);
    // A timer due first cuts it short (nothing else would wake it for the timer): a piece,
    // not the I/O's sleep, and the timer runs in the turn after it.
    let (wait, sleeps, fired_ns) = a_timed_sleep(500_000, Some(Duration::from_micros(50)));
    assert_eq!(wait.woke_ns - wait.from_ns, 50_000);
    assert_eq!(sleeps, 0);
    assert_eq!(fired_ns, Some(wait.woke_ns));
}

/// A poller with no wake fd whose second look before each block finds work the first
/// `found` times it is asked.
struct SecondLook {
    asked: std::rc::Rc<std::cell::Cell<u32>>,
    found: u32,
}

impl super::super::Poller for SecondLook {
    fn poll(&mut self, _r: &mut Reactor, _state: &mut ()) -> usize {
        0
    }

    fn before_block(&mut self) -> bool {
        self.asked.set(self.asked.get() + 1);
        self.asked.get() <= self.found
    }
}

#[test]
fn work_a_poller_finds_before_the_reactor_blocks_keeps_it_from_blocking() {
    let (mut r, _handle) = Reactor::<()>::standalone(super::super::StandaloneConfig {
        tuning: ReactorTuning {
            idle_spin_ns: 0,
            ..ReactorTuning::default()
        },
        ..Default::default()
    })
    .unwrap();
    let asked = std::rc::Rc::new(std::cell::Cell::new(0));
    r.add_poller(Box::new(SecondLook {
        asked: asked.clone(),
        found: 1,
    }))
    .unwrap();
    // Nothing else can wake the reactor before this timer: a park that blocks lasts it out.
    let park_ns = 200_000_000;
    r.after(std::time::Duration::from_nanos(park_ns), |_, _| {});
    let start = std::time::Instant::now();
    assert_eq!(r.poll(&mut ()), 0);
    r.idle();
    let first = start.elapsed();
    assert_eq!(asked.get(), 1, "asked once, before the park");
    assert!(
        first.as_nanos() < u128::from(park_ns) / 2,
        "the work found kept the reactor from blocking ({first:?})"
    );
    // Asked again before the next park, finding nothing: now it blocks until the timer.
    assert_eq!(r.poll(&mut ()), 0);
    r.idle();
    assert_eq!(asked.get(), 2);
    assert!(start.elapsed().as_nanos() >= u128::from(park_ns));
}

/// A policy whose idle decision is to spin for ever.
struct SpinForEver;

impl PollPolicy for SpinForEver {
    fn name(&self) -> &str {
        "spin-for-ever"
    }

    fn decide(&mut self, _ctx: &PollContext<'_>) -> Decision {
        Decision::Spin
    }

    fn decide_idle(&mut self, _ctx: &hypoll_policy::IdleContext) -> Duration {
        Duration::MAX
    }
}

#[test]
fn a_policys_idle_spin_is_bounded() {
    let (handle, rx) = mailbox(0, 0, 16).unwrap();
    let mut r: Reactor = Reactor::new(
        0,
        rx,
        Arc::new([handle]),
        Box::new(SpinForEver),
        ReactorTuning::default(),
    )
    .unwrap();
    // Before any request, the tuning's spin; after one, the policy's, cut at the bound.
    assert_eq!(
        r.decide_idle_spin_ns(),
        ReactorTuning::default().idle_spin_ns
    );
    r.note_arrivals(1);
    assert_eq!(r.decide_idle_spin_ns(), super::super::IDLE_SPIN_NS_MAX);
    // An embedder's own longer spin is its choice, and the bound then.
    r.tuning.idle_spin_ns = 2 * super::super::IDLE_SPIN_NS_MAX;
    assert_eq!(r.decide_idle_spin_ns(), r.tuning.idle_spin_ns);
}
