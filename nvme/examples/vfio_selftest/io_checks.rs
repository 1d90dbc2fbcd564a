//! Checks of the I/O path on a controller that opened: Identify, data round trips through
//! bounce pages and pinned buffers, ring wraps, full and deep queues, interrupts, parallel
//! queue pairs, and a controller reset under load.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use hypoll_nvme::{
    wait_readable, Command, Controller, IoBuf, IoError, QueuePair, Status, SubmitError, SyncIo,
    VfioController,
};

use crate::{ensure, pattern, reap, Check, IO_TIMEOUT, SEED};

pub fn identify(ctrl: &VfioController, expect_bytes: Option<u64>, serial: &str) -> Check {
    let id = ctrl.identity();
    let ns = ctrl.namespace();
    let (major, minor) = ctrl.version();
    println!(
        "   model {:?} serial {:?} firmware {:?} NVMe {major}.{minor}, MDTS {:?}, {} namespace(s); \
         namespace 1: {} blocks of {} bytes, {} bytes per command",
        id.model, id.serial, id.firmware, id.mdts_bytes, id.namespaces, ns.capacity_lbas,
        ns.lba_size_bytes, ns.transfer_bytes_max
    );
    ensure(id.model.contains("QEMU NVMe"), || {
        format!("model {:?}", id.model)
    })?;
    ensure(id.serial == serial, || {
        format!("serial {:?}, expected {serial:?}", id.serial)
    })?;
    ensure(major >= 1, || format!("version {major}.{minor}"))?;
    ensure(
        ns.lba_size_bytes == 512 || ns.lba_size_bytes == 4096,
        || format!("block size {}", ns.lba_size_bytes),
    )?;
    if let Some(bytes) = expect_bytes {
        ensure(ns.capacity_bytes() == bytes, || {
            format!(
                "capacity {} bytes, the disk has {bytes}",
                ns.capacity_bytes()
            )
        })?;
    }
    Ok(())
}

pub fn round_trips(ctrl: &VfioController) -> Check {
    let mut qp = ctrl.create_queue_pair(8).map_err(|e| e.to_string())?;
    let lba = qp.namespace().lba_size_bytes as usize;
    let mut io = SyncIo::new(&mut *qp, IO_TIMEOUT);
    // One block, one page, two pages (PRP2), three and 32 pages (PRP lists).
    for (i, len) in [lba, 4096, 8192, 12288, 65536 + 4096, 128 << 10]
        .into_iter()
        .enumerate()
    {
        let slba = 1000 * i as u64;
        let data = pattern(SEED + i as u64, len);
        io.write(slba, &data)
            .map_err(|e| format!("write {len} bytes: {e}"))?;
        let back = io
            .read(slba, (len / lba) as u32)
            .map_err(|e| format!("read {len} bytes: {e}"))?;
        ensure(back[..] == data[..], || {
            format!("{len} bytes read back differ")
        })?;
    }
    io.flush().map_err(|e| format!("flush: {e}"))?;
    // Write Zeroes clears what a write put there.
    io.write(50, &pattern(SEED, 8 * lba))
        .map_err(|e| e.to_string())?;
    io.write_zeroes(50, 8)
        .map_err(|e| format!("write zeroes: {e}"))?;
    let back = io.read(50, 8).map_err(|e| e.to_string())?;
    ensure(back.iter().all(|&b| b == 0), || {
        "write zeroes left data".into()
    })?;
    // FUA write.
    let data = pattern(SEED + 99, 4096);
    {
        let qp = io.queue_pair();
        // SAFETY: `data` outlives the command: it is reaped below before `data` is dropped.
        unsafe {
            qp.submit(
                &Command::write(60, (4096 / lba) as u32, &data).with_fua(true),
                7,
            )
        }
        .map_err(|e| e.to_string())?;
        let c = reap(qp, 1)?;
        ensure(c[0].status.is_success() && c[0].tag == 7, || {
            format!("FUA write: {c:?}")
        })?;
    }
    let back = io
        .read(60, (4096 / lba) as u32)
        .map_err(|e| e.to_string())?;
    ensure(back[..] == data[..], || {
        "FUA write read back differs".into()
    })?;
    Ok(())
}

