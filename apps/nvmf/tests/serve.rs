//! The NVMe/TCP front end over real sockets: a server on a loopback port and a host that
//! speaks the protocol byte for byte (the builders of `hypoll_nvmf::client`), blocking.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hypoll_nvme::fabrics::CNTLID_DYNAMIC;
use hypoll_nvme::spec::{CompletionEntry, Status};
use hypoll_nvme::tcp::decode::{Decode, Decoder, Role};
use hypoll_nvme::tcp::{Fes, Pdu, R2t};
use hypoll_nvmf::client::Host;
use hypoll_nvmf::{BlockRange, NvmfServer};

use support::{mem, port, server, BLOCK, BLOCKS};

const NQN: &str = "nqn.2026-12.io.hypoll:serve";

/// What the target sent, owned.
#[derive(Debug)]
enum Got {
    Resp(CompletionEntry),
    Data {
        cid: u16,
        offset: u32,
        data: Vec<u8>,
        last: bool,
        success: bool,
    },
    R2t(R2t),
    Term(u16),
    Closed,
}

struct Wire {
    s: TcpStream,
    host: Host,
    dec: Decoder,
    buf: Vec<u8>,
}

impl Wire {
    fn new(server: &NvmfServer) -> Wire {
        let s = TcpStream::connect(("127.0.0.1", port(server))).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        Wire {
            s,
            host: Host::default(),
            dec: Decoder::new(Role::Host, 0, 1 << 20),
            buf: Vec::new(),
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).unwrap();
    }

    fn recv(&mut self) -> Got {
        loop {
            match self
                .dec
                .decode(&self.buf)
                .expect("the target sends valid PDUs")
            {
                Decode::Pdu(p) => {
                    let got = match p.pdu {
                        Pdu::IcResp(_) => None,
                        Pdu::CapsuleResp(c) => Some(Got::Resp(c)),
                        Pdu::C2HData(h) => Some(Got::Data {
                            cid: h.cccid,
                            offset: h.datao,
                            data: self.buf[p.data.clone()].to_vec(),
                            last: h.last,
                            success: h.success,
                        }),
                        Pdu::R2T(r) => Some(Got::R2t(r)),
                        Pdu::C2HTermReq(t) => Some(Got::Term(t.fes)),
                        other => panic!("{other:?} from a target"),
                    };
                    self.buf.drain(..p.len);
                    if let Some(g) = got {
                        return g;
                    }
                    continue;
                }
                Decode::NeedMore(_) => {}
            }
            let mut chunk = [0u8; 65536];
            match self.s.read(&mut chunk) {
                Ok(0) => return Got::Closed,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Got::Closed,
                Err(e) => panic!("reading: {e}"),
            }
        }
    }

    fn resp(&mut self) -> CompletionEntry {
        match self.recv() {
            Got::Resp(c) => c,
            other => panic!("expected a response, got {other:?}"),
        }
    }

    fn init(&mut self) {
        let req = self.host.ic_req(0);
        self.send(&req);
        // The ICResp is skipped by `recv`; nothing else comes before the next command.
    }

    /// ICReq, Connect of the admin queue (with `kato_ms`), CC.EN: returns the controller.
    fn admin(&mut self, kato_ms: u32) -> u16 {
        self.init();
        let c = self.host.connect(1, 0, 31, kato_ms, CNTLID_DYNAMIC, NQN);
        self.send(&c);
        let r = self.resp();
        assert_eq!(r.status(), Status::SUCCESS);
        let e = self.host.enable(2);
        self.send(&e);
        assert_eq!(self.resp().status(), Status::SUCCESS);
        r.dw0 as u16
    }

    fn io(&mut self, cntlid: u16, qid: u16) {
        self.init();
        let c = self.host.connect(1, qid, 127, 0, cntlid, NQN);
        self.send(&c);
        assert_eq!(self.resp().status(), Status::SUCCESS);
    }

