//! What a reactor thread's turn runs: messages in order (within and across reactors, a
//! full mailbox refused), timers on a parked reactor, pollers until removed, functions after
//! a batch of completions, and a timestamp a poller can refresh.

mod support;

use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hypoll_nvme::{monotonic_ns, IoBuf};
use hypoll_reactor::{
    Device, DeviceId, IoDone, IoOp, IoRequest, Reactor, ReactorConfig, ReactorSet, SendError,
};
use support::{config, wait_for};

#[test]
fn messages_arrive_in_order_within_and_across_reactors() {
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
    let cfg = ReactorConfig {
        mailbox_capacity: 4,
        ..config(1, "classic")
    };
    let set = ReactorSet::start(cfg, |_| Ok(())).unwrap();
    let h = &set.handles()[0];
    let (block_tx, block_rx) = crossbeam_channel::bounded::<()>(0);
    let (stuck_tx, stuck_rx) = crossbeam_channel::bounded::<()>(1);
    h.send(move |_, _| {
        stuck_tx.send(()).unwrap();
        let _ = block_rx.recv_timeout(Duration::from_secs(10));
    })
    .unwrap();
    // Once the reactor is stuck in that message (taken from the mailbox), 4 more fit.
    stuck_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let results: Vec<_> = (0..10).map(|_| h.send(|_, _| {})).collect();
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 4);
    assert!(results[4..].iter().all(|r| *r == Err(SendError::Full)));
    block_tx.send(()).unwrap();
    assert!(set.shutdown().panics.is_empty());
}

/// On a reactor thread, timers wake a parked reactor (its timerfd: nothing else would), in
/// deadline order and never early, and a cancelled periodic timer stops. How late they may
/// be, and how regular a periodic one is, `waits.rs` checks in virtual time.
#[test]
fn timers_fire_in_order_never_early_even_on_a_parked_reactor() {
    let set = ReactorSet::start(config(1, "classic"), |_| Ok(())).unwrap();
    let h = &set.handles()[0];
    wait_for("the first park", || h.stats().counters.parks > 0);
    let fired = Arc::new(Mutex::new(Vec::new()));
    let sink = fired.clone();
    let started = Arc::new(AtomicU64::new(0));
    let start_ns = started.clone();
    h.send(move |r, _| {
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
        assert!(
            at_ns >= t0 + delay_ms * 1_000_000,
            "{delay_ms} ms timer fired {} ns early",
            t0 + delay_ms * 1_000_000 - at_ns
        );
    }
    drop(fired);

    // A periodic timer, then cancelled.
    let ticks = Arc::new(AtomicU64::new(0));
    let t = ticks.clone();
    let (id_tx, id_rx) = crossbeam_channel::bounded(1);
    h.send(move |r, _| {
        let id = r.every(Duration::from_millis(2), move |_, _| {
            t.fetch_add(1, Ordering::SeqCst);
        });
        id_tx.send(id).unwrap();
    })
    .unwrap();
    let id = id_rx.recv().unwrap();
    wait_for("3 ticks", || ticks.load(Ordering::SeqCst) >= 3);
    let (done_tx, done_rx) = crossbeam_channel::bounded(1);
    h.send(move |r, _| done_tx.send(r.cancel_timer(id)).unwrap())
        .unwrap();
    assert!(done_rx.recv().unwrap(), "the periodic timer was live");
    let n = ticks.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(ticks.load(Ordering::SeqCst), n, "no ticks after cancel");
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
fn refresh_now_ns_restamps_the_turn_after_a_wait() {
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

#[test]
fn a_function_asked_for_by_callbacks_runs_once_after_their_batch() {
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