/// Buffers from the pinned pool go to the controller without a bounce copy, and read back
/// the same through either path.
pub fn zero_copy(ctrl: &VfioController) -> Check {
    ensure(ctrl.describe().contains("zero-copy"), || {
        format!("the pinned pool is not mapped: {}", ctrl.describe())
    })?;
    let mut qp = ctrl.queue_pair(4).map_err(|e| e.to_string())?;
    let lba = qp.namespace().lba_size_bytes as usize;
    for (i, len) in [4096usize, 8192, 128 << 10].into_iter().enumerate() {
        let slba = 3000 + 400 * i as u64;
        let nlb = (len / lba) as u32;
        let data = pattern(SEED + 50 + i as u64, len);
        let mut out = IoBuf::pinned(len);
        out.copy_from_slice(&data);
        let before = qp.zero_copy_ios();
        // SAFETY: `out` outlives the command, reaped below.
        unsafe { qp.submit(&Command::write(slba, nlb, &out), 1) }.map_err(|e| e.to_string())?;
        let c = reap(&mut qp, 1)?;
        ensure(c[0].status.is_success(), || format!("pinned write: {c:?}"))?;
        let mut back = IoBuf::pinned(len);
        // SAFETY: as above.
        unsafe { qp.submit(&Command::read(slba, nlb, &mut back), 2) }.map_err(|e| e.to_string())?;
        let c = reap(&mut qp, 1)?;
        ensure(c[0].status.is_success(), || format!("pinned read: {c:?}"))?;
        ensure(qp.zero_copy_ios() == before + 2, || {
            format!("{len} bytes: pinned buffers were bounced")
        })?;
        ensure(back[..] == data[..], || {
            format!("{len} bytes read back (zero-copy) differ")
        })?;
        // A heap buffer bounces, and sees what the zero-copy write wrote.
        let mut heap = IoBuf::zeroed(len);
        // SAFETY: as above.
        unsafe { qp.submit(&Command::read(slba, nlb, &mut heap), 3) }.map_err(|e| e.to_string())?;
        let c = reap(&mut qp, 1)?;
        ensure(c[0].status.is_success(), || format!("heap read: {c:?}"))?;
        ensure(qp.zero_copy_ios() == before + 2, || {
            "a heap buffer went zero-copy".into()
        })?;
        ensure(heap[..] == data[..], || {
            format!("{len} bytes read back (bounced) differ")
        })?;
    }
    Ok(())
}

pub fn out_of_range(ctrl: &VfioController) -> Check {
    let mut qp = ctrl.create_queue_pair(4).map_err(|e| e.to_string())?;
    let cap = qp.namespace().capacity_lbas;
    let mut io = SyncIo::new(&mut *qp, IO_TIMEOUT);
    for (slba, nlb) in [(cap, 1), (cap - 1, 2), (u64::MAX - 1, 1)] {
        match io.read(slba, nlb) {
            Err(IoError::Status(s)) if s == Status::LBA_OUT_OF_RANGE => {}
            other => return Err(format!("read at {slba}+{nlb}: {other:?}")),
        }
    }
    match io.write(cap, &vec![1u8; qp_lba(ctrl)]) {
        Err(IoError::Status(s)) if s == Status::LBA_OUT_OF_RANGE => {}
        other => return Err(format!("write past the end: {other:?}")),
    }
    // The last block is in range.
    io.read(cap - 1, 1)
        .map_err(|e| format!("last block: {e}"))?;
    Ok(())
}

fn qp_lba(ctrl: &VfioController) -> usize {
    ctrl.namespace().lba_size_bytes as usize
}

