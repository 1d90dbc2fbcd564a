//! The `uring` device against real files written with real data (never sparse: reading a
//! hole never reaches the device): every opcode, every opening error, data read back equals
//! data written, and the interrupt-driven fallback where polled I/O is unsupported.

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use hypoll_nvme::{
    wait_readable, Command, CompletionMode, Controller, DeviceConfig, IoBuf, IoError, QueuePair,
    Status, SubmitError, SyncIo, TaskRun, UringConfig, UringController,
};
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;

const LBA: usize = 4096;
const TIMEOUT: Duration = Duration::from_secs(10);

/// A temporary file of `blocks` 4 KiB blocks of seeded random data, written and synced.
struct DataFile {
    _dir: tempfile::TempDir,
    path: PathBuf,
    data: Vec<u8>,
}

fn data_file(blocks: usize, seed: u64) -> DataFile {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir");
    let path = dir.path().join("disk.img");
    let mut data = vec![0u8; blocks * LBA];
    Pcg64::seed_from_u64(seed).fill(&mut data[..]);
    let mut f = fs::File::create(&path).expect("create data file");
    f.write_all(&data).expect("write data file");
    f.sync_all().expect("sync data file");
    DataFile {
        _dir: dir,
        path,
        data,
    }
}

fn open(device: &str) -> std::io::Result<std::sync::Arc<dyn Controller>> {
    device
        .parse::<DeviceConfig>()
        .expect("device string parses")
        .open()
}

fn open_err(cfg: &UringConfig) -> String {
    match UringController::open(cfg) {
        Ok(_) => panic!("{cfg} opened, expected an error"),
        Err(e) => e.to_string(),
    }
}

fn file_contents(path: &Path) -> Vec<u8> {
    let mut f = fs::File::open(path).expect("open");
    let mut out = Vec::new();
    f.read_to_end(&mut out).expect("read");
    out
}

#[test]
fn every_opcode_round_trips_through_the_file() {
    let file = data_file(256, 1);
    let ctrl = open(&format!("uring:{}", file.path.display())).expect("open");
    let ns = ctrl.namespace();
    assert_eq!(ns.lba_size_bytes as usize, LBA);
    assert_eq!(ns.capacity_lbas, 256);
    let mut qp = ctrl.create_queue_pair(8).expect("queue pair");
    let mut io = SyncIo::new(&mut *qp, TIMEOUT);

    // Reads return what was written to the file before the device was opened.
    for lba in [0u64, 7, 255] {
        let got = io.read(lba, 1).expect("read");
        let at = lba as usize * LBA;
        assert_eq!(&got[..], &file.data[at..at + LBA], "block {lba}");
    }
    // A multi-block read.
    let got = io.read(10, 4).expect("read 4 blocks");
    assert_eq!(&got[..], &file.data[10 * LBA..14 * LBA]);

    // Writes read back, through the device and through the file.
    let pattern: Vec<u8> = (0..2 * LBA).map(|i| (i * 7 + 3) as u8).collect();
    io.write(20, &pattern).expect("write");
    assert_eq!(&io.read(20, 2).expect("read back")[..], &pattern[..]);
    // FUA write.
    let fua = IoBuf::from_slice(&[0x5a; LBA]);
    // SAFETY: `fua` outlives the command, which completes before `wait_one` returns.
    unsafe {
        io.queue_pair()
            .submit(&Command::write(30, 1, &fua).with_fua(true), 99)
            .expect("fua write")
    };
    assert_eq!(wait_one(io.queue_pair()), (99, Status::SUCCESS));
    io.flush().expect("flush");
    let on_disk = file_contents(&file.path);
    assert_eq!(&on_disk[20 * LBA..22 * LBA], &pattern[..]);
    assert_eq!(&on_disk[30 * LBA..31 * LBA], &[0x5a; LBA][..]);

    // Write Zeroes and Deallocate both read back as zeroes, and leave neighbours alone.
    io.write_zeroes(40, 3).expect("write zeroes");
    assert!(io.read(40, 3).expect("read").iter().all(|&b| b == 0));
    io.deallocate(50, 2).expect("deallocate");
    assert!(io.read(50, 2).expect("read").iter().all(|&b| b == 0));
    assert_eq!(
        &io.read(43, 1).expect("read")[..],
        &file.data[43 * LBA..44 * LBA]
    );
    assert_eq!(
        &io.read(52, 1).expect("read")[..],
        &file.data[52 * LBA..53 * LBA]
    );
    // The file keeps its size: the namespace never shrinks.
    assert_eq!(fs::metadata(&file.path).unwrap().len(), 256 * LBA as u64);

    // Out of range: an NVMe status, not a panic or a submit error.
    assert_eq!(
        io.read(256, 1).err(),
        Some(IoError::Status(Status::LBA_OUT_OF_RANGE))
    );
    assert_eq!(
        io.write(255, &[0u8; 2 * LBA]),
        Err(IoError::Status(Status::LBA_OUT_OF_RANGE))
    );
    assert_eq!(
        io.write_zeroes(250, 7),
        Err(IoError::Status(Status::LBA_OUT_OF_RANGE))
    );
}

