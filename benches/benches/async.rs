//! What `async` costs over callbacks: 4 KiB reads on `null` at queue depth 1 and 128, on
//! one reactor, through completion callbacks and through tasks awaiting I/O futures, side
//! by side in one run: the difference is what the executor and the futures add per I/O
//! (figures and the budget in docs/results.md).
//!
//! `cargo bench -p hypoll-benches --bench async`

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use crossbeam_channel::Sender;
use hypoll_async::{Executor, HasExecutor, Local};
use hypoll_nvme::{monotonic_ns, IoBuf};
use hypoll_reactor::{
    allowed_cores, CoreList, Device, DeviceId, IoDone, Reactor, ReactorConfig, ReactorHandle,
    ReactorSet,
};

/// The reactor's state: its executor, and the callback path's run in progress.
struct Bench {
    executor: Executor<Bench>,
    /// I/Os still to submit.
    to_submit: u64,
    started_ns: u64,
    report: Option<Sender<u64>>,
}

impl HasExecutor for Bench {
    fn executor(&self) -> &Executor<Bench> {
        &self.executor
    }
}

/// The callback path, as the reactor bench runs it: each completion resubmits the same
/// buffer until the budget is spent.
fn resubmit(r: &mut Reactor<Bench>, run: &mut Bench, done: IoDone) {
    assert!(done.result.is_ok(), "null I/O failed: {:?}", done.result);
    let buf = done.buf.expect("a read returns its buffer");
    if run.to_submit > 0 {
        run.to_submit -= 1;
        let slba = (done.user * 8) % (1 << 20);
        r.read(DeviceId::FIRST, slba, 8, buf, resubmit)
            .expect("the slot just freed has room");
    } else if r.outstanding() == 0 {
        let elapsed_ns = r.now_ns() - run.started_ns;
        if let Some(tx) = run.report.take() {
            tx.send(elapsed_ns).expect("bench thread waits");
        }
    }
}

fn run_callbacks(h: &ReactorHandle<Bench>, ios: u64, qd: u64) -> Duration {
    let (tx, rx) = crossbeam_channel::bounded(1);
    h.send(move |r, run| {
        let first = qd.min(ios);
        run.to_submit = ios - first;
        run.report = Some(tx);
        run.started_ns = monotonic_ns();
        for i in 0..first {
            r.read(DeviceId::FIRST, i * 8, 8, IoBuf::zeroed(4096), resubmit)
                .expect("depth 128 queue");
        }
    })
    .expect("reactor accepts the workload");
    Duration::from_nanos(rx.recv().expect("workload reports"))
}

/// What the tasks of one async run share.
struct Shared {
    /// I/Os still to submit, taken one at a time by whichever task is free.
    to_submit: Cell<u64>,
    /// Tasks still running.
    live: Cell<u64>,
    started_ns: u64,
    report: Sender<u64>,
}

/// The async path: each of `qd` tasks reads in a loop, one I/O in flight at a time, until
/// the budget is spent; the last one out reports.
async fn reader(io: Local<Bench>, shared: Rc<Shared>, first_slba: u64) {
    let mut buf = IoBuf::zeroed(4096);
    let mut slba = first_slba;
    while shared.to_submit.get() > 0 {
        shared.to_submit.set(shared.to_submit.get() - 1);
        buf = io
            .read(DeviceId::FIRST, slba, 8, buf)
            .await
            .expect("null I/O succeeds");
        slba = (slba + 8 * 128) % (1 << 20);
    }
    shared.live.set(shared.live.get() - 1);
    if shared.live.get() == 0 {
        let elapsed_ns = monotonic_ns() - shared.started_ns;
        shared.report.send(elapsed_ns).expect("bench thread waits");
    }
}

fn run_tasks(h: &ReactorHandle<Bench>, ios: u64, qd: u64) -> Duration {
    let (tx, rx) = crossbeam_channel::bounded(1);
    h.send(move |_r, state| {
        let tasks = qd.min(ios);
        let shared = Rc::new(Shared {
            to_submit: Cell::new(ios),
            live: Cell::new(tasks),
            started_ns: monotonic_ns(),
            report: tx,
        });
        let io = state.executor.local();
        for i in 0..tasks {
            let task = reader(io.clone(), shared.clone(), i * 8);
            drop(io.spawn_local(task).expect("room for the tasks"));
        }
    })
    .expect("reactor accepts the workload");
    Duration::from_nanos(rx.recv().expect("workload reports"))
}

fn callbacks_vs_tasks(c: &mut Criterion) {
    let core = allowed_cores().expect("allowed cores")[0];
    let device = Device::open("null").expect("null device");
    let cfg = ReactorConfig {
        cores: Some(CoreList::new(vec![core])),
        ..ReactorConfig::default()
    };
    let set = ReactorSet::start(cfg, move |r| {
        r.attach(&device, 128)?;
        Ok(Bench {
            executor: Executor::install(r)?,
            to_submit: 0,
            started_ns: 0,
            report: None,
        })
    })
    .expect("reactor starts");
    let h = set.handles()[0].clone();
    let mut group = c.benchmark_group("null 4KiB read");
    group.throughput(Throughput::Elements(1));
    for qd in [1u64, 128] {
        group.bench_function(format!("callback/qd{qd}"), |b| {
            b.iter_custom(|iters| run_callbacks(&h, iters, qd))
        });
        group.bench_function(format!("async/qd{qd}"), |b| {
            b.iter_custom(|iters| run_tasks(&h, iters, qd))
        });
    }
    group.finish();
    let report = set.shutdown();
    assert!(report.panics.is_empty());
}

criterion_group!(benches, callbacks_vs_tasks);
criterion_main!(benches);
