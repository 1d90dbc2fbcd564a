//! The `uring` device shared: several of them on one reactor, and one file open on several
//! reactors at once. Each reactor owns its own ring; these check that nothing in a ring's
//! setup, its interrupt eventfd or the reactor's wait mixes them up, with the default rings
//! and with rings that have a kernel submission thread of their own (`sqpoll=on`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hypoll_reactor::{Device, DeviceId, IoBuf, IoDone, Reactor, StandaloneConfig};

/// Longest any test here waits for its I/O.
const PATIENCE: Duration = Duration::from_secs(20);
const BLOCK_BYTES: usize = 4096;
const FILE_BYTES: usize = 4 << 20;
/// Blocks each device or reactor writes and reads back.
const BLOCKS: u64 = 64;
/// Room for every I/O a test keeps in flight at once (a reactor reads every range at once).
const QUEUE_DEPTH: usize = 256;
/// Device string options every test runs with: the default rings, and rings whose
/// submission thread sleeps after the shortest idle time the option takes, so that it is
/// asleep between a test's bursts and each burst must wake it.
const OPTIONS: [&str; 2] = ["", ",sqpoll=on,sqpoll_idle_ms=1"];
/// Longer than a submission thread's idle time under `OPTIONS`: it falls asleep.
const THREAD_SLEEPS: Duration = Duration::from_millis(10);

/// A file of `FILE_BYTES` in a directory of test `test`'s own, filled with data, not sparse: a hole would make the kernel's
/// reads of it skip the disk.
fn data_file(test: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hypoll-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, vec![0xa5u8; FILE_BYTES]).unwrap();
    path
}

fn open(path: &Path, options: &str) -> Device {
    Device::open(&format!("uring:{}{options}", path.display())).unwrap()
}

/// The bytes block `lba` holds once writer `who` wrote it.
fn pattern(who: u8, lba: u64) -> Vec<u8> {
    (0..BLOCK_BYTES)
        .map(|i| who ^ (lba as u8) ^ (i as u8).wrapping_mul(31))
        .collect()
}

#[derive(Default)]
struct State {
    done: u64,
    failed: u64,
    /// Reads whose bytes were not what their writer wrote.
    wrong: u64,
    /// Messages run.
    messages: u64,
    /// Reads keep being submitted while this is set.
    reading: bool,
}

fn reactor(policy: &str) -> Reactor<State> {
    let cfg = StandaloneConfig {
        policy: policy.to_string(),
        ..StandaloneConfig::default()
    };
    Reactor::<State>::standalone(cfg).unwrap().0
}

/// Turns `r` until `want` I/Os completed.
fn drive(r: &mut Reactor<State>, state: &mut State, want: u64) {
    let deadline = Instant::now() + PATIENCE;
    while state.done < want {
        assert!(
            Instant::now() < deadline,
            "{} of {want} I/Os after {PATIENCE:?}",
            state.done
        );
        if r.poll(state) == 0 {
            r.idle();
        }
    }
}

/// Writes `who`'s pattern to blocks `first..first + BLOCKS` of `dev`, all in flight at once.
fn write_blocks(r: &mut Reactor<State>, dev: DeviceId, who: u8, first: u64) {
    for lba in first..first + BLOCKS {
        let buf = IoBuf::from_slice(&pattern(who, lba));
        r.write(dev, lba, 1, buf, |_, s: &mut State, d| {
            s.done += 1;
            s.failed += u64::from(d.result.is_err());
        })
        .unwrap_or_else(|e| panic!("write {lba} refused: {:?}", e.reason));
    }
}

/// Reads blocks `first..first + BLOCKS` of `dev` and counts those that are not `who`'s.
fn read_blocks(r: &mut Reactor<State>, dev: DeviceId, who: u8, first: u64) {
    read_blocks_from(r, dev, who, first, BLOCKS);
}

/// Reads `count` blocks from `first` of `dev`, all in flight at once, checking `who`'s
/// pattern in each.
fn read_blocks_from(r: &mut Reactor<State>, dev: DeviceId, who: u8, first: u64, count: u64) {
    for lba in first..first + count {
        let check = move |_: &mut Reactor<State>, s: &mut State, d: IoDone| {
            s.done += 1;
            match &d.result {
                Ok(()) => {
                    let right = d.buf.as_deref() == Some(&pattern(who, lba)[..]);
                    s.wrong += u64::from(!right);
                }
                Err(_) => s.failed += 1,
            }
        };
        r.read(dev, lba, 1, IoBuf::zeroed(BLOCK_BYTES), check)
            .unwrap_or_else(|e| panic!("read {lba} refused: {:?}", e.reason));
    }
}