/// Reaps exactly one completion, spinning on the ring.
fn wait_one(qp: &mut dyn QueuePair) -> (u64, Status) {
    let deadline = std::time::Instant::now() + TIMEOUT;
    let mut seen = None;
    while seen.is_none() {
        qp.process_completions(1, &mut |c| seen = Some((c.tag, c.status)));
        assert!(std::time::Instant::now() < deadline, "no completion");
    }
    seen.unwrap()
}

#[test]
fn a_full_queue_pushes_back_and_many_in_flight_all_complete_once() {
    let file = data_file(128, 2);
    let ctrl = open(&format!("uring:{}", file.path.display())).expect("open");
    let depth = 16;
    let mut qp = ctrl.create_queue_pair(depth).expect("queue pair");
    let mut bufs: Vec<IoBuf> = (0..depth).map(|_| IoBuf::zeroed(LBA)).collect();
    for (i, buf) in bufs.iter_mut().enumerate() {
        // SAFETY: every buffer outlives the loop below, which reaps every command.
        unsafe { qp.submit(&Command::read(i as u64 * 3, 1, buf), i as u64) }.expect("submit");
    }
    assert_eq!(qp.outstanding(), depth);
    let mut spare = IoBuf::zeroed(LBA);
    // SAFETY: refused, so the device never sees the buffer.
    let full = unsafe { qp.submit(&Command::read(0, 1, &mut spare), 1000) };
    assert_eq!(full, Err(SubmitError::QueueFull { depth }));
    let mut seen = vec![0u32; depth];
    let deadline = std::time::Instant::now() + TIMEOUT;
    while qp.outstanding() > 0 {
        qp.process_completions(4, &mut |c| {
            assert_eq!(c.status, Status::SUCCESS);
            seen[c.tag as usize] += 1;
        });
        assert!(std::time::Instant::now() < deadline, "completions missing");
    }
    assert!(
        seen.iter().all(|&n| n == 1),
        "each completes once: {seen:?}"
    );
    for (i, buf) in bufs.iter().enumerate() {
        let at = i * 3 * LBA;
        assert_eq!(&buf[..], &file.data[at..at + LBA], "tag {i}");
    }
}

#[test]
fn without_polled_io_completions_arrive_by_interrupt_on_the_eventfd() {
    let file = data_file(16, 3);
    let auto = UringController::open(&UringConfig::new(&file.path)).expect("open");
    match auto.mode() {
        CompletionMode::Interrupt => {
            assert!(
                auto.describe().contains("interrupt completions"),
                "{}",
                auto.describe()
            );
            // Asking for polled I/O where there is none is an error that says what to do.
            let mut on = UringConfig::new(&file.path);
            on.iopoll = hypoll_nvme::IopollMode::On;
            let msg = open_err(&on);
            assert!(
                msg.contains("not supported") && msg.contains("iopoll=auto"),
                "{msg}"
            );
        }
        // On an NVMe namespace with poll queues the probe finds IOPOLL.
        CompletionMode::Poll | CompletionMode::HybridPoll => {}
    }
    // Both ways the kernel can post the completions: deferred to the queue pair's own
    // io_uring_enter (the default, where the kernel has it), and signalled to the thread.
    for taskrun in [TaskRun::Defer, TaskRun::Signal] {
        completions_arrive_on_the_eventfd(&file, taskrun);
    }
}

