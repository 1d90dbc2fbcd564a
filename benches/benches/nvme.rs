//! Cost of one submit plus its completion, in ns, on the `null` device and on the emulated
//! controller with zero latency: the floor under every policy's per-I/O cost. And a vectored
//! write of four 1 KiB segments against four 1 KiB writes, the choice a group commit makes.
//!
//! `cargo bench -p hypoll-benches --bench nvme`

use std::io::IoSlice;

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

/// Submits one write of `records` as segments, and reaps it.
fn vectored_write(qp: &mut dyn QueuePair, records: &[IoBuf], slba: u64) -> usize {
    let segs: [IoSlice<'_>; 4] = std::array::from_fn(|i| IoSlice::new(&records[i]));
    let nlb = (4 * RECORD_BYTES / 512) as u32;
    let cmd = Command::writev(slba, nlb, &segs);
    // SAFETY: the completion is reaped before this function returns, while `records` is
    // borrowed.
    unsafe { qp.submit(&cmd, slba) }.expect("queue has room");
    let mut reaped = 0;
    while reaped == 0 {
        reaped = qp.process_completions(1, &mut |c| {
            debug_assert!(c.status.is_success());
        });
    }
    reaped
}

/// Submits one write per record, one after the other on the device, then reaps them all.
fn separate_writes(qp: &mut dyn QueuePair, records: &[IoBuf], slba: u64) -> usize {
    let nlb = (RECORD_BYTES / 512) as u32;
    for (i, record) in records.iter().enumerate() {
        let cmd = Command::write(slba + i as u64 * u64::from(nlb), nlb, record);
        // SAFETY: every completion is reaped below, before `records` is released.
        unsafe { qp.submit(&cmd, i as u64) }.expect("queue has room");
    }
    let mut reaped = 0;
    while reaped < records.len() {
        reaped += qp.process_completions(records.len(), &mut |_| {});
    }
    reaped
}

/// A group commit's records: four of 1 KiB, in buffers of their own.
const RECORD_BYTES: usize = 1024;

fn vectored_against_separate(c: &mut Criterion) {
    let null = NullController::new(&NullConfig::default());
    let emu = EmuController::new(EmuConfig {
        size_bytes: 1 << 30,
        ..EmuConfig::zero_latency()
    })
    .expect("emulated controller");
    let records: Vec<IoBuf> = (0..4)
        .map(|i| IoBuf::from_slice(&[i; RECORD_BYTES]))
        .collect();
    let mut group = c.benchmark_group("4 KiB as four 1 KiB records");
    group.throughput(Throughput::Elements(1));
    let devices: [(&str, Box<dyn QueuePair>); 2] = [
        ("null", Box::new(null.queue_pair(128).unwrap())),
        ("emu zero-latency", Box::new(emu.queue_pair(128).unwrap())),
    ];
    // Writes stay inside the first 2 MiB, which the first pass allocates: what is measured
    // is the commands' cost, not the page faults of a sparse store growing.
    const SPAN_BLOCKS: u64 = 4096;
    for (name, mut qp) in devices {
        group.bench_function(format!("{name} writev 4 x 1 KiB"), |b| {
            let mut slba = 0;
            b.iter(|| {
                slba = (slba + 8) % SPAN_BLOCKS;
                vectored_write(&mut *qp, &records, slba)
            })
        });
        group.bench_function(format!("{name} 4 writes of 1 KiB"), |b| {
            let mut slba = 0;
            b.iter(|| {
                slba = (slba + 8) % SPAN_BLOCKS;
                separate_writes(&mut *qp, &records, slba)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, submit_and_complete, vectored_against_separate);
criterion_main!(benches);
