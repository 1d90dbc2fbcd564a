//! Unit tests of `sqpoll=on`: the keys and the rules between them, data through a ring whose
//! submission thread takes the entries, that thread woken after it went to sleep (on every
//! route a reactor takes: a poll, an armed eventfd, a wait inside the ring), several rings
//! with threads of their own at once, and what the kernel refuses.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::*;
use crate::config::ConfigError;
use crate::device::DeviceConfig;
use crate::qpair::{Command, QueuePair};
use crate::spec::Status;
use crate::sync::SyncIo;
use crate::sys::EventFd;

const LBA: usize = 4096;
const TIMEOUT: Duration = Duration::from_secs(10);
/// A submission thread's idle time short enough that a test sees it fall asleep.
const SHORT_IDLE_MS: u32 = 5;

/// A file of `blocks` blocks of data that depends on `seed` (never sparse).
fn data_file(dir: &Path, name: &str, blocks: usize, seed: usize) -> (PathBuf, Vec<u8>) {
    let path = dir.join(name);
    let data: Vec<u8> = (0..blocks * LBA)
        .map(|i| (i * 31 + i / LBA * 7 + seed) as u8)
        .collect();
    std::fs::write(&path, &data).unwrap();
    (path, data)
}

/// A `sqpoll=on` device string's configuration, in interrupt mode, with `idle_ms`.
fn sqpoll_config(path: &Path, idle_ms: u32) -> UringConfig {
    let spec = format!(
        "uring:{},iopoll=off,sqpoll=on,sqpoll_idle_ms={idle_ms}",
        path.display()
    );
    match spec.parse::<DeviceConfig>().unwrap() {
        DeviceConfig::Uring(cfg) => cfg,
        other => panic!("{spec} parsed as {other:?}"),
    }
}

/// Threads of this process that are io_uring submission threads.
fn submission_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with("iou-sqp"))
        })
        .count()
}

/// Polls until one completion comes, for up to `TIMEOUT`.
fn wait_one(qp: &mut UringQueuePair) -> (u64, Status) {
    let deadline = Instant::now() + TIMEOUT;
    let mut seen = None;
    while seen.is_none() {
        qp.process_completions(1, &mut |c| seen = Some((c.tag, c.status)));
        assert!(
            Instant::now() < deadline,
            "no completion within {TIMEOUT:?}"
        );
    }
    seen.unwrap()
}

/// Sleeps until the queue pair's submission thread is asleep (well past its idle time).
fn until_asleep(qp: &mut UringQueuePair) {
    let deadline = Instant::now() + TIMEOUT;
    while !qp.submission_thread_asleep() {
        assert!(
            Instant::now() < deadline,
            "the submission thread never slept"
        );
        std::thread::sleep(Duration::from_millis(u64::from(SHORT_IDLE_MS) * 4));
    }
}