#[test]
fn several_uring_devices_on_one_reactor_keep_their_own_data() {
    let (a, b) = (
        data_file("uring-devices", "a.img"),
        data_file("uring-devices", "b.img"),
    );
    // `interrupt` waits on both rings' eventfds at once; `classic` polls both rings.
    for (policy, options) in ["interrupt", "classic"]
        .into_iter()
        .flat_map(|p| OPTIONS.map(|o| (p, o)))
    {
        let mut r = reactor(policy);
        let dev_a = r.attach(&open(&a, options), QUEUE_DEPTH).unwrap();
        let dev_b = r.attach(&open(&b, options), QUEUE_DEPTH).unwrap();
        let mut state = State::default();
        // The same blocks on both devices, written with different data, all in flight.
        write_blocks(&mut r, dev_a, 1, 0);
        write_blocks(&mut r, dev_b, 2, 0);
        drive(&mut r, &mut state, 2 * BLOCKS);
        std::thread::sleep(THREAD_SLEEPS);
        read_blocks(&mut r, dev_a, 1, 0);
        read_blocks(&mut r, dev_b, 2, 0);
        drive(&mut r, &mut state, 4 * BLOCKS);
        // Then one read on each device, alone. Among many reads a submission thread can
        // post completions faster than the turns take them, so that every turn finds one
        // and the reactor never idles (a call to `idle` after a turn that did work does
        // nothing); with two reads of the disk in flight, a turn soon finds none, and
        // `interrupt` waits on both rings at once.
        std::thread::sleep(THREAD_SLEEPS);
        read_blocks_from(&mut r, dev_a, 1, 0, 1);
        read_blocks_from(&mut r, dev_b, 2, BLOCKS - 1, 1);
        drive(&mut r, &mut state, 4 * BLOCKS + 2);
        let what = format!("policy {policy}, options {options:?}");
        assert_eq!((state.failed, state.wrong), (0, 0), "{what}");
        if policy == "interrupt" {
            assert!(r.counters().interrupt_waits > 0, "{what}: never waited");
        }
        let report = r.shut_down(&mut state);
        assert_eq!(report.failed_ios, 0, "{what}");
    }
    std::fs::remove_dir_all(a.parent().unwrap()).unwrap();
}

#[test]
fn one_file_on_several_reactors_at_once() {
    let path = data_file("uring-shared", "shared.img");
    const REACTORS: u8 = 3;
    // Each reactor, on its own thread with its own ring on the same file, writes its own
    // range, then (once all have written) reads every range back; every other one with a
    // submission thread.
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(usize::from(REACTORS)));
    let threads: Vec<_> = (0..REACTORS)
        .map(|who| {
            let (path, barrier) = (path.clone(), barrier.clone());
            std::thread::spawn(move || {
                let policy = if who % 2 == 0 { "interrupt" } else { "classic" };
                let mut r = reactor(policy);
                let options = OPTIONS[usize::from(who) % OPTIONS.len()];
                let dev = r.attach(&open(&path, options), QUEUE_DEPTH).unwrap();
                let mut state = State::default();
                write_blocks(&mut r, dev, who, u64::from(who) * BLOCKS);
                drive(&mut r, &mut state, BLOCKS);
                barrier.wait();
                std::thread::sleep(THREAD_SLEEPS);
                for other in 0..REACTORS {
                    read_blocks(&mut r, dev, other, u64::from(other) * BLOCKS);
                }
                drive(&mut r, &mut state, BLOCKS * (1 + u64::from(REACTORS)));
                r.shut_down(&mut state);
                (state.failed, state.wrong)
            })
        })
        .collect();
    for (who, t) in threads.into_iter().enumerate() {
        assert_eq!(t.join().unwrap(), (0, 0), "reactor {who}");
    }
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// Keeps one read of block `lba` in flight: each completion submits the next while
/// `State::reading` is set.
fn read_again(r: &mut Reactor<State>, dev: DeviceId, lba: u64) {
    let next = move |r: &mut Reactor<State>, s: &mut State, d: IoDone| {
        s.done += 1;
        s.failed += u64::from(d.result.is_err());
        if s.reading {
            read_again(r, dev, lba);
        }
    };
    r.read(dev, lba, 1, IoBuf::zeroed(BLOCK_BYTES), next)
        .unwrap_or_else(|e| panic!("read {lba} refused: {:?}", e.reason));
}

/// A reactor whose one busy device is a `uring` queue pair waits inside its ring
/// (`wait=ring`, the default) rather than in epoll; messages sent meanwhile from another
/// thread all still run. `wait=epoll` keeps the epoll route.
#[test]
fn a_reactor_waits_inside_the_ring_and_still_runs_its_messages() {
    let path = data_file("uring-ring-wait", "ring.img");
    const MESSAGES: u64 = 200;
    for (wait, options) in ["ring", "epoll"]
        .into_iter()
        .flat_map(|w| OPTIONS.map(|o| (w, o)))
    {
        let cfg = StandaloneConfig {
            policy: "interrupt".to_string(),
            ..StandaloneConfig::default()
        };
        let (mut r, handle) = Reactor::<State>::standalone(cfg).unwrap();
        let device = open(&path, &format!(",wait={wait}{options}"));
        let dev = r.attach(&device, QUEUE_DEPTH).unwrap();
        let mut state = State {
            reading: true,
            ..State::default()
        };
        for lba in 0..4 {
            read_again(&mut r, dev, lba);
        }
        let sender = std::thread::spawn(move || {
            for _ in 0..MESSAGES {
                std::thread::sleep(Duration::from_micros(300));
                handle
                    .send(|_, s: &mut State| s.messages += 1)
                    .expect("the reactor takes messages");
            }
        });
        let deadline = Instant::now() + PATIENCE;
        while state.messages < MESSAGES {
            assert!(
                Instant::now() < deadline,
                "wait={wait}: {} of {MESSAGES} messages ran after {PATIENCE:?}",
                state.messages
            );
            if r.poll(&mut state) == 0 {
                r.idle();
            }
        }
        sender.join().unwrap();
        state.reading = false;
        let counters = *r.counters();
        assert!(counters.interrupt_waits > 0, "wait={wait}: never waited");
        if wait == "ring" {
            assert!(counters.ring_waits > 0, "never waited inside the ring");
        } else {
            assert_eq!(counters.ring_waits, 0, "wait=epoll waited inside the ring");
        }
        assert_eq!(state.failed, 0, "wait={wait}");
        let report = r.shut_down(&mut state);
        assert_eq!(report.failed_ios, 0);
    }
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}
