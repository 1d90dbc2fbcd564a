//! A real vhost-user-blk client against the back end: libblkio's `virtio-blk-vhost-user`
//! driver (the `blkio` crate) connects to a server started in this process, sets up its
//! memory (memfd regions added with ADD_MEM_REG) and two queues, and sends every request
//! type it has. Data written is read back, on the other queue; a read past the capacity
//! fails; a read-only export refuses writes; a client that leaves and one that comes after
//! it see the same data.

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::time::Duration;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use hypoll_reactor::{CoreList, Device};
use hypoll_vhost::{VhostConfig, VhostExport, VhostServer};

/// Bytes of the client's buffer region.
const BUF_BYTES: usize = 1 << 20;

fn server(spec: &str, read_only: bool, socket: &Path) -> VhostServer {
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_test_writer()
        .try_init();
    let cores = hypoll_reactor::allowed_cores().unwrap();
    let two: Vec<usize> = cores.iter().copied().take(2).collect();
    let cores = CoreList::parse(
        &two.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(","),
    )
    .unwrap();
    VhostServer::start(VhostConfig {
        exports: vec![VhostExport {
            name: "disk0".into(),
            device: Device::open(spec).unwrap(),
            read_only,
            socket: socket.to_path_buf(),
        }],
        cores: Some(cores),
        policy: "adaptive".into(),
        queue_depth: 64,
        num_queues: 2,
    })
    .unwrap()
}

/// A connected, started client with `queues` queues and one mapped buffer region.
struct Client {
    // Queues before the instance and its region: they use both.
    queues: Vec<Blkioq>,
    region: MemoryRegion,
    blkio: Blkio,
}

impl Client {
    fn connect(socket: &Path, queues: i32, read_only: bool) -> blkio::Result<Client> {
        let mut blkio = Blkio::new("virtio-blk-vhost-user")?;
        blkio.set_str("path", socket.to_str().unwrap())?;
        blkio.set_bool("read-only", read_only)?;
        blkio.connect()?;
        blkio.set_i32("num-queues", queues)?;
        let started = blkio.start()?;
        let region = blkio.alloc_mem_region(BUF_BYTES)?;
        blkio.map_mem_region(&region)?;
        Ok(Client {
            queues: started.queues,
            region,
            blkio,
        })
    }

    fn buf(&mut self) -> &mut [u8] {
        // SAFETY: the region is `BUF_BYTES` of shared memory mapped by `blkio` for as long
        // as the client lives; no request is in flight while the test touches it (each
        // call waits for its completion).
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, BUF_BYTES) }
    }

    /// Runs one request on queue `q` and waits for it: its `ret` (0, or a negative errno).
    fn run(&mut self, q: usize, submit: impl FnOnce(&mut Blkioq, *mut u8)) -> i32 {
        let addr = self.region.addr as *mut u8;
        let queue = &mut self.queues[q];
        submit(queue, addr);
        let mut done = [const { MaybeUninit::<Completion>::uninit() }; 1];
        let mut timeout = Duration::from_secs(10);
        let n = queue.do_io(&mut done, 1, Some(&mut timeout), None).unwrap();
        assert_eq!(n, 1, "the request completed within the timeout");
        // SAFETY: `do_io` filled `n` completions.
        unsafe { done[0].assume_init_read() }.ret
    }

    /// The buffer's first `len` bytes as segments of the device's largest (`size_max`),
    /// as a driver must send them.
    fn segments(&mut self, len: usize) -> Vec<libc::iovec> {
        let seg = self.blkio.get_i32("max-segment-len").unwrap() as usize;
        let base = self.region.addr;
        (0..len)
            .step_by(seg)
            .map(|at| libc::iovec {
                iov_base: (base + at) as *mut libc::c_void,
                iov_len: seg.min(len - at),
            })
            .collect()
    }

    fn read(&mut self, q: usize, offset: u64, len: usize) -> i32 {
        let iov = self.segments(len);
        let n = iov.len() as u32;
        self.run(q, |queue, _| {
            queue.readv(offset, iov.as_ptr(), n, 0, ReqFlags::empty())
        })
    }

    fn write(&mut self, q: usize, offset: u64, len: usize) -> i32 {
        let iov = self.segments(len);
        let n = iov.len() as u32;
        self.run(q, |queue, _| {
            queue.writev(offset, iov.as_ptr(), n, 0, ReqFlags::empty())
        })
    }
}

