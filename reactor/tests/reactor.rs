//! Integration tests of the reactor: messages, timers, pinning, parking, I/O, policies,
//! shutdown and panics, on real threads.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hypoll_nvme::{monotonic_ns, IoBuf, SubmitError};
use hypoll_reactor::{
    allowed_cores, thread_cores, timer_slack_ns, CoreError, CoreList, Device, DeviceId, IoDone,
    IoFailure, IoOp, IoRequest, PolicyFactory, Reactor, ReactorConfig, ReactorHandle, ReactorSet,
    ReactorStats, ReactorTuning, RejectReason, Rejected, SendError, StartError,
};

/// Tests run one at a time: they measure CPU and timing, on machines with as few as two
/// cores, and spinning reactors of a parallel test would share their cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Up to `n` cores this process may use.
fn cores(n: usize) -> CoreList {
    CoreList::new(allowed_cores().unwrap().into_iter().take(n).collect())
}

fn config(n: usize, policy: &str) -> ReactorConfig {
    ReactorConfig {
        cores: Some(cores(n)),
        policy: policy.to_string(),
        ..ReactorConfig::default()
    }
}

/// Waits until `cond` holds, for up to 10 s.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn messages_arrive_in_order_within_and_across_reactors() {
    let _serial = serial();
    let set = ReactorSet::start(config(2, "classic"), |_| Ok(())).unwrap();
    let handles = set.handles().clone();
    let last = handles.len() - 1;
    let seen = Arc::new(Mutex::new(Vec::new()));
    // From an outside thread, retrying when the mailbox is full.
    for i in 0..5_000u64 {
        loop {
            let seen = seen.clone();
            match handles[last].send(move |_, _| seen.lock().unwrap().push(i)) {
                Ok(()) => break,
                Err(SendError::Full) => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
    }
    wait_for("5000 messages", || seen.lock().unwrap().len() == 5_000);
    assert!(seen.lock().unwrap().iter().copied().eq(0..5_000));

    // From reactor 0 to the last reactor, from inside reactor code.
    let across = Arc::new(Mutex::new(Vec::new()));
    let sink = across.clone();
    handles[0]
        .send(move |r, _| {
            let target = r.handles()[r.handles().len() - 1].clone();
            for i in 0..500u64 {
                let sink = sink.clone();
                target
                    .send(move |r, _| sink.lock().unwrap().push((r.index(), i)))
                    .expect("mailbox of 1024 holds 500");
            }
        })
        .unwrap();
    wait_for("500 cross-reactor messages", || {
        across.lock().unwrap().len() == 500
    });
    let got = across.lock().unwrap();
    assert!(got.iter().all(|&(index, _)| index == last));
    assert!(got.iter().map(|&(_, i)| i).eq(0..500));
    drop(got);
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn a_full_mailbox_is_reported_not_grown() {
    let _serial = serial();
    let cfg = ReactorConfig {
        mailbox_capacity: 4,
        ..config(1, "classic")
    };
    let set = ReactorSet::start(cfg, |_| Ok(())).unwrap();
    let h = &set.handles()[0];
    let (block_tx, block_rx) = crossbeam_channel::bounded::<()>(0);
    h.send(move |_, _| {
        let _ = block_rx.recv_timeout(Duration::from_secs(10));
    })
    .unwrap();
    // Once the reactor is stuck in that message, at most 4 more fit.
    std::thread::sleep(Duration::from_millis(50));
    let results: Vec<_> = (0..10).map(|_| h.send(|_, _| {})).collect();
    assert!(results.iter().filter(|r| r.is_ok()).count() <= 5);
    assert!(results.contains(&Err(SendError::Full)));
    block_tx.send(()).unwrap();
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn timers_fire_on_time_even_on_a_parked_reactor() {
    let _serial = serial();
    let set = ReactorSet::start(config(1, "classic"), |_| Ok(())).unwrap();
    let fired = Arc::new(Mutex::new(Vec::new()));
    let sink = fired.clone();
    let started = Arc::new(AtomicU64::new(0));
    let start_ns = started.clone();
    set.handles()[0]
        .send(move |r, _| {
            start_ns.store(r.now_ns(), Ordering::SeqCst);
            for delay_ms in [30u64, 10, 20] {
                let sink = sink.clone();
                r.after(Duration::from_millis(delay_ms), move |_, _| {
                    sink.lock().unwrap().push((delay_ms, monotonic_ns()));
                });
            }
        })
        .unwrap();
    wait_for("three timers", || fired.lock().unwrap().len() == 3);
    let fired = fired.lock().unwrap();
    let t0 = started.load(Ordering::SeqCst);
    let order: Vec<u64> = fired.iter().map(|&(d, _)| d).collect();
    assert_eq!(order, vec![10, 20, 30], "timers fire in deadline order");
    for &(delay_ms, at_ns) in fired.iter() {
        let late_ns = at_ns as i64 - (t0 + delay_ms * 1_000_000) as i64;
        // Never early; late by at most 5 ms, room for a shared machine's scheduling.
        assert!(
            (0..5_000_000).contains(&late_ns),
            "{delay_ms} ms timer off by {late_ns} ns"
        );
    }
    drop(fired);

    // A periodic timer, then cancelled.
    let ticks = Arc::new(AtomicU64::new(0));
    let t = ticks.clone();
    let (id_tx, id_rx) = crossbeam_channel::bounded(1);
    set.handles()[0]
        .send(move |r, _| {
            let id = r.every(Duration::from_millis(2), move |_, _| {
                t.fetch_add(1, Ordering::SeqCst);
            });
            id_tx.send(id).unwrap();
        })
        .unwrap();
    let id = id_rx.recv().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let (done_tx, done_rx) = crossbeam_channel::bounded(1);
    set.handles()[0]
        .send(move |r, _| done_tx.send(r.cancel_timer(id)).unwrap())
        .unwrap();
    assert!(done_rx.recv().unwrap(), "the periodic timer was live");
    let n = ticks.load(Ordering::SeqCst);
    assert!((25..=55).contains(&n), "{n} ticks of 2 ms in ~100 ms");
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(ticks.load(Ordering::SeqCst), n, "no ticks after cancel");
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn reactors_are_pinned_named_and_run_with_1ns_timer_slack() {
    let _serial = serial();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    let set = ReactorSet::start(config(2, "classic"), move |r| {
        sink.lock().unwrap().push((
            r.core(),
            thread_cores().unwrap(),
            std::thread::current().name().unwrap().to_string(),
            timer_slack_ns().unwrap(),
        ));
        Ok(())
    })
    .unwrap();
    // Pinning holds while the reactor runs, too.
    let (tx, rx) = crossbeam_channel::unbounded();
    for h in set.handles().iter() {
        let tx = tx.clone();
        h.send(move |r, _| tx.send((r.core(), thread_cores().unwrap())).unwrap())
            .unwrap();
    }
    for _ in 0..set.handles().len() {
        let (core, mask) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(mask, vec![core]);
    }
    for (core, mask, name, slack) in seen.lock().unwrap().iter() {
        assert_eq!(
            mask,
            &vec![*core],
            "sched_getaffinity on the reactor thread"
        );
        assert_eq!(name, &format!("hypoll-r{core}"));
        assert_eq!(*slack, 1);
    }
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn start_errors_are_clear() {
    let _serial = serial();
    let outside = allowed_cores().unwrap().last().unwrap() + 1;
    let cfg = ReactorConfig {
        cores: Some(CoreList::new(vec![outside])),
        ..ReactorConfig::default()
    };
    match ReactorSet::start(cfg, |_| Ok(())) {
        Err(StartError::Cores(CoreError::NotAllowed { core, .. })) => assert_eq!(core, outside),
        other => panic!("expected NotAllowed, got {:?}", other.err()),
    }
    let err = ReactorSet::start(config(1, "warp-speed"), |_| Ok(()))
        .err()
        .unwrap();
    assert!(err.to_string().contains("warp-speed"), "{err}");
    let err = ReactorSet::<()>::start(config(1, "classic"), |_| Err("no disk".into()))
        .err()
        .unwrap();
    assert!(err.to_string().contains("no disk"), "{err}");
    let err = ReactorSet::<()>::start(config(1, "classic"), |_| panic!("init exploded"))
        .err()
        .unwrap();
    assert!(err.to_string().contains("init exploded"), "{err}");
    // One reactor's init panics while another has started: reported, not hung.
    let err = ReactorSet::start(config(2, "classic"), |r| {
        if r.index() == r.handles().len() - 1 {
            panic!("second init exploded");
        }
        Ok(())
    })
    .err()
    .unwrap();
    assert!(err.to_string().contains("second init exploded"), "{err}");
}

#[test]
fn a_parked_reactor_uses_under_1_percent_of_a_core() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("disk.img");
    std::fs::write(&file, vec![0u8; 1 << 20]).unwrap();
    // After real I/O, idle means parked, whatever the policy and the device: `classic`
    // polls every completion, which on io_uring still counts on the ring's eventfd, a line
    // the parked reactor listens on (it once woke the reactor at once, park after park).
    for (spec, policy, idle_s) in [
        ("emu:nand,size=64M".to_string(), "adaptive", 5),
        (
            format!("uring:{},direct=0,lba=512", file.display()),
            "classic",
            2,
        ),
    ] {
        let device = Device::open(&spec).unwrap();
        let set = ReactorSet::start(config(1, policy), move |r| {
            r.attach(&device, 8)?;
            Ok(())
        })
        .unwrap();
        let h = &set.handles()[0];
        let parks_before_io = h.stats().counters.parks;
        assert_eq!(drive(h, 200, 4, write_block, succeeded), 0, "{spec}");
        wait_for("the reactor to park after its I/O", || {
            h.stats().counters.parks > parks_before_io
        });
        let cpu0 = h.cpu_ns().unwrap();
        let parks0 = h.stats().counters.parks;
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_secs(idle_s));
        let cpu_pct = 100.0 * (h.cpu_ns().unwrap() - cpu0) as f64 / t0.elapsed().as_nanos() as f64;
        let parks = h.stats().counters.parks - parks0;
        assert!(
            cpu_pct < 1.0,
            "{spec}: parked reactor used {cpu_pct:.3} % of a core ({parks} parks)"
        );
        // And it still wakes for a message.
        let (tx, rx) = crossbeam_channel::bounded(1);
        h.send(move |r, _| tx.send(r.core()).unwrap()).unwrap();
        rx.recv_timeout(Duration::from_secs(1))
            .expect("a parked reactor wakes for messages");
        assert!(set.shutdown().panics.is_empty());
    }
}

/// Drives `count` I/Os at queue depth `qd` on a reactor's first device: `make(i)` builds
/// I/O number `i`, `check(i, done)` judges its completion. Returns how many failed `check`.
type Make = fn(u64) -> (IoRequest, Option<IoBuf>);
type Check = fn(u64, &IoDone) -> bool;

fn drive(h: &ReactorHandle, count: u64, qd: u64, make: Make, check: Check) -> u64 {
    struct Driver {
        next: u64,
        done: u64,
        failed: u64,
        count: u64,
        make: Make,
        check: Check,
        tx: crossbeam_channel::Sender<u64>,
    }
    fn issue(r: &mut Reactor, driver: &Rc<RefCell<Driver>>) {
        let (i, make) = {
            let mut d = driver.borrow_mut();
            if d.next == d.count {
                return;
            }
            d.next += 1;
            (d.next - 1, d.make)
        };
        let (req, buf) = make(i);
        let driver2 = driver.clone();
        r.submit(DeviceId::FIRST, req.with_user(i), buf, move |r, _, done| {
            let finished = {
                let mut d = driver2.borrow_mut();
                if !(d.check)(done.user, &done) {
                    d.failed += 1;
                }
                d.done += 1;
                (d.done == d.count).then_some(d.failed)
            };
            match finished {
                Some(failed) => driver2.borrow().tx.send(failed).unwrap(),
                None => issue(r, &driver2),
            }
        })
        .expect("the queue has room for qd I/Os");
    }
    let (tx, rx) = crossbeam_channel::bounded(1);
    h.send(move |r, _| {
        let driver = Rc::new(RefCell::new(Driver {
            next: 0,
            done: 0,
            failed: 0,
            count,
            make,
            check,
            tx,
        }));
        for _ in 0..qd {
            issue(r, &driver);
        }
    })
    .unwrap();
    rx.recv_timeout(Duration::from_secs(60))
        .expect("workload finished")
}

fn pattern(i: u64) -> IoBuf {
    let mut b = IoBuf::zeroed(4096);
    for (j, x) in b.iter_mut().enumerate() {
        *x = (i as usize * 7 + j / 3) as u8;
    }
    b
}

fn write_block(i: u64) -> (IoRequest, Option<IoBuf>) {
    (IoRequest::new(IoOp::Write, i * 8, 8), Some(pattern(i)))
}

fn read_block(i: u64) -> (IoRequest, Option<IoBuf>) {
    (
        IoRequest::new(IoOp::Read, i * 8, 8),
        Some(IoBuf::zeroed(4096)),
    )
}

fn succeeded(_: u64, done: &IoDone) -> bool {
    done.result.is_ok() && done.buf.is_some()
}

fn matches_pattern(i: u64, done: &IoDone) -> bool {
    done.result.is_ok() && done.buf.as_deref() == Some(&pattern(i)[..])
}

/// Writes then reads back `count` 4 KiB blocks through one reactor under `policy`; returns
/// the reactor's final statistics.
fn write_then_read(device: &str, policy: &str, count: u64, qd: u64) -> ReactorStats {
    let device = Device::open(device).unwrap();
    let set = ReactorSet::start(config(1, policy), move |r| {
        r.attach(&device, 64)?;
        Ok(())
    })
    .unwrap();
    let h = &set.handles()[0];
    assert_eq!(
        drive(h, count, qd, write_block, succeeded),
        0,
        "writes failed"
    );
    assert_eq!(
        drive(h, count, qd, read_block, matches_pattern),
        0,
        "reads differ"
    );
    let report = set.shutdown();
    assert!(report.panics.is_empty());
    assert_eq!(report.exits[0].failed_ios, 0);
    report.exits[0].stats
}

#[test]
fn data_written_through_a_reactor_reads_back_under_every_policy() {
    let _serial = serial();
    for policy in [
        "classic",
        "interrupt",
        "hybrid",
        "fixed:5",
        "hybrid-3/4",
        "hybrid-min",
        "uring-hybrid",
        "adaptive",
        "oracle",
    ] {
        let stats = write_then_read("emu:optane,size=64M", policy, 2_000, 8);
        assert_eq!(stats.counters.ios, 4_000, "{policy}");
        assert_eq!(stats.counters.io_errors, 0, "{policy}");
    }
}

#[test]
fn the_policy_decides_how_the_reactor_waits() {
    let _serial = serial();
    // 300 us per I/O: time enough for every kind of wait, even in a debug build.
    let dev = "emu:nand,size=64M,read_us=300,write_us=300";
    let classic = write_then_read(dev, "classic", 600, 1);
    assert_eq!(classic.counters.sleeps, 0);
    assert_eq!(classic.counters.interrupt_waits, 0);
    // It spins: many empty polls per I/O (CPU time would say the same on a quiet machine,
    // but a spinning thread gets only its share of a busy one).
    assert!(
        classic.counters.idle_polls > 10 * classic.counters.ios,
        "classic spins: {:?}",
        classic.counters
    );

    let interrupt = write_then_read(dev, "interrupt", 600, 1);
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

    let hybrid = write_then_read(dev, "hybrid", 600, 1);
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
    let _serial = serial();
    // A policy asks for 1 s per I/O (once the first 100 ms window of statistics is out) on a
    // 300 us device. Past `long_sleep_ns` (1 ms) the reactor waits on the interrupt instead,
    // bounded by the sleep's end, so each I/O ends when the device completes it: hundreds of
    // I/Os would otherwise take hundreds of seconds.
    let start = Instant::now();
    let dev = "emu:nand,size=64M,read_us=300,write_us=300";
    let stats = write_then_read(dev, "fixed:1000000", 600, 1);
    let elapsed = start.elapsed();
    assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
    assert_eq!(stats.counters.ios, 1_200);
    // Long sleeps are interrupt waits, not timed sleeps.
    assert_eq!(stats.counters.sleeps, 0, "{:?}", stats.counters);
    assert!(
        stats.counters.interrupt_waits >= 200,
        "{:?}",
        stats.counters
    );
}

/// A policy of the test's own: one interruptible sleep of `sleep` per I/O, then spin. Counts
/// the completions it is told were seen after an interrupt wait.
struct SleepInterruptibly {
    sleep: Duration,
    after_interrupt: Arc<AtomicU64>,
}

impl hypoll_policy::PollPolicy for SleepInterruptibly {
    fn name(&self) -> &str {
        "test-sleep-interruptibly"
    }

    fn decide(&mut self, ctx: &hypoll_policy::PollContext<'_>) -> hypoll_policy::Decision {
        assert!(
            ctx.interrupts,
            "an emulated device in real time has an interrupt"
        );
        if ctx.oldest.slept {
            hypoll_policy::Decision::Spin
        } else {
            hypoll_policy::Decision::SleepInterruptible(self.sleep)
        }
    }

    fn on_completion(&mut self, seen: &hypoll_policy::Observation) {
        if seen.after_interrupt {
            assert!(seen.censored);
            self.after_interrupt.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Writes then reads back `count` blocks at QD 1 on `device` under `SleepInterruptibly`.
fn sleep_interruptibly(device: &str, sleep: Duration, count: u64) -> (ReactorStats, u64) {
    let after_interrupt = Arc::new(AtomicU64::new(0));
    let seen = after_interrupt.clone();
    let cfg = ReactorConfig {
        custom_policy: Some(PolicyFactory::new(move |_| {
            Box::new(SleepInterruptibly {
                sleep,
                after_interrupt: seen.clone(),
            })
        })),
        ..config(1, "classic")
    };
    let device = Device::open(device).unwrap();
    let set = ReactorSet::start(cfg, move |r| {
        r.attach(&device, 8)?;
        Ok(())
    })
    .unwrap();
    let h = &set.handles()[0];
    assert_eq!(drive(h, count, 1, write_block, succeeded), 0);
    assert_eq!(drive(h, count, 1, read_block, matches_pattern), 0);
    let report = set.shutdown();
    assert!(report.panics.is_empty(), "{:?}", report.panics);
    (
        report.exits[0].stats,
        after_interrupt.load(Ordering::Relaxed),
    )
}

#[test]
fn a_completion_ends_an_interruptible_sleep() {
    let _serial = serial();
    // 1 s asked, 300 us device: the completion's interrupt ends every sleep (100 I/Os
    // would otherwise take 100 s), each is an interrupt wait, and the policy hears that its
    // completion was seen after one.
    let start = Instant::now();
    let dev = "emu:nand,size=16M,read_us=300,write_us=300";
    let (stats, after_interrupt) = sleep_interruptibly(dev, Duration::from_secs(1), 50);
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(stats.counters.ios, 100);
    assert_eq!(stats.counters.sleeps, 0, "{:?}", stats.counters);
    assert!(
        stats.counters.interrupt_waits >= 100,
        "{:?}",
        stats.counters
    );
    assert!(
        after_interrupt >= 90,
        "{after_interrupt} of 100 seen after an interrupt"
    );
}

#[test]
fn an_interruptible_sleep_that_runs_its_course_is_the_ios_one_sleep() {
    let _serial = serial();
    // 50 us asked, 2 ms device: each sleep ends at its deadline, counts as the I/O's one
    // sleep (the policy then sees `slept` and spins) and measures its overshoot.
    let dev = "emu:nand,size=16M,read_us=2000,write_us=2000,tail_pct=0";
    let (stats, after_interrupt) = sleep_interruptibly(dev, Duration::from_micros(50), 50);
    assert_eq!(stats.counters.ios, 100);
    // One sleep per I/O (a few may complete before the reactor gets to decide, on a loaded
    // machine).
    assert!(
        (90..=100).contains(&stats.counters.sleeps),
        "{:?}",
        stats.counters
    );
    assert_eq!(stats.counters.interrupt_waits, 0, "{:?}", stats.counters);
    assert_eq!(after_interrupt, 0);
    assert!(stats.overshoot_mean_ns().is_some());
}

#[test]
fn a_deep_queue_on_null_completes_every_io() {
    let _serial = serial();
    let device = Device::open("null").unwrap();
    let set = ReactorSet::start(config(1, "classic"), move |r| {
        r.attach(&device, 128)?;
        Ok(())
    })
    .unwrap();
    let failed = drive(&set.handles()[0], 200_000, 128, read_block, succeeded);
    assert_eq!(failed, 0);
    let stats = set.shutdown().exits[0].stats;
    assert_eq!(stats.counters.ios, 200_000);
}

#[test]
fn shutdown_drains_what_completes_and_fails_the_rest_with_a_clear_status() {
    let _serial = serial();
    // Commands on this device never complete; the shutdown waits 200 ms, then fails them.
    let device = Device::open("emu:optane,size=16M,lost_pct=100").unwrap();
    let cfg = ReactorConfig {
        tuning: ReactorTuning {
            shutdown_timeout: Duration::from_millis(200),
            ..ReactorTuning::default()
        },
        ..config(1, "classic")
    };
    let set = ReactorSet::start(cfg, move |r| {
        r.attach(&device, 16)?;
        Ok(())
    })
    .unwrap();
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let sink = outcomes.clone();
    set.handles()[0]
        .send(move |r, _| {
            for i in 0..10u64 {
                let sink = sink.clone();
                r.read(
                    DeviceId::FIRST,
                    i * 8,
                    8,
                    IoBuf::zeroed(4096),
                    move |_, _, done| {
                        sink.lock()
                            .unwrap()
                            .push((done.user, done.result, done.buf.is_some()));
                    },
                )
                .unwrap();
            }
        })
        .unwrap();
    wait_for("10 I/Os in flight", || {
        set.handles()[0].stats().outstanding == 10
    });
    let t0 = Instant::now();
    let report = set.shutdown();
    assert!(t0.elapsed() >= Duration::from_millis(200));
    assert_eq!(report.exits[0].failed_ios, 10);
    assert_eq!(report.exits[0].drained_ios, 0);
    let outcomes = outcomes.lock().unwrap();
    assert_eq!(outcomes.len(), 10, "every I/O's callback ran");
    for (_, result, buf_back) in outcomes.iter() {
        assert_eq!(*result, Err(IoFailure::Shutdown));
        assert!(buf_back, "the buffer came back");
    }

    // A slow device whose I/O completes within the timeout is drained, not failed.
    let device = Device::open("emu:nand,size=16M,read_us=20000,jitter=0,tail_pct=0").unwrap();
    let set = ReactorSet::start(config(1, "classic"), move |r| {
        r.attach(&device, 16)?;
        Ok(())
    })
    .unwrap();
    set.handles()[0]
        .send(|r, _| {
            for i in 0..5u64 {
                r.read(
                    DeviceId::FIRST,
                    i * 8,
                    8,
                    IoBuf::zeroed(4096),
                    |_, _, done| {
                        assert!(done.result.is_ok());
                    },
                )
                .unwrap();
            }
        })
        .unwrap();
    wait_for("5 I/Os in flight", || {
        set.handles()[0].stats().outstanding == 5
    });
    let report = set.shutdown();
    assert_eq!(report.exits[0].drained_ios, 5);
    assert_eq!(report.exits[0].failed_ios, 0);
    assert!(report.panics.is_empty());
}

#[test]
fn submissions_are_refused_with_reasons_and_the_buffer_back() {
    let _serial = serial();
    let device = Device::open("emu:optane,size=1M").unwrap();
    let set = ReactorSet::start(config(1, "classic"), move |r| {
        r.attach(&device, 2)?;
        Ok(())
    })
    .unwrap();
    let (tx, rx) = crossbeam_channel::bounded(1);
    set.handles()[0]
        .send(move |r, _| {
            let mut reasons = Vec::new();
            let mut note = |res: Result<(), Rejected>| {
                let e = res.unwrap_err();
                reasons.push((e.reason, e.buf.is_some()));
            };
            note(
                r.submit(
                    DeviceId::FIRST,
                    IoRequest::new(IoOp::Read, 0, 8),
                    None,
                    |_, _, _| {},
                )
                .map_err(Rejected::boxed),
            );
            note(
                r.flush(DeviceId::from_index(9), |_, _, _| {})
                    .map_err(Rejected::boxed),
            );
            note(
                r.read(DeviceId::FIRST, 0, 0, IoBuf::zeroed(4096), |_, _, _| {})
                    .map_err(Rejected::boxed),
            );
            let mut room = vec![r.has_room(DeviceId::FIRST)];
            r.flush(DeviceId::FIRST, |_, _, _| {}).unwrap();
            room.push(r.has_room(DeviceId::FIRST));
            r.flush(DeviceId::FIRST, |_, _, _| {}).unwrap();
            // Full: has_room says so before an I/O is built to be refused.
            room.push(r.has_room(DeviceId::FIRST));
            note(
                r.read(DeviceId::FIRST, 0, 8, IoBuf::zeroed(4096), |_, _, _| {})
                    .map_err(Rejected::boxed),
            );
            assert_eq!(room, [true, true, false]);
            tx.send(reasons).unwrap();
        })
        .unwrap();
    let reasons = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(
        reasons,
        vec![
            (RejectReason::Buffer, false),
            (RejectReason::UnknownDevice, false),
            (
                RejectReason::Submit(SubmitError::InvalidField("zero-length transfer (nlb = 0)")),
                true
            ),
            (
                RejectReason::Submit(SubmitError::QueueFull { depth: 2 }),
                true
            ),
        ]
    );
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn a_reactor_panic_is_reported_not_hung() {
    let _serial = serial();
    let set = ReactorSet::start(config(2, "classic"), |_| Ok(())).unwrap();
    let victim = set.handles()[0].clone();
    victim.send(|_, _| panic!("disk on fire")).unwrap();
    wait_for("the reactor to die", || {
        set.finished().contains(&victim.core())
    });
    assert_eq!(victim.send(|_, _| {}), Err(SendError::Stopped));
    let report = set.shutdown();
    assert_eq!(report.panics.len(), 1);
    assert_eq!(report.panics[0].core, victim.core());
    assert!(report.panics[0].message.contains("disk on fire"));
    assert_eq!(report.exits.len() + report.panics.len(), cores(2).len());
}

#[test]
fn write_zeroes_and_deallocate_reach_the_device() {
    let _serial = serial();
    let device = Device::open("emu:optane,size=16M").unwrap();
    let set = ReactorSet::start(config(1, "classic"), move |r| {
        r.attach(&device, 8)?;
        Ok(())
    })
    .unwrap();
    let h = &set.handles()[0];
    assert_eq!(drive(h, 64, 8, write_block, succeeded), 0);
    let (tx, rx) = crossbeam_channel::bounded(2);
    h.send(move |r, _| {
        let tx2 = tx.clone();
        r.write_zeroes(DeviceId::FIRST, 0, 8 * 32, move |_, _, done| {
            tx.send(done.result).unwrap()
        })
        .unwrap();
        r.deallocate(DeviceId::FIRST, 8 * 32, 8 * 32, move |_, _, done| {
            tx2.send(done.result).unwrap()
        })
        .unwrap();
    })
    .unwrap();
    for _ in 0..2 {
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), Ok(()));
    }
    // Every block now reads back as zeroes.
    fn zeroed(_: u64, done: &IoDone) -> bool {
        done.result.is_ok()
            && done
                .buf
                .as_deref()
                .is_some_and(|b| b.iter().all(|&x| x == 0))
    }
    assert_eq!(drive(h, 64, 8, read_block, zeroed), 0);
    assert!(set.shutdown().panics.is_empty());
}

/// Counts its polls and removes itself after `limit`.
struct Countdown {
    polls: Arc<AtomicU64>,
    limit: u64,
    /// Its own id, known once `add_poller` returned.
    id: Rc<std::cell::Cell<Option<hypoll_reactor::PollerId>>>,
}

impl hypoll_reactor::Poller for Countdown {
    fn poll(&mut self, r: &mut Reactor, _: &mut ()) -> usize {
        let n = self.polls.fetch_add(1, Ordering::SeqCst) + 1;
        if n == self.limit {
            r.remove_poller(self.id.get().expect("id set after adding"));
        }
        1
    }
}

#[test]
fn pollers_run_every_turn_until_removed_even_from_inside_poll() {
    let _serial = serial();
    let set = ReactorSet::start(config(1, "classic"), |_| Ok(())).unwrap();
    let polls = Arc::new(AtomicU64::new(0));
    let counter = polls.clone();
    wait_for("the first park", || {
        set.handles()[0].stats().counters.parks > 0
    });
    let parks_before = set.handles()[0].stats().counters.parks;
    set.handles()[0]
        .send(move |r, _| {
            // Removed from outside before it ever runs.
            let never = r
                .add_poller(Box::new(Countdown {
                    polls: Arc::new(AtomicU64::new(0)),
                    limit: 1,
                    id: Rc::default(),
                }))
                .unwrap();
            r.remove_poller(never);
            let slot = Rc::new(std::cell::Cell::new(None));
            let id = r
                .add_poller(Box::new(Countdown {
                    polls: counter,
                    limit: 1_000,
                    id: slot.clone(),
                }))
                .unwrap();
            slot.set(Some(id));
        })
        .unwrap();
    wait_for("1000 polls", || polls.load(Ordering::SeqCst) >= 1_000);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        polls.load(Ordering::SeqCst),
        1_000,
        "removed from inside its own poll"
    );
    // With its poller gone the reactor parks again.
    let h = &set.handles()[0];
    wait_for("a park after the poller left", || {
        h.stats().counters.parks > parks_before
    });
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn a_panic_in_an_io_callback_is_reported() {
    let _serial = serial();
    let device = Device::open("null").unwrap();
    let set = ReactorSet::start(config(1, "classic"), move |r| {
        r.attach(&device, 8)?;
        Ok(())
    })
    .unwrap();
    let h = set.handles()[0].clone();
    h.send(|r, _| {
        r.flush(DeviceId::FIRST, |_, _, _| panic!("callback exploded"))
            .unwrap();
    })
    .unwrap();
    wait_for("the reactor to die", || set.finished().contains(&h.core()));
    let report = set.shutdown();
    assert_eq!(report.panics.len(), 1);
    assert!(report.panics[0].message.contains("callback exploded"));
    assert!(
        h.cpu_ns().is_some(),
        "CPU time stays readable, frozen at exit"
    );
}

#[test]
fn refresh_now_ns_restamps_the_turn_after_a_wait() {
    let _serial = serial();
    let set = ReactorSet::start(config(1, "classic"), |_| Ok(())).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    set.handles()[0]
        .send(move |r, _| {
            let before_ns = r.now_ns();
            std::thread::sleep(Duration::from_millis(5));
            // Still the turn's timestamp until refreshed.
            let stale_ns = r.now_ns();
            let fresh_ns = r.refresh_now_ns();
            tx.send((before_ns, stale_ns, fresh_ns, r.now_ns()))
                .unwrap();
        })
        .unwrap();
    let (before_ns, stale_ns, fresh_ns, now_ns) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(stale_ns, before_ns);
    assert!(
        fresh_ns >= before_ns + 5_000_000,
        "{before_ns} -> {fresh_ns}"
    );
    assert_eq!(now_ns, fresh_ns);
    assert!(set.shutdown().panics.is_empty());
}

/// Each reactor's state is its own: messages, timers, pollers and I/O callbacks on a
/// reactor are all handed `&mut` to the one its `init` made, and the exit hook's value for
/// each reactor comes back from `shutdown`.
#[test]
fn each_reactor_has_its_own_state_handed_to_everything_and_returned_at_exit() {
    struct Tally {
        index: usize,
        messages: u64,
        timers: u64,
        polls: u64,
        ios: u64,
    }
    struct CountPolls;
    impl hypoll_reactor::Poller<Tally> for CountPolls {
        fn poll(&mut self, _r: &mut Reactor<Tally>, tally: &mut Tally) -> usize {
            tally.polls += 1;
            0
        }
    }
    let cores = allowed_cores().unwrap();
    let cores: Vec<usize> = cores.iter().copied().cycle().take(2).collect();
    let cfg = ReactorConfig {
        cores: Some(CoreList::new(cores)),
        ..ReactorConfig::default()
    };
    let device = Device::open("null").unwrap();
    let set = ReactorSet::start_with_exit(
        cfg,
        move |r: &mut Reactor<Tally>| {
            r.attach(&device, 8)?;
            r.add_poller(Box::new(CountPolls))?;
            Ok(Tally {
                index: r.index(),
                messages: 0,
                timers: 0,
                polls: 0,
                ios: 0,
            })
        },
        |_, tally: Tally| tally,
    )
    .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    for (i, h) in set.handles().iter().enumerate() {
        // Reactor i gets i + 1 messages, each reading i + 1 blocks of 8.
        for _ in 0..=i {
            let tx = tx.clone();
            h.send(move |r, tally| {
                tally.messages += 1;
                r.after(Duration::from_millis(1), move |r, tally| {
                    tally.timers += 1;
                    r.read(
                        DeviceId::FIRST,
                        0,
                        8,
                        IoBuf::zeroed(4096),
                        move |_, tally, done| {
                            assert!(done.result.is_ok());
                            tally.ios += 1;
                            tx.send(()).unwrap();
                        },
                    )
                    .unwrap();
                });
            })
            .unwrap();
        }
    }
    for _ in 0..3 {
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
    }
    let report = set.shutdown();
    assert!(report.panics.is_empty());
    let mut tallies: Vec<&Tally> = report.exits.iter().map(|e| &e.output).collect();
    tallies.sort_by_key(|t| t.index);
    assert_eq!(tallies.len(), 2);
    for (i, t) in tallies.iter().enumerate() {
        assert_eq!(t.index, i, "each reactor's own state comes back");
        let n = i as u64 + 1;
        assert_eq!((t.messages, t.timers, t.ios), (n, n, n), "reactor {i}");
        assert!(t.polls > 0, "its poller was handed its state");
    }
}

#[test]
fn a_function_asked_for_by_callbacks_runs_once_after_their_batch() {
    let _serial = serial();
    let device = Device::open("null").unwrap();
    let set = ReactorSet::start(config(1, "classic"), move |r| {
        r.attach(&device, 16)?;
        Ok(Vec::<String>::new())
    })
    .unwrap();
    /// Tells what ran, in order.
    fn after(_: &mut Reactor<Vec<String>>, log: &mut Vec<String>) {
        log.push("after".to_string());
    }
    fn done(r: &mut Reactor<Vec<String>>, log: &mut Vec<String>, io: IoDone) {
        assert!(r.after_completions(after));
        log.push(format!("io {}", io.user));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    set.handles()[0]
        .send(move |r, log| {
            // Outside a batch nothing is asked for: the caller does the work itself.
            assert!(!r.after_completions(after));
            for i in 0..8 {
                let req = IoRequest::new(IoOp::Read, i * 8, 8).with_user(i);
                r.submit(DeviceId::FIRST, req, Some(IoBuf::zeroed(4096)), done)
                    .map_err(|e| e.reason)
                    .unwrap();
            }
            log.clear();
        })
        .unwrap();
    wait_for("the batch", || {
        let tx = tx.clone();
        set.handles()[0]
            .send(move |_, log| tx.send(log.clone()).unwrap())
            .unwrap();
        rx.recv().unwrap().len() == 9
    });
    set.handles()[0]
        .send(move |_, log| tx.send(log.clone()).unwrap())
        .unwrap();
    let log = rx.recv().unwrap();
    // `null` completes all eight in the next turn's reap: one batch, then `after` once.
    let ios: Vec<String> = (0..8).map(|i| format!("io {i}")).collect();
    assert_eq!(log[..8], ios[..]);
    assert_eq!(log[8], "after");
    assert!(set.shutdown().panics.is_empty());
}
