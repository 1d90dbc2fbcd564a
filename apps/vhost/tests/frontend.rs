//! The back end under a QEMU-like front end (the `vhost` crate's own): the memory table
//! set with SET_MEM_TABLE at a guest address far from the front end's own, a ring set up,
//! enabled, fed, and stopped with GET_VRING_BASE, which answers only once every request
//! the ring took has been answered; then restarted from that base, and a second front end
//! served after the first left.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use hypoll_reactor::{CoreList, Device};
use hypoll_vhost::testkit::{put_chain, put_header};
use hypoll_vhost::{VhostConfig, VhostExport, VhostServer};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
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
        let file = tempfile::tempfile().unwrap();
        file.set_len(MEM_BYTES).unwrap();
        let mapping = MmapRegion::build(
            Some(FileOffset::new(file.try_clone().unwrap(), 0)),
            MEM_BYTES as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
        )
        .unwrap();
        let region = GuestRegionMmap::new(mapping, GuestAddress(GPA)).unwrap();
        Guest {
            mem: GuestMemoryMmap::from_regions(vec![region]).unwrap(),
            file,
            posted: 0,
        }
    }

    /// Posts a write of one sector of `byte`s to sector `k` (descriptors 3k..3k+2).
    fn post_write(&mut self, byte: u8) {
        let k = self.posted;
        let first = 3 * (k % 5);
        let header = GPA + 0x4000 + 0x100 * u64::from(k);
        let data = GPA + 0x8000 + 0x1000 * u64::from(k);
        put_header(&self.mem, header, vb::VIRTIO_BLK_T_OUT, u64::from(k));
        self.mem
            .write_slice(&[byte; 512], GuestAddress(data))
            .unwrap();
        let table = GPA + DESC + 16 * u64::from(first);
        put_chain(
            &self.mem,
            table,
            &[
                (header, 16, false),
                (data, 512, false),
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

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(GPA + USED + 2)).unwrap()
    }

    fn status(&self, k: u16) -> u8 {
        let at = GPA + 0x4000 + 0x100 * u64::from(k) + 0x80;
        self.mem.read_obj(GuestAddress(at)).unwrap()
    }
}

fn server(socket: &Path) -> VhostServer {
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_test_writer()
        .try_init();
    let cores = hypoll_reactor::allowed_cores().unwrap();
    let list: Vec<String> = cores.iter().take(2).map(ToString::to_string).collect();
    VhostServer::start(VhostConfig {
        exports: vec![VhostExport {
            name: "disk".into(),
            // A device slow enough that requests are still in flight when the stop comes.
            device: Device::open("emu:nand,size=1M").unwrap(),
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
    let mut f = Frontend::connect(socket, 2).unwrap();
    f.set_owner().unwrap();
    let features = f.get_features().unwrap();
    f.set_features(features).unwrap();
    let protocol = f.get_protocol_features().unwrap();
    assert!(protocol.contains(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ));
    f.set_protocol_features(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ)
        .unwrap();
    assert_eq!(f.get_queue_num().unwrap(), 2);
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
