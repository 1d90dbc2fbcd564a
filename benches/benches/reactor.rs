//! Reactor costs: the cross-reactor message round trip, and the single-core I/O rate on the
//! `null` device at queue depth 1, 32 and 128 (the framework's own cost per I/O: SPDK's
//! budget is 100 ns, hypoll's target is at least 5 M I/Os per second per core at depth 128).
//!
//! `cargo bench -p hypoll-benches --bench reactor`

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use crossbeam_channel::Sender;
use hypoll_nvme::{monotonic_ns, IoBuf};
use hypoll_reactor::{
    allowed_cores, CoreList, Device, DeviceId, IoDone, Reactor, ReactorConfig, ReactorHandle,
    ReactorSet,
};

/// Each reactor's state: the run in progress.
#[derive(Default)]
struct Run {
    /// I/Os still to submit.
    to_submit: u64,
    /// Pings still to send.
    pings_left: u64,
    /// When the run started, and where to report its elapsed time.
    started_ns: u64,
    report: Option<Sender<u64>>,
}

/// Completion callback of the I/O-rate workload: resubmits the same buffer until the budget
/// is spent, then reports the elapsed time once the last I/O is in. Captures nothing, so the
/// reactor boxes it without allocating.
fn resubmit(r: &mut Reactor<Run>, run: &mut Run, done: IoDone) {
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

/// Runs `ios` 4 KiB reads on null at depth `qd` on the reactor; returns the elapsed time.
fn run_ios(h: &ReactorHandle<Run>, ios: u64, qd: u64) -> Duration {
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

fn io_rate(c: &mut Criterion) {
    let core = allowed_cores().expect("allowed cores")[0];
    let device = Device::open("null").expect("null device");
    let cfg = ReactorConfig {
        cores: Some(CoreList::new(vec![core])),
        ..ReactorConfig::default()
    };
    let set = ReactorSet::start(cfg, move |r| {
        r.attach(&device, 128)?;
        Ok(Run::default())
    })
    .expect("reactor starts");
    let h = set.handles()[0].clone();
    let mut group = c.benchmark_group("reactor null 4KiB read");
    group.throughput(Throughput::Elements(1));
    for qd in [1u64, 32, 128] {
        group.bench_function(format!("qd{qd}"), |b| {
            b.iter_custom(|iters| run_ios(&h, iters, qd))
        });
    }
    group.finish();
    let report = set.shutdown();
    assert!(report.panics.is_empty());
}

/// One ping from reactor A to reactor B and back, repeated until the budget is spent.
fn ping(a: &mut Reactor<Run>, run: &mut Run) {
    if run.pings_left == 0 {
        let elapsed_ns = a.now_ns() - run.started_ns;
        if let Some(tx) = run.report.take() {
            tx.send(elapsed_ns).expect("bench thread waits");
        }
        return;
    }
    run.pings_left -= 1;
    let handles = a.handles().clone();
    let back = handles[a.index()].clone();
    handles[1 - a.index()]
        .send(move |_b, _| back.send(ping).expect("A's mailbox has room"))
        .expect("B's mailbox has room");
}

fn message_round_trip(c: &mut Criterion) {
    let cores = allowed_cores().expect("allowed cores");
    if cores.len() < 2 {
        eprintln!("message round trip needs 2 cores; this process may use {cores:?}");
        return;
    }
    let cfg = ReactorConfig {
        cores: Some(CoreList::new(cores[..2].to_vec())),
        ..ReactorConfig::default()
    };
    let set = ReactorSet::start(cfg, |_| Ok(Run::default())).expect("reactors start");
    let a = set.handles()[0].clone();
    let mut group = c.benchmark_group("reactor messages");
    group.throughput(Throughput::Elements(1));
    group.bench_function("cross-reactor round trip", |b| {
        b.iter_custom(|iters| {
            let (tx, rx) = crossbeam_channel::bounded(1);
            a.send(move |a, run| {
                run.pings_left = iters;
                run.report = Some(tx);
                run.started_ns = monotonic_ns();
                ping(a, run);
            })
            .expect("A accepts");
            Duration::from_nanos(rx.recv().expect("pings report"))
        })
    });
    group.finish();
    let report = set.shutdown();
    assert!(report.panics.is_empty());
}

criterion_group!(benches, io_rate, message_round_trip);
criterion_main!(benches);
