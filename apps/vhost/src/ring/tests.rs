//! A ring on a reactor driven by hand, with a guest played by the test: requests read
//! through to the device and answered on the used ring; notifications off while the ring
//! is polled, on again (and the ring looked at once more) before the reactor blocks; a
//! kick waking a parked reactor; a stop that publishes the ring's base.

use std::fs::File;
use std::io::Read;
use std::os::fd::FromRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypoll_reactor::{Device, Reactor, ReactorTuning, StandaloneConfig};
use virtio_bindings::virtio_blk as vb;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::{RingShared, RingStart};
use crate::blk::{Geometry, S_OK};
use crate::memory::{ConnShared, MemoryTable};
use crate::server::Standalone;
use crate::shard::VhostShard;
use crate::testkit::{put_chain, put_header};

const SIZE: u16 = 16;
const DESC: u64 = 0x1000;
const AVAIL: u64 = 0x2000;
const USED: u64 = 0x3000;
/// Where request `k` keeps its header, status byte and data.
fn header(k: u16) -> u64 {
    0x4000 + 0x100 * u64::from(k)
}
fn status(k: u16) -> u64 {
    header(k) + 0x80
}
fn data(k: u16) -> u64 {
    0x8000 + 0x1000 * u64::from(k)
}

/// An eventfd, as the front end would pass one.
fn eventfd() -> File {
    // SAFETY: eventfd takes no pointers; a non-negative return is a new fd we own.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and nothing else owns it.
    unsafe { File::from_raw_fd(fd) }
}

/// The test's side of the ring: it posts reads as a driver does.
struct Guest {
    mem: Arc<GuestMemoryMmap>,
    posted: u16,
    kick: File,
}

impl Guest {
    /// Posts a read of one sector into request slot `posted`; kicks if the ring asked to
    /// be told (event index). Returns whether it kicked.
    fn post_read(&mut self) -> bool {
        let k = self.posted;
        self.post(vb::VIRTIO_BLK_T_IN, u64::from(k), 512, None)
    }

    /// Posts a request of `kind` at `sector` with `len` data bytes in request slot
    /// `posted` (descriptors `3 * (posted % 5)` on): written by the guest as `fill` if
    /// given, else for the device to write. Returns whether it kicked.
    fn post(&mut self, kind: u32, sector: u64, len: u32, fill: Option<u8>) -> bool {
        self.post_at(kind, sector, len, data(self.posted), fill)
    }

    /// [`Guest::post`] with the data at guest address `at`.
    fn post_at(&mut self, kind: u32, sector: u64, len: u32, at: u64, fill: Option<u8>) -> bool {
        let k = self.posted;
        let first = 3 * (k % 5);
        put_header(&self.mem, header(k), kind, sector);
        if let Some(byte) = fill {
            let bytes = vec![byte; len as usize];
            self.mem.write_slice(&bytes, GuestAddress(at)).unwrap();
        }
        let table = DESC + 16 * u64::from(first);
        put_chain(
            &self.mem,
            table,
            &[
                (header(k), 16, false),
                (at, len, fill.is_none()),
                (status(k), 1, true),
            ],
        );
        // `put_chain` links 0, 1, 2 of the table it is given: relink to absolute indices.
        for i in 0..2u16 {
            let at = GuestAddress(table + 16 * u64::from(i) + 14);
            self.mem.write_obj(first + i + 1, at).unwrap();
        }
        self.mem.write_obj(0xeeu8, GuestAddress(status(k))).unwrap();
        let slot = AVAIL + 4 + 2 * u64::from(k % SIZE);
        self.mem.write_obj(first, GuestAddress(slot)).unwrap();
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let old = k;
        self.posted += 1;
        self.mem
            .write_obj(self.posted, GuestAddress(AVAIL + 2))
            .unwrap();
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // vring_need_event(avail_event, new, old)
        let event = self.avail_event();
        let kick = self.posted.wrapping_sub(event).wrapping_sub(1) < self.posted.wrapping_sub(old);
        if kick {
            use std::io::Write;
            (&self.kick).write_all(&1u64.to_ne_bytes()).unwrap();
        }
        kick
    }

    fn avail_event(&self) -> u16 {
        self.mem
            .read_obj(GuestAddress(USED + 4 + 8 * u64::from(SIZE)))
            .unwrap()
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(USED + 2)).unwrap()
    }

    fn status(&self, k: u16) -> u8 {
        self.mem.read_obj(GuestAddress(status(k))).unwrap()
    }
}

/// A reactor with one ring on an emulated device, and the guest; the reactor parks as soon
/// as it goes idle.
fn setup() -> (Reactor<Standalone>, Standalone, Guest, Arc<RingShared>) {
    setup_with(StandaloneConfig {
        tuning: ReactorTuning {
            idle_spin_ns: 0,
            ..ReactorTuning::default()
        },
        ..StandaloneConfig::default()
    })
}

/// [`setup`] with the reactor built from `cfg`.
fn setup_with(cfg: StandaloneConfig) -> (Reactor<Standalone>, Standalone, Guest, Arc<RingShared>) {
    setup_ring(cfg, |_| {})
}