/// A depth-3 queue (4 entries) wraps its rings many times; every phase flip must be seen.
pub fn queue_wrap(ctrl: &VfioController) -> Check {
    let mut qp = ctrl.create_queue_pair(3).map_err(|e| e.to_string())?;
    let lba = qp_lba(ctrl);
    let mut io = SyncIo::new(&mut *qp, IO_TIMEOUT);
    for i in 0..41u64 {
        let data = pattern(SEED ^ i, lba);
        io.write(2000 + i, &data)
            .map_err(|e| format!("write {i}: {e}"))?;
    }
    for i in 0..41u64 {
        let back = io.read(2000 + i, 1).map_err(|e| format!("read {i}: {e}"))?;
        ensure(back[..] == pattern(SEED ^ i, lba)[..], || {
            format!("block {i} differs")
        })?;
    }
    // Batches of three in flight across the wrap point.
    let bufs: Vec<IoBuf> = (0..3).map(|_| IoBuf::zeroed(lba)).collect();
    let mut bufs = bufs;
    let qp = io.queue_pair();
    for round in 0..20u64 {
        for (k, buf) in bufs.iter_mut().enumerate() {
            // SAFETY: each buffer is reaped below before it is touched again.
            unsafe {
                qp.submit(
                    &Command::read(2000 + k as u64, 1, buf),
                    round * 3 + k as u64,
                )
            }
            .map_err(|e| format!("round {round}: {e}"))?;
        }
        let c = reap(qp, 3)?;
        ensure(c.iter().all(|c| c.status.is_success()), || format!("{c:?}"))?;
        for (k, buf) in bufs.iter().enumerate() {
            ensure(buf[..] == pattern(SEED ^ k as u64, lba)[..], || {
                format!("round {round}: buffer {k} differs")
            })?;
        }
    }
    Ok(())
}

/// A full queue refuses with QueueFull, never blocks, and works again after reaping.
pub fn full_queue(ctrl: &VfioController) -> Check {
    let depth = 8;
    let mut qp = ctrl.create_queue_pair(depth).map_err(|e| e.to_string())?;
    let lba = qp_lba(ctrl);
    let mut bufs: Vec<IoBuf> = (0..depth + 1).map(|_| IoBuf::zeroed(lba)).collect();
    let (head, extra) = bufs.split_at_mut(depth);
    for (i, buf) in head.iter_mut().enumerate() {
        // SAFETY: every buffer is reaped below before `bufs` is dropped.
        unsafe { qp.submit(&Command::read(i as u64, 1, buf), i as u64) }
            .map_err(|e| format!("submit {i}: {e}"))?;
    }
    ensure(qp.outstanding() == depth, || {
        format!("outstanding {}", qp.outstanding())
    })?;
    // SAFETY: refused, so the device never sees the buffer.
    let refused = unsafe { qp.submit(&Command::read(0, 1, &mut extra[0]), 99) };
    ensure(refused == Err(SubmitError::QueueFull { depth }), || {
        format!("{refused:?}")
    })?;
    let c = reap(&mut *qp, depth)?;
    let mut tags: Vec<u64> = c.iter().map(|c| c.tag).collect();
    tags.sort_unstable();
    ensure(tags == (0..depth as u64).collect::<Vec<_>>(), || {
        format!("tags {tags:?}")
    })?;
    // SAFETY: reaped below.
    unsafe { qp.submit(&Command::read(0, 1, &mut extra[0]), 100) }.map_err(|e| e.to_string())?;
    let c = reap(&mut *qp, 1)?;
    ensure(c[0].tag == 100 && c[0].status.is_success(), || {
        format!("{c:?}")
    })
}

