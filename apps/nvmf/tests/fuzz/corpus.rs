//! The seed corpus of `apps/nvmf/fuzz-corpus/`: real conversations, each one host
//! connection's byte stream, made by talking to a live session (so each H2CData answers the
//! R2T the target really sent). `the_corpus_is_what_its_generator_makes` checks the files
//! against this; `HYPOLL_WRITE_CORPUS=1` rewrites them.

use hypoll_nvme::fabrics::*;
use hypoll_nvme::tcp::decode::{Decode, Decoder, Role};
use hypoll_nvme::tcp::{Digests, Fes, Pdu};
use hypoll_nvmf::client::Host;
use hypoll_nvmf::{BlockRange, Session, Step};

use super::driver::{anchor, digests, target, NQN};

/// A conversation being recorded.
struct Convo {
    s: Session,
    /// Controller 1, which the I/O queue conversations join.
    _anchor: Session,
    host: Host,
    stream: Vec<u8>,
    /// Transfer tags of the R2Ts received, by command.
    r2ts: Vec<(u16, u16)>,
}

impl Convo {
    fn new(digests: Digests) -> Convo {
        let t = target();
        Convo {
            _anchor: anchor(&t),
            s: Session::new(t),
            host: Host::new(digests),
            stream: Vec::new(),
            r2ts: Vec::new(),
        }
    }

    fn send(&mut self, pdu: Vec<u8>) -> &mut Convo {
        let mut out = Vec::new();
        let (used, step) = self.s.step(&pdu, 0, &mut out);
        assert_eq!(used, pdu.len(), "one whole PDU: {step:?}");
        {
            if let Step::Io(cmd) = &step {
                // Answer at once, as the fuzz driver does later.
                match cmd.op {
                    hypoll_nvmf::IoOp::Read { blocks, .. } => {
                        let d = vec![0u8; blocks as usize * 512];
                        self.s.complete_read(cmd.cid, &[&d], &mut out).unwrap();
                    }
                    hypoll_nvmf::IoOp::Write {
                        data: hypoll_nvmf::WriteData::Solicited,
                        ..
                    } => {}
                    _ => self
                        .s
                        .complete(cmd.cid, hypoll_nvme::spec::Status::SUCCESS, &mut out)
                        .unwrap(),
                }
            }
            if let Step::WriteData {
                cid, last: true, ..
            } = step
            {
                self.s
                    .complete(cid, hypoll_nvme::spec::Status::SUCCESS, &mut out)
                    .unwrap();
            }
        }
        let f = self.s.framing();
        let d = Decoder {
            digests: f.digests,
            pda_bytes: f.pda_bytes,
            ..Decoder::new(Role::Host, 0, 1 << 20)
        };
        let mut o = &out[..];
        while let Ok(Decode::Pdu(p)) = d.decode(o) {
            if let Pdu::R2T(r) = p.pdu {
                self.r2ts.push((r.cccid, r.ttag));
            }
            o = &o[p.len..];
        }
        self.stream.extend_from_slice(&pdu);
        self
    }

    fn ttag(&self, cid: u16) -> u16 {
        self.r2ts
            .iter()
            .rev()
            .find(|(c, _)| *c == cid)
            .expect("an R2T")
            .1
    }

    /// ICReq, and the grant: the host frames what follows as the target said.
    fn init(&mut self) -> &mut Convo {
        let req = self.host.ic_req(0);
        self.send(req);
        self.host.framing = self.s.framing();
        self
    }

    fn admin(&mut self, subnqn: &str, kato_ms: u32) -> &mut Convo {
        self.init();
        let c = self.host.connect(1, 0, 15, kato_ms, CNTLID_DYNAMIC, subnqn);
        self.send(c);
        let p = self.host.property_get(2, property::CAP, true);
        self.send(p);
        let e = self.host.enable(3);
        self.send(e);
        let p = self.host.property_get(4, property::CSTS, false);
        self.send(p)
    }

    fn io(&mut self, cattr: u8) -> &mut Convo {
        self.init();
        let mut c = self.host.connect(1, 1, 15, 0, 1, NQN);
        if cattr != 0 {
            assert!(
                !self.host.framing.digests.header,
                "a header digest would need fixing"
            );
            c[8 + 46] = cattr;
        }
        self.send(c)
    }
}

fn ranges() -> [BlockRange; 2] {
    [
        BlockRange { slba: 0, blocks: 8 },
        BlockRange {
            slba: 100,
            blocks: 16,
        },
    ]
}

fn admin_connect(digests: Digests) -> Vec<u8> {
    let mut c = Convo::new(digests);
    c.admin(NQN, 5000);
    let h = c.host.clone();
    c.send(h.identify(5, cns::CONTROLLER, 0));
    c.send(h.set_features(6, feature::NUMBER_OF_QUEUES, 3 | 3 << 16));
    c.send(h.identify(7, cns::ACTIVE_NAMESPACES, 0));
    c.send(h.identify(8, cns::NAMESPACE, 1));
    c.send(h.identify(9, cns::NAMESPACE_DESCRIPTORS, 1));
    c.send(h.get_log_page(10, log_page::ERROR, 64, 0));
    c.send(h.get_log_page(11, log_page::SMART, 512, 0));
    c.send(h.set_features(12, feature::ASYNC_EVENT_CONFIG, 0xff));
    c.send(h.get_features(13, feature::KEEP_ALIVE_TIMER, 0));
    c.send(h.async_event_request(14));
    c.send(h.keep_alive(15));
    c.send(h.property_set(16, property::CC, 0));
    c.stream.clone()
}

