//! The idle decision: spun for a client that sends every few microseconds, parked on at once
//! for one idle for seconds, gaps seen after a park learnt a wake-up shorter.

use std::time::Duration;

use super::super::probe::PROBE_WARMUP;
use super::super::{Adaptive, ADAPTIVE_SAMPLES_MIN};
use super::Arrivals;
use crate::arrivals::{Arrival, ArrivalStats, IdleContext};
use crate::policy::{PollPolicy, Slept};

const US: u64 = 1_000;
/// What the reactor spins without a policy (its default tuning).
const IDLE_SPIN_NS: u64 = 50 * US;

/// Reports sleeps that overshoot by `overshoot_ns` and cost `cpu_ns` of CPU, past the
/// warm-up that is not learnt: a park then costs `cpu_ns + overshoot_ns`.
fn calibrate(policy: &mut Adaptive, overshoot_ns: u64, cpu_ns: u64) {
    for k in 0..PROBE_WARMUP as u64 + 64 {
        let slept = Slept {
            requested_ns: 10 * US,
            actual_ns: 10 * US + overshoot_ns,
        };
        policy.on_sleep(&slept, (k % 2 == 0).then_some(cpu_ns));
    }
    assert_eq!(policy.park_cost_ns(), Some(cpu_ns + overshoot_ns));
}

/// A front end as the reactor reports it: batches of one request, the reactor's own stats.
struct Client {
    stats: ArrivalStats,
}

impl Client {
    fn new() -> Client {
        Client {
            stats: ArrivalStats::default(),
        }
    }

    /// A request seen at `now_ns`; `waited_from_ns`: the reactor waited from then and
    /// found it on waking.
    fn arrive(&mut self, policy: &mut dyn PollPolicy, now_ns: u64, waited_from_ns: Option<u64>) {
        let previous_ns = self.stats.record(now_ns, 1);
        policy.on_arrivals(&Arrival {
            now_ns,
            requests: 1,
            previous_ns,
            waited_from_ns: waited_from_ns.filter(|_| previous_ns.is_some()),
        });
    }

    /// `count` requests `gap_ns` apart, watched all along. Returns the last one's time.
    fn every(&mut self, policy: &mut dyn PollPolicy, gap_ns: u64, count: usize) -> u64 {
        for _ in 0..count {
            let now_ns = self.stats.last_ns + gap_ns;
            self.arrive(policy, now_ns, None);
        }
        self.stats.last_ns
    }

    /// The idle decision `gone_ns` after the last request.
    fn idle(&self, policy: &mut dyn PollPolicy, gone_ns: u64) -> Duration {
        policy.decide_idle(&IdleContext {
            now_ns: self.stats.last_ns + gone_ns,
            arrivals: self.stats,
            idle_spin_ns: IDLE_SPIN_NS,
        })
    }
}

#[test]
fn a_client_sending_every_5_us_is_spun_for() {
    let mut policy = Adaptive::default();
    let mut client = Client::new();
    client.stats.last_ns = 1_000_000;
    client.every(&mut policy, 5 * US, 100);
    // Before a park's cost is measured: what the reactor spins without a policy.
    assert_eq!(
        client.idle(&mut policy, US),
        Duration::from_nanos(IDLE_SPIN_NS)
    );
    // A park costs 12 us in this test: spinning the 4 us left to the next request is cheaper.
    calibrate(&mut policy, 4 * US, 8 * US);
    let spin = client.idle(&mut policy, US).as_nanos() as u64;
    assert_eq!(spin, 4 * US, "spun until the next request is due");
    // It would have come by now: the client is not as fast as it was, so park.
    assert_eq!(client.idle(&mut policy, 6 * US), Duration::ZERO);
}

