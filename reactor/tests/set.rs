//! A set of reactor threads: each pinned to its core, named, with 1 ns timer slack; clear
//! start errors; a panic (in a message or an I/O callback) reported, not hung; each
//! reactor's own state handed to everything it runs and returned at exit.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use hypoll_nvme::IoBuf;
use hypoll_reactor::{
    allowed_cores, thread_cores, timer_slack_ns, CoreError, CoreList, Device, DeviceId, Reactor,
    ReactorConfig, ReactorSet, SendError, StartError,
};
use support::{config, cores, wait_for};

#[test]
fn reactors_are_pinned_named_and_run_with_1ns_timer_slack() {
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
fn a_reactor_panic_is_reported_not_hung() {
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
fn a_panic_in_an_io_callback_is_reported() {
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
