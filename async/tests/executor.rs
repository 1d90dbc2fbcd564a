//! The executor on real reactors: spawning from a thread and from tasks, join handles
//! across reactors, wakes from other threads while the reactor parks, panics, closing.

mod common;

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use common::{serial, start, wait_for, App};
use hypoll_async::{yield_now, JoinError, SpawnExt};

/// A flag another thread sets: the simplest future woken from off the reactor.
#[derive(Default)]
struct Flag {
    state: Mutex<(bool, Option<Waker>)>,
}

impl Flag {
    fn set(&self) {
        let waker = {
            let mut state = self.state.lock().unwrap();
            state.0 = true;
            state.1.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    fn wait(self: Arc<Self>) -> impl Future<Output = ()> {
        FlagSet(self)
    }
}

struct FlagSet(Arc<Flag>);

impl Future for FlagSet {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut state = self.0.state.lock().unwrap();
        if state.0 {
            return Poll::Ready(());
        }
        state.1 = Some(cx.waker().clone());
        Poll::Pending
    }
}

#[test]
fn a_task_spawned_from_a_thread_runs_on_its_reactor_and_its_result_comes_back() {
    let _serial = serial();
    let set = start(1, None);
    let handle = set.handles()[0].clone();
    let core = handle.core();
    // The future holds an `Rc`: it is built on the reactor, never sent.
    let task = handle
        .spawn(move |io| async move {
            let shared = Rc::new(Cell::new(40));
            yield_now().await;
            shared.set(shared.get() + 2);
            let on = io.with(|r, _| r.core());
            (shared.get(), on)
        })
        .unwrap();
    assert_eq!(task.wait(), Ok((42, core)));
    let report = set.shutdown();
    assert!(report.panics.is_empty());
}

#[test]
fn a_task_awaits_the_join_handle_of_a_task_on_another_reactor() {
    let _serial = serial();
    let set = start(2, None);
    let handles = set.handles().clone();
    if handles.len() < 2 {
        eprintln!("needs 2 cores");
        return;
    }
    let other = handles[1].clone();
    let task = handles[0]
        .spawn(move |_io| async move {
            let far = other.spawn(|io| async move { io.with(|r, _| r.index()) });
            far.unwrap().await
        })
        .unwrap();
    assert_eq!(task.wait(), Ok(Ok(1)));
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn a_task_that_spawns_thousands_of_tasks_joins_them_all() {
    let _serial = serial();
    let set = start(1, None);
    let task = set.handles()[0]
        .spawn(|io| async move {
            let mut joins = Vec::new();
            for i in 0..5_000u64 {
                joins.push(
                    io.spawn_local(async move {
                        yield_now().await;
                        i
                    })
                    .unwrap(),
                );
            }
            let peak = io.tasks();
            let mut sum = 0;
            for join in joins {
                sum += join.await.unwrap();
            }
            (sum, peak, io.tasks())
        })
        .unwrap();
    let (sum, peak, after) = task.wait().unwrap();
    assert_eq!(sum, (0..5_000u64).sum::<u64>());
    assert_eq!(peak, 5_001, "every child alive at once, with the parent");
    assert_eq!(after, 1, "the children left the registry as they ended");
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn a_spawn_past_the_task_limit_is_refused() {
    let _serial = serial();
    let set = ReactorSetWithLimit::start(3);
    let task = set.handles()[0]
        .spawn(|io| async move {
            let a = io.spawn_local(std::future::pending::<()>());
            let b = io.spawn_local(std::future::pending::<()>());
            let c = io.spawn_local(std::future::pending::<()>());
            (a.is_ok(), b.is_ok(), c.err())
        })
        .unwrap();
    let (a, b, c) = task.wait().unwrap();
    assert!(a && b);
    assert_eq!(c, Some(hypoll_async::SpawnError::TooManyTasks { max: 3 }));
    assert!(set.shutdown().panics.is_empty());
}

/// A set whose executors run at most `tasks_max` tasks.
struct ReactorSetWithLimit;

impl ReactorSetWithLimit {
    fn start(tasks_max: usize) -> hypoll_reactor::ReactorSet<App> {
        let cfg = hypoll_async::ExecutorConfig::default().with_tasks_max(tasks_max);
        hypoll_reactor::ReactorSet::start(common::config(1), move |r| {
            Ok(App {
                executor: hypoll_async::Executor::install_with(r, cfg)?,
                device: None,
            })
        })
        .unwrap()
    }
}

#[test]
fn a_panic_in_a_task_ends_that_task_only() {
    let _serial = serial();
    let set = start(1, None);
    let h = set.handles()[0].clone();
    let survivor = h
        .spawn(|io| async move {
            for _ in 0..3 {
                io.sleep(Duration::from_millis(5)).await;
            }
            "still here"
        })
        .unwrap();
    let doomed = h
        .spawn(|_io| async move {
            yield_now().await;
            if true {
                panic!("boom");
            }
        })
        .unwrap();
    assert_eq!(
        doomed.wait(),
        Err(JoinError::Panicked {
            message: "boom".to_string()
        })
    );
    assert_eq!(survivor.wait(), Ok("still here"));
    // A panic in a task awaited by another task reaches it as an error too.
    let parent = h
        .spawn(|io| async move {
            let child = io.spawn_local(async { panic!("child") }).unwrap();
            child.await
        })
        .unwrap();
    assert!(matches!(parent.wait(), Ok(Err(JoinError::Panicked { .. }))));
    // A panic while the future is being built, on the reactor, is the task's too.
    let unbuilt = h.spawn(|_io| -> std::future::Ready<()> { panic!("no future") });
    assert!(matches!(
        unbuilt.unwrap().wait(),
        Err(JoinError::Panicked { message }) if message == "no future"
    ));
    let counters = h.spawn(|io| async move { io.counters() }).unwrap().wait();
    assert_eq!(counters.unwrap().panics, 2);
    let report = set.shutdown();
    assert!(report.panics.is_empty(), "the reactor went on");
}

/// The race every parked reactor must close: a task woken from another thread just as the
/// reactor parks must still run. Each round waits until the reactor has parked (or is
/// about to), then wakes the task after a varying delay, and needs the task to finish
/// within a second.
#[test]
fn a_wake_from_another_thread_while_the_reactor_parks_is_never_lost() {
    let _serial = serial();
    let set = start(1, None);
    let h = set.handles()[0].clone();
    for round in 0..300u64 {
        let flag = Arc::new(Flag::default());
        let waiting = flag.clone();
        // Read before the spawn: the reactor parks after taking it.
        let parks = h.stats().counters.parks;
        let task = h.spawn(move |_io| waiting.wait()).unwrap();
        // Half the rounds wake once the reactor is parked for sure; the others wake at
        // once, or after a few microseconds, around its spin-then-park.
        if round % 2 == 0 {
            wait_for("the reactor to park", || h.stats().counters.parks > parks);
        } else {
            let until = Instant::now() + Duration::from_micros(round % 97);
            while Instant::now() < until {}
        }
        flag.set();
        let t0 = Instant::now();
        while !task.is_finished() {
            assert!(
                t0.elapsed() < Duration::from_secs(1),
                "round {round}: a wake from another thread was lost"
            );
            std::thread::yield_now();
        }
        task.wait().unwrap();
    }
    let stats = h.stats();
    assert!(stats.counters.parks >= 150, "{:?}", stats.counters);
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn stopping_the_reactor_cancels_blocked_tasks_on_its_thread() {
    let _serial = serial();
    let set = start(1, None);
    let h = set.handles()[0].clone();
    /// Tells, when dropped, which thread dropped it.
    struct Tell(Arc<Mutex<Option<String>>>);
    impl Drop for Tell {
        fn drop(&mut self) {
            let name = std::thread::current().name().map(str::to_string);
            *self.0.lock().unwrap() = Some(name.unwrap_or_default());
        }
    }
    let dropped_on = Arc::new(Mutex::new(None));
    let tell = Tell(dropped_on.clone());
    let blocked = h
        .spawn(move |_io| async move {
            let _tell = tell;
            std::future::pending::<()>().await
        })
        .unwrap();
    wait_for("the task to start", || {
        h.spawn(|io| async move { io.tasks() }).unwrap().wait() == Ok(2)
    });
    let report = set.shutdown();
    assert!(report.panics.is_empty());
    assert_eq!(blocked.wait(), Err(JoinError::Cancelled));
    let name = dropped_on
        .lock()
        .unwrap()
        .clone()
        .expect("the future was dropped");
    assert!(name.starts_with("hypoll-r"), "dropped on {name:?}");
}
