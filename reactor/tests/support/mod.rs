//! What the reactor's integration tests share: cores and configs for reactor threads, a
//! wait for a condition, and a workload of I/Os that runs on a reactor thread or on a
//! reactor in virtual time ([`SimReactor`]). Each test file uses part of it.
#![allow(dead_code)]

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypoll_nvme::{IoBuf, VirtualClock};
use hypoll_reactor::sim::{SimReactor, WaitCosts};
use hypoll_reactor::{
    allowed_cores, CoreList, Device, DeviceId, IoDone, IoOp, IoRequest, PolicyFactory, Reactor,
    ReactorConfig, ReactorHandle, ReactorSet, ReactorStats, StandaloneConfig,
};

/// Up to `n` cores this process may use.
pub fn cores(n: usize) -> CoreList {
    CoreList::new(allowed_cores().unwrap().into_iter().take(n).collect())
}

pub fn config(n: usize, policy: &str) -> ReactorConfig {
    ReactorConfig {
        cores: Some(cores(n)),
        policy: policy.to_string(),
        ..ReactorConfig::default()
    }
}

/// Waits until `cond` holds, for up to 10 s.
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Builds I/O number `i` of a workload.
pub type Make = fn(u64) -> (IoRequest, Option<IoBuf>);
/// Judges the completion of I/O number `i`.
pub type Check = fn(u64, &IoDone) -> bool;

/// A message that drives `count` I/Os at queue depth `qd` on its reactor's first device:
/// `make(i)` builds I/O number `i`, `check(i, done)` judges its completion. The receiver
/// gets how many failed `check` once all completed.
pub fn workload(
    count: u64,
    qd: u64,
    make: Make,
    check: Check,
) -> (
    impl FnOnce(&mut Reactor, &mut ()) + Send + 'static,
    crossbeam_channel::Receiver<u64>,
) {
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
    let start = move |r: &mut Reactor, _: &mut ()| {
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
    };
    (start, rx)
}

/// Drives a [`workload`] on a reactor thread. Returns how many I/Os failed `check`.
pub fn drive(h: &ReactorHandle, count: u64, qd: u64, make: Make, check: Check) -> u64 {
    let (start, rx) = workload(count, qd, make, check);
    h.send(start).unwrap();
    rx.recv_timeout(Duration::from_secs(60))
        .expect("workload finished")
}

/// Drives a [`workload`] on a reactor in virtual time, for up to `limit` of it. Returns how
/// many I/Os failed `check`.
pub fn drive_virtual(
    sim: &mut SimReactor,
    count: u64,
    qd: u64,
    make: Make,
    check: Check,
    limit: Duration,
) -> u64 {
    let (start, rx) = workload(count, qd, make, check);
    sim.send(start).unwrap();
    let mut failed = None;
    let finished = sim.run_while(&mut (), limit.as_nanos() as u64, |_, _| {
        failed = rx.try_recv().ok();
        failed.is_none()
    });
    assert!(
        finished,
        "the workload did not finish in {limit:?} of virtual time"
    );
    failed.expect("finished")
}

pub fn pattern(i: u64) -> IoBuf {
    let mut b = IoBuf::zeroed(4096);
    for (j, x) in b.iter_mut().enumerate() {
        *x = (i as usize * 7 + j / 3) as u8;
    }
    b
}

pub fn write_block(i: u64) -> (IoRequest, Option<IoBuf>) {
    (IoRequest::new(IoOp::Write, i * 8, 8), Some(pattern(i)))
}

pub fn read_block(i: u64) -> (IoRequest, Option<IoBuf>) {
    (
        IoRequest::new(IoOp::Read, i * 8, 8),
        Some(IoBuf::zeroed(4096)),
    )
}

pub fn succeeded(_: u64, done: &IoDone) -> bool {
    done.result.is_ok() && done.buf.is_some()
}

pub fn matches_pattern(i: u64, done: &IoDone) -> bool {
    done.result.is_ok() && done.buf.as_deref() == Some(&pattern(i)[..])
}