#[test]
fn a_client_idle_for_seconds_is_parked_on_at_once_after_learning() {
    let mut policy = Adaptive::default();
    calibrate(&mut policy, 4 * US, 8 * US);
    let mut client = Client::new();
    let second_ns = 1_000_000_000;
    // Each request is found on waking from a park that began 20 us after the last.
    for k in 1..=ADAPTIVE_SAMPLES_MIN as u64 + 1 {
        let decision = client.idle(&mut policy, 20 * US);
        if k <= ADAPTIVE_SAMPLES_MIN as u64 {
            assert_eq!(
                decision,
                Duration::from_nanos(IDLE_SPIN_NS),
                "learning, {k}"
            );
        }
        let last_ns = client.stats.last_ns;
        client.arrive(
            &mut policy,
            last_ns + 2 * second_ns,
            Some(last_ns + 20 * US),
        );
    }
    assert_eq!(
        client.idle(&mut policy, 20 * US),
        Duration::ZERO,
        "learnt: parks at once"
    );
}

#[test]
fn a_client_fast_only_now_and_then_is_parked_on() {
    let mut policy = Adaptive::default();
    calibrate(&mut policy, 4 * US, 8 * US);
    let mut client = Client::new();
    // One gap in 10 is 5 us, the others 1 ms: spinning 4 us catches one request in ten and
    // costs the other nine their spin as well as the park.
    for k in 0..64 {
        let gap_ns = if k % 10 == 0 { 5 * US } else { 1_000 * US };
        client.every(&mut policy, gap_ns, 1);
    }
    assert_eq!(client.idle(&mut policy, US), Duration::ZERO);
    // Half and half: catching half of them at 4 us each beats paying every park.
    let mut policy = Adaptive::default();
    calibrate(&mut policy, 4 * US, 8 * US);
    for k in 0..64 {
        let gap_ns = if k % 2 == 0 { 5 * US } else { 1_000 * US };
        client.every(&mut policy, gap_ns, 1);
    }
    assert_eq!(client.idle(&mut policy, US), Duration::from_nanos(4 * US));
}

#[test]
fn a_gap_seen_after_a_park_is_learnt_a_wake_up_shorter() {
    let mut arrivals = Arrivals::new();
    let wake_ns = 40 * US;
    let mut stats = ArrivalStats::default();
    // Requests 5 us apart, each found a wake-up late, after a park that began 2 us after
    // the last request.
    for k in 0..32u64 {
        let now_ns = 1_000_000 + k * 45 * US;
        let previous_ns = stats.record(now_ns, 1);
        arrivals.learn(
            &Arrival {
                now_ns,
                requests: 1,
                previous_ns,
                waited_from_ns: previous_ns.map(|p| p + 2 * US),
            },
            wake_ns,
        );
    }
    let ctx = IdleContext {
        now_ns: stats.last_ns + 2 * US,
        arrivals: stats,
        idle_spin_ns: IDLE_SPIN_NS,
    };
    // Learnt as 5 us: a spin of the 3 us left, not of the 43 us seen.
    assert_eq!(arrivals.spin_ns(&ctx, 12 * US), Some(3 * US));
    // Never shorter than the reactor polled for: a wait that began 20 us after the last
    // request bounds the gap below by 20 us, whatever the wake-up.
    let mut arrivals = Arrivals::new();
    for k in 0..32u64 {
        arrivals.learn(
            &Arrival {
                now_ns: (k + 1) * 45 * US,
                requests: 1,
                previous_ns: Some(k * 45 * US),
                waited_from_ns: Some(k * 45 * US + 20 * US),
            },
            wake_ns,
        );
    }
    assert_eq!(arrivals.spin_ns(&ctx, 30 * US), Some(18 * US));
}

#[test]
fn every_policy_keeps_the_reactors_idle_spin_until_a_park_is_priced() {
    // The seed policies always (the trait's default), adaptive until it measured a park.
    for info in crate::list() {
        let mut policy = crate::build(info.name)
            .or_else(|_| crate::build(&format!("{}:5", info.name)))
            .unwrap();
        let mut client = Client::new();
        client.every(&mut *policy, 5 * US, 100);
        assert_eq!(
            client.idle(&mut *policy, US),
            Duration::from_nanos(IDLE_SPIN_NS),
            "{}",
            info.name
        );
    }
}
