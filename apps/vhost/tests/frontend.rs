//! The back end under a QEMU-like front end (the `vhost` crate's own): the memory table
//! set with SET_MEM_TABLE at a guest address far from the front end's own, a ring set up,
//! enabled, fed, and stopped with GET_VRING_BASE, which answers only once every request
//! the ring took has been answered; then restarted from that base, and a second front end
//! served after the first left. And the inflight protocol: an area the back end allocates
//! and records into, handed back to a back end that succeeds one which died with requests
//! in flight. And the life cycle around requests in flight on a slow device: a memory
//! table set while one is in flight is handled (and the next message answered) only once
//! that request is answered, and the graceful stop answers what the rings took before the
//! reactors stop.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use hypoll_reactor::{CoreList, Device};
use hypoll_vhost::inflight::{queue_region_bytes, InflightArea, InflightQueue};
use hypoll_vhost::testkit::{put_chain, put_header};
use hypoll_vhost::{VhostConfig, VhostExport, VhostServer};
use vhost::vhost_user::message::{
    VhostUserHeaderFlag, VhostUserInflight, VhostUserProtocolFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_blk as vb;
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};
use vmm_sys_util::eventfd::EventFd;

const MEM_BYTES: u64 = 1 << 20;
/// Where the guest sees its memory, and where the front end has it mapped: different, as
/// under QEMU.
const GPA: u64 = 0x1_0000_0000;
const USER: u64 = 0x7f00_0000_0000;
const SIZE: u16 = 16;
const DESC: u64 = 0x1000;
const AVAIL: u64 = 0x2000;
const USED: u64 = 0x3000;

struct Guest {
    mem: GuestMemoryMmap,
    file: File,
    posted: u16,
}

impl Guest {
    fn new() -> Guest {
        let (file, mem) = shared_memory(GPA);
        Guest {
            mem,
            file,
            posted: 0,
        }
    }

    /// Posts a write of one sector of `byte`s to sector `k` (descriptors 3k..3k+2).
    fn post_write(&mut self, byte: u8) {
        let k = self.posted;
        self.post(vb::VIRTIO_BLK_T_OUT, u64::from(k), Some(byte));
    }

    /// Posts request `posted` (descriptors `3 * (posted % 5)` on), of `kind` at `sector`:
    /// one sector of `fill` written, or one for the device to fill.
    fn post(&mut self, kind: u32, sector: u64, fill: Option<u8>) {
        self.post_at(kind, sector, Self::data(self.posted), fill);
    }

    /// [`Guest::post`] with the data at guest address `data` (`fill` only inside the memory
    /// this guest maps).
    fn post_at(&mut self, kind: u32, sector: u64, data: u64, fill: Option<u8>) {
        let k = self.posted;
        let first = 3 * (k % 5);
        let header = GPA + 0x4000 + 0x100 * u64::from(k);
        put_header(&self.mem, header, kind, sector);
        if let Some(byte) = fill {
            self.mem
                .write_slice(&[byte; 512], GuestAddress(data))
                .unwrap();
        }
        let table = GPA + DESC + 16 * u64::from(first);
        put_chain(
            &self.mem,
            table,
            &[
                (header, 16, false),
                (data, 512, fill.is_none()),
                (header + 0x80, 1, true),
            ],
        );
        for i in 0..2u16 {
            let at = GuestAddress(table + 16 * u64::from(i) + 14);
            self.mem.write_obj(first + i + 1, at).unwrap();
        }
        let slot = GPA + AVAIL + 4 + 2 * u64::from(k % SIZE);
        self.mem.write_obj(first, GuestAddress(slot)).unwrap();
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.posted += 1;
        self.mem
            .write_obj(self.posted, GuestAddress(GPA + AVAIL + 2))
            .unwrap();
    }

    fn data(k: u16) -> u64 {
        GPA + 0x8000 + 0x1000 * u64::from(k)
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(GPA + USED + 2)).unwrap()
    }

    fn status(&self, k: u16) -> u8 {
        let at = GPA + 0x4000 + 0x100 * u64::from(k) + 0x80;
        self.mem.read_obj(GuestAddress(at)).unwrap()
    }
}