#[test]
fn sqpoll_keys_parse_check_each_other_and_print_back() {
    let mut cfg = UringConfig::new("/tmp/disk.img");
    assert_eq!(cfg.sqpoll(), None);
    cfg.set("sqpoll", "on").unwrap();
    assert_eq!(
        cfg.sqpoll(),
        Some(SqPoll {
            idle_ms: SQPOLL_IDLE_MS_DEFAULT,
            cpu: None
        })
    );
    assert_eq!(cfg.to_string(), "uring:/tmp/disk.img,sqpoll=on");
    cfg.set("sqpoll_idle_ms", "20").unwrap();
    cfg.set("sqpoll_cpu", "1").unwrap();
    assert_eq!(
        cfg.to_string(),
        "uring:/tmp/disk.img,sqpoll=on,sqpoll_idle_ms=20,sqpoll_cpu=1"
    );
    assert_eq!(
        cfg.sqpoll(),
        Some(SqPoll {
            idle_ms: 20,
            cpu: Some(1)
        })
    );
    // The canonical text parses back to the same configuration.
    assert_eq!(
        cfg.to_string().parse::<DeviceConfig>().unwrap(),
        DeviceConfig::Uring(cfg.clone())
    );
    for (key, value) in [
        ("sqpoll", "maybe"),
        ("sqpoll", ""),
        ("sqpoll_idle_ms", "0"),
        ("sqpoll_idle_ms", "60001"),
        ("sqpoll_idle_ms", "1s"),
        ("sqpoll_idle_ms", "-5"),
        ("sqpoll_cpu", "-1"),
        ("sqpoll_cpu", "1024"),
        ("sqpoll_cpu", "any"),
    ] {
        assert!(
            matches!(cfg.set(key, value), Err(ConfigError::BadValue { .. })),
            "{key}={value} accepted"
        );
    }
    // The thread's settings need the thread, in whatever order the keys come.
    for spec in [
        "uring:/tmp/disk.img,sqpoll_idle_ms=10",
        "uring:/tmp/disk.img,sqpoll_cpu=0",
        "uring:/tmp/disk.img,sqpoll=on,sqpoll_idle_ms=10,sqpoll=off",
    ] {
        let err = spec.parse::<DeviceConfig>().unwrap_err().to_string();
        assert!(err.contains("sqpoll=on"), "{spec}: {err}");
    }
    for spec in [
        "uring:/tmp/disk.img,sqpoll_idle_ms=10,sqpoll=on",
        "uring:/tmp/disk.img,sqpoll_cpu=0,sqpoll=1",
        "uring:/tmp/disk.img,sqpoll=off",
    ] {
        spec.parse::<DeviceConfig>()
            .unwrap_or_else(|e| panic!("{spec}: {e}"));
    }
}

/// Reads and writes round-trip through a ring whose submission thread takes them, and a
/// queue pair with nothing left to do says so: every entry is the kernel's once handed over
/// (the thread may take some before the hand-over counts them), so arming the eventfd
/// leaves it quiet and a reactor can sleep.
#[test]
fn reads_and_writes_round_trip_through_a_submission_thread() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = data_file(dir.path(), "disk.img", 32, 1);
    let ctrl = UringController::open(&sqpoll_config(&path, SQPOLL_IDLE_MS_DEFAULT)).unwrap();
    let described = ctrl.describe();
    assert!(described.contains("SQPOLL"), "{described}");
    assert!(described.contains("taskrun= does not apply"), "{described}");
    let mut qp = ctrl.queue_pair(8).unwrap();
    assert!(qp.has_submission_thread());
    assert!(!qp.defer_taskrun);
    assert!(submission_threads() >= 1);
    let mut io = SyncIo::new(&mut qp, TIMEOUT);
    for lba in [0, 5, 31] {
        let got = io.read(lba, 1).unwrap();
        assert_eq!(&got[..], &data[lba as usize * LBA..][..LBA]);
    }
    let pattern: Vec<u8> = (0..3 * LBA).map(|i| (i * 11 + 5) as u8).collect();
    io.write(7, &pattern).unwrap();
    io.flush().unwrap();
    assert_eq!(&io.read(7, 3).unwrap()[..], &pattern[..]);
    // Many at once, more than fit in one poll's reap.
    let mut bufs: Vec<crate::IoBuf> = (0..8).map(|_| crate::IoBuf::zeroed(LBA)).collect();
    for (tag, buf) in bufs.iter_mut().enumerate() {
        // SAFETY: every buffer outlives its read, reaped below.
        unsafe { qp.submit(&Command::read(tag as u64 + 10, 1, buf), tag as u64) }.unwrap();
    }
    // The thread, awake, takes them before the queue pair hands them over.
    std::thread::sleep(Duration::from_millis(20));
    let mut done = 0;
    while done < 8 {
        let (_, status) = wait_one(&mut qp);
        assert_eq!(status, Status::SUCCESS);
        done += 1;
    }
    for (tag, buf) in bufs.iter().enumerate() {
        assert_eq!(&buf[..], &data[(tag + 10) * LBA..][..LBA], "read {tag}");
    }
    assert_eq!(qp.unsubmitted(), 0);
    qp.arm_interrupt();
    let fd = qp.interrupt_fd().expect("interrupt mode");
    assert!(
        !crate::sys::wait_readable(fd, 50).unwrap(),
        "an idle queue pair signalled its eventfd: a reactor would never sleep"
    );
    std::fs::File::open(&path).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap()[7 * LBA..10 * LBA],
        pattern[..]
    );
}