/// [`setup_with`], the ring's start edited by `edit` before the ring starts.
fn setup_ring(
    cfg: StandaloneConfig,
    edit: impl FnOnce(&mut RingStart),
) -> (Reactor<Standalone>, Standalone, Guest, Arc<RingShared>) {
    let rig = rig("emu:dram,size=1M", cfg, edit);
    (rig.r, rig.state, rig.guest, rig.shared)
}

/// A ring on a reactor, its guest, and the guest's memory table as the control holds it.
struct Rig {
    r: Reactor<Standalone>,
    state: Standalone,
    guest: Guest,
    shared: Arc<RingShared>,
    table: MemoryTable,
    conn: Arc<ConnShared>,
}

/// A ring on `device` (1 MiB of guest memory at guest address 0), built from `cfg`, its
/// start edited by `edit`.
fn rig(device: &str, cfg: StandaloneConfig, edit: impl FnOnce(&mut RingStart)) -> Rig {
    let (mut r, _handle) = Reactor::<Standalone>::standalone(cfg).unwrap();
    let device = Device::open(device).unwrap();
    let geometry = Geometry::new(&device.ctrl.namespace(), false, false, false, 1);
    let vhost = VhostShard::new(&mut r, &[("d".into(), device, geometry)], 32).unwrap();
    let mut state = Standalone { vhost };
    let file = tempfile::tempfile().unwrap();
    file.set_len(1 << 20).unwrap();
    let mut table = MemoryTable::default();
    table.add(0, 1 << 20, 0x7000_0000, 0, file).unwrap();
    let conn = ConnShared::new();
    table.publish(&conn);
    let mem = conn.memory().1.unwrap().guest().clone();
    let kick = eventfd();
    let shared = RingShared::new();
    let mut start = RingStart {
        export: 0,
        conn: conn.clone(),
        shared: shared.clone(),
        queue_size: SIZE,
        desc: DESC,
        avail: AVAIL,
        used: USED,
        base: 0,
        event_idx: true,
        indirect: false,
        kick: kick.try_clone().unwrap(),
        call: Some(eventfd()),
        err: None,
        inflight: None,
        tell_control: Box::new(|| {}),
    };
    edit(&mut start);
    state.vhost.start_ring(&mut r, start);
    assert_eq!(state.vhost.rings(), 1);
    let guest = Guest {
        mem,
        posted: 0,
        kick,
    };
    Rig {
        r,
        state,
        guest,
        shared,
        table,
        conn,
    }
}

/// Polls until the guest has `n` requests answered.
fn answered(r: &mut Reactor<Standalone>, state: &mut Standalone, guest: &Guest, n: u16) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while guest.used_idx() != n {
        assert!(Instant::now() < deadline, "request {n} answered in time");
        r.poll(state);
    }
    assert_eq!(guest.status(n - 1), S_OK);
}

/// Polls until a turn finds nothing.
fn quiet(r: &mut Reactor<Standalone>, state: &mut Standalone) {
    while r.poll(state) > 0 {}
}

#[test]
fn a_request_posted_while_notifications_are_off_is_found_before_the_reactor_blocks() {
    let (mut r, mut state, mut guest, _shared) = setup();
    // Nothing can wake a block before this timer: a block that should not happen shows.
    let timer = Duration::from_secs(2);
    r.after(timer, |_, _| {});
    assert!(guest.post_read(), "a new ring asks to be kicked");
    answered(&mut r, &mut state, &guest, 1);
    quiet(&mut r, &mut state);
    // The ring was read: notifications went off (event index: the avail event stays
    // behind), so the next request is not kicked...
    assert_eq!(guest.avail_event(), 0);
    assert!(
        !guest.post_read(),
        "no kick while the reactor polls the ring"
    );
    // ... and the reactor, about to block, turns them on, looks again, finds it.
    let before = Instant::now();
    r.idle();
    assert!(before.elapsed() < timer / 2, "the reactor did not block");
    assert_eq!(guest.avail_event(), 1, "notifications are on again");
    answered(&mut r, &mut state, &guest, 2);
}

#[test]
fn a_kick_wakes_a_reactor_blocked_with_notifications_on() {
    let (mut r, mut state, mut guest, _shared) = setup();
    let timer = Duration::from_secs(3);
    r.after(timer, |_, _| {});
    guest.post_read();
    answered(&mut r, &mut state, &guest, 1);
    quiet(&mut r, &mut state);
    let mem = guest.mem.clone();
    let kick = guest.kick.try_clone().unwrap();
    // Timed from before the poster starts: its 100 ms cannot begin earlier.
    let before = Instant::now();
    let poster = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        let mut g = Guest {
            mem,
            posted: 1,
            kick,
        };
        g.post_read()
    });
    r.idle();
    let woke = before.elapsed();
    assert!(
        poster.join().unwrap(),
        "notifications were on: the guest kicked"
    );
    assert!(
        woke >= Duration::from_millis(100) && woke < timer / 2,
        "blocked until the kick ({woke:?})"
    );
    guest.posted = 2;
    answered(&mut r, &mut state, &guest, 2);
}

