//! The step API: a reactor with no thread of its own, driven from the test's thread with
//! `poll` and `idle`, as an embedder's own loop drives it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use hypoll_reactor::{Device, IoBuf, Reactor, ReactorTuning, SendError, StandaloneConfig};

/// Longest any test here waits for something that should take microseconds.
const PATIENCE: Duration = Duration::from_secs(10);

#[derive(Default)]
struct State {
    messages: u64,
    callbacks: u64,
    ok: u64,
}

/// Turns `r` until `done` holds, idling after every turn that found nothing.
fn drive(r: &mut Reactor<State>, state: &mut State, done: impl Fn(&State) -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !done(state) {
        assert!(Instant::now() < deadline, "not done after {PATIENCE:?}");
        if r.poll(state) == 0 {
            r.idle();
        }
    }
}

#[test]
fn a_reactor_driven_by_hand_runs_messages_and_io() {
    let (mut r, handle) = Reactor::<State>::standalone(StandaloneConfig::default()).unwrap();
    let dev = r.attach(&Device::open("null").unwrap(), 8).unwrap();
    let mut state = State::default();
    // From another thread, a message that submits eight reads.
    let sender = handle.clone();
    std::thread::spawn(move || {
        sender
            .send(move |r, s| {
                s.messages += 1;
                for lba in 0..8 {
                    let read = r.read(dev, lba, 1, IoBuf::zeroed(4096), |_, s: &mut State, d| {
                        s.callbacks += 1;
                        s.ok += u64::from(d.result.is_ok());
                    });
                    assert!(read.is_ok(), "read {lba} refused");
                }
            })
            .unwrap();
    })
    .join()
    .unwrap();
    drive(&mut r, &mut state, |s| s.callbacks == 8);
    assert_eq!((state.messages, state.ok), (1, 8));
    assert_eq!(r.counters().ios, 8);
    assert_eq!(r.outstanding(), 0);
    // One from this thread too.
    handle.send(|_, s| s.messages += 1).unwrap();
    drive(&mut r, &mut state, |s| s.messages == 2);
    assert_eq!(r.counters().messages, 2);
    assert!(r.counters().polls > 0);

    let report = r.shut_down(&mut state);
    assert_eq!((report.drained_ios, report.failed_ios), (0, 0));
    assert_eq!(report.stats.counters.ios, 8);
    assert_eq!(
        handle.send(|_, s| s.messages += 1).unwrap_err(),
        SendError::Stopped
    );
    // Shut down: turns do nothing, a second shutdown reports again.
    assert_eq!(r.poll(&mut state), 0);
    r.idle();
    assert_eq!(r.shut_down(&mut state).failed_ios, 0);
}

#[test]
fn an_idle_step_that_parks_wakes_for_a_message_from_another_thread() {
    let cfg = StandaloneConfig {
        tuning: ReactorTuning {
            idle_spin_ns: 0,
            ..ReactorTuning::default()
        },
        ..StandaloneConfig::default()
    };
    let (mut r, handle) = Reactor::<State>::standalone(cfg).unwrap();
    let mut state = State::default();
    // A lost wake-up would leave `idle` parked for good: the watchdog fails the test
    // rather than letting it hang.
    let woke = Arc::new(AtomicBool::new(false));
    let watched = woke.clone();
    std::thread::spawn(move || {
        std::thread::sleep(3 * PATIENCE);
        if !watched.load(Ordering::SeqCst) {
            eprintln!("an idle reactor missed a message: lost wake-up");
            std::process::exit(1);
        }
    });

    // A message sent once the reactor is surely parked.
    let (ack_tx, ack_rx) = mpsc::channel::<()>();
    let sender = handle.clone();
    let helper = std::thread::spawn(move || {
        let deadline = Instant::now() + PATIENCE;
        while sender.stats().counters.parks == 0 {
            assert!(Instant::now() < deadline, "the reactor never parked");
            std::thread::sleep(Duration::from_millis(1));
        }
        sender.send(|_, s| s.messages += 1).unwrap();
        // Then messages racing the park, each sent as soon as the last one ran.
        for _ in 0..200 {
            ack_rx.recv().unwrap();
            sender.send(|_, s| s.messages += 1).unwrap();
        }
    });
    assert_eq!(r.poll(&mut state), 0);
    r.idle();
    assert_eq!(r.counters().parks, 1);
    assert_eq!(r.poll(&mut state), 1, "the message that woke it runs next");
    for n in 2..=201 {
        ack_tx.send(()).unwrap();
        drive(&mut r, &mut state, |s| s.messages == n);
    }
    woke.store(true, Ordering::SeqCst);
    helper.join().unwrap();
    assert_eq!(r.counters().messages, 201);
    r.shut_down(&mut state);
}
