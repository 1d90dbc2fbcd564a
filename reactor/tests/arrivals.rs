//! Requests arriving from a front end, in virtual time ([`SimReactor`]): a poller reports
//! the requests it takes (`Reactor::note_arrivals`), the policy decides how long the idle
//! reactor spins for the next one (`PollPolicy::decide_idle`), and the reactor spins that
//! long, then parks with the front end's signal on; a request then wakes it. `adaptive`
//! spins for a client that sends every few microseconds and parks at once on one that
//! sends every few milliseconds, where the default spin costs more.

mod support;

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hypoll_nvme::VirtualClock;
use hypoll_reactor::sim::{SimReactor, WaitCosts};
use hypoll_reactor::{
    Arrival, Decision, Device, IdleContext, PolicyFactory, PollContext, PollPolicy, Poller,
    Reactor, ReactorTuning, StandaloneConfig,
};
use support::{drive_virtual, succeeded, write_block, COSTS, TURN_NS};

const US: u64 = 1_000;
const MS: u64 = 1_000_000;

/// What the front end and the test's guest share: requests posted and not yet taken, and
/// whether the guest signals (the poller turns that off while it is polled, on before the
/// reactor blocks, as a virtqueue's notifications).
#[derive(Clone, Default)]
struct Ring {
    pending: Rc<Cell<u64>>,
    notify: Rc<Cell<bool>>,
    taken: Rc<Cell<u64>>,
}

impl Ring {
    /// The guest posts a request, and signals if asked to.
    fn post(&self, sim: &mut SimReactor) {
        self.pending.set(self.pending.get() + 1);
        if self.notify.get() {
            sim.signal();
        }
    }

    /// Runs `sim` until the request posted last is taken, for at most `limit_ns`. Returns
    /// how long that took.
    fn until_taken(&self, sim: &mut SimReactor, limit_ns: u64) -> u64 {
        let from_ns = sim.clock().now_ns();
        let taken = self.taken.clone();
        let all = self.taken.get() + self.pending.get();
        assert!(
            sim.run_while(&mut (), limit_ns, |_, _| taken.get() < all),
            "taken in time"
        );
        sim.clock().now_ns() - from_ns
    }
}

/// The front end's poller: takes what is posted and reports it.
struct FrontEnd(Ring);

impl Poller for FrontEnd {
    fn poll(&mut self, r: &mut Reactor, _: &mut ()) -> usize {
        let n = self.0.pending.replace(0);
        if n > 0 {
            // Requests are flowing: no signals while the reactor polls.
            self.0.notify.set(false);
            r.note_arrivals(n as usize);
            self.0.taken.set(self.0.taken.get() + n);
        }
        n as usize
    }

    fn before_block(&mut self) -> bool {
        self.0.notify.set(true);
        self.0.pending.get() > 0
    }
}

/// A policy that spins `spin` for the next request, and counts what it is told.
struct IdleSpin {
    spin: Duration,
    asked: Arc<AtomicU64>,
    arrivals: Arc<AtomicU64>,
}

impl PollPolicy for IdleSpin {
    fn name(&self) -> &str {
        "test-idle-spin"
    }

    fn decide(&mut self, _: &PollContext<'_>) -> Decision {
        Decision::Spin
    }

    fn on_arrivals(&mut self, arrival: &Arrival) {
        self.arrivals.fetch_add(arrival.requests, Ordering::Relaxed);
    }

    fn decide_idle(&mut self, ctx: &IdleContext) -> Duration {
        assert!(ctx.arrivals.seen(), "asked only once a front end reported");
        self.asked.fetch_add(1, Ordering::Relaxed);
        self.spin
    }
}

/// A reactor in virtual time under `cfg` on a machine with `costs`, with the front end.
fn with_front_end(cfg: StandaloneConfig, costs: WaitCosts) -> (SimReactor, Ring, VirtualClock) {
    let clock = VirtualClock::new(1_000_000_000);
    let mut sim = SimReactor::new(cfg, &clock, costs, 3, TURN_NS).unwrap();
    let ring = Ring::default();
    sim.reactor()
        .add_poller(Box::new(FrontEnd(ring.clone())))
        .unwrap();
    (sim, ring, clock)
}

