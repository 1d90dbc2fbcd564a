//! The VFIO driver's tests against a real NVMe controller: QEMU's, inside the guest that
//! scripts/vfio-guest boots. Needs a function bound to vfio-pci, so it is an example (run by
//! the guest) rather than a `cargo test`.
//!
//!   vfio_selftest <bdf> [--expect-bytes N] [--serial S] [--nonviable <bdf>] [--io-only]
//!                 [--skip-reset]
//!
//! `--io-only` runs the I/O checks and skips the error checks (which unbind the function);
//! `--skip-reset` skips the controller reset (QEMU 7.2 can crash on a reset with I/O in
//! flight, so the suite runs it on one controller only: docs/vfio.md).
//!
//! Prints one line per check, `ok <name>` or `FAILED <name>: <why>`, and exits non-zero if
//! any failed. Every check is bounded in time (IO_TIMEOUT per command, a fixed number of
//! commands). Data patterns come from a seeded generator; the seed is printed.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypoll_nvme::vfio::VfioError;
use hypoll_nvme::{
    wait_readable, Command, Completion, Controller, IoBuf, IoError, QueuePair, Status, SubmitError,
    SyncIo, VfioConfig, VfioController,
};

const IO_TIMEOUT: Duration = Duration::from_secs(10);
const SEED: u64 = 0x5eed_0010;

type Check = Result<(), String>;

fn ensure(cond: bool, why: impl FnOnce() -> String) -> Check {
    if cond {
        Ok(())
    } else {
        Err(why())
    }
}

/// xorshift64*: a reproducible byte pattern per (seed, block).
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

/// Reaps until `want` completions arrived or IO_TIMEOUT passed.
fn reap(qp: &mut dyn QueuePair, want: usize) -> Result<Vec<Completion>, String> {
    let mut got = Vec::with_capacity(want);
    let deadline = Instant::now() + IO_TIMEOUT;
    while got.len() < want {
        qp.process_completions(want - got.len(), &mut |c| got.push(c));
        if Instant::now() > deadline {
            return Err(format!(
                "only {} of {want} completions within {IO_TIMEOUT:?}",
                got.len()
            ));
        }
    }
    Ok(got)
}

fn open(cfg: &VfioConfig) -> Result<Arc<VfioController>, String> {
    VfioController::open(cfg)
        .map(Arc::new)
        .map_err(|e| format!("open: {e}"))
}