fn completions_arrive_on_the_eventfd(file: &DataFile, taskrun: TaskRun) {
    let mut off = UringConfig::new(&file.path);
    off.iopoll = hypoll_nvme::IopollMode::Off;
    off.taskrun = taskrun;
    let ctrl = UringController::open(&off).expect("open with iopoll=off");
    assert_eq!(ctrl.mode(), CompletionMode::Interrupt);
    let described = ctrl.describe();
    match taskrun {
        TaskRun::Defer => assert!(
            described.contains("DEFER_TASKRUN"),
            "says whether task work is deferred: {described}"
        ),
        TaskRun::Signal => assert!(
            described.contains("completions signalled (taskrun=signal)"),
            "{described}"
        ),
    }
    let mut qp = ctrl.queue_pair(4).expect("queue pair");
    let fd = qp.interrupt_fd().expect("an eventfd in interrupt mode");
    let _ = fd.as_fd();
    let mut buf = IoBuf::zeroed(LBA);
    // SAFETY: `buf` outlives the command, reaped below.
    unsafe { qp.submit(&Command::read(5, 1, &mut buf), 7) }.expect("submit");
    qp.arm_interrupt();
    let fd = qp.interrupt_fd().expect("eventfd");
    assert!(
        wait_readable(fd, 10_000).expect("poll the eventfd"),
        "the eventfd never fired"
    );
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + TIMEOUT;
    while got.is_empty() {
        qp.process_completions(4, &mut |c| got.push(c));
        assert!(std::time::Instant::now() < deadline);
    }
    assert_eq!((got[0].tag, got[0].status), (7, Status::SUCCESS));
    assert_eq!(&buf[..], &file.data[5 * LBA..6 * LBA]);
    // Armed with a completion already waiting: readable at once.
    // SAFETY: as above.
    unsafe { qp.submit(&Command::read(6, 1, &mut buf), 8) }.expect("submit");
    let deadline = std::time::Instant::now() + TIMEOUT;
    while !qp_has_completion(&mut qp) {
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(Duration::from_micros(100));
    }
    qp.arm_interrupt();
    assert!(wait_readable(qp.interrupt_fd().unwrap(), 0).unwrap());
    assert_eq!(wait_one(&mut qp), (8, Status::SUCCESS));
}

/// Whether a completion is ready, without reaping it: the eventfd counts posted ones.
fn qp_has_completion(qp: &mut hypoll_nvme::UringQueuePair) -> bool {
    qp.arm_interrupt();
    wait_readable(qp.interrupt_fd().unwrap(), 0).unwrap()
}

#[test]
fn page_cache_mode_reads_and_writes_too() {
    let file = data_file(32, 4);
    let ctrl = open(&format!("uring:{},direct=0", file.path.display())).expect("open");
    assert!(
        ctrl.describe().contains("page cache"),
        "{}",
        ctrl.describe()
    );
    let mut qp = ctrl.create_queue_pair(4).expect("queue pair");
    let mut io = SyncIo::new(&mut *qp, TIMEOUT);
    assert_eq!(&io.read(3, 1).unwrap()[..], &file.data[3 * LBA..4 * LBA]);
    io.write(4, &[0xee; LBA]).unwrap();
    io.flush().unwrap();
    assert_eq!(
        &file_contents(&file.path)[4 * LBA..5 * LBA],
        &[0xee; LBA][..]
    );
}

#[test]
fn size_and_lba_keys_shape_the_namespace() {
    let file = data_file(64, 5);
    let ctrl = open(&format!("uring:{},size=128K,lba=512", file.path.display())).expect("open");
    let ns = ctrl.namespace();
    assert_eq!((ns.lba_size_bytes, ns.capacity_lbas), (512, 256));
    let mut qp = ctrl.create_queue_pair(2).expect("queue pair");
    let mut io = SyncIo::new(&mut *qp, TIMEOUT);
    assert_eq!(&io.read(8, 8).unwrap()[..], &file.data[LBA..2 * LBA]);
    assert_eq!(
        io.read(256, 1).err(),
        Some(IoError::Status(Status::LBA_OUT_OF_RANGE))
    );
}

