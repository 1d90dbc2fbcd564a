//! How a reactor waits, in virtual time ([`SimReactor`]: the step API on a virtual clock and
//! waiter): what its policy decides (spin, sleep, wait for an interrupt) and what that costs
//! it in CPU, long and interruptible sleeps, parking, timers and messages waking a parked
//! reactor. Run in virtual time these do not measure the machine, so they hold the same on
//! a busy one and run beside other tests; what needs the real kernel (epoll, timerfd, an
//! io_uring eventfd) `epoll.rs` and `turn.rs` check on reactor threads.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use hypoll_nvme::VirtualClock;
use hypoll_reactor::sim::SimReactor;
use hypoll_reactor::{ReactorStats, StandaloneConfig};
use support::{
    drive_virtual, sim_reactor, sleep_interruptibly, succeeded, write_block,
    write_then_read_virtual, write_then_read_virtual_with, COSTS, TURN_NS,
};

const MS: u64 = 1_000_000;

/// The latest a timer may run past its deadline on a parked reactor: the wake-up's
/// overshoot (`COSTS` draws it from one to two times its base).
const TIMER_LATE_NS_MAX: u64 = 2 * COSTS.overshoot_ns;

fn classic(clock: &VirtualClock) -> SimReactor {
    SimReactor::new(StandaloneConfig::default(), clock, COSTS, 7, TURN_NS).unwrap()
}

#[test]
fn timers_fire_on_time_even_on_a_parked_reactor() {
    let clock = VirtualClock::new(1_000_000_000);
    let mut sim = classic(&clock);
    // (delay, when it ran, parks by then)
    let fired = Arc::new(Mutex::new(Vec::new()));
    let sink = fired.clone();
    let t0 = clock.now_ns();
    sim.send(move |r, _| {
        assert_eq!(r.now_ns(), t0);
        for delay_ms in [30u64, 10, 20] {
            let sink = sink.clone();
            r.after(Duration::from_millis(delay_ms), move |r, _| {
                let parks = r.counters().parks;
                sink.lock().unwrap().push((delay_ms, r.now_ns(), parks));
            });
        }
    })
    .unwrap();
    sim.run_for(&mut (), 40 * MS);
    let fired = fired.lock().unwrap().clone();
    let order: Vec<u64> = fired.iter().map(|&(d, _, _)| d).collect();
    assert_eq!(order, vec![10, 20, 30], "timers fire in deadline order");
    let mut parks_before = 0;
    for &(delay_ms, at_ns, parks) in &fired {
        let late_ns = at_ns as i64 - (t0 + delay_ms * MS) as i64;
        assert!(
            (0..=TIMER_LATE_NS_MAX as i64).contains(&late_ns),
            "{delay_ms} ms timer off by {late_ns} ns"
        );
        // It was parked: only the timer woke it.
        assert!(
            parks > parks_before,
            "{delay_ms} ms timer: no park before it"
        );
        parks_before = parks;
    }

    // A periodic timer keeps its cadence (a late tick does not delay the next), then
    // cancelled it stops.
    let ticks_seen = Arc::new(Mutex::new(Vec::new()));
    let sink = ticks_seen.clone();
    let id = Arc::new(Mutex::new(None));
    let id_sink = id.clone();
    let start_ns = clock.now_ns();
    sim.send(move |r, _| {
        let every = r.every(Duration::from_millis(2), move |r, _| {
            sink.lock().unwrap().push(r.now_ns());
        });
        *id_sink.lock().unwrap() = Some((every, r.now_ns()));
    })
    .unwrap();
    // The message wakes the parked reactor an interrupt's latency later, and arms it then.
    let arming_ns = COSTS.interrupt_ns + TURN_NS;
    sim.run_for(&mut (), arming_ns + 100 * MS + TIMER_LATE_NS_MAX);
    let (every, armed_ns) = id.lock().unwrap().expect("armed");
    assert!(armed_ns - start_ns <= arming_ns);
    let ticks = ticks_seen.lock().unwrap().clone();
    assert_eq!(ticks.len(), 50, "2 ms ticks in 100 ms: {ticks:?}");
    for (k, &at_ns) in ticks.iter().enumerate() {
        let due_ns = armed_ns + 2 * MS * (k as u64 + 1);
        assert!(
            (due_ns..=due_ns + TIMER_LATE_NS_MAX).contains(&at_ns),
            "tick {k} at {at_ns}, due at {due_ns}"
        );
    }
    let cancelled = Arc::new(Mutex::new(None));
    let answer = cancelled.clone();
    sim.send(move |r, _| *answer.lock().unwrap() = Some(r.cancel_timer(every)))
        .unwrap();
    sim.run_for(&mut (), 20 * MS);
    assert_eq!(*cancelled.lock().unwrap(), Some(true), "it was live");
    assert_eq!(
        ticks_seen.lock().unwrap().len(),
        50,
        "no ticks after cancel"
    );
}