/// [`MEM_BYTES`] of memory in a file, mapped shared where the guest sees it at `gpa`.
fn shared_memory(gpa: u64) -> (File, GuestMemoryMmap) {
    let file = tempfile::tempfile().unwrap();
    file.set_len(MEM_BYTES).unwrap();
    let mapping = MmapRegion::build(
        Some(FileOffset::new(file.try_clone().unwrap(), 0)),
        MEM_BYTES as usize,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_SHARED,
    )
    .unwrap();
    let region = GuestRegionMmap::new(mapping, GuestAddress(gpa)).unwrap();
    (file, GuestMemoryMmap::from_regions(vec![region]).unwrap())
}

fn server(socket: &Path) -> VhostServer {
    // A device slow enough that requests are still in flight when the stop comes.
    server_on(socket, "emu:nand,size=1M")
}

/// A device whose writes take 300 ms, every one: a write is surely in flight for a while.
const SLOW_WRITES: &str = "emu:dram,size=1M,write_us=300000,jitter=0,tail_pct=0";

/// A server of export "disk" on `device`, two reactors, two queues.
fn server_on(socket: &Path, device: &str) -> VhostServer {
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_test_writer()
        .try_init();
    let cores = hypoll_reactor::allowed_cores().unwrap();
    let list: Vec<String> = cores.iter().take(2).map(ToString::to_string).collect();
    VhostServer::start(VhostConfig {
        exports: vec![VhostExport {
            name: "disk".into(),
            device: Device::open(device).unwrap(),
            read_only: false,
            socket: socket.to_path_buf(),
        }],
        cores: Some(CoreList::parse(&list.join(",")).unwrap()),
        policy: "adaptive".into(),
        queue_depth: 32,
        num_queues: 2,
    })
    .unwrap()
}

/// Connects and sets ring 0 up from `base`, QEMU's way.
fn connect(socket: &Path, guest: &Guest, base: u16, kick: &EventFd, call: &EventFd) -> Frontend {
    connect_with(socket, guest, base, kick, call, None)
}

/// [`connect`], with the inflight area `inflight` handed over first (a new one asked for
/// and returned when it holds no file yet), as QEMU does on every start.
fn connect_with(
    socket: &Path,
    guest: &Guest,
    base: u16,
    kick: &EventFd,
    call: &EventFd,
    inflight: Option<&mut (VhostUserInflight, Option<File>)>,
) -> Frontend {
    let mut f = Frontend::connect(socket, 2).unwrap();
    f.set_owner().unwrap();
    let features = f.get_features().unwrap();
    f.set_features(features).unwrap();
    let protocol = f.get_protocol_features().unwrap();
    // REPLY_ACK, as QEMU negotiates it: a message sent with NEED_REPLY returns once the
    // back end has handled it.
    let mut ack = VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK;
    assert!(protocol.contains(ack | VhostUserProtocolFeatures::INFLIGHT_SHMFD));
    if inflight.is_some() {
        ack |= VhostUserProtocolFeatures::INFLIGHT_SHMFD;
    }
    f.set_protocol_features(ack).unwrap();
    assert_eq!(f.get_queue_num().unwrap(), 2);
    if let Some((info, file)) = inflight {
        if file.is_none() {
            let (got, area) = f
                .get_inflight_fd(&VhostUserInflight::new(0, 0, 2, SIZE))
                .unwrap();
            *info = got;
            *file = Some(area);
        }
        let fd = file.as_ref().unwrap().as_raw_fd();
        f.set_inflight_fd(info, fd).unwrap();
    }
    f.set_mem_table(&[VhostUserMemoryRegionInfo {
        guest_phys_addr: GPA,
        memory_size: MEM_BYTES,
        userspace_addr: USER,
        mmap_offset: 0,
        mmap_handle: guest.file.as_raw_fd(),
    }])
    .unwrap();
    f.set_vring_num(0, SIZE).unwrap();
    f.set_vring_addr(
        0,
        &VringConfigData {
            queue_max_size: SIZE,
            queue_size: SIZE,
            flags: 0,
            desc_table_addr: USER + DESC,
            used_ring_addr: USER + USED,
            avail_ring_addr: USER + AVAIL,
            log_addr: None,
        },
    )
    .unwrap();
    f.set_vring_base(0, base).unwrap();
    f.set_vring_call(0, call).unwrap();
    f.set_vring_kick(0, kick).unwrap();
    f.set_vring_enable(0, true).unwrap();
    f
}

