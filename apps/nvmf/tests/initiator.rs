//! The `nvme-tcp:` initiator device (hypoll-nvme) against this crate's target, in process,
//! over loopback: every command kind and its data, vectored commands, two queue pairs,
//! many commands in flight, the interrupt line, and a connection cut mid-I/O.

mod support;

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hypoll_nvme::nvmetcp::CONNECTION_LOST;
use hypoll_nvme::{
    Command, Completion, Controller, DeviceConfig, IoBuf, IoError, NvmeTcpController, Opcode,
    QueuePair, Status, SubmitError, SyncIo,
};

use support::{mem, port, server, BLOCK, BLOCKS};

const NQN: &str = "nqn.2026-12.io.hypoll:initiator";
const TIMEOUT: Duration = Duration::from_secs(10);

fn open(port: u16) -> NvmeTcpController {
    let text = format!("nvme-tcp:127.0.0.1:{port}/{NQN}");
    let DeviceConfig::NvmeTcp(cfg) = text.parse().unwrap() else {
        panic!("an nvme-tcp device string")
    };
    NvmeTcpController::open(&cfg).unwrap()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29) ^ seed)
        .collect()
}

/// Reaps until `n` completions are in, within [`TIMEOUT`].
fn reap(qp: &mut dyn QueuePair, n: usize) -> Vec<Completion> {
    let mut got = Vec::new();
    let deadline = Instant::now() + TIMEOUT;
    while got.len() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions",
            got.len()
        );
        qp.process_completions(64, &mut |c| got.push(c));
    }
    got
}

#[test]
fn every_command_kind_round_trips_through_the_target() {
    let s = server(NQN, &mem());
    let ctrl = open(port(&s));
    let ns = ctrl.namespace();
    assert_eq!((ns.lba_size_bytes, ns.capacity_lbas), (BLOCK, BLOCKS));
    assert!(ctrl.supports(Opcode::WriteZeroes) && ctrl.supports(Opcode::DatasetManagement));
    assert_eq!(s.target().controllers(), 1);
    let mut qp = ctrl.create_queue_pair(32).unwrap();
    let mut io = SyncIo::new(&mut *qp, TIMEOUT);

    // In the capsule, and (larger than the target takes in a capsule) on its R2T.
    let small = pattern(1, 4096);
    io.write(8, &small).unwrap();
    assert_eq!(&io.read(8, 8).unwrap()[..], &small[..]);
    let big = pattern(2, 64 << 10);
    io.write(200, &big).unwrap();
    assert_eq!(&io.read(200, 128).unwrap()[..], &big[..]);
    io.flush().unwrap();

    io.write_zeroes(8, 2).unwrap();
    io.write_zeroes_deallocating(10, 2).unwrap();
    let after = io.read(8, 8).unwrap();
    assert!(after[..2048].iter().all(|&b| b == 0));
    assert_eq!(after[2048..], small[2048..]);
    io.deallocate(200, 16).unwrap();
    let after = io.read(200, 128).unwrap();
    assert!(after[..16 * 512].iter().all(|&b| b == 0));
    assert_eq!(after[16 * 512..], big[16 * 512..]);

    // Past the end: the target's status, and the queue goes on.
    assert_eq!(
        io.read(BLOCKS - 4, 8).err(),
        Some(IoError::Status(Status::LBA_OUT_OF_RANGE))
    );
    assert_eq!(&io.read(8, 8).unwrap()[2048..], &small[2048..]);
    drop(qp);
    drop(ctrl);
    // Closing the admin queue ends the controller.
    let deadline = Instant::now() + TIMEOUT;
    while s.target().controllers() > 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn vectored_commands_gather_and_scatter() {
    let s = server(NQN, &mem());
    let ctrl = open(port(&s));
    let mut qp = ctrl.queue_pair(8).unwrap();
    let data = pattern(3, 3 * 4096);
    // Three uneven pieces; 12 KiB goes on an R2T (over the 8 KiB in-capsule size).
    let pieces = [&data[..1000], &data[1000..9000], &data[9000..]];
    let segs: Vec<IoSlice<'_>> = pieces.iter().map(|p| IoSlice::new(p)).collect();
    // SAFETY: `data` outlives the command, which is reaped below.
    unsafe { qp.submit(&Command::writev(40, 24, &segs), 1) }.unwrap();
    assert_eq!(reap(&mut qp, 1)[0].status, Status::SUCCESS);
    let (mut a, mut b) = (vec![0u8; 5000], vec![0u8; 3 * 4096 - 5000]);
    {
        let mut segs = [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)];
        // SAFETY: the buffers outlive the command, which is reaped before they are read.
        unsafe { qp.submit(&Command::readv(40, 24, &mut segs), 2) }.unwrap();
        assert_eq!(
            reap(&mut qp, 1)[0],
            Completion {
                tag: 2,
                status: Status::SUCCESS
            }
        );
    }
    assert_eq!([a, b].concat(), data);
}