/// A timer's delay counts from the call that arms it, not from the start of the turn the
/// call is made in: a callback that runs late in a long turn (here, one that takes 5 ms of
/// the reactor's time before it arms) still gets its whole delay.
#[test]
fn a_timer_armed_late_in_a_long_turn_counts_from_the_call() {
    let clock = VirtualClock::new(1_000_000_000);
    let mut sim = classic(&clock);
    let armed_at = Arc::new(Mutex::new(None));
    let fired_at = Arc::new(Mutex::new(Vec::new()));
    let (armed, fired, busy) = (armed_at.clone(), fired_at.clone(), clock.clone());
    sim.send(move |r, _| {
        busy.advance_by(5 * MS);
        *armed.lock().unwrap() = Some(busy.now_ns());
        let once = fired.clone();
        r.after(Duration::from_millis(10), move |r, _| {
            once.lock().unwrap().push(("once", r.now_ns()))
        });
        let every = r.every(Duration::from_millis(10), move |r, _| {
            fired.lock().unwrap().push(("every", r.now_ns()))
        });
        r.after(Duration::from_millis(15), move |r, _| {
            r.cancel_timer(every);
        });
    })
    .unwrap();
    sim.run_for(&mut (), 30 * MS);
    let armed_ns = armed_at.lock().unwrap().expect("the message ran");
    let fired = fired_at.lock().unwrap().clone();
    assert_eq!(fired.len(), 2, "{fired:?}");
    for (which, at_ns) in fired {
        let late_ns = at_ns as i64 - (armed_ns + 10 * MS) as i64;
        assert!(
            (0..=TIMER_LATE_NS_MAX as i64).contains(&late_ns),
            "{which} timer off by {late_ns} ns from its call plus 10 ms"
        );
    }
}

#[test]
fn a_parked_reactor_uses_under_1_percent_of_a_core() {
    // After I/O, idle means parked, whatever the policy: `adaptive` calibrates and probes
    // while I/O is in flight, and must stop once none is.
    let clock = VirtualClock::new(1_000_000_000);
    let cfg = StandaloneConfig {
        policy: "adaptive".to_string(),
        ..StandaloneConfig::default()
    };
    let mut sim = sim_reactor(cfg, &clock, "emu:nand,size=64M");
    let limit = Duration::from_secs(60);
    assert_eq!(
        drive_virtual(&mut sim, 200, 4, write_block, succeeded, limit),
        0
    );
    let parks_before = sim.reactor().counters().parks;
    assert!(
        sim.run_while(&mut (), 10 * MS, |r, _| r.counters().parks == parks_before),
        "it parks after its I/O"
    );
    let before: ReactorStats = sim.stats();
    sim.run_for(&mut (), 5_000 * MS);
    let idle = sim.stats().since(&before);
    assert!(
        idle.cpu_pct() < 1.0,
        "parked reactor used {:.3} % of a core: {:?}",
        idle.cpu_pct(),
        idle.counters
    );
    assert_eq!(idle.counters.sleeps + idle.counters.interrupt_waits, 0);
    // And it still wakes for a message, at once.
    let sent_ns = clock.now_ns();
    let ran = Arc::new(Mutex::new(None));
    let sink = ran.clone();
    sim.send(move |r, _| *sink.lock().unwrap() = Some(r.now_ns()))
        .unwrap();
    sim.run_for(&mut (), MS);
    let ran_ns = ran
        .lock()
        .unwrap()
        .expect("a parked reactor wakes for messages");
    assert!(
        ran_ns - sent_ns <= COSTS.interrupt_ns + TURN_NS,
        "{}",
        ran_ns - sent_ns
    );
}

