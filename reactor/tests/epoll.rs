//! What a reactor thread's waits need the real kernel for: a device's interrupt line (an
//! io_uring file's eventfd, the emulator's) does not wake a parked reactor over and over,
//! ends an interruptible sleep, and an interruptible sleep with nothing to end it runs its
//! course (epoll's timeout). Only the reactor's own thread's CPU and counters are
//! measured, so these hold beside other tests on a busy machine; but they run one after
//! another, in one test: each pins its reactor to the first allowed core, and a reactor
//! that shares its core with another scenario's spinning one can be descheduled past a
//! completion it was meant to wait for. How the policies wait, and what it costs them,
//! `waits.rs` checks in virtual time.

mod support;

use std::time::{Duration, Instant};

use hypoll_reactor::{Device, ReactorConfig, ReactorSet, ReactorStats};
use support::{
    config, drive, matches_pattern, read_block, sleep_interruptibly_counted, succeeded, wait_for,
    write_block,
};

/// Drives 200 writes through a reactor thread under `policy` on `spec`, lets it park, and
/// checks that over `idle` parked it used under 1 % of a core, and that a message still
/// wakes it. The CPU is the reactor thread's own: a busy machine does not add to it.
fn parked_after_io(spec: &str, policy: &str, idle: Duration) {
    let device = Device::open(spec).unwrap();
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
    std::thread::sleep(idle);
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

fn a_parked_reactor_on_an_io_uring_file_uses_under_1_percent_of_a_core() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("disk.img");
    std::fs::write(&file, vec![0u8; 1 << 20]).unwrap();
    // After real I/O, idle means parked: `classic` polls every completion, which on io_uring
    // still counts on the ring's eventfd, a line the parked reactor listens on (it once woke
    // the reactor at once, park after park).
    let spec = format!("uring:{},direct=0,lba=512", file.display());
    parked_after_io(&spec, "classic", Duration::from_secs(2));
}

fn a_parked_reactor_on_an_emulated_device_uses_under_1_percent_of_a_core() {
    // The emulator's interrupt line is an eventfd too; `adaptive` waits on it while I/O is
    // in flight.
    parked_after_io("emu:nand,size=64M", "adaptive", Duration::from_secs(5));
}

/// Writes then reads back `count` blocks at QD 1 on `device` on a reactor thread under a
/// policy that sleeps interruptibly for `sleep` once per I/O. Returns the reactor's
/// statistics, how many sleeps the policy asked for, and how many completions it was told
/// came after an interrupt.
fn sleep_interruptibly_on_a_thread(
    device: &str,
    sleep: Duration,
    count: u64,
) -> (ReactorStats, u64, u64) {
    let (policy, asked, after_interrupt) = sleep_interruptibly_counted(sleep);
    let cfg = ReactorConfig {
        custom_policy: Some(policy),
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
        asked.load(std::sync::atomic::Ordering::Relaxed),
        after_interrupt.load(std::sync::atomic::Ordering::Relaxed),
    )
}

fn a_completion_ends_an_interruptible_sleep() {
    // 1 s asked, 300 us device: the completion's interrupt ends every sleep (100 I/Os
    // would otherwise take 100 s), each is an interrupt wait, and the policy hears that its
    // completion was seen after one. An I/O the reactor found complete before it asked the
    // policy (its thread held off the core for the device's 300 us) asks for no sleep.
    let start = Instant::now();
    let dev = "emu:nand,size=16M,read_us=300,write_us=300";
    let (stats, asked, after_interrupt) =
        sleep_interruptibly_on_a_thread(dev, Duration::from_secs(1), 50);
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(stats.counters.ios, 100);
    assert_eq!(stats.counters.sleeps, 0, "{:?}", stats.counters);
    assert_eq!(
        stats.counters.interrupt_waits, asked,
        "every sleep asked for is an interrupt wait: {:?}",
        stats.counters
    );
    assert!(asked >= 90, "{asked} of 100 I/Os asked for a sleep");
    assert!(
        after_interrupt >= 90,
        "{after_interrupt} of 100 seen after an interrupt"
    );
}

fn an_interruptible_sleep_that_runs_its_course_is_the_ios_one_sleep() {
    // 50 us asked, 2 ms device: a sleep ends at its deadline (epoll's timeout), counts as
    // the I/O's one sleep and measures its overshoot, never as an interrupt wait. How many
    // I/Os sleep depends on the machine (one that completed before the reactor got to
    // decide had none); `waits.rs` counts them exactly in virtual time.
    let dev = "emu:nand,size=16M,read_us=2000,write_us=2000,tail_pct=0";
    let (stats, _asked, after_interrupt) =
        sleep_interruptibly_on_a_thread(dev, Duration::from_micros(50), 50);
    assert_eq!(stats.counters.ios, 100);
    assert!(stats.counters.sleeps > 0, "{:?}", stats.counters);
    assert_eq!(stats.counters.interrupt_waits, 0, "{:?}", stats.counters);
    assert_eq!(after_interrupt, 0);
    assert!(stats.overshoot_mean_ns().is_some());
}

#[test]
fn the_reactor_threads_waits_on_the_kernel_one_scenario_at_a_time() {
    a_parked_reactor_on_an_io_uring_file_uses_under_1_percent_of_a_core();
    a_parked_reactor_on_an_emulated_device_uses_under_1_percent_of_a_core();
    a_completion_ends_an_interruptible_sleep();
    an_interruptible_sleep_that_runs_its_course_is_the_ios_one_sleep();
}