#[test]
fn opening_errors_name_the_problem_and_the_fix() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();

    let missing = dir.path().join("absent.img");
    let msg = open_err(&UringConfig::new(&missing));
    assert!(
        msg.contains("no such file") && msg.contains("fill it"),
        "{msg}"
    );
    let err: std::io::Error = UringController::open(&UringConfig::new(&missing))
        .err()
        .unwrap()
        .into();
    assert_eq!(err.kind(), std::io::ErrorKind::NotFound);

    let odd = dir.path().join("odd.img");
    fs::write(&odd, vec![1u8; LBA + 512]).unwrap();
    let msg = open_err(&UringConfig::new(&odd));
    assert!(
        msg.contains("not a multiple of the block size (4096"),
        "{msg}"
    );
    // With 512-byte blocks the same file is fine.
    let mut small_blocks = UringConfig::new(&odd);
    small_blocks.lba_bytes = Some(512);
    UringController::open(&small_blocks).expect("a 512-byte namespace fits");

    let empty = dir.path().join("empty.img");
    fs::write(&empty, b"").unwrap();
    assert!(open_err(&UringConfig::new(&empty)).contains("empty"));

    let mut too_big = UringConfig::new(&odd);
    too_big.size_bytes = Some(1 << 20);
    assert!(open_err(&too_big).contains("larger than the file"));

    // A character device is neither a file nor a block device.
    let msg = open_err(&UringConfig::new("/dev/null"));
    assert!(
        msg.contains("not a regular file or a block device"),
        "{msg}"
    );

    // procfs refuses O_DIRECT.
    let msg = open_err(&UringConfig::new("/proc/version"));
    assert!(
        msg.contains("does not support O_DIRECT") && msg.contains("direct=0"),
        "{msg}"
    );

    // Parse errors name the key.
    let e = "uring:".parse::<DeviceConfig>().unwrap_err().to_string();
    assert!(e.contains("path"), "{e}");
    let e = "uring:/x,direct=maybe"
        .parse::<DeviceConfig>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("direct") && e.contains("0 or 1"), "{e}");
}

#[test]
fn permission_denied_is_reported_as_such() {
    let file = data_file(4, 6);
    fs::set_permissions(&file.path, fs::Permissions::from_mode(0o400)).unwrap();
    let cfg = UringConfig::new(&file.path);
    // Root passes permission checks: drop to an unprivileged file-system uid on this thread
    // only (setfsuid is per thread), which also drops CAP_DAC_OVERRIDE for file access.
    let msg = std::thread::spawn(move || {
        // SAFETY: setfsuid changes only this thread's file-system uid; the thread ends here.
        unsafe { libc::syscall(libc::SYS_setfsuid, 65534) };
        UringController::open(&cfg).err().map(|e| e.to_string())
    })
    .join()
    .unwrap()
    .expect("a read-only file cannot be opened for writing");
    assert!(msg.contains("permission denied"), "{msg}");
}

#[test]
fn io_uring_blocked_by_seccomp_is_reported_as_unavailable() {
    let file = data_file(4, 7);
    let cfg = UringConfig::new(&file.path);
    let msg = std::thread::spawn(move || {
        deny_io_uring_setup_on_this_thread();
        UringController::open(&cfg).err().map(|e| e.to_string())
    })
    .join()
    .unwrap()
    .expect("io_uring_setup is blocked");
    assert!(
        msg.contains("io_uring is not available")
            && msg.contains("ENOSYS")
            && msg.contains("seccomp"),
        "{msg}"
    );
}