#[test]
fn a_stopped_ring_answers_what_it_took_and_publishes_its_base() {
    let (mut r, mut state, mut guest, shared) = setup();
    for _ in 0..3 {
        guest.post_read();
    }
    shared.request_stop();
    let deadline = Instant::now() + Duration::from_secs(5);
    while shared.stopped().is_none() {
        assert!(Instant::now() < deadline, "the ring stopped in time");
        r.poll(&mut state);
    }
    // Whatever it took was answered; the base is where it stopped taking.
    let base = shared.stopped().unwrap().unwrap();
    assert_eq!(guest.used_idx(), base);
    assert!(base <= 3);
    assert_eq!(state.vhost.rings(), 0, "the ring let go of its inbox");
    assert_eq!(state.vhost.spaces.len(), 0, "and of its registered memory");
}

/// Drives the reactor as its thread would until the guest has `n` requests answered.
fn run_until_answered(r: &mut Reactor<Standalone>, state: &mut Standalone, guest: &Guest, n: u16) {
    while guest.used_idx() != n {
        if r.poll(state) == 0 {
            r.idle();
        }
    }
}

#[test]
fn an_idle_guest_costs_its_reactor_under_1_percent_of_a_core() {
    // With the policy's idle decision (adaptive) and with the default one (classic: the
    // reactor's own spin), after a run of requests, and only the reactor's thread's CPU:
    // what other tests on the machine do does not count.
    for policy in ["adaptive", "classic"] {
        let (mut r, mut state, mut guest, _shared) = setup_with(StandaloneConfig {
            policy: policy.to_string(),
            ..StandaloneConfig::default()
        });
        let requests = 40;
        for n in 1..=requests {
            guest.post_read();
            run_until_answered(&mut r, &mut state, &guest, n);
        }
        assert_eq!(r.counters().arrivals, u64::from(requests));
        // The window opens before the guest's thread starts its second: the request comes
        // at least a second into it.
        let cpu = hypoll_reactor::ThreadCpuClock::current().unwrap();
        let cpu_before_ns = cpu.cpu_ns().unwrap();
        let before = Instant::now();
        // The guest idles for a second, then posts from its own thread, as a vCPU would.
        let idle = Duration::from_secs(1);
        let mem = guest.mem.clone();
        let kick = guest.kick.try_clone().unwrap();
        let poster = std::thread::spawn(move || {
            std::thread::sleep(idle);
            let mut g = Guest {
                mem,
                posted: requests,
                kick,
            };
            g.post_read()
        });
        run_until_answered(&mut r, &mut state, &guest, requests + 1);
        let wall = before.elapsed();
        let cpu_pct =
            100.0 * (cpu.cpu_ns().unwrap() - cpu_before_ns) as f64 / wall.as_nanos() as f64;
        assert!(
            poster.join().unwrap(),
            "{policy}: the reactor parked with notifications on: the guest kicked"
        );
        assert!(wall >= idle, "{policy}: {wall:?}");
        assert!(
            cpu_pct < 1.0,
            "{policy}: an idle guest cost {cpu_pct:.3} % of a core ({:?})",
            r.counters()
        );
        assert_eq!(guest.status(requests), S_OK);
        // The policy decided how long the reactor spun for the guest before it parked.
        assert!(
            r.counters().idle_decisions > 0,
            "{policy}: {:?}",
            r.counters()
        );
    }
}

#[test]
fn a_used_ring_past_guest_memory_or_misaligned_breaks_the_ring_and_nothing_is_written() {
    // Guest memory is 1 MiB: a used ring whose elements run past its end, and one at an
    // address that is not a multiple of 4.
    for used in [(1 << 20) - 16, USED + 2] {
        let err = eventfd();
        let err_seen = err.try_clone().unwrap();
        let cfg = StandaloneConfig {
            tuning: ReactorTuning {
                idle_spin_ns: 0,
                ..ReactorTuning::default()
            },
            ..StandaloneConfig::default()
        };
        let (mut r, mut state, mut guest, _shared) = setup_ring(cfg, |start| {
            start.used = used;
            start.err = Some(err);
        });
        guest.post_read();
        for _ in 0..100 {
            r.poll(&mut state);
        }
        let mut count = [0u8; 8];
        assert_eq!(
            (&err_seen).read(&mut count).unwrap(),
            8,
            "used ring at {used:#x}: the error eventfd was signalled"
        );
        assert_eq!(u64::from_ne_bytes(count), 1);
        assert_eq!(
            guest.status(0),
            0xee,
            "{used:#x}: the request was not answered"
        );
        let mut tail = vec![0u8; 16];
        guest
            .mem
            .read_slice(&mut tail, GuestAddress((1 << 20) - 16))
            .unwrap();
        assert!(
            tail.iter().all(|b| *b == 0),
            "{used:#x}: nothing written there"
        );
        let mut near = [0u8; 16];
        guest.mem.read_slice(&mut near, GuestAddress(USED)).unwrap();
        assert!(near.iter().all(|b| *b == 0), "{used:#x}: nor there");
    }
}

mod inflight;
mod quiesce;
