//! Per-I/O timeouts on real reactor threads: lost commands are aborted, stuck ones reset,
//! and on a device that can do neither they are abandoned, under every way of waiting
//! (spinning, sleeping, blocking on the interrupt).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hypoll_nvme::{EmuController, IoBuf};
use hypoll_reactor::sim::LimitedController;
use hypoll_reactor::{
    allowed_cores, CoreList, Device, DeviceId, DeviceOptions, IoFailure, ReactorConfig,
    ReactorHandle, ReactorSet,
};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn config(policy: &str) -> ReactorConfig {
    ReactorConfig {
        cores: Some(CoreList::new(
            allowed_cores().unwrap().into_iter().take(1).collect(),
        )),
        policy: policy.to_string(),
        ..ReactorConfig::default()
    }
}

const IO_TIMEOUT: Duration = Duration::from_millis(30);
const ABORT_TIMEOUT: Duration = Duration::from_millis(20);
const RESET_TIMEOUT: Duration = Duration::from_millis(20);
/// A reactor times an I/O from its batch's timestamp, taken a little before the test's
/// clock read: an I/O may end this much before its timeout as the test measures it.
const EARLY: Duration = Duration::from_millis(1);
/// How late a reactor thread may be scheduled on this shared 2-core machine.
const LATE: Duration = Duration::from_secs(1);

fn options() -> DeviceOptions {
    DeviceOptions::new(16)
        .with_io_timeout(Some(IO_TIMEOUT))
        .with_abort_timeout(ABORT_TIMEOUT)
        .with_reset_timeout(RESET_TIMEOUT)
}

/// (result, buffer back, latency) of each I/O.
type Outcomes = Arc<Mutex<Vec<(Result<(), IoFailure>, bool, Duration)>>>;

/// Submits `n` 4 KiB reads on reactor 0 and waits up to 5 s for their callbacks.
fn read_n(h: &ReactorHandle, n: u64) -> Vec<(Result<(), IoFailure>, bool, Duration)> {
    let outcomes: Outcomes = Arc::new(Mutex::new(Vec::new()));
    let sink = outcomes.clone();
    h.send(move |r| {
        for i in 0..n {
            let sink = sink.clone();
            let t0 = Instant::now();
            r.read(
                DeviceId::FIRST,
                i * 8,
                8,
                IoBuf::zeroed(4096),
                move |_, done| {
                    sink.lock()
                        .unwrap()
                        .push((done.result, done.buf.is_some(), t0.elapsed()));
                },
            )
            .unwrap();
        }
    })
    .unwrap();
    let start = Instant::now();
    while outcomes.lock().unwrap().len() < n as usize {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "I/Os did not complete: {} of {n}",
            outcomes.lock().unwrap().len()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let got = outcomes.lock().unwrap().clone();
    got
}

/// The stats a reactor publishes lag by up to 10 ms: wait until `cond` holds.
fn eventually(h: &ReactorHandle, what: &str, cond: impl Fn(&hypoll_reactor::Counters) -> bool) {
    let start = Instant::now();
    while !cond(&h.stats().counters) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{what}: {:?}",
            h.stats()
        );
        // A message wakes a parked reactor, which publishes.
        let _ = h.send(|_| {});
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn lost_commands_are_aborted_at_their_timeout_however_the_reactor_waits() {
    let _serial = serial();
    for policy in ["classic", "hybrid", "interrupt"] {
        let device = Device::open("emu:optane,size=16M,lost_pct=100").unwrap();
        let set = ReactorSet::start(config(policy), move |r| {
            r.attach_with(&device, options()).map(drop)
        })
        .unwrap();
        let h = &set.handles()[0];
        let outcomes = read_n(h, 4);
        for (result, buf_back, latency) in &outcomes {
            assert_eq!(*result, Err(IoFailure::TimedOut), "{policy}");
            assert!(buf_back, "{policy}: the buffer comes back");
            assert!(
                *latency >= IO_TIMEOUT - EARLY && *latency < IO_TIMEOUT + LATE,
                "{policy}: aborted {latency:?} after submission"
            );
        }
        eventually(h, policy, |c| c.io_timeouts == 4 && c.aborts == 4);
        let c = h.stats().counters;
        assert_eq!(
            (c.resets, c.abandoned_ios, c.io_errors),
            (0, 0, 4),
            "{policy}"
        );
        let report = set.shutdown();
        assert_eq!(report.exits[0].failed_ios, 0);
    }
}

#[test]
fn commands_deaf_to_aborts_are_completed_by_a_reset() {
    let _serial = serial();
    for policy in ["classic", "interrupt"] {
        let device = Device::open("emu:optane,size=16M,lost_pct=100,stuck_pct=100").unwrap();
        let set = ReactorSet::start(config(policy), move |r| {
            r.attach_with(&device, options()).map(drop)
        })
        .unwrap();
        let h = &set.handles()[0];
        let outcomes = read_n(h, 3);
        for (result, buf_back, latency) in &outcomes {
            assert_eq!(*result, Err(IoFailure::TimedOut), "{policy}");
            assert!(buf_back);
            assert!(
                *latency >= IO_TIMEOUT + ABORT_TIMEOUT - EARLY
                    && *latency < IO_TIMEOUT + ABORT_TIMEOUT + LATE,
                "{policy}: reset {latency:?} after submission"
            );
        }
        eventually(h, policy, |c| c.io_timeouts == 3 && c.resets >= 1);
        assert_eq!(h.stats().counters.abandoned_ios, 0);
        set.shutdown();
    }
}

#[test]
fn a_device_that_cannot_abort_or_reset_gets_its_commands_abandoned_and_quarantined() {
    let _serial = serial();
    let ctrl = EmuController::new(
        "emu:optane,size=16M,lost_pct=100"
            .parse::<hypoll_nvme::DeviceSpec>()
            .map(|s| match s {
                hypoll_nvme::DeviceSpec::Emu(cfg) => cfg,
                _ => unreachable!(),
            })
            .unwrap(),
    )
    .unwrap();
    let device = Device::new(Arc::new(LimitedController::new(ctrl.clone(), false, false)));
    let set = ReactorSet::start(config("interrupt"), move |r| {
        r.attach_with(&device, options()).map(drop)
    })
    .unwrap();
    let h = &set.handles()[0];
    let outcomes = read_n(h, 5);
    for (result, buf_back, latency) in &outcomes {
        assert_eq!(*result, Err(IoFailure::Abandoned));
        assert!(!buf_back, "the device may still write into it: quarantined");
        assert!(
            *latency >= IO_TIMEOUT - EARLY && *latency < IO_TIMEOUT + LATE,
            "{latency:?}"
        );
    }
    eventually(h, "abandoned", |c| {
        c.abandoned_ios == 5 && c.reset_failures >= 1
    });
    // Nothing live is outstanding: the reactor parks rather than polling for them.
    assert_eq!(h.stats().outstanding, 0);
    // The controller comes back (reset from elsewhere): the late completions free the
    // quarantined buffers.
    ctrl.reset();
    eventually(h, "late completions", |c| c.late_completions == 5);
    // More I/O works; shutdown does not wait for anything.
    let outcomes = read_n(h, 1);
    assert_eq!(outcomes[0].0, Err(IoFailure::Abandoned));
    let t0 = Instant::now();
    let report = set.shutdown();
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "shutdown waited for abandoned I/O"
    );
    assert_eq!(report.exits[0].failed_ios, 0);
}
