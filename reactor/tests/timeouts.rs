//! Per-I/O timeouts on real reactor threads: lost commands are aborted, stuck ones reset,
//! and on a device that can do neither they are abandoned, under every way of waiting
//! (spinning, sleeping, blocking on the interrupt). The bounds on time leave room for a
//! busy machine (`LATE`), so these run beside other tests; the simulation holds every
//! timeout to its bound in virtual time.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hypoll_nvme::{EmuController, IoBuf};
use hypoll_reactor::sim::LimitedController;
use hypoll_reactor::{
    allowed_cores, CoreList, Device, DeviceId, DeviceOptions, IoFailure, ReactorConfig,
    ReactorHandle, ReactorSet,
};

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
/// How late a reactor thread may be scheduled on a shared machine with few cores.
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
    h.send(move |r, _| {
        for i in 0..n {
            let sink = sink.clone();
            let t0 = Instant::now();
            r.read(
                DeviceId::FIRST,
                i * 8,
                8,
                IoBuf::zeroed(4096),
                move |_, _, done| {
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
        let _ = h.send(|_, _| {});
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn lost_commands_are_aborted_at_their_timeout_however_the_reactor_waits() {
    for policy in ["classic", "hybrid", "interrupt"] {
        let device = Device::open("emu:optane,size=16M,lost_pct=100").unwrap();
        let set = ReactorSet::start(config(policy), move |r| {
            r.attach_with(&device, options())?;
            Ok(())
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
        eventually(h, policy, |c| {
            c.io_timeouts == 4 && c.aborts == 4 && c.io_errors == 4
        });
        let c = h.stats().counters;
        assert_eq!((c.resets, c.abandoned_ios), (0, 0), "{policy}");
        let report = set.shutdown();
        assert_eq!(report.exits[0].failed_ios, 0);
    }
}

#[test]
fn commands_deaf_to_aborts_are_completed_by_a_reset() {
    for policy in ["classic", "interrupt"] {
        let device = Device::open("emu:optane,size=16M,lost_pct=100,stuck_pct=100").unwrap();
        let set = ReactorSet::start(config(policy), move |r| {
            r.attach_with(&device, options())?;
            Ok(())
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
        eventually(h, policy, |c| {
            c.io_timeouts == 3 && c.resets >= 1 && c.io_errors == 3
        });
        assert_eq!(h.stats().counters.abandoned_ios, 0);
        set.shutdown();
    }
}

#[test]
fn a_device_that_cannot_abort_or_reset_gets_its_commands_abandoned_and_quarantined() {
    let ctrl = EmuController::new(
        "emu:optane,size=16M,lost_pct=100"
            .parse::<hypoll_nvme::DeviceConfig>()
            .map(|s| match s {
                hypoll_nvme::DeviceConfig::Emu(cfg) => cfg,
                _ => unreachable!(),
            })
            .unwrap(),
    )
    .unwrap();
    let device = Device::new(Arc::new(LimitedController::new(ctrl.clone(), false, false)));
    let set = ReactorSet::start(config("interrupt"), move |r| {
        r.attach_with(&device, options())?;
        Ok(())
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

#[test]
fn a_full_queue_pair_makes_io_wait_in_a_bounded_queue_then_refuses() {
    // Depth 2 and room for 4 waiting: 6 I/Os are accepted at once, the 7th is refused.
    let device = Device::open("emu:nand,size=16M").unwrap();
    let set = ReactorSet::start(config("classic"), move |r| {
        r.attach_with(
            &device,
            DeviceOptions {
                depth: 2,
                ..options().with_wait_queue(4)
            },
        )?;
        Ok(())
    })
    .unwrap();
    let h = &set.handles()[0];
    let (tx, rx) = crossbeam_channel::unbounded();
    h.send(move |r, _| {
        let mut refused = Vec::new();
        for i in 0..7u64 {
            let tx = tx.clone();
            let submitted = r.submit(
                DeviceId::FIRST,
                hypoll_reactor::IoRequest::new(hypoll_reactor::IoOp::Read, i * 8, 8).with_user(i),
                Some(IoBuf::zeroed(4096)),
                move |_, _, done| tx.send((done.user, done.result)).unwrap(),
            );
            if let Err(e) = submitted {
                refused.push((i, e.reason, e.buf.is_some()));
            }
        }
        assert_eq!(r.outstanding(), 6, "2 on the queue pair, 4 waiting");
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(matches!(
            refused[0],
            (
                6,
                hypoll_reactor::RejectReason::Submit(hypoll_nvme::SubmitError::QueueFull { .. }),
                true
            )
        ));
    })
    .unwrap();
    let mut done: Vec<(u64, Result<(), IoFailure>)> = (0..6)
        .map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap())
        .collect();
    done.sort_by_key(|&(user, _)| user);
    assert_eq!(
        done,
        (0..6).map(|i| (i, Ok(()))).collect::<Vec<_>>(),
        "the waiting I/Os ran once slots freed"
    );
    set.shutdown();

    // Behind quarantined slots, waiting I/Os time out, and then the device refuses more
    // with a reason that says retrying is pointless.
    let ctrl = EmuController::new(
        match "emu:optane,size=16M,lost_pct=100"
            .parse::<hypoll_nvme::DeviceConfig>()
            .unwrap()
        {
            hypoll_nvme::DeviceConfig::Emu(cfg) => cfg,
            _ => unreachable!(),
        },
    )
    .unwrap();
    let device = Device::new(Arc::new(LimitedController::new(ctrl, false, false)));
    let set = ReactorSet::start(config("interrupt"), move |r| {
        r.attach_with(
            &device,
            DeviceOptions {
                depth: 2,
                ..options().with_wait_queue(2)
            },
        )?;
        Ok(())
    })
    .unwrap();
    let h = &set.handles()[0];
    let mut outcomes: Vec<_> = read_n(h, 4).into_iter().map(|(r, b, _)| (r, b)).collect();
    outcomes.sort_by_key(|o| format!("{o:?}"));
    assert_eq!(
        outcomes,
        vec![
            (Err(IoFailure::Abandoned), false),
            (Err(IoFailure::Abandoned), false),
            (Err(IoFailure::TimedOut), true),
            (Err(IoFailure::TimedOut), true),
        ]
    );
    let (tx, rx) = crossbeam_channel::bounded(1);
    let (answer_tx, answer_rx) = crossbeam_channel::bounded(1);
    h.send(move |r, _| {
        let refused = r
            .read(
                DeviceId::FIRST,
                0,
                8,
                IoBuf::zeroed(4096),
                move |_, _, done| answer_tx.send((done.user, done.result)).unwrap(),
            )
            .unwrap_err();
        tx.send((refused.reason, refused.buf.is_some())).unwrap();
        // The callback comes back with the refusal, not run: it still answers.
        let done = hypoll_reactor::IoDone {
            device: refused.device,
            result: Err(IoFailure::Refused),
            buf: refused.buf,
            user: 7,
            latency_ns: 0,
        };
        (refused.callback)(r, &mut (), done);
    })
    .unwrap();
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(5)).unwrap(),
        (
            hypoll_reactor::RejectReason::Quarantined { abandoned: 2 },
            true
        )
    );
    assert_eq!(
        answer_rx.recv_timeout(Duration::from_secs(5)).unwrap(),
        (7, Err(IoFailure::Refused))
    );
    set.shutdown();
}

#[test]
fn send_timeout_waits_for_room_in_a_full_mailbox_but_not_forever() {
    let cfg = ReactorConfig {
        mailbox_capacity: 2,
        ..config("classic")
    };
    let set = ReactorSet::start(cfg, |_| Ok(())).unwrap();
    let h = &set.handles()[0];
    let (release_tx, release_rx) = crossbeam_channel::bounded::<()>(0);
    let (stuck_tx, stuck_rx) = crossbeam_channel::bounded::<()>(1);
    h.send(move |_, _| {
        stuck_tx.send(()).unwrap();
        let _ = release_rx.recv_timeout(Duration::from_secs(10));
    })
    .unwrap();
    stuck_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    // The reactor is stuck in that message: fill its mailbox.
    while h.send(|_, _| {}).is_ok() {}
    let t0 = Instant::now();
    assert_eq!(
        h.send_timeout(|_, _| {}, Duration::from_millis(30)),
        Err(hypoll_reactor::SendError::Full)
    );
    assert!(t0.elapsed() >= Duration::from_millis(30), "it waited");
    // Room appears once the reactor runs again: a patient sender gets through.
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        release_tx.send(()).unwrap();
    });
    let (ran_tx, ran_rx) = crossbeam_channel::bounded(1);
    h.send_timeout(move |_, _| ran_tx.send(()).unwrap(), Duration::from_secs(5))
        .unwrap();
    ran_rx.recv_timeout(Duration::from_secs(5)).unwrap();
    releaser.join().unwrap();
    set.shutdown();
}