/// Once its ring stays empty past `sqpoll_idle_ms` the submission thread sleeps and takes
/// nothing until woken. Each route a reactor takes to hand entries over wakes it: a poll, an
/// armed eventfd (epoll), a wait inside the ring.
#[test]
fn a_submission_thread_that_went_to_sleep_is_woken_by_the_next_submission() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = data_file(dir.path(), "disk.img", 16, 2);
    let ctrl = UringController::open(&sqpoll_config(&path, SHORT_IDLE_MS)).unwrap();
    let mut qp = ctrl.queue_pair(8).unwrap();
    let mut buf = crate::IoBuf::zeroed(LBA);

    // A poll.
    until_asleep(&mut qp);
    // SAFETY: `buf` outlives the read, reaped below.
    unsafe { qp.submit(&Command::read(3, 1, &mut buf), 1) }.unwrap();
    assert_eq!(wait_one(&mut qp), (1, Status::SUCCESS));
    assert_eq!(&buf[..], &data[3 * LBA..4 * LBA]);

    // The eventfd, armed with the entry still pending: arming hands it over.
    until_asleep(&mut qp);
    // SAFETY: as above.
    unsafe { qp.submit(&Command::read(4, 1, &mut buf), 2) }.unwrap();
    qp.arm_interrupt();
    let fd = qp.interrupt_fd().expect("interrupt mode");
    assert!(
        crate::sys::wait_readable(fd, TIMEOUT.as_millis() as i32).unwrap(),
        "no completion signalled: the sleeping thread was not woken"
    );
    qp.disarm_interrupt();
    assert_eq!(wait_one(&mut qp), (2, Status::SUCCESS));
    assert_eq!(&buf[..], &data[4 * LBA..5 * LBA]);

    // A wait inside the ring, after a poll that (with a thread to take them) holds nothing.
    assert!(qp.can_wait_in_ring());
    let wake = EventFd::new().unwrap();
    until_asleep(&mut qp);
    // SAFETY: as above.
    unsafe { qp.submit(&Command::read(5, 1, &mut buf), 3) }.unwrap();
    // The poll wakes the thread; on a busy machine the read may be done before the poll
    // looks for completions, and is reaped there.
    let mut seen = None;
    qp.process_completions(8, &mut |c| seen = Some((c.tag, c.status)));
    assert_eq!(qp.unsubmitted(), 0, "held back although a thread takes it");
    qp.prepare_ring_wait(&wake);
    let deadline_ns = crate::sys::monotonic_ns() + TIMEOUT.as_nanos() as u64;
    if seen.is_some() {
        eprintln!("the read completed within the waking poll: the wait in the ring not tested");
    }
    while seen.is_none() {
        let how = qp.wait_in_ring(&wake, Some(deadline_ns));
        assert_ne!(
            how,
            RingWake::Deadline,
            "the wait was never ended by the read"
        );
        qp.process_completions(8, &mut |c| seen = Some((c.tag, c.status)));
    }
    assert_eq!(seen, Some((3, Status::SUCCESS)));
    assert_eq!(&buf[..], &data[5 * LBA..6 * LBA]);
}