fn wait_used(guest: &Guest, n: u16) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while guest.used_idx() != n {
        assert!(Instant::now() < deadline, "{n} requests answered in time");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn get_vring_base_answers_once_the_ring_has_answered_what_it_took() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vhost.sock");
    let server = server(&socket);
    let mut guest = Guest::new();
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    let mut f = connect(&socket, &guest, 0, &kick, &call);
    guest.post_write(1);
    kick.write(1).unwrap();
    wait_used(&guest, 1);
    assert_eq!(guest.status(0), 0);
    assert!(call.read().unwrap() >= 1, "the guest was signalled");

    // Three more, and the stop right behind them: whatever the ring took is answered
    // before the answer, which is where it stopped.
    for b in 2..5 {
        guest.post_write(b);
    }
    kick.write(1).unwrap();
    let base = f.get_vring_base(0).unwrap() as u16;
    assert!((1..=4).contains(&base), "{base}");
    assert_eq!(guest.used_idx(), base, "every request taken was answered");
    // Stopped: nothing more is taken, kicked or not.
    guest.post_write(5);
    kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(guest.used_idx(), base);

    // Restarted from the base (a new kick eventfd starts it): the rest is served.
    f.set_vring_base(0, base).unwrap();
    f.set_vring_kick(0, &kick).unwrap();
    f.set_vring_enable(0, true).unwrap();
    kick.write(1).unwrap();
    wait_used(&guest, 5);
    assert!((0..5).all(|k| guest.status(k) == 0));

    // A second front end, after the first left, finds the data and the ring where the
    // first left them.
    // The first front end closed its socket before the second connected: the back end
    // takes the second at once.
    drop(f);
    let f = connect(&socket, &guest, 5, &kick, &call);
    guest.post_write(9);
    kick.write(1).unwrap();
    wait_used(&guest, 6);
    assert_eq!(guest.status(5), 0);
    drop(f);
    assert!(server.shutdown().panics.is_empty());
}

/// Writes used element `i` (`head`, `len`) and the used index `i + 1`, as a back end does.
fn put_used(guest: &Guest, i: u16, head: u16, len: u32) {
    let at = GPA + USED + 4 + 8 * u64::from(i);
    guest
        .mem
        .write_obj(u32::from(head), GuestAddress(at))
        .unwrap();
    guest.mem.write_obj(len, GuestAddress(at + 4)).unwrap();
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    guest
        .mem
        .write_obj(i + 1, GuestAddress(GPA + USED + 2))
        .unwrap();
}

/// The head of used element `i`.
fn used_head(guest: &Guest, i: u16) -> u16 {
    let at = GPA + USED + 4 + 8 * u64::from(i);
    guest.mem.read_obj::<u32>(GuestAddress(at)).unwrap() as u16
}