/// Runs `sim` until it parks next; returns how long that took.
fn until_parked(sim: &mut SimReactor, limit_ns: u64) -> u64 {
    let from_ns = sim.clock().now_ns();
    let parks = sim.reactor().counters().parks;
    assert!(
        sim.run_while(&mut (), limit_ns, |r, _| r.counters().parks == parks),
        "parked in time"
    );
    sim.clock().now_ns() - from_ns
}

#[test]
fn the_reactor_spins_what_the_policy_decides_then_parks_and_a_request_wakes_it() {
    for spin_us in [0, 200] {
        let asked = Arc::new(AtomicU64::new(0));
        let arrivals = Arc::new(AtomicU64::new(0));
        let (asked2, arrivals2) = (asked.clone(), arrivals.clone());
        let cfg = StandaloneConfig {
            custom_policy: Some(PolicyFactory::new(move |_| {
                Box::new(IdleSpin {
                    spin: Duration::from_micros(spin_us),
                    asked: asked2.clone(),
                    arrivals: arrivals2.clone(),
                })
            })),
            ..StandaloneConfig::default()
        };
        let idle_spin_ns = ReactorTuning::default().idle_spin_ns;
        let (mut sim, ring, _clock) = with_front_end(cfg, COSTS);
        // No request yet: the policy is not asked, and the reactor spins what it always did.
        let spun_ns = until_parked(&mut sim, 10 * MS);
        assert!(
            (idle_spin_ns..=idle_spin_ns + 2 * TURN_NS).contains(&spun_ns),
            "{spun_ns}"
        );
        assert_eq!(asked.load(Ordering::Relaxed), 0);
        assert!(ring.notify.get(), "signals on before the park");
        for k in 1..=3 {
            sim.run_for(&mut (), 5 * MS);
            let cpu_ns = sim.cpu_ns();
            // Parked: the request's signal wakes it an interrupt's latency later.
            ring.post(&mut sim);
            let took_ns = ring.until_taken(&mut sim, 10 * MS);
            assert!(took_ns <= COSTS.interrupt_ns + TURN_NS, "{took_ns}");
            assert!(!ring.notify.get(), "signals off while polled");
            // Then it spins what the policy said, and parks.
            let spun_ns = until_parked(&mut sim, 10 * MS);
            let spin_ns = spin_us * US;
            assert!(
                (spin_ns..=spin_ns + 2 * TURN_NS).contains(&spun_ns),
                "spin {spin_us} us: parked after {spun_ns} ns"
            );
            assert!(ring.notify.get());
            assert_eq!(
                asked.load(Ordering::Relaxed),
                k,
                "asked once per idle stretch"
            );
            assert_eq!(arrivals.load(Ordering::Relaxed), k);
            // What the stretch cost: the wake, its turns, the park.
            let cost_ns = sim.cpu_ns() - cpu_ns;
            assert!(
                cost_ns <= spin_ns + 4 * TURN_NS + 2 * COSTS.sleep_cpu_ns,
                "{cost_ns}"
            );
        }
        let counters = *sim.reactor().counters();
        assert_eq!((counters.arrivals, counters.idle_decisions), (3, 3));
        assert_eq!(sim.reactor().arrivals().batches, 3);
        // A park that a stray wake-up ends with nothing to do parks again at once, without
        // asking: the stretch's decision holds.
        let parks = sim.waits().parks;
        sim.run_for(&mut (), 500 * MS);
        assert!(sim.waits().parks >= parks + 4, "{:?}", sim.waits());
        assert_eq!(asked.load(Ordering::Relaxed), 3);
    }
}

/// A machine where a park costs a good deal more than a few microseconds of spinning: a
/// wait's CPU 10 us, timers 2 to 4 us late.
const DEAR_PARKS: WaitCosts = WaitCosts {
    sleep_cpu_ns: 10 * US,
    ..COSTS
};