/// Installs a seccomp filter, on the calling thread only, that fails io_uring_setup with
/// ENOSYS as a container runtime's default profile does.
fn deny_io_uring_setup_on_this_thread() {
    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
    const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
    const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
    let stmt = |code: u16, k: u32| libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    };
    let jump = |code: u16, k: u32, jt: u8, jf: u8| libc::sock_filter { code, jt, jf, k };
    let ld_w_abs = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    let jeq_k = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    let ret_k = (libc::BPF_RET | libc::BPF_K) as u16;
    // struct seccomp_data: nr at offset 0, arch at offset 4.
    let mut prog = [
        stmt(ld_w_abs, 4),
        jump(jeq_k, AUDIT_ARCH_X86_64, 1, 0),
        stmt(ret_k, SECCOMP_RET_ALLOW),
        stmt(ld_w_abs, 0),
        jump(jeq_k, libc::SYS_io_uring_setup as u32, 0, 1),
        stmt(ret_k, SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        stmt(ret_k, SECCOMP_RET_ALLOW),
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    // SAFETY: PR_SET_NO_NEW_PRIVS and PR_SET_SECCOMP affect only this thread (no TSYNC);
    // `fprog` points at a valid filter program for the duration of the call.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                std::ptr::from_ref(&fprog)
            ),
            0,
            "installing the seccomp filter: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[test]
fn writes_land_at_the_right_offsets_of_a_big_random_workload() {
    // Random writes from one queue pair at depth, then every block checked against a model.
    let blocks = 512;
    let file = data_file(blocks, 8);
    let ctrl = open(&format!("uring:{}", file.path.display())).expect("open");
    let mut qp = ctrl.create_queue_pair(32).expect("queue pair");
    let mut model = file.data.clone();
    let mut rng = Pcg64::seed_from_u64(8);
    let mut bufs: Vec<IoBuf> = Vec::new();
    // Distinct blocks per batch: two writes in flight to one block have no defined order.
    for _batch in 0..8 {
        let mut picked: Vec<usize> = (0..blocks).collect();
        for i in 0..32 {
            let j = rng.random_range(i..blocks);
            picked.swap(i, j);
        }
        bufs.clear();
        for (tag, &lba) in picked[..32].iter().enumerate() {
            let mut buf = IoBuf::zeroed(LBA);
            rng.fill(&mut buf[..]);
            model[lba * LBA..(lba + 1) * LBA].copy_from_slice(&buf);
            bufs.push(buf);
            // SAFETY: `bufs` keeps every buffer alive until the batch is reaped below.
            unsafe { qp.submit(&Command::write(lba as u64, 1, &bufs[tag]), tag as u64) }
                .expect("submit");
        }
        let mut done = 0;
        let deadline = std::time::Instant::now() + TIMEOUT;
        while done < 32 {
            done += qp.process_completions(32, &mut |c| assert_eq!(c.status, Status::SUCCESS));
            assert!(std::time::Instant::now() < deadline);
        }
    }
    drop(qp);
    let mut f = fs::File::open(&file.path).unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut on_disk = Vec::new();
    f.read_to_end(&mut on_disk).unwrap();
    assert!(on_disk == model, "file differs from the model");
}

#[test]
fn pinned_buffers_go_through_the_registered_fixed_buffer() {
    let file = data_file(32, 9);
    let ctrl = UringController::open(&UringConfig::new(&file.path)).expect("open");
    assert!(
        ctrl.describe().contains("fixed buffers"),
        "{}",
        ctrl.describe()
    );
    let mut qp = ctrl.queue_pair(4).expect("queue pair");
    if !qp.has_fixed_buffers() {
        // An unprivileged user over RLIMIT_MEMLOCK: the describe line says why.
        assert!(ctrl.describe().contains("no fixed buffers"));
        return;
    }
    let mut pinned = IoBuf::pinned(2 * LBA);
    assert!(pinned.is_pinned());
    // SAFETY: `pinned` outlives the command, reaped by wait_one.
    unsafe { qp.submit(&Command::read(2, 2, &mut pinned), 1) }.unwrap();
    assert_eq!(wait_one(&mut qp), (1, Status::SUCCESS));
    assert_eq!(&pinned[..], &file.data[2 * LBA..4 * LBA]);
    assert_eq!(qp.fixed_ios(), 1);
    pinned.fill(0x42);
    // SAFETY: as above.
    unsafe { qp.submit(&Command::write(9, 2, &pinned), 2) }.unwrap();
    assert_eq!(wait_one(&mut qp), (2, Status::SUCCESS));
    assert_eq!(qp.fixed_ios(), 2);
    // A heap buffer takes the plain path and reads what the fixed write wrote.
    let mut heap = IoBuf::zeroed(2 * LBA);
    // SAFETY: as above.
    unsafe { qp.submit(&Command::read(9, 2, &mut heap), 3) }.unwrap();
    assert_eq!(wait_one(&mut qp), (3, Status::SUCCESS));
    assert_eq!(qp.fixed_ios(), 2);
    assert!(heap.iter().all(|&b| b == 0x42));
}

#[test]
fn abort_completes_each_command_exactly_once_and_reset_is_left_to_the_kernel() {
    let file = data_file(64, 10);
    let ctrl = open(&format!("uring:{}", file.path.display())).expect("open");
    let mut qp = ctrl.create_queue_pair(8).expect("queue pair");
    // Nothing outstanding under that tag: nothing to do.
    assert_eq!(qp.abort(42), Ok(()));
    let mut bufs: Vec<IoBuf> = (0..4).map(|_| IoBuf::zeroed(LBA)).collect();
    for (i, buf) in bufs.iter_mut().enumerate() {
        // SAFETY: every buffer outlives the loop below, which reaps every command.
        unsafe { qp.submit(&Command::read(i as u64, 1, buf), i as u64) }.expect("submit");
    }
    // SAFETY: no buffer.
    unsafe { qp.submit(&Command::flush(), 4) }.expect("flush");
    for tag in 0..5 {
        assert_eq!(qp.abort(tag), Ok(()), "abort {tag}");
    }
    let mut seen = [0u32; 5];
    let deadline = std::time::Instant::now() + TIMEOUT;
    while qp.outstanding() > 0 {
        qp.process_completions(8, &mut |c| {
            assert!(
                c.status == Status::SUCCESS || c.status == Status::ABORT_REQUESTED,
                "tag {}: {:?}",
                c.tag,
                c.status
            );
            seen[c.tag as usize] += 1;
        });
        assert!(std::time::Instant::now() < deadline, "completions missing");
    }
    // The cancel requests' own completions never surface as commands' completions.
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(qp.process_completions(8, &mut |c| panic!("extra {c:?}")), 0);
    assert_eq!(seen, [1; 5]);
    assert_eq!(qp.reset(), Err(hypoll_nvme::RecoveryError::Unsupported));
}

#[test]
fn write_zeroes_without_zero_range_punches_then_allocates_unless_deallocation_is_allowed() {
    // tmpfs has no FALLOC_FL_ZERO_RANGE; skip where /dev/shm is absent.
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        return;
    };
    let path = dir.path().join("disk.img");
    let data: Vec<u8> = (0..16 * LBA).map(|i| (i % 251) as u8 + 1).collect();
    fs::write(&path, &data).unwrap();
    let ctrl = open(&format!("uring:{},direct=0", path.display())).expect("open");
    let mut qp = ctrl.create_queue_pair(4).expect("queue pair");
    let mut io = SyncIo::new(&mut *qp, TIMEOUT);
    for round in 0..2 {
        // The first refusal switches the queue pair to punch-hole; both rounds zero.
        let at = 2 + 4 * round;
        io.write_zeroes(at, 2).expect("write zeroes");
        assert!(
            io.read(at, 2).unwrap().iter().all(|&b| b == 0),
            "round {round}"
        );
        assert_eq!(
            &io.read(at + 2, 1).unwrap()[..],
            &data[(at as usize + 2) * LBA..(at as usize + 3) * LBA]
        );
    }
    // Zeroes stay allocated unless the command allows deallocation: tmpfs keeps a page per
    // 4 KiB, so an 8-block hole would show in the file's allocated size.
    let allocated_bytes = || fs::metadata(&path).unwrap().blocks() * 512;
    let full = allocated_bytes();
    io.write_zeroes(8, 8).expect("write zeroes");
    assert!(io.read(8, 8).unwrap().iter().all(|&b| b == 0));
    assert_eq!(
        allocated_bytes(),
        full,
        "zeroes without deallocation left a hole"
    );
    io.write_zeroes_deallocating(8, 8)
        .expect("write zeroes, deallocating");
    assert!(io.read(8, 8).unwrap().iter().all(|&b| b == 0));
    assert!(
        allocated_bytes() <= full - 8 * LBA as u64,
        "a deallocating write zeroes punched no hole: {} of {full} bytes allocated",
        allocated_bytes()
    );
}