/// Writes then reads back `count` 4 KiB blocks through one reactor thread under `policy`;
/// returns the reactor's final statistics.
pub fn write_then_read(device: &str, policy: &str, count: u64, qd: u64) -> ReactorStats {
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

/// A machine for reactors in virtual time: timers late by 2 to 4 us, a wait's CPU 1 us, an
/// interrupt 5 us after its completion, devices with an interrupt line, and a block with
/// nothing due lasting up to 100 ms (a stray wake-up that often).
pub const COSTS: WaitCosts = WaitCosts {
    overshoot_ns: 2_000,
    sleep_cpu_ns: 1_000,
    interrupt_ns: 5_000,
    wait_ns_max: 100_000_000,
    interrupts: true,
};

/// What one turn of a reactor in virtual time costs it (a spin is a turn).
pub const TURN_NS: u64 = 1_000;

/// A reactor in virtual time on `clock`, under `cfg`, with `device` attached on the same
/// clock (an emulated one: a spec of `emu:...`), at depth 64.
pub fn sim_reactor(cfg: StandaloneConfig, clock: &VirtualClock, device: &str) -> SimReactor {
    let mut sim = SimReactor::new(cfg, clock, COSTS, 1, TURN_NS).unwrap();
    let Ok(hypoll_nvme::DeviceConfig::Emu(emu)) = device.parse() else {
        panic!("{device}: an emulated device");
    };
    let ctrl =
        hypoll_nvme::EmuController::with_clock(emu, hypoll_nvme::Clock::Virtual(clock.clone()))
            .unwrap();
    let device = Device::new(Arc::new(ctrl));
    sim.reactor().attach(&device, 64).unwrap();
    sim
}

/// Writes then reads back `count` 4 KiB blocks through one reactor in virtual time under
/// `policy`; returns its statistics in virtual time.
pub fn write_then_read_virtual(device: &str, policy: &str, count: u64, qd: u64) -> ReactorStats {
    let cfg = StandaloneConfig {
        policy: policy.to_string(),
        ..StandaloneConfig::default()
    };
    write_then_read_virtual_with(device, cfg, count, qd)
}

/// [`write_then_read_virtual`] under a policy of the test's own.
pub fn write_then_read_virtual_with(
    device: &str,
    cfg: StandaloneConfig,
    count: u64,
    qd: u64,
) -> ReactorStats {
    let clock = VirtualClock::new(1_000_000_000);
    let mut sim = sim_reactor(cfg, &clock, device);
    let limit = Duration::from_secs(3_600);
    let failed = drive_virtual(&mut sim, count, qd, write_block, succeeded, limit);
    assert_eq!(failed, 0, "writes failed");
    let failed = drive_virtual(&mut sim, count, qd, read_block, matches_pattern, limit);
    assert_eq!(failed, 0, "reads differ");
    sim.stats()
}

/// A policy of the tests' own: one interruptible sleep of `sleep` per I/O, then spin. Counts
/// the sleeps it asks for, and the completions it is told were seen after an interrupt wait.
pub struct SleepInterruptibly {
    pub sleep: Duration,
    pub asked: Arc<AtomicU64>,
    pub after_interrupt: Arc<AtomicU64>,
}

impl hypoll_policy::PollPolicy for SleepInterruptibly {
    fn name(&self) -> &str {
        "test-sleep-interruptibly"
    }

    fn decide(&mut self, ctx: &hypoll_policy::PollContext<'_>) -> hypoll_policy::Decision {
        assert!(ctx.interrupts, "an emulated device has an interrupt here");
        if ctx.oldest.slept {
            hypoll_policy::Decision::Spin
        } else {
            self.asked.fetch_add(1, Ordering::Relaxed);
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

/// A factory of [`SleepInterruptibly`] policies, and the count of completions seen after an
/// interrupt that they share.
pub fn sleep_interruptibly(sleep: Duration) -> (PolicyFactory, Arc<AtomicU64>) {
    let (factory, _asked, after_interrupt) = sleep_interruptibly_counted(sleep);
    (factory, after_interrupt)
}

/// [`sleep_interruptibly`], with the count of sleeps the policies asked for too.
pub fn sleep_interruptibly_counted(
    sleep: Duration,
) -> (PolicyFactory, Arc<AtomicU64>, Arc<AtomicU64>) {
    let asked = Arc::new(AtomicU64::new(0));
    let after_interrupt = Arc::new(AtomicU64::new(0));
    let (asked_by, seen) = (asked.clone(), after_interrupt.clone());
    let factory = PolicyFactory::new(move |_| {
        Box::new(SleepInterruptibly {
            sleep,
            asked: asked_by.clone(),
            after_interrupt: seen.clone(),
        })
    });
    (factory, asked, after_interrupt)
}