#[test]
fn two_queue_pairs_see_each_others_writes_with_many_commands_in_flight() {
    let s = server(NQN, &mem());
    let ctrl = open(port(&s));
    let mut q1 = ctrl.queue_pair(32).unwrap();
    let mut q2 = ctrl.queue_pair(32).unwrap();
    assert_ne!(q1.qid(), q2.qid());
    assert_eq!(s.target().io_queues(1), 2);
    // 32 writes of 16 KiB at once on one (each on its R2T), 32 reads at once on the other.
    let bufs: Vec<IoBuf> = (0..32)
        .map(|i| IoBuf::from_slice(&pattern(i, 16384)))
        .collect();
    for (i, b) in bufs.iter().enumerate() {
        // SAFETY: `bufs` outlives the commands, all reaped below.
        unsafe { q1.submit(&Command::write(i as u64 * 32, 32, b), i as u64) }.unwrap();
    }
    // SAFETY: a flush carries no memory.
    let full = unsafe { q1.submit(&Command::flush(), 99) };
    assert_eq!(full, Err(SubmitError::QueueFull { depth: 32 }));
    let done = reap(&mut q1, 32);
    assert!(done.iter().all(|c| c.status == Status::SUCCESS), "{done:?}");
    let mut reads: Vec<IoBuf> = (0..32).map(|_| IoBuf::zeroed(16384)).collect();
    for (i, b) in reads.iter_mut().enumerate() {
        // SAFETY: as above.
        unsafe { q2.submit(&Command::read(i as u64 * 32, 32, b), i as u64) }.unwrap();
    }
    let mut done = reap(&mut q2, 32);
    done.sort_by_key(|c| c.tag);
    for (i, c) in done.iter().enumerate() {
        assert_eq!(
            *c,
            Completion {
                tag: i as u64,
                status: Status::SUCCESS
            }
        );
        assert_eq!(&reads[i][..], &bufs[i][..], "read {i}");
    }
    assert_eq!(q2.outstanding(), 0);
}

#[test]
fn the_interrupt_line_rises_for_an_answer_and_stays_down_when_idle() {
    let s = server(NQN, "emu:nand,size=8M,lba=512");
    let ctrl = open(port(&s));
    let mut qp = ctrl.queue_pair(4).unwrap();
    let mut buf = IoBuf::zeroed(4096);
    // SAFETY: `buf` outlives the command, reaped below.
    unsafe { qp.submit(&Command::read(0, 8, &mut buf), 7) }.unwrap();
    qp.arm_interrupt();
    let fd = qp.interrupt_fd().unwrap();
    assert!(
        hypoll_nvme::wait_readable(fd, 5000).unwrap(),
        "no interrupt"
    );
    assert_eq!(reap(&mut qp, 1)[0].tag, 7);
    qp.disarm_interrupt();
    let fd = qp.interrupt_fd().unwrap();
    assert!(
        !hypoll_nvme::wait_readable(fd, 50).unwrap(),
        "readable while idle"
    );
}

/// A TCP relay that can cut every connection through it at once.
struct Relay {
    port: u16,
    cut: Arc<AtomicBool>,
    streams: Arc<Mutex<Vec<TcpStream>>>,
}

impl Relay {
    fn new(to: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let streams = Arc::new(Mutex::new(Vec::new()));
        let (c, st) = (cut.clone(), streams.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if c.load(Ordering::Acquire) {
                    return;
                }
                let client = client.unwrap();
                let target = TcpStream::connect(("127.0.0.1", to)).unwrap();
                for s in [&client, &target] {
                    st.lock().unwrap().push(s.try_clone().unwrap());
                }
                let pipe = |mut from: TcpStream, mut to: TcpStream| {
                    std::thread::spawn(move || {
                        let mut b = [0u8; 65536];
                        while let Ok(n) = from.read(&mut b) {
                            if n == 0 || to.write_all(&b[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(Shutdown::Both);
                    });
                };
                pipe(client.try_clone().unwrap(), target.try_clone().unwrap());
                pipe(target, client);
            }
        });
        Relay { port, cut, streams }
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::Release);
        for s in self.streams.lock().unwrap().iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

#[test]
fn a_connection_cut_mid_io_fails_its_commands_and_refuses_more() {
    // Slow reads, so they are at the device when the connection goes.
    let s = server(NQN, "emu:nand,size=8M,lba=512,read_us=20000");
    let relay = Relay::new(port(&s));
    let ctrl = open(relay.port);
    let mut qp = ctrl.queue_pair(16).unwrap();
    let mut bufs: Vec<IoBuf> = (0..16).map(|_| IoBuf::zeroed(4096)).collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        // SAFETY: `bufs` outlives the commands, all reaped below.
        unsafe { qp.submit(&Command::read(i as u64 * 8, 8, b), i as u64) }.unwrap();
    }
    relay.cut();
    let started = Instant::now();
    let done = reap(&mut qp, 16);
    assert!(started.elapsed() < TIMEOUT);
    assert!(done.iter().all(|c| c.status == CONNECTION_LOST), "{done:?}");
    assert_eq!(qp.outstanding(), 0);
    assert!(qp.broken().is_some());
    // SAFETY: refused, so the buffer is never lent.
    let refused = unsafe { qp.submit(&Command::read(0, 8, &mut bufs[0]), 99) };
    assert_eq!(refused, Err(SubmitError::Disabled));
    // The target lets go of the controller and its queue.
    let deadline = Instant::now() + TIMEOUT;
    while s.connections_open() > 0 {
        assert!(Instant::now() < deadline, "{} open", s.connections_open());
        std::thread::sleep(Duration::from_millis(10));
    }
}
