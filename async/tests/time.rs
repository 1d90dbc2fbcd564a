//! Time in tasks: sleeps on the reactor's timers (the reactor parks meanwhile), timeouts
//! around I/O (the I/O is not cancelled under the device), and yielding.

mod common;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use common::{serial, start};
use hypoll_async::{yield_now, Elapsed, SpawnExt};
use hypoll_reactor::{Device, DeviceId, DeviceOptions, IoBuf};

#[test]
fn a_sleeping_task_lets_its_reactor_park_and_wakes_on_time() {
    let _serial = serial();
    let set = start(1, None);
    let h = set.handles()[0].clone();
    let parks_before = h.stats().counters.parks;
    let slept = h
        .spawn(|io| async move {
            let t0 = Instant::now();
            io.sleep(Duration::from_millis(30)).await;
            t0.elapsed()
        })
        .unwrap()
        .wait()
        .unwrap();
    assert!(slept >= Duration::from_millis(30), "{slept:?}");
    assert!(slept < Duration::from_millis(500), "{slept:?}");
    assert!(
        h.stats().counters.parks > parks_before,
        "a reactor whose only task sleeps parks"
    );
    assert!(set.shutdown().panics.is_empty());
}

/// A sleep counts from its first poll, not from the start of the reactor turn that polls
/// it: here the message that spawns the task holds the turn for longer than the sleep, so a
/// deadline counted from the turn's start would already have passed when the task began.
#[test]
fn a_sleep_counts_from_its_first_poll_even_late_in_a_long_turn() {
    let _serial = serial();
    let set = start(1, None);
    let (tx, rx) = std::sync::mpsc::channel();
    set.handles()[0]
        .send(move |_r, s| {
            let io = s.executor.local();
            let task = async move {
                let t0 = Instant::now();
                io.sleep(Duration::from_millis(30)).await;
                tx.send(t0.elapsed()).unwrap();
            };
            drop(s.executor.spawn_local(task).unwrap());
            // The rest of the turn's work, after the spawn and before its executor runs.
            std::thread::sleep(Duration::from_millis(100));
        })
        .unwrap();
    let slept = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(slept >= Duration::from_millis(30), "{slept:?}");
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn a_timeout_drops_a_slow_read_which_still_completes_under_the_device() {
    let _serial = serial();
    // The device is configured (`read_us`) so that every read outlasts the timeout below.
    let device = Device::open("emu:nand,size=16M,read_us=20000,jitter=0,tail_pct=0").unwrap();
    let set = start(1, Some((device, DeviceOptions::new(4))));
    let h = set.handles()[0].clone();
    let (outcome, in_flight_after, fast) = h
        .spawn(|io| async move {
            let slow = io.read(DeviceId::FIRST, 0, 8, IoBuf::zeroed(4096));
            let outcome = io.timeout(Duration::from_millis(2), slow).await.map(|_| ());
            let in_flight_after = io.ios_in_flight();
            // Given time, a read completes inside its limit.
            let read = io.read(DeviceId::FIRST, 8, 8, IoBuf::zeroed(4096));
            let fast = io.timeout(Duration::from_secs(5), read).await;
            (outcome, in_flight_after, fast.map(|r| r.is_ok()))
        })
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(outcome, Err(Elapsed));
    assert_eq!(in_flight_after, 1, "the timed-out read is still in flight");
    assert_eq!(fast, Ok(true));
    let h2 = h.clone();
    common::wait_for("the timed-out read to complete", move || {
        h2.spawn(|io| async move { io.ios_in_flight() })
            .unwrap()
            .wait()
            == Ok(0)
    });
    let report = set.shutdown();
    assert_eq!(
        report.exits[0].stats.counters.ios, 2,
        "both reads completed"
    );
    assert_eq!(report.exits[0].failed_ios, 0);
}

#[test]
fn yielding_tasks_take_turns() {
    let _serial = serial();
    let set = start(1, None);
    let order = set.handles()[0]
        .spawn(|io| async move {
            let order = Rc::new(RefCell::new(Vec::new()));
            let mut joins = Vec::new();
            for t in 0..3 {
                let order = order.clone();
                joins.push(
                    io.spawn_local(async move {
                        for step in 0..3 {
                            order.borrow_mut().push((t, step));
                            yield_now().await;
                        }
                    })
                    .unwrap(),
                );
            }
            for join in joins {
                join.await.unwrap();
            }
            Rc::try_unwrap(order).unwrap().into_inner()
        })
        .unwrap()
        .wait()
        .unwrap();
    let expected: Vec<_> = (0..3).flat_map(|s| (0..3).map(move |t| (t, s))).collect();
    assert_eq!(order, expected, "round robin, one step each");
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn a_sleep_dropped_early_holds_neither_its_task_nor_the_shutdown() {
    let _serial = serial();
    let set = start(1, None);
    let h = set.handles()[0].clone();
    let elapsed = h
        .spawn(|io| async move {
            let t0 = Instant::now();
            // The long sleep loses the race and is dropped (its timer cancelled).
            let never = io.sleep(Duration::from_secs(3600));
            let quick = io.timeout(Duration::from_millis(5), never).await;
            assert_eq!(quick, Err(Elapsed));
            t0.elapsed()
        })
        .unwrap()
        .wait()
        .unwrap();
    assert!(elapsed < Duration::from_secs(1));
    // Shutdown does not wait for the hour-long timer.
    let t0 = Instant::now();
    assert!(set.shutdown().panics.is_empty());
    assert!(t0.elapsed() < Duration::from_secs(5));
}