    /// Reads `blocks` at `slba`: the data, or the failure's status.
    fn read(&mut self, cid: u16, slba: u64, blocks: u32) -> Result<Vec<u8>, Status> {
        let r = self.host.read(cid, 1, slba, blocks, BLOCK);
        self.send(&r);
        let mut data = Vec::new();
        loop {
            match self.recv() {
                Got::Data {
                    cid: c,
                    offset,
                    data: d,
                    success,
                    last,
                } => {
                    assert_eq!((c, offset as usize), (cid, data.len()));
                    assert!(last || !success, "success is only on the last data PDU");
                    data.extend_from_slice(&d);
                    if success {
                        return Ok(data);
                    }
                }
                Got::Resp(c) if c.status().is_success() => {
                    assert_eq!(c.cid, cid);
                    assert_eq!(data.len(), (blocks * BLOCK) as usize);
                    return Ok(data);
                }
                Got::Resp(c) => return Err(c.status()),
                other => panic!("{other:?}"),
            }
        }
    }

    /// Writes `data` at `slba`, in the capsule if `in_capsule`, else on the target's R2Ts.
    fn write(&mut self, cid: u16, slba: u64, data: &[u8], in_capsule: bool) -> Status {
        if in_capsule {
            let w = self.host.write(cid, 1, slba, data, BLOCK);
            self.send(&w);
            return self.resp().status();
        }
        let blocks = data.len() as u32 / BLOCK;
        let w = self.host.write_solicited(cid, 1, slba, blocks, BLOCK);
        self.send(&w);
        loop {
            match self.recv() {
                Got::R2t(r) => {
                    assert_eq!(r.cccid, cid);
                    let (at, len) = (r.r2to as usize, r.r2tl as usize);
                    // In two H2CData PDUs, to cover data offsets.
                    let half = (len / 2).next_multiple_of(4);
                    let a = self
                        .host
                        .h2c_data(cid, r.ttag, at as u32, &data[at..at + half], false);
                    let b = self.host.h2c_data(
                        cid,
                        r.ttag,
                        (at + half) as u32,
                        &data[at + half..at + len],
                        at + len == data.len(),
                    );
                    self.send(&[a, b].concat());
                }
                Got::Resp(c) => {
                    assert_eq!(c.cid, cid);
                    return c.status();
                }
                other => panic!("{other:?}"),
            }
        }
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn every_command_kind_reaches_the_device_and_data_reads_back() {
    let s = server(NQN, &mem());
    let mut admin = Wire::new(&s);
    let cntlid = admin.admin(0);
    let mut q = Wire::new(&s);
    q.io(cntlid, 1);

    let small = pattern(1, 4096);
    assert_eq!(q.write(10, 8, &small, true), Status::SUCCESS);
    assert_eq!(q.read(11, 8, 8).unwrap(), small);
    // Larger than the device's transfer size: several device commands, one answer.
    let big = pattern(2, 128 << 10);
    assert_eq!(q.write(12, 100, &big, false), Status::SUCCESS);
    assert_eq!(q.read(13, 100, 256).unwrap(), big);

    let flush = q.host.flush(14, 1);
    q.send(&flush);
    assert_eq!(q.resp().status(), Status::SUCCESS);

    let z = q.host.write_zeroes(15, 1, 8, 4, false);
    q.send(&z);
    assert_eq!(q.resp().status(), Status::SUCCESS);
    let after = q.read(16, 8, 8).unwrap();
    assert!(after[..2048].iter().all(|&b| b == 0));
    assert_eq!(after[2048..], small[2048..]);

    let ranges = [
        BlockRange {
            slba: 100,
            blocks: 8,
        },
        BlockRange {
            slba: 300,
            blocks: 8,
        },
    ];
    let d = q.host.deallocate(17, 1, &ranges, true);
    q.send(&d);
    assert_eq!(q.resp().status(), Status::SUCCESS);
    let after = q.read(18, 100, 256).unwrap();
    assert!(after[..4096].iter().all(|&b| b == 0));
    assert_eq!(after[4096..100 * 512], big[4096..100 * 512]);
    assert!(after[200 * 512..208 * 512].iter().all(|&b| b == 0));

    assert_eq!(q.read(19, BLOCKS - 4, 8), Err(Status::LBA_OUT_OF_RANGE));
    // The queue goes on after a refusal.
    assert_eq!(q.read(20, 8, 1).unwrap(), vec![0; 512]);
    drop((q, admin));
    let report = s.stop();
    assert_eq!(report.connections_left, 0);
    assert!(report.flush_failures.is_empty(), "{report:?}");
}

#[test]
fn many_commands_in_flight_are_each_answered_once() {
    let s = server(NQN, &mem());
    let mut admin = Wire::new(&s);
    let cntlid = admin.admin(0);
    let mut q = Wire::new(&s);
    q.io(cntlid, 1);
    let data = pattern(3, 64 << 10);
    assert_eq!(q.write(1, 0, &data, false), Status::SUCCESS);
    // 100 reads of 4 KiB at once, in one send.
    let reads: Vec<u8> = (0..100u16)
        .flat_map(|cid| q.host.read(cid, 1, u64::from(cid % 16) * 8, 8, BLOCK))
        .collect();
    q.send(&reads);
    let mut seen = [false; 100];
    let mut pieces: Vec<Vec<u8>> = vec![Vec::new(); 100];
    let mut answered = 0;
    while answered < 100 {
        match q.recv() {
            Got::Data {
                cid, data, success, ..
            } => {
                pieces[cid as usize].extend_from_slice(&data);
                if success {
                    assert!(!seen[cid as usize]);
                    seen[cid as usize] = true;
                    answered += 1;
                }
            }
            Got::Resp(c) => {
                assert_eq!(c.status(), Status::SUCCESS);
                assert!(!seen[c.cid as usize]);
                seen[c.cid as usize] = true;
                answered += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    for (cid, got) in pieces.iter().enumerate() {
        let at = (cid % 16) * 4096;
        assert_eq!(got[..], data[at..at + 4096], "cid {cid}");
    }
}

#[test]
fn a_host_that_stops_its_keep_alives_is_disconnected_with_its_queues() {
    let s = server(NQN, &mem());
    let mut admin = Wire::new(&s);
    let cntlid = admin.admin(300);
    let mut q = Wire::new(&s);
    q.io(cntlid, 1);
    let started = Instant::now();
    assert!(matches!(admin.recv(), Got::Closed));
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(250), "{waited:?}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    // Its I/O queue ends with it, idle as it is.
    assert!(matches!(q.recv(), Got::Closed));
    assert_eq!(s.target().controllers(), 0);
}

#[test]
fn a_host_that_sends_keep_alives_stays() {
    let s = server(NQN, &mem());
    let mut admin = Wire::new(&s);
    admin.admin(300);
    for cid in 10..20 {
        std::thread::sleep(Duration::from_millis(100));
        let k = admin.host.keep_alive(cid);
        admin.send(&k);
        assert_eq!(admin.resp().status(), Status::SUCCESS);
    }
    assert_eq!(s.target().controllers(), 1);
}

#[test]
fn a_bad_pdu_gets_a_termination_request_and_the_server_goes_on() {
    let s = server(NQN, &mem());
    let mut w = Wire::new(&s);
    w.init();
    // A second ICReq is out of sequence.
    let again = w.host.ic_req(0);
    w.send(&again);
    assert!(matches!(w.recv(), Got::Term(fes) if fes == Fes::PduSequenceError as u16));
    assert!(matches!(w.recv(), Got::Closed));
    let mut admin = Wire::new(&s);
    let cntlid = admin.admin(0);
    let mut q = Wire::new(&s);
    q.io(cntlid, 1);
    assert_eq!(q.read(1, 0, 1).unwrap(), vec![0; 512]);
}

#[test]
fn a_host_that_leaves_mid_io_leaves_nothing_behind() {
    // Slow enough that the reads are at the device when the host goes.
    let s = server(NQN, "emu:nand,size=8M,lba=512");
    for _ in 0..3 {
        let mut admin = Wire::new(&s);
        let cntlid = admin.admin(0);
        let mut q = Wire::new(&s);
        q.io(cntlid, 1);
        let reads: Vec<u8> = (0..64u16)
            .flat_map(|cid| q.host.read(cid, 1, u64::from(cid) * 8, 8, BLOCK))
            .collect();
        q.send(&reads);
        drop(q);
        drop(admin);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.connections_open() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(s.connections_open(), 0);
    assert_eq!(s.target().controllers(), 0);
    // And it still serves.
    let mut admin = Wire::new(&s);
    let cntlid = admin.admin(0);
    let mut q = Wire::new(&s);
    q.io(cntlid, 1);
    assert_eq!(q.read(1, 0, 1).unwrap(), vec![0; 512]);
    let report = s.stop();
    assert_eq!((report.connections_left, report.failed_ios), (0, 0));
}