#[test]
fn a_front_end_that_hands_back_its_inflight_area_has_what_was_left_in_flight_answered_once() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vhost.sock");
    let server = server(&socket);
    let mut guest = Guest::new();
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());

    // The back end allocates the area: one region per queue, and it records into it.
    let mut inflight = (VhostUserInflight::default(), None);
    let f = connect_with(&socket, &guest, 0, &kick, &call, Some(&mut inflight));
    let size = 2 * queue_region_bytes(SIZE) as u64;
    assert_eq!(
        (
            inflight.0.mmap_size,
            inflight.0.num_queues,
            inflight.0.queue_size
        ),
        (size, 2, SIZE)
    );
    let file = inflight.1.as_ref().unwrap().try_clone().unwrap();
    let area = InflightArea::open(file, 0, size, 2, SIZE).unwrap();
    guest.post_write(0xb0);
    kick.write(1).unwrap();
    wait_used(&guest, 1);
    assert_eq!(guest.status(0), 0);
    drop(f);

    // A back end then took three writes (heads 3, 6, 9), answered the second, and died
    // just after it published the third's answer to the guest, before clearing it: the
    // front end's area holds what that back end recorded (played here with the same
    // bookkeeping).
    let mut dead = InflightQueue::new(area.clone(), 0, SIZE).unwrap();
    dead.recover(1);
    for b in [0xb1, 0xb2, 0xb3] {
        guest.post_write(b);
    }
    for head in [3, 6, 9] {
        dead.take(head);
    }
    dead.before_put(6);
    put_used(&guest, 1, 6, 1);
    dead.after_put(6, 2);
    dead.before_put(9);
    put_used(&guest, 2, 9, 1);
    drop(dead);

    // QEMU reconnects, hands the area back, and starts the ring at the guest's used index:
    // only the first write is still owed, and is run and answered once.
    let f = connect_with(&socket, &guest, 3, &kick, &call, Some(&mut inflight));
    wait_used(&guest, 4);
    assert_eq!(used_head(&guest, 3), 3);
    assert_eq!(guest.status(1), 0);
    // The guest's next request is the next avail entry: a read of that write's data.
    guest.post(vb::VIRTIO_BLK_T_IN, 1, None);
    kick.write(1).unwrap();
    wait_used(&guest, 5);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(guest.used_idx(), 5, "nothing answered twice");
    assert_eq!(used_head(&guest, 4), 12);
    let mut got = [0u8; 512];
    guest
        .mem
        .read_slice(&mut got, GuestAddress(Guest::data(4)))
        .unwrap();
    assert!(
        got.iter().all(|b| *b == 0xb1),
        "the resubmitted write was done"
    );
    let left = InflightQueue::new(area, 0, SIZE).unwrap();
    assert!(
        (0..SIZE).all(|h| !left.is_inflight(h)),
        "nothing left marked"
    );
    drop(f);
    assert!(server.shutdown().panics.is_empty());
}

/// A second memory region (as a hot-plugged one), where the guest sees it, and the front
/// end's address of it.
const GPA_C: u64 = GPA + MEM_BYTES;
const USER_C: u64 = USER + MEM_BYTES;

/// A server on [`SLOW_WRITES`], its front end with ring 0 set up, and the guest's write in
/// flight there.
struct InFlight {
    _dir: tempfile::TempDir,
    server: VhostServer,
    guest: Guest,
    kick: EventFd,
    call: EventFd,
    f: Frontend,
}

/// Posts a write of `byte`s and lets the ring take it: the device holds it for 300 ms.
fn write_in_flight(byte: u8) -> InFlight {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vhost.sock");
    let server = server_on(&socket, SLOW_WRITES);
    let mut guest = Guest::new();
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    let f = connect(&socket, &guest, 0, &kick, &call);
    guest.post_write(byte);
    kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(guest.used_idx(), 0, "the write is in flight");
    InFlight {
        _dir: dir,
        server,
        guest,
        kick,
        call,
        f,
    }
}