/// Several devices and queue pairs, each ring with its own submission thread, each queue
/// pair on a thread of its own as reactors are: every one reads its own file's data and
/// writes land where they were sent.
#[test]
fn several_rings_with_submission_threads_keep_their_own_data() {
    const DEVICES: usize = 3;
    let dir = tempfile::tempdir().unwrap();
    let files: Vec<_> = (0..DEVICES)
        .map(|d| data_file(dir.path(), &format!("disk{d}.img"), 16, d * 3))
        .collect();
    let threads: Vec<_> = files
        .iter()
        .cloned()
        .enumerate()
        .map(|(d, (path, data))| {
            std::thread::spawn(move || {
                let ctrl = UringController::open(&sqpoll_config(&path, SHORT_IDLE_MS)).unwrap();
                // Two queue pairs on one device: two rings, two threads.
                let mut qps = [ctrl.queue_pair(4).unwrap(), ctrl.queue_pair(4).unwrap()];
                for round in 0..20u64 {
                    for (q, qp) in qps.iter_mut().enumerate() {
                        let lba = (round * 2 + q as u64) % 16;
                        let mut io = SyncIo::new(qp, TIMEOUT);
                        let got = io.read(lba, 1).unwrap();
                        assert_eq!(&got[..], &data[lba as usize * LBA..][..LBA], "device {d}");
                        let mark = vec![(d * 16 + q) as u8; LBA];
                        io.write(lba, &mark).unwrap();
                        assert_eq!(&io.read(lba, 1).unwrap()[..], &mark[..]);
                        io.write(lba, &data[lba as usize * LBA..][..LBA]).unwrap();
                    }
                    if round % 5 == 4 {
                        // Let the threads fall asleep between some rounds.
                        std::thread::sleep(Duration::from_millis(u64::from(SHORT_IDLE_MS) * 4));
                    }
                }
                // Two rings, two threads of this process.
                let tids = qps.map(|qp| qp.submission_thread_tid().expect("SqThread"));
                assert_ne!(tids[0], tids[1]);
                for tid in tids {
                    let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"));
                    assert!(comm.unwrap().starts_with("iou-sqp"));
                }
                tids
            })
        })
        .collect();
    let mut tids: Vec<u32> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    tids.sort_unstable();
    tids.dedup();
    assert_eq!(
        tids.len(),
        2 * DEVICES,
        "a submission thread shared between rings"
    );
    for (path, data) in &files {
        assert_eq!(&std::fs::read(path).unwrap(), data);
    }
}

/// What the kernel refuses is refused when the device opens, naming the option: a
/// submission thread pinned to a CPU that is not there.
#[test]
fn a_submission_thread_on_a_cpu_that_is_not_there_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = data_file(dir.path(), "disk.img", 4, 3);
    let mut cfg = sqpoll_config(&path, SHORT_IDLE_MS);
    cfg.set("sqpoll_cpu", &(SQPOLL_CPU_LIMIT - 1).to_string())
        .unwrap();
    match UringController::open(&cfg) {
        Ok(_) => panic!("a thread on CPU {} was accepted", SQPOLL_CPU_LIMIT - 1),
        Err(e) => {
            let text = e.to_string();
            assert!(matches!(e, UringOpenError::SqpollRefused { .. }), "{text}");
            assert!(text.contains("sqpoll"), "{text}");
            assert!(
                text.contains(&format!("CPU {}", SQPOLL_CPU_LIMIT - 1)),
                "{text}"
            );
        }
    }
    // A CPU this process may run on is taken.
    if let Some(cpu) = first_allowed_cpu() {
        cfg.sqpoll_cpu = Some(cpu);
        let ctrl = UringController::open(&cfg).unwrap();
        let mut qp = ctrl.queue_pair(4).unwrap();
        SyncIo::new(&mut qp, TIMEOUT).read(1, 1).unwrap();
    }
}

/// The first CPU this process may run on, as `/proc/self/status` lists them.
fn first_allowed_cpu() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    let first = list.trim().split([',', '-']).next()?;
    first.parse().ok()
}

/// CPU time this process's thread `tid` has run, in ns.
fn thread_cpu_ns(tid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).unwrap();
    stat.split_whitespace().next().unwrap().parse().unwrap()
}

/// The submission thread polls for its idle time after each submission, and that time is
/// counted: it grows, and the process-wide sum includes it (other tests' threads come and
/// go meanwhile, so the sum itself may shrink).
#[test]
fn the_submission_threads_cpu_time_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = data_file(dir.path(), "disk.img", 4, 4);
    let ctrl = UringController::open(&sqpoll_config(&path, 200)).unwrap();
    let mut qp = ctrl.queue_pair(4).unwrap();
    let tid = qp.submission_thread_tid().expect("SqThread");
    let before_ns = thread_cpu_ns(tid);
    SyncIo::new(&mut qp, TIMEOUT).read(1, 1).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let after_ns = thread_cpu_ns(tid);
    assert!(
        after_ns > before_ns,
        "{before_ns} ns then {after_ns} ns: the thread did not poll"
    );
    let all_ns = io_uring_threads_cpu_ns();
    assert!(
        all_ns >= after_ns,
        "{all_ns} ns in all, {after_ns} ns in one"
    );
}