#[test]
fn the_policy_decides_how_the_reactor_waits() {
    // 300 us per I/O: time enough for every kind of wait.
    let dev = "emu:nand,size=64M,read_us=300,write_us=300";
    let classic = write_then_read_virtual(dev, "classic", 600, 1);
    assert_eq!(classic.counters.sleeps, 0);
    assert_eq!(classic.counters.interrupt_waits, 0);
    // It spins: many empty polls per I/O, and a core's worth of CPU.
    assert!(
        classic.counters.idle_polls > 10 * classic.counters.ios,
        "classic spins: {:?}",
        classic.counters
    );
    assert!(classic.cpu_pct() > 99.0, "{:.1} %", classic.cpu_pct());

    let interrupt = write_then_read_virtual(dev, "interrupt", 600, 1);
    assert_eq!(interrupt.counters.sleeps, 0);
    assert!(
        interrupt.counters.interrupt_waits >= 1_000,
        "{:?}",
        interrupt.counters
    );
    assert!(
        interrupt.cpu_pct() < classic.cpu_pct() / 2.0,
        "interrupts {:.1} % CPU against classic {:.1} %",
        interrupt.cpu_pct(),
        classic.cpu_pct()
    );

    let hybrid = write_then_read_virtual(dev, "hybrid", 600, 1);
    // One sleep per I/O once the first window is published (100 ms): most I/Os slept.
    assert!(hybrid.counters.sleeps > 600, "{:?}", hybrid.counters);
    assert!(hybrid.counters.sleeps <= 1_200, "at most once per I/O");
    assert!(
        hybrid.cpu_pct() < classic.cpu_pct() * 0.8,
        "hybrid {:.1} % CPU against classic {:.1} %",
        hybrid.cpu_pct(),
        classic.cpu_pct()
    );
    assert!(hybrid.overshoot_mean_ns().unwrap() > 0);
}

#[test]
fn a_long_sleep_ends_when_the_io_completes() {
    // A policy asks for 1 s per I/O (once the first 100 ms window of statistics is out) on a
    // 300 us device. Past `long_sleep_ns` (1 ms) the reactor waits on the interrupt instead,
    // bounded by the sleep's end, so each I/O ends when the device completes it: hundreds of
    // I/Os would otherwise take hundreds of seconds.
    let dev = "emu:nand,size=64M,read_us=300,write_us=300";
    let stats = write_then_read_virtual(dev, "fixed:1000000", 600, 1);
    assert!(
        stats.wall_ns < 20_000 * MS,
        "took {} ms of virtual time",
        stats.wall_ns / MS
    );
    assert_eq!(stats.counters.ios, 1_200);
    // Long sleeps are interrupt waits, not timed sleeps.
    assert_eq!(stats.counters.sleeps, 0, "{:?}", stats.counters);
    assert!(
        stats.counters.interrupt_waits >= 200,
        "{:?}",
        stats.counters
    );
}

#[test]
fn an_interruptible_sleep_that_runs_its_course_is_the_ios_one_sleep() {
    // 50 us asked, 2 ms device: each sleep ends at its deadline, counts as the I/O's one
    // sleep (the policy then sees `slept` and spins) and measures its overshoot.
    let dev = "emu:nand,size=16M,read_us=2000,write_us=2000,tail_pct=0";
    let (policy, after_interrupt) = sleep_interruptibly(Duration::from_micros(50));
    let cfg = StandaloneConfig {
        custom_policy: Some(policy),
        ..StandaloneConfig::default()
    };
    let stats = write_then_read_virtual_with(dev, cfg, 50, 1);
    assert_eq!(stats.counters.ios, 100);
    // One sleep per I/O: in virtual time no I/O completes before the reactor decides.
    assert_eq!(stats.counters.sleeps, 100, "{:?}", stats.counters);
    assert_eq!(stats.counters.interrupt_waits, 0, "{:?}", stats.counters);
    assert_eq!(
        after_interrupt.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    let overshoot_ns = stats.overshoot_mean_ns().expect("sleeps measured");
    assert!(
        (COSTS.overshoot_ns..=2 * COSTS.overshoot_ns).contains(&overshoot_ns),
        "{overshoot_ns} ns"
    );
}