#[test]
fn a_memory_table_set_while_a_request_is_in_flight_is_handled_once_it_is_answered() {
    let InFlight {
        _dir,
        server,
        mut guest,
        kick,
        call: _call,
        f,
    } = write_in_flight(0x5a);

    // A new table: the first region as it was, and a second (QEMU after a memory hotplug).
    let (file_c, mem_c) = shared_memory(GPA_C);
    let sent = Instant::now();
    f.set_mem_table(&[
        VhostUserMemoryRegionInfo {
            guest_phys_addr: GPA,
            memory_size: MEM_BYTES,
            userspace_addr: USER,
            mmap_offset: 0,
            mmap_handle: guest.file.as_raw_fd(),
        },
        VhostUserMemoryRegionInfo {
            guest_phys_addr: GPA_C,
            memory_size: MEM_BYTES,
            userspace_addr: USER_C,
            mmap_offset: 0,
            mmap_handle: file_c.as_raw_fd(),
        },
    ])
    .unwrap();
    // The table's message is handled, and this one answered, only once the write taken
    // under the old table is answered.
    f.get_features().unwrap();
    assert_eq!(
        guest.used_idx(),
        1,
        "answered after the request in flight ({:?})",
        sent.elapsed()
    );
    assert_eq!(guest.status(0), 0);

    // The new table serves the guest's next request: a read of the write into the new
    // region.
    guest.post_at(vb::VIRTIO_BLK_T_IN, 0, GPA_C + 0x1000, None);
    kick.write(1).unwrap();
    wait_used(&guest, 2);
    assert_eq!(guest.status(1), 0);
    let mut got = [0u8; 512];
    mem_c
        .read_slice(&mut got, GuestAddress(GPA_C + 0x1000))
        .unwrap();
    assert!(
        got.iter().all(|b| *b == 0x5a),
        "the write's data, read back"
    );
    drop(f);
    assert!(server.shutdown().panics.is_empty());
}

#[test]
fn the_graceful_stop_answers_a_request_in_flight_before_the_reactors_stop() {
    let InFlight {
        _dir,
        server,
        guest,
        kick: _kick,
        call,
        f,
    } = write_in_flight(0x6b);

    let report = server.shutdown();
    assert!(report.panics.is_empty());
    assert_eq!(
        report.exits.iter().map(|e| e.failed_ios).sum::<u64>(),
        0,
        "nothing was left for the shutdown to fail"
    );
    assert_eq!(guest.used_idx(), 1, "the write was answered");
    assert_eq!(guest.status(0), 0, "with its real status");
    assert!(call.read().unwrap() >= 1, "and the guest was signalled");
    drop(f);
}

/// Where the second ring's tables lie in the guest's memory (the guest posts nothing there).
const RING1: u64 = 0xc_0000;

/// A stop that comes while a memory table waits for the rings answers the table only once
/// every ring has stopped, the one with a request in flight included, not as soon as the
/// first (an idle ring on the other reactor) has: until then the old memory is in use.
#[test]
fn a_memory_table_waiting_when_the_stop_comes_is_answered_once_every_ring_has_stopped() {
    let w = write_in_flight(0x7c);
    let (server, guest, call, mut f) = (w.server, w.guest, w.call, w.f);
    // Ring 1, idle, on the other reactor.
    let (kick1, call1) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    f.set_vring_num(1, SIZE).unwrap();
    f.set_vring_addr(
        1,
        &VringConfigData {
            queue_max_size: SIZE,
            queue_size: SIZE,
            flags: 0,
            desc_table_addr: USER + RING1,
            used_ring_addr: USER + RING1 + USED - DESC,
            avail_ring_addr: USER + RING1 + AVAIL - DESC,
            log_addr: None,
        },
    )
    .unwrap();
    f.set_vring_base(1, 0).unwrap();
    f.set_vring_call(1, &call1).unwrap();
    f.set_vring_kick(1, &kick1).unwrap();
    f.set_vring_enable(1, true).unwrap();

    let table = [VhostUserMemoryRegionInfo {
        guest_phys_addr: GPA,
        memory_size: MEM_BYTES,
        userspace_addr: USER,
        mmap_offset: 0,
        mmap_handle: guest.file.as_raw_fd(),
    }];
    let mem = guest.mem.clone();
    // The table's acknowledgement, and what the guest's used index was when it came.
    f.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    let front = std::thread::spawn(move || {
        f.set_mem_table(&table).unwrap();
        let used: u16 = mem.read_obj(GuestAddress(GPA + USED + 2)).unwrap();
        (f, used)
    });
    // The table is read and waits for ring 0's write; then the stop.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(guest.used_idx(), 0, "the write is still in flight");
    let report = server.shutdown();
    assert!(report.panics.is_empty());
    let (_f, used_at_ack) = front.join().unwrap();
    assert_eq!(
        used_at_ack, 1,
        "the table was answered before the write was"
    );
    assert_eq!(guest.status(0), 0);
    assert!(call.read().unwrap() >= 1);
}
