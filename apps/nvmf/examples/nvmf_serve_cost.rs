//! The NVMe/TCP server's instructions per command on its reactor thread, the counterpart of
//! hypoll-nbd's `serve_cost`: a server on a `null` export, and a host thread sending 4 KiB
//! reads on one I/O queue over loopback TCP in batches of `depth` (one write each, each
//! batch answered before the next) until `count` are answered (SQ flow control off when `flow` is not given, as the nvme-tcp device asks).
//! Socket-watching and request gathering are off. Count with `scripts/serve-cost
//! nvmf_serve_cost [DEPTH]`.

use std::io::{Read, Write};
use std::net::TcpStream;

use hypoll_frontend::ListenAddr;
use hypoll_nvme::fabrics::{CATTR_DISABLE_SQ_FLOW_CONTROL, CNTLID_DYNAMIC};
use hypoll_nvme::spec::Status;
use hypoll_nvme::tcp::decode::{Decode, Decoder, Role};
use hypoll_nvme::tcp::Pdu;
use hypoll_nvmf::client::Host;
use hypoll_nvmf::{NvmfConfig, NvmfExport, NvmfServer};
use hypoll_reactor::Device;

const NQN: &str = "nqn.2026-12.io.hypoll:cost";

struct Wire {
    s: TcpStream,
    dec: Decoder,
    buf: Vec<u8>,
}

impl Wire {
    /// The next PDU's kind: (command, answered), skipping what needs no count.
    fn next(&mut self) -> (u16, bool, Status) {
        loop {
            if let Ok(Decode::Pdu(p)) = self.dec.decode(&self.buf) {
                let got = match p.pdu {
                    Pdu::CapsuleResp(c) => Some((c.cid, true, c.status())),
                    Pdu::C2HData(h) => Some((h.cccid, h.success, Status::SUCCESS)),
                    _ => None,
                };
                self.buf.drain(..p.len);
                match got {
                    Some(g) => return g,
                    None => continue,
                }
            }
            let mut chunk = [0u8; 65536];
            let n = self.s.read(&mut chunk).unwrap();
            assert!(n > 0, "the server closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    fn ask(&mut self, bytes: &[u8]) -> (u16, bool, Status) {
        self.s.write_all(bytes).unwrap();
        self.next()
    }
}

fn wire(addr: std::net::SocketAddr, host: &Host) -> Wire {
    let s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let mut w = Wire {
        s,
        dec: Decoder::new(Role::Host, 0, 1 << 20),
        buf: Vec::new(),
    };
    w.s.write_all(&host.ic_req(0)).unwrap();
    w
}

fn main() {
    let mut args = std::env::args().skip(1);
    let count: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(2000);
    let depth: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(32);
    let flow = args.next().as_deref() == Some("flow");
    let export = NvmfExport {
        name: "null".into(),
        device: Device::open("null,size=1G,lba=4096").unwrap(),
        read_only: false,
    };
    let mut cfg = NvmfConfig::new(vec![export], "127.0.0.1:0".parse().unwrap());
    cfg.subsystem_nqn = NQN.into();
    cfg.service.idle_spin_ns = 0;
    cfg.service.coalesce_ns = 0;
    let server = NvmfServer::start(cfg).unwrap();
    let ListenAddr::Tcp(addr) = server.local_addr().clone() else {
        unreachable!("a TCP listener")
    };
    let host = Host::default();
    let mut admin = wire(addr, &host);
    let (_, _, st) = admin.ask(&host.connect(1, 0, 31, 0, CNTLID_DYNAMIC, NQN));
    assert_eq!(st, Status::SUCCESS);
    let cntlid = server.target().controllers() as u16;
    assert_eq!(admin.ask(&host.enable(2)).2, Status::SUCCESS);
    let mut q = wire(addr, &host);
    let mut connect = host.connect(1, 1, 127, 0, cntlid, NQN);
    if !flow {
        // CATTR, bits 23:16 of CDW11: the capsule's SQE starts 8 bytes in.
        connect[8 + 44 + 2] |= CATTR_DISABLE_SQ_FLOW_CONTROL;
    }
    assert_eq!(q.ask(&connect).2, Status::SUCCESS);
    // Batches of `depth` reads in one write, each batch answered before the next: the
    // server sees the same arrivals whatever the scheduler does.
    let mut sent = 0;
    while sent < count {
        let n = depth.min(count - sent);
        let batch: Vec<u8> = (0..n)
            .flat_map(|i| host.read(i as u16, 1, (sent + i) % 4096, 1, 4096))
            .collect();
        q.s.write_all(&batch).unwrap();
        let mut answered = 0;
        while answered < n {
            let (_, done, status) = q.next();
            if done {
                assert_eq!(status, Status::SUCCESS);
                answered += 1;
            }
        }
        sent += n;
    }
    drop((q, admin));
    let report = server.stop();
    assert_eq!(report.connections_left, 0);
    println!("{count} reads at depth {depth}, SQ flow control {flow}");
}