/// A reactor under `policy` with the front end and an emulated NAND device, after 200
/// writes (time for `adaptive` to measure its sleeps, and so a park's cost).
fn after_io(policy: &str) -> (SimReactor, Ring) {
    let cfg = StandaloneConfig {
        policy: policy.to_string(),
        ..StandaloneConfig::default()
    };
    let (mut sim, ring, clock) = with_front_end(cfg, DEAR_PARKS);
    let Ok(hypoll_nvme::DeviceConfig::Emu(emu)) = "emu:nand,size=16M".parse() else {
        unreachable!()
    };
    let ctrl =
        hypoll_nvme::EmuController::with_clock(emu, hypoll_nvme::Clock::Virtual(clock)).unwrap();
    sim.reactor()
        .attach(&Device::new(Arc::new(ctrl)), 16)
        .unwrap();
    let limit = Duration::from_secs(60);
    assert_eq!(
        drive_virtual(&mut sim, 200, 1, write_block, succeeded, limit),
        0
    );
    (sim, ring)
}

/// A client that posts `count` requests `gap_ns` apart: the parks it caused and the CPU it
/// cost the reactor over the last `measured` of them.
fn client(sim: &mut SimReactor, ring: &Ring, gap_ns: u64, count: u64, measured: u64) -> (u64, u64) {
    let mut before = None;
    for k in 0..count {
        if k == count - measured {
            before = Some((sim.waits().parks, sim.cpu_ns()));
        }
        sim.run_for(&mut (), gap_ns);
        ring.post(sim);
        ring.until_taken(sim, 10 * MS);
    }
    let (parks, cpu_ns) = before.unwrap();
    (sim.waits().parks - parks, sim.cpu_ns() - cpu_ns)
}

#[test]
fn adaptive_spins_for_a_fast_client_and_parks_at_once_on_a_slow_one() {
    let default_spin_ns = ReactorTuning::default().idle_spin_ns;
    let (mut sim, ring) = after_io("adaptive");
    // Every 3 us: spun for (a park costs its CPU and a wake-up, more than 3 us), once
    // learnt.
    let (parks, _) = client(&mut sim, &ring, 3 * US, 300, 200);
    assert_eq!(parks, 0, "{:?}", sim.reactor().counters());
    // Every 10 ms: once the fast gaps are forgotten, parked on at once, where the reactor's
    // own spin would burn 50 us each time.
    let (parks, cpu_ns) = client(&mut sim, &ring, 10 * MS, 150, 50);
    assert_eq!(parks, 50);
    let per_request_ns = cpu_ns / 50;
    assert!(
        per_request_ns < default_spin_ns / 2,
        "{per_request_ns} ns of CPU per request"
    );
    let idle_pct = 100.0 * cpu_ns as f64 / (50.0 * 10.0 * MS as f64);
    assert!(idle_pct < 1.0, "{idle_pct:.3} % of a core");

    // The default decision (classic's): the reactor's own spin after every request, under
    // 1 % of a core too at this rate, but dearer.
    let (mut sim, ring) = after_io("classic");
    let (parks, classic_ns) = client(&mut sim, &ring, 10 * MS, 100, 50);
    assert_eq!(parks, 50);
    assert!(classic_ns / 50 >= default_spin_ns, "{}", classic_ns / 50);
    assert!(100.0 * classic_ns as f64 / (50.0 * 10.0 * MS as f64) < 1.0);
    assert!(cpu_ns < classic_ns / 3, "{cpu_ns} against {classic_ns}");

    // An attached guest that sends nothing costs nothing, with either.
    for policy in ["adaptive", "classic"] {
        let (mut sim, ring) = after_io(policy);
        client(&mut sim, &ring, 20 * US, 40, 1);
        let cpu_ns = sim.cpu_ns();
        sim.run_for(&mut (), 5_000 * MS);
        let idle_pct = 100.0 * (sim.cpu_ns() - cpu_ns) as f64 / (5_000.0 * MS as f64);
        assert!(idle_pct < 1.0, "{policy}: {idle_pct:.3} % of a core");
        // And a request still wakes it.
        ring.post(&mut sim);
        assert!(ring.until_taken(&mut sim, MS) <= COSTS.interrupt_ns + TURN_NS);
    }
}