/// 64 commands in flight with bounce pages shared through the pool; over-MDTS commands get
/// Invalid Field without reaching the device.
pub fn deep_queue(ctrl: &VfioController) -> Check {
    let depth = 64;
    let mut qp = ctrl.create_queue_pair(depth).map_err(|e| e.to_string())?;
    let lba = qp_lba(ctrl);
    let len = 16 << 10;
    let datas: Vec<Vec<u8>> = (0..depth)
        .map(|i| pattern(SEED + 1000 + i as u64, len))
        .collect();
    for (i, d) in datas.iter().enumerate() {
        // SAFETY: `datas` outlives the reap below.
        unsafe {
            qp.submit(
                &Command::write((i * 64) as u64, (len / lba) as u32, d),
                i as u64,
            )
        }
        .map_err(|e| format!("write {i}: {e}"))?;
    }
    let c = reap(&mut *qp, depth)?;
    ensure(c.iter().all(|c| c.status.is_success()), || format!("{c:?}"))?;
    let mut bufs: Vec<IoBuf> = (0..depth).map(|_| IoBuf::zeroed(len)).collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        // SAFETY: reaped below before `bufs` is read or dropped.
        unsafe {
            qp.submit(
                &Command::read((i * 64) as u64, (len / lba) as u32, b),
                i as u64,
            )
        }
        .map_err(|e| format!("read {i}: {e}"))?;
    }
    let c = reap(&mut *qp, depth)?;
    ensure(c.iter().all(|c| c.status.is_success()), || format!("{c:?}"))?;
    for (i, b) in bufs.iter().enumerate() {
        ensure(b[..] == datas[i][..], || format!("read {i} differs"))?;
    }
    let max = qp.namespace().transfer_bytes_max as usize;
    let mut big = IoBuf::zeroed(max + 4096);
    // SAFETY: completes at once (Invalid Field) without reaching the device; reaped below.
    unsafe { qp.submit(&Command::read(0, ((max + 4096) / lba) as u32, &mut big), 5) }
        .map_err(|e| e.to_string())?;
    let c = reap(&mut *qp, 1)?;
    ensure(c[0].status == Status::INVALID_FIELD, || {
        format!("over MDTS: {c:?}")
    })
}

/// MSI-X: an armed queue pair's eventfd becomes readable when its completion is posted.
pub fn interrupts(ctrl: &VfioController) -> Check {
    let mut qp = ctrl.create_queue_pair(4).map_err(|e| e.to_string())?;
    ensure(qp.interrupt_fd().is_some(), || {
        "no interrupt fd (MSI-X)".into()
    })?;
    let mut buf = IoBuf::zeroed(qp_lba(ctrl));
    let mut woke = 0;
    for i in 0..5 {
        qp.arm_interrupt();
        let fd = qp.interrupt_fd().expect("checked");
        ensure(!wait_readable(fd, 0).map_err(|e| e.to_string())?, || {
            format!("round {i}: readable before any I/O")
        })?;
        // SAFETY: reaped below before `buf` is touched.
        unsafe { qp.submit(&Command::read(0, 1, &mut buf), i) }.map_err(|e| e.to_string())?;
        let fd = qp.interrupt_fd().expect("checked");
        if wait_readable(fd, IO_TIMEOUT.as_millis() as i32).map_err(|e| e.to_string())? {
            woke += 1;
        }
        let c = reap(&mut *qp, 1)?;
        ensure(c[0].status.is_success(), || format!("{c:?}"))?;
    }
    // Polling never arms: completions reaped without arming leave the fd unreadable, even
    // once their MSI-X messages have landed (an idle reactor parks on this fd).
    for i in 0..5 {
        // SAFETY: reaped below before `buf` is touched.
        unsafe { qp.submit(&Command::read(0, 1, &mut buf), 10 + i) }.map_err(|e| e.to_string())?;
        let c = reap(&mut *qp, 1)?;
        ensure(c[0].status.is_success(), || format!("{c:?}"))?;
    }
    std::thread::sleep(Duration::from_millis(20));
    let fd = qp.interrupt_fd().expect("checked");
    ensure(!wait_readable(fd, 0).map_err(|e| e.to_string())?, || {
        "the interrupt fd is readable after polled completions, with nothing armed".into()
    })?;
    println!(
        "   {woke}/5 completions raised the interrupt fd (fd {})",
        qp.interrupt_fd().map_or(-1, |f| f.as_raw_fd())
    );
    ensure(woke == 5, || {
        format!("only {woke} of 5 completions interrupted")
    })
}