fn identify(ctrl: &VfioController, expect_bytes: Option<u64>, serial: &str) -> Check {
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

fn round_trips(ctrl: &VfioController) -> Check {
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
fn zero_copy(ctrl: &VfioController) -> Check {
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

fn out_of_range(ctrl: &VfioController) -> Check {
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
fn queue_wrap(ctrl: &VfioController) -> Check {
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
fn full_queue(ctrl: &VfioController) -> Check {
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
fn deep_queue(ctrl: &VfioController) -> Check {
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
fn interrupts(ctrl: &VfioController) -> Check {
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
fn parallel_queue_pairs(ctrl: &Arc<VfioController>) -> Check {
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
fn reset_mid_workload(ctrl: &VfioController) -> Check {
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

fn expect_open_error(cfg: &VfioConfig, what: &str, matches: impl Fn(&VfioError) -> bool) -> Check {
    match VfioController::open(cfg) {
        Ok(_) => Err(format!("opened; expected {what}")),
        Err(e) => {
            println!("   error as the user sees it: {e}");
            ensure(matches(&e), || format!("expected {what}, got {e:?}"))
        }
    }
}

fn not_bound(cfg: &VfioConfig) -> Check {
    let unbind = "/sys/bus/pci/drivers/vfio-pci/unbind";
    std::fs::write(unbind, &cfg.bdf).map_err(|e| format!("{unbind}: {e}"))?;
    let result = expect_open_error(cfg, "NotBoundToVfio", |e| {
        matches!(e, VfioError::NotBoundToVfio { driver: None, .. })
            && e.to_string().contains("vfio-pci/bind")
    });
    let bind = "/sys/bus/pci/drivers/vfio-pci/bind";
    std::fs::write(bind, &cfg.bdf).map_err(|e| format!("{bind}: {e}"))?;
    result?;
    // Bound again: it opens.
    open(cfg).map(drop)
}

fn nonviable(bdf: &str) -> Check {
    let cfg = VfioConfig::parse(bdf)?;
    expect_open_error(
        &cfg,
        "GroupNotViable",
        |e| matches!(e, VfioError::GroupNotViable { others, .. } if !others.is_empty()),
    )
}

/// Runs in a child process: gives up CAP_IPC_LOCK, limits locked memory to 64 KiB, and
/// opens the controller, which must fail to pin its queues.
fn pin_child(cfg: &VfioConfig) -> Check {
    drop_cap_ipc_lock()?;
    let lim = libc::rlimit {
        rlim_cur: 64 << 10,
        rlim_max: 64 << 10,
    };
    // SAFETY: setrlimit reads one live rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) } != 0 {
        return Err(format!("setrlimit: {}", std::io::Error::last_os_error()));
    }
    let opened = VfioController::open(cfg);
    let ctrl = match opened {
        // The admin queue is 3 pages: it may fit; the queue pair's memory cannot.
        Ok(ctrl) => ctrl,
        Err(e) => {
            println!("   error as the user sees it: {e}");
            return ensure(matches!(e, VfioError::PinFailed { .. }), || {
                format!("{e:?}")
            });
        }
    };
    match ctrl.create_queue_pair(64) {
        Ok(_) => Err("a 64-deep queue pair pinned over 8 MiB under a 64 KiB limit".into()),
        Err(e) => {
            println!("   error as the user sees it: {e}");
            ensure(
                e.to_string().contains("cannot pin") && e.to_string().contains("65536 bytes"),
                || format!("{e}"),
            )
        }
    }
}

/// Clears CAP_IPC_LOCK from the effective and permitted sets (capset(2), version 3).
fn drop_cap_ipc_lock() -> Check {
    const CAP_V3: u32 = 0x2008_0522;
    const CAP_IPC_LOCK: u32 = 14;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: CAP_V3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget writes two Data structures for a version-3 header.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } != 0 {
        return Err(format!("capget: {}", std::io::Error::last_os_error()));
    }
    data[0].effective &= !(1 << CAP_IPC_LOCK);
    data[0].permitted &= !(1 << CAP_IPC_LOCK);
    // SAFETY: capset reads the header and two Data structures.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) } != 0 {
        return Err(format!("capset: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn pin_failure(cfg: &VfioConfig) -> Check {
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = std::process::Command::new(me)
        .arg(&cfg.bdf)
        .arg("--pin-child")
        .output()
        .map_err(|e| e.to_string())?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    ensure(out.status.success(), || {
        format!("child: {}", String::from_utf8_lossy(&out.stderr))
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(bdf) = args.first() else {
        eprintln!(
            "usage: vfio_selftest <bdf> [--expect-bytes N] [--serial S] [--nonviable <bdf>] \
             [--io-only] [--skip-reset]"
        );
        std::process::exit(2);
    };
    let cfg = VfioConfig::parse(bdf).unwrap_or_else(|e| {
        eprintln!("{bdf:?}: expected {e}");
        std::process::exit(2)
    });
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    if args.iter().any(|a| a == "--pin-child") {
        match pin_child(&cfg) {
            Ok(()) => std::process::exit(0),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(1)
            }
        }
    }
    if let Some(n) = flag("--stress-reset").and_then(|v| v.parse::<u32>().ok()) {
        // Soak: the reset check `n` times on one controller (not part of the suite).
        let ctrl = open(&cfg).unwrap_or_else(|e| panic!("{e}"));
        for i in 0..n {
            if let Err(e) = reset_mid_workload(&ctrl) {
                println!("FAILED reset {i}: {e}");
                std::process::exit(1);
            }
        }
        println!("{n} resets passed");
        std::process::exit(0);
    }
    let expect_bytes = flag("--expect-bytes").and_then(|v| v.parse().ok());
    let serial = flag("--serial").unwrap_or_else(|| "hypoll0".to_string());
    let io_only = args.iter().any(|a| a == "--io-only");
    let skip_reset = args.iter().any(|a| a == "--skip-reset");
    println!("vfio_selftest on {} (pattern seed {SEED:#x})", cfg.bdf);
    let mut failed = 0;
    let mut run = |name: &str, check: &mut dyn FnMut() -> Check| {
        let start = Instant::now();
        match check() {
            Ok(()) => println!("ok {name} ({:.2} s)", start.elapsed().as_secs_f64()),
            Err(why) => {
                failed += 1;
                println!("FAILED {name}: {why}");
            }
        }
    };
    match open(&cfg) {
        Ok(ctrl) => {
            run("identify", &mut || identify(&ctrl, expect_bytes, &serial));
            run(
                "round trips (1 block to 32 pages, flush, write zeroes, FUA)",
                &mut || round_trips(&ctrl),
            );
            run("zero-copy pinned buffers", &mut || zero_copy(&ctrl));
            run("out-of-range LBA", &mut || out_of_range(&ctrl));
            run("queue wrap", &mut || queue_wrap(&ctrl));
            run("full queue", &mut || full_queue(&ctrl));
            run("64 in flight, over-MDTS", &mut || deep_queue(&ctrl));
            run("MSI-X interrupts", &mut || interrupts(&ctrl));
            run("parallel queue pairs", &mut || parallel_queue_pairs(&ctrl));
            if !skip_reset {
                run("controller reset mid-workload", &mut || {
                    reset_mid_workload(&ctrl)
                });
            }
        }
        Err(e) => run("open", &mut || Err(e.clone())),
    }
    // These need the group closed: the controller above is dropped by now.
    if !io_only {
        run("error: not bound to vfio-pci", &mut || not_bound(&cfg));
        run("error: cannot pin memory", &mut || pin_failure(&cfg));
    }
    if let Some(other) = flag("--nonviable") {
        run("error: group not viable", &mut || nonviable(&other));
    }
    if failed > 0 {
        println!("vfio_selftest: {failed} check(s) FAILED");
        std::process::exit(1);
    }
    println!("vfio_selftest: all checks passed");
}
