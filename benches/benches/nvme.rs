//! Cost of one submit plus its completion, in ns, on the `null` device and on the emulated
//! controller with zero latency: the floor under every policy's per-I/O cost.
//!
//! `cargo bench -p hypoll-benches --bench nvme`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hypoll_nvme::{
    Command, EmuConfig, EmuController, IoBuf, NullConfig, NullController, QueuePair,
};

/// Submits one 4 KiB read and reaps its completion.
fn one_io(qp: &mut dyn QueuePair, buf: &mut IoBuf, slba: u64) -> usize {
    let cmd = Command::read(slba, 8, buf);
    // SAFETY: the completion is reaped before this function returns, while `buf` is borrowed.
    unsafe { qp.submit(&cmd, slba) }.expect("queue has room");
    let mut reaped = 0;
    while reaped == 0 {
        reaped = qp.process_completions(1, &mut |c| {
            debug_assert!(c.status.is_success());
        });
    }
    reaped
}

/// Submits `batch` reads, then reaps them all: the amortised cost at queue depth `batch`.
fn batch_io(qp: &mut dyn QueuePair, bufs: &mut [IoBuf]) -> usize {
    for (i, buf) in bufs.iter_mut().enumerate() {
        let cmd = Command::read(i as u64 * 8, 8, buf);
        // SAFETY: every completion is reaped below, before `bufs` is released.
        unsafe { qp.submit(&cmd, i as u64) }.expect("queue has room");
    }
    let mut reaped = 0;
    while reaped < bufs.len() {
        reaped += qp.process_completions(bufs.len(), &mut |_| {});
    }
    reaped
}

fn submit_and_complete(c: &mut Criterion) {
    let null = NullController::new(&NullConfig::default());
    let emu = EmuController::new(EmuConfig {
        size_bytes: 1 << 30,
        ..EmuConfig::zero_latency()
    })
    .expect("emulated controller");

    let mut group = c.benchmark_group("submit+complete");
    group.throughput(Throughput::Elements(1));
    let mut buf = IoBuf::zeroed(4096);
    let mut qp = null.queue_pair(128).unwrap();
    group.bench_function("null qd1", |b| {
        let mut slba = 0;
        b.iter(|| {
            slba = (slba + 8) % 1_000_000;
            one_io(&mut qp, &mut buf, slba)
        })
    });
    let mut qp = emu.queue_pair(128).unwrap();
    group.bench_function("emu zero-latency qd1", |b| {
        let mut slba = 0;
        b.iter(|| {
            slba = (slba + 8) % 1_000_000;
            one_io(&mut qp, &mut buf, slba)
        })
    });
    group.finish();

    let mut group = c.benchmark_group("submit+complete batch of 32");
    group.throughput(Throughput::Elements(32));
    let mut bufs: Vec<IoBuf> = (0..32).map(|_| IoBuf::zeroed(4096)).collect();
    let mut qp = null.queue_pair(128).unwrap();
    group.bench_function("null qd32", |b| b.iter(|| batch_io(&mut qp, &mut bufs)));
    let mut qp = emu.queue_pair(128).unwrap();
    group.bench_function("emu zero-latency qd32", |b| {
        b.iter(|| batch_io(&mut qp, &mut bufs))
    });
    group.finish();
}

criterion_group!(benches, submit_and_complete);
criterion_main!(benches);