/// Two reactors' worth of queue pairs, each on its own thread, in parallel.
pub fn parallel_queue_pairs(ctrl: &Arc<VfioController>) -> Check {
    let threads: Vec<_> = (0..2u64)
        .map(|t| {
            let ctrl = ctrl.clone();
            std::thread::spawn(move || -> Check {
                let mut qp = ctrl.create_queue_pair(16).map_err(|e| e.to_string())?;
                let lba = qp.namespace().lba_size_bytes as usize;
                let mut io = SyncIo::new(&mut *qp, IO_TIMEOUT);
                for i in 0..32u64 {
                    let slba = 10_000 + t * 1000 + i * 8;
                    let data = pattern(SEED + t * 100 + i, 4096);
                    io.write(slba, &data).map_err(|e| e.to_string())?;
                    let back = io
                        .read(slba, (4096 / lba) as u32)
                        .map_err(|e| e.to_string())?;
                    ensure(back[..] == data[..], || format!("thread {t}: {i} differs"))?;
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join().map_err(|_| "thread panicked".to_string())??;
    }
    Ok(())
}

/// A controller reset with commands in flight: every outstanding command completes, the
/// ones the controller had not finished with "Command Aborted due to SQ Deletion"; then new
/// I/O works on the same queue pair and on one that sat idle through the reset.
pub fn reset_mid_workload(ctrl: &VfioController) -> Check {
    let depth = 32;
    let lba = qp_lba(ctrl);
    let mut idle = ctrl.create_queue_pair(4).map_err(|e| e.to_string())?;
    let mut qp = ctrl.create_queue_pair(depth).map_err(|e| e.to_string())?;
    let len: usize = 128 << 10;
    let data = pattern(SEED + 7, len);
    let mut aborted_total = 0;
    for attempt in 1..=10 {
        for i in 0..depth {
            // SAFETY: `data` outlives every completion, all reaped below.
            unsafe {
                qp.submit(
                    &Command::write((i * 256) as u64, (len / lba) as u32, &data),
                    i as u64,
                )
            }
            .map_err(|e| format!("write {i}: {e}"))?;
        }
        let before = ctrl.resets();
        // Through the trait, as a reactor's timeout escalation does.
        qp.reset().map_err(|e| format!("reset: {e}"))?;
        ensure(ctrl.resets() == before + 1, || "reset not counted".into())?;
        let c = reap(&mut *qp, depth)?;
        let aborted = c
            .iter()
            .filter(|c| c.status == Status::ABORTED_SQ_DELETION)
            .count();
        let ok = c.iter().filter(|c| c.status.is_success()).count();
        ensure(aborted + ok == depth, || {
            format!("unexpected statuses: {c:?}")
        })?;
        let mut tags: Vec<u64> = c.iter().map(|c| c.tag).collect();
        tags.sort_unstable();
        ensure(tags == (0..depth as u64).collect::<Vec<_>>(), || {
            format!("tags {tags:?}")
        })?;
        ensure(qp.outstanding() == 0, || {
            format!("{} still outstanding", qp.outstanding())
        })?;
        println!("   attempt {attempt}: {aborted} of {depth} writes aborted by the reset, {ok} completed");
        aborted_total += aborted;
        if aborted_total > 0 {
            break;
        }
    }
    ensure(aborted_total > 0, || {
        "in 10 resets no command was still in flight".into()
    })?;
    // Past the blocks the bursts wrote, inside even a small namespace.
    let slba = ctrl.namespace().capacity_lbas / 2;
    for (name, q) in [
        ("reset queue pair", &mut qp),
        ("idle queue pair", &mut idle),
    ] {
        let mut io = SyncIo::new(&mut **q, IO_TIMEOUT);
        let fresh = pattern(SEED + 8, 8192);
        io.write(slba, &fresh)
            .map_err(|e| format!("{name}: write after reset: {e}"))?;
        let back = io
            .read(slba, (8192 / lba) as u32)
            .map_err(|e| format!("{name}: {e}"))?;
        ensure(back[..] == fresh[..], || {
            format!("{name}: data differs after reset")
        })?;
    }
    Ok(())
}