fn socket_in(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("vhost.sock")
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn every_request_type_on_two_queues_with_data_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let socket = socket_in(&dir);
    let server = server("emu:dram,size=16M", false, &socket);
    let mut c = Client::connect(&socket, 2, false).unwrap();
    assert_eq!(c.blkio.get_u64("capacity").unwrap(), 16 << 20);

    // Written on queue 0, read back on queue 1.
    let data = pattern(7, 64 << 10);
    c.buf()[..data.len()].copy_from_slice(&data);
    assert_eq!(c.write(0, 1 << 20, data.len()), 0);
    c.buf()[..data.len()].fill(0);
    assert_eq!(c.read(1, 1 << 20, data.len()), 0);
    assert_eq!(&c.buf()[..data.len()], &data[..], "the data came back");
    assert_eq!(c.run(1, |q, _| q.flush(0, ReqFlags::empty())), 0);

    // Write zeroes over part of it, then discard another part.
    assert_eq!(
        c.run(0, |q, _| q.write_zeroes(
            1 << 20,
            4096,
            0,
            ReqFlags::NO_UNMAP
        )),
        0
    );
    c.buf()[..8192].fill(0xff);
    assert_eq!(c.read(0, 1 << 20, 8192), 0);
    assert!(c.buf()[..4096].iter().all(|&b| b == 0), "zeroed");
    assert_eq!(&c.buf()[4096..8192], &data[4096..8192], "the rest kept");
    assert_eq!(
        c.run(1, |q, _| q.discard(2 << 20, 64 << 10, 0, ReqFlags::empty())),
        0
    );

    // Past the end: refused by the back end.
    let past = c.read(0, (16 << 20) - 4096, 8192);
    assert!(past < 0, "a read past capacity fails ({past})");
    // And the queue goes on.
    assert_eq!(c.read(0, 1 << 20, 4096), 0);

    // Both queues at once.
    let (left, right) = (pattern(1, 4096), pattern(2, 4096));
    c.buf()[..4096].copy_from_slice(&left);
    c.buf()[4096..8192].copy_from_slice(&right);
    let addr = c.region.addr as *mut u8;
    c.queues[0].write(0, addr, 4096, 10, ReqFlags::empty());
    // SAFETY: inside the region.
    c.queues[1].write(4096, unsafe { addr.add(4096) }, 4096, 11, ReqFlags::empty());
    for q in 0..2 {
        let mut done = [const { MaybeUninit::<Completion>::uninit() }; 1];
        let mut timeout = Duration::from_secs(10);
        assert_eq!(
            c.queues[q]
                .do_io(&mut done, 1, Some(&mut timeout), None)
                .unwrap(),
            1
        );
        // SAFETY: filled by `do_io`.
        let done = unsafe { done[0].assume_init_read() };
        assert_eq!((done.user_data, done.ret), (10 + q, 0));
    }
    c.buf()[..8192].fill(0);
    assert_eq!(c.read(1, 0, 8192), 0);
    assert_eq!(&c.buf()[..4096], &left[..]);
    assert_eq!(&c.buf()[4096..8192], &right[..]);

    drop(c);
    let report = server.shutdown();
    assert!(report.panics.is_empty(), "{:?}", report.panics);
}

#[test]
fn a_client_that_comes_after_one_that_left_sees_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let socket = socket_in(&dir);
    let file = dir.path().join("disk.img");
    std::fs::write(&file, vec![0u8; 8 << 20]).unwrap();
    let spec = format!("uring:{}", file.display());
    let server = server(&spec, false, &socket);
    let data = pattern(42, 128 << 10);
    {
        let mut c = Client::connect(&socket, 1, false).unwrap();
        c.buf()[..data.len()].copy_from_slice(&data);
        assert_eq!(c.write(0, 4 << 20, data.len()), 0);
        assert_eq!(c.run(0, |q, _| q.flush(0, ReqFlags::empty())), 0);
    }
    let mut c = Client::connect(&socket, 2, false).unwrap();
    assert_eq!(c.read(1, 4 << 20, data.len()), 0);
    assert_eq!(&c.buf()[..data.len()], &data[..]);
    drop(c);
    assert!(server.shutdown().panics.is_empty());
    let on_disk = std::fs::read(&file).unwrap();
    assert_eq!(&on_disk[4 << 20..(4 << 20) + data.len()], &data[..]);
}

#[test]
fn a_read_only_export_refuses_writes_and_serves_reads() {
    let dir = tempfile::tempdir().unwrap();
    let socket = socket_in(&dir);
    let server = server("emu:dram,size=4M", true, &socket);
    let mut c = Client::connect(&socket, 1, true).unwrap();
    assert!(c.blkio.get_bool("read-only").unwrap());
    let wrote = c.write(0, 0, 4096);
    assert!(wrote < 0, "a write to a read-only export fails ({wrote})");
    assert_eq!(c.read(0, 0, 4096), 0);
    drop(c);
    assert!(server.shutdown().panics.is_empty());
}

#[test]
fn memory_mapped_and_unmapped_while_the_rings_run_is_used_then_let_go() {
    let dir = tempfile::tempdir().unwrap();
    let socket = socket_in(&dir);
    let server = server("emu:dram,size=4M", false, &socket);
    let mut c = Client::connect(&socket, 1, false).unwrap();
    // A second region, added (ADD_MEM_REG) while the ring runs, written from.
    let extra = c.blkio.alloc_mem_region(64 << 10).unwrap();
    c.blkio.map_mem_region(&extra).unwrap();
    // SAFETY: 64 KiB mapped by blkio; no request uses it yet.
    let bytes = unsafe { std::slice::from_raw_parts_mut(extra.addr as *mut u8, 4096) };
    bytes.fill(0x3c);
    let addr = extra.addr as *mut u8;
    assert_eq!(
        c.run(0, |q, _| q.write(8192, addr, 4096, 0, ReqFlags::empty())),
        0
    );
    // Taken back (REM_MEM_REG): the ring goes on with the first region.
    c.blkio.unmap_mem_region(&extra);
    c.blkio.free_mem_region(&extra);
    assert_eq!(c.read(0, 8192, 4096), 0);
    assert!(c.buf()[..4096].iter().all(|&b| b == 0x3c));
    drop(c);
    assert!(server.shutdown().panics.is_empty());
}