fn keep_alive() -> Vec<u8> {
    let mut c = Convo::new(Digests::default());
    c.admin(NQN, 1000);
    let h = c.host.clone();
    for cid in 5..8 {
        c.send(h.keep_alive(cid));
    }
    c.send(h.set_features(8, feature::KEEP_ALIVE_TIMER, 100));
    c.send(h.keep_alive(9));
    c.send(h.async_event_request(10));
    c.send(h.async_event_request(11));
    c.send(h.async_event_request(12));
    c.stream.clone()
}

fn discovery() -> Vec<u8> {
    let mut c = Convo::new(Digests::default());
    c.admin(DISCOVERY_NQN, 0);
    let h = c.host.clone();
    c.send(h.identify(5, cns::CONTROLLER, 0));
    c.send(h.get_log_page(6, log_page::DISCOVERY, 1024, 0));
    c.send(h.get_log_page(7, log_page::DISCOVERY, 2048, 0));
    c.send(h.keep_alive(8));
    c.stream.clone()
}

fn io_read_write(digests: Digests) -> Vec<u8> {
    let mut c = Convo::new(digests);
    c.io(0);
    let h = c.host.clone();
    c.send(h.read(2, 1, 0, 8, 512));
    c.send(h.write(3, 1, 8, &[0xa5; 2048], 512));
    c.send(h.flush(4, 1));
    c.send(h.write_zeroes(5, 1, 16, 32, true));
    c.send(h.deallocate(6, 1, &ranges(), true));
    c.send(h.read(7, 2, 0, 1, 512));
    c.stream.clone()
}

fn io_r2t_write(digests: Digests) -> Vec<u8> {
    let mut c = Convo::new(digests);
    c.io(0);
    let h = c.host.clone();
    c.send(h.write_solicited(2, 1, 64, 24, 512));
    let tt = c.ttag(2);
    let data: Vec<u8> = (0..24 * 512).map(|i| (i / 512) as u8).collect();
    for (i, piece) in data.chunks(4096).enumerate() {
        let off = i as u32 * 4096;
        let last = off as usize + piece.len() == data.len();
        c.send(h.h2c_data(2, tt, off, piece, last));
    }
    c.send(h.deallocate(3, 1, &ranges(), false));
    let tt = c.ttag(3);
    c.send(h.deallocate_data(3, tt, &ranges()));
    c.send(h.read(4, 1, 64, 24, 512));
    c.stream.clone()
}

fn io_no_sq_flow_control() -> Vec<u8> {
    let mut c = Convo::new(Digests::default());
    c.io(CATTR_DISABLE_SQ_FLOW_CONTROL);
    let h = c.host.clone();
    c.send(h.read(2, 1, 0, 16, 512));
    c.send(h.read(3, 1, 16, 1, 512));
    c.send(h.disconnect(4));
    c.stream.clone()
}

fn io_bad_commands() -> Vec<u8> {
    let mut c = Convo::new(Digests::default());
    c.io(0);
    let h = c.host.clone();
    c.send(h.read(2, 1, 4095, 2, 512));
    c.send(h.read(3, 7, 0, 1, 512));
    c.send(h.read(4, 1, 0, 64, 512));
    c.send(h.write(5, 2, 0, &[1; 512], 512));
    c.send(h.keep_alive(6));
    c.send(h.write_solicited(7, 1, 0, 4, 4096));
    c.send(h.property_get(8, property::CAP, true));
    c.stream.clone()
}

fn bad_pdus() -> Vec<u8> {
    let mut c = Convo::new(Digests::default());
    c.io(0);
    let mut bad = c.host.flush(2, 1);
    bad[3] = 0x40; // a data offset on a capsule without data
    c.stream.extend(bad);
    c.stream.extend(c.host.term_req(Fes::PduSequenceError));
    c.stream.clone()
}

/// Every seed, by file name.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("admin_connect.bin", admin_connect(Digests::default())),
        ("admin_connect_digests.bin", admin_connect(digests())),
        ("keep_alive.bin", keep_alive()),
        ("discovery.bin", discovery()),
        ("io_read_write.bin", io_read_write(Digests::default())),
        ("io_read_write_digests.bin", io_read_write(digests())),
        ("io_r2t_write.bin", io_r2t_write(Digests::default())),
        ("io_r2t_write_digests.bin", io_r2t_write(digests())),
        ("io_no_sq_flow_control.bin", io_no_sq_flow_control()),
        ("io_bad_commands.bin", io_bad_commands()),
        ("bad_pdus.bin", bad_pdus()),
    ]
}
