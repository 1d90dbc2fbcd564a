//! Conversations with a session, as a host has them: the admin queue here, I/O in
//! `tests/io.rs`, faults and limits in `tests/faults.rs`.

use std::sync::Arc;

use hypoll_nvme::fabrics::*;
use hypoll_nvme::spec::{CompletionEntry, Status};
use hypoll_nvme::tcp::decode::{Decode, Decoder, Role};
use hypoll_nvme::tcp::{DataHeader, Digests, IcResp, Pdu, R2t};

use super::*;
use crate::client::Host;
use crate::config::{DiscoveryEntry, NamespaceConfig, TargetConfig};

mod faults;
mod io;

pub(crate) const NQN: &str = "nqn.2026-12.io.hypoll:test";
const MS: u64 = 1_000_000;

/// What the target sent, owned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    IcResp(IcResp),
    Resp(CompletionEntry),
    Data(DataHeader, Vec<u8>),
    R2t(R2t),
    Term { fes: u16, fei: u32 },
}

impl Reply {
    pub(crate) fn status(&self) -> Status {
        match self {
            Reply::Resp(c) => c.status(),
            other => panic!("not a response: {other:?}"),
        }
    }

    pub(crate) fn dw0(&self) -> u32 {
        match self {
            Reply::Resp(c) => c.dw0,
            other => panic!("not a response: {other:?}"),
        }
    }
}

pub(crate) fn namespaces() -> Vec<NamespaceConfig> {
    let ns = |read_only| NamespaceConfig {
        block_bytes: 512,
        blocks: 2048,
        read_only,
        volatile_cache: true,
        write_zeroes: true,
        deallocate: true,
        uuid: NamespaceConfig::uuid_for("mem"),
    };
    vec![ns(false), ns(true)]
}

pub(crate) fn config() -> TargetConfig {
    let mut c = TargetConfig::new(NQN);
    c.namespaces = namespaces();
    c.discovery = vec![DiscoveryEntry {
        addr: "127.0.0.1:4420".parse().unwrap(),
        portid: 1,
    }];
    c.limits.transfer_bytes_max = 64 << 10;
    c.limits.r2t_bytes_max = 64 << 10;
    c
}

/// One connection: a session and the host that talks to it.
pub(crate) struct Conn {
    pub(crate) s: Session,
    pub(crate) host: Host,
    pub(crate) now: u64,
    input: Vec<u8>,
}

impl Conn {
    pub(crate) fn new(target: &Arc<Target>) -> Conn {
        Conn {
            s: Session::new(target.clone()),
            host: Host::default(),
            now: 0,
            input: Vec::new(),
        }
    }

    /// Feeds `bytes`; returns the events and the replies they sent.
    pub(crate) fn send(&mut self, bytes: &[u8]) -> (Vec<Step>, Vec<Reply>) {
        self.input.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut steps = Vec::new();
        loop {
            let (used, step) = self.s.step(&self.input, self.now, &mut out);
            if let Step::Io(IoCommand {
                op:
                    IoOp::Write {
                        data: WriteData::InCapsule(r),
                        ..
                    },
                ..
            }) = &step
            {
                // The data lies where the step said.
                assert!(r.end <= used);
            }
            self.input.drain(..used);
            let stop = matches!(step, Step::NeedMore(_) | Step::Close(_));
            steps.push(step);
            if stop {
                break;
            }
        }
        (steps, self.decode(&out))
    }

    /// Sends one PDU that must get exactly one reply.
    pub(crate) fn ask(&mut self, bytes: &[u8]) -> Reply {
        let (_, mut r) = self.send(bytes);
        assert_eq!(r.len(), 1, "{r:?}");
        r.pop().unwrap()
    }

    pub(crate) fn decode(&self, mut out: &[u8]) -> Vec<Reply> {
        let f = self.s.framing();
        let d = Decoder {
            digests: f.digests,
            pda_bytes: f.pda_bytes,
            ..Decoder::new(Role::Host, 0, u32::MAX / 2)
        };
        let mut v = Vec::new();
        while !out.is_empty() {
            let Ok(Decode::Pdu(p)) = d.decode(out) else {
                panic!("unparsable output: {:?}", d.decode(out))
            };
            assert!(p.data_digest_ok);
            v.push(match p.pdu {
                Pdu::IcResp(r) => Reply::IcResp(r),
                Pdu::CapsuleResp(c) => Reply::Resp(c),
                Pdu::C2HData(h) => Reply::Data(h, out[p.data.clone()].to_vec()),
                Pdu::R2T(r) => Reply::R2t(r),
                Pdu::C2HTermReq(t) => Reply::Term {
                    fes: t.fes,
                    fei: t.fei,
                },
                other => panic!("{other:?} from a controller"),
            });
            out = &out[p.len..];
        }
        v
    }

    /// ICReq and ICResp.
    pub(crate) fn init(&mut self) -> IcResp {
        let req = self.host.ic_req(0);
        match self.ask(&req) {
            Reply::IcResp(r) => r,
            other => panic!("{other:?}"),
        }
    }

    /// ICReq, Connect of the admin queue, CC.EN: a ready controller. Returns its ID.
    pub(crate) fn admin(&mut self, subnqn: &str, kato_ms: u32) -> u16 {
        self.init();
        let r = self.ask(&self.host.connect(1, 0, 31, kato_ms, CNTLID_DYNAMIC, subnqn));
        assert_eq!(r.status(), Status::SUCCESS);
        let cntlid = r.dw0() as u16;
        assert_eq!(self.ask(&self.host.enable(2)).status(), Status::SUCCESS);
        cntlid
    }

    /// ICReq and Connect of I/O queue `qid` to controller `cntlid`.
    pub(crate) fn io(&mut self, cntlid: u16, qid: u16) -> Status {
        self.init();
        self.ask(&self.host.connect(1, qid, 31, 0, cntlid, NQN))
            .status()
    }

    /// A command whose answer is data and a response; returns the data.
    pub(crate) fn data(&mut self, bytes: &[u8]) -> Vec<u8> {
        let (_, r) = self.send(bytes);
        match &r[..] {
            [Reply::Data(h, d), Reply::Resp(c)] => {
                assert!(h.last && !h.success);
                assert_eq!(c.status(), Status::SUCCESS);
                assert_eq!(h.cccid, c.cid);
                d.clone()
            }
            other => panic!("{other:?}"),
        }
    }
}

pub(crate) fn target() -> Arc<Target> {
    Target::new(config()).unwrap()
}

#[test]
fn icresp_grants_what_the_host_asks_within_what_is_allowed() {
    let mut cfg = config();
    cfg.digests_allowed.data = false;
    let t = Target::new(cfg).unwrap();
    let mut c = Conn::new(&t);
    c.host = Host::new(Digests {
        header: true,
        data: true,
    });
    let r = c.init();
    assert_eq!(
        r.digests,
        Digests {
            header: true,
            data: false
        }
    );
    assert_eq!((r.pfv, r.cpda, r.maxh2cdata), (0, 0, 128 << 10));
    assert!(c.s.framing().digests.header);
}

#[test]
fn the_admin_queue_connects_enables_and_identifies() {
    let t = target();
    let mut c = Conn::new(&t);
    c.init();
    // An admin command before Connect is out of sequence.
    let r = c.ask(&c.host.keep_alive(9));
    assert_eq!(r.status(), Status::COMMAND_SEQUENCE_ERROR);
    let r = c.ask(&c.host.connect(1, 0, 31, 5000, CNTLID_DYNAMIC, NQN));
    assert_eq!((r.status(), r.dw0()), (Status::SUCCESS, 1));
    assert_eq!(c.s.queue(), Some((1, 0)));
    // Before CC.EN, only fabrics commands.
    assert_eq!(
        c.ask(&c.host.identify(3, cns::CONTROLLER, 0)).status(),
        Status::COMMAND_SEQUENCE_ERROR
    );
    let Reply::Resp(cap) = c.ask(&c.host.property_get(4, property::CAP, true)) else {
        panic!()
    };
    let cap = u64::from(cap.dw0) | u64::from(cap.dw1) << 32;
    assert_eq!(cap & 0xffff, 127, "MQES");
    assert_ne!(cap & (1 << 16), 0, "CQR");
    assert_ne!(cap & (1 << 37), 0, "NVM command set");
    assert_eq!(
        c.ask(&c.host.property_get(5, property::VS, false)).dw0(),
        0x10300
    );
    assert_eq!(
        c.ask(&c.host.property_get(5, property::CAP, false))
            .status(),
        Status::INVALID_FIELD,
        "CAP is 8 bytes"
    );
    assert_eq!(
        c.ask(&c.host.property_get(6, property::CSTS, false)).dw0(),
        0
    );
    assert_eq!(c.ask(&c.host.enable(7)).status(), Status::SUCCESS);
    assert_eq!(
        c.ask(&c.host.property_get(8, property::CSTS, false)).dw0(),
        1
    );

    let id = c.data(&c.host.identify(10, cns::CONTROLLER, 0));
    assert_eq!(u16::from_le_bytes([id[78], id[79]]), 1, "CNTLID");
    assert_eq!(&id[768..768 + NQN.len()], NQN.as_bytes());
    assert_eq!(id[768 + NQN.len()], 0);
    assert_eq!(id[77], 4, "MDTS: 64 KiB in 4 KiB pages");
    assert_eq!(
        u32::from_le_bytes(id[516..520].try_into().unwrap()),
        2,
        "NN"
    );
    assert_eq!(u16::from_le_bytes([id[520], id[521]]), 0b1100, "ONCS");
    assert_eq!(
        u32::from_le_bytes(id[536..540].try_into().unwrap()) & 3,
        1,
        "SGLS"
    );
    assert_eq!(
        u32::from_le_bytes(id[1792..1796].try_into().unwrap()),
        (64 + 8192) / 16,
        "IOCCSZ"
    );
    assert_eq!(id[111], 1, "an I/O controller");

    let ns = c.data(&c.host.identify(11, cns::NAMESPACE, 1));
    assert_eq!(u64::from_le_bytes(ns[..8].try_into().unwrap()), 2048);
    assert_eq!(ns[130], 9, "LBADS: 512-byte blocks");
    assert_eq!(ns[99], 0);
    assert_eq!(
        c.data(&c.host.identify(12, cns::NAMESPACE, 2))[99],
        1,
        "read-only"
    );
    assert_eq!(
        c.ask(&c.host.identify(13, cns::NAMESPACE, 3)).status(),
        Status::INVALID_NAMESPACE
    );
    let list = c.data(&c.host.identify(14, cns::ACTIVE_NAMESPACES, 0));
    assert_eq!(&list[..12], &[1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
    let list = c.data(&c.host.identify(15, cns::ACTIVE_NAMESPACES, 1));
    assert_eq!(&list[..8], &[2, 0, 0, 0, 0, 0, 0, 0]);
    let desc = c.data(&c.host.identify(16, cns::NAMESPACE_DESCRIPTORS, 1));
    assert_eq!((desc[0], desc[1]), (2, 16), "NGUID first");
    assert_eq!(&desc[4..20], &namespaces()[0].uuid);
    assert_eq!((desc[20], desc[21]), (3, 16), "then the UUID");
    assert_eq!(
        (desc[40], desc[41], desc[44]),
        (4, 1, 0),
        "then the NVM command set"
    );
    assert_eq!(
        c.ask(&c.host.identify(17, 0x10, 0)).status(),
        Status::INVALID_FIELD
    );
}

#[test]
fn logs_and_features() {
    let t = target();
    let mut c = Conn::new(&t);
    c.admin(NQN, 0);
    assert_eq!(
        c.data(&c.host.get_log_page(3, log_page::ERROR, 64, 0)),
        [0; 64]
    );
    let smart = c.data(&c.host.get_log_page(4, log_page::SMART, 512, 0));
    assert_eq!((smart[3], smart[4]), (100, 10));
    let fw = c.data(&c.host.get_log_page(4, log_page::FIRMWARE_SLOT, 512, 0));
    assert_eq!((fw[0], &fw[8..13]), (1, &b"0.1.0"[..]));
    let r = c.ask(&c.host.get_log_page(4, 0x0c, 512, 0));
    assert_eq!(r.status(), Status::INVALID_LOG_PAGE, "no ANA log");
    // Past the log's end the page reads zeroes; an offset past it is refused.
    let part = c.data(&c.host.get_log_page(5, log_page::SMART, 16, 0));
    assert_eq!(part.len(), 16);
    let r = c.ask(&c.host.get_log_page(6, log_page::SMART, 16, 1024));
    assert_eq!(r.status(), Status::INVALID_FIELD);
    let r = c.ask(&c.host.get_log_page(7, log_page::DISCOVERY, 1024, 0));
    assert_eq!(
        r.status(),
        Status::INVALID_LOG_PAGE,
        "not on an NVM subsystem"
    );
    let r = c.ask(&c.host.get_log_page(8, log_page::SMART, 128 << 10, 0));
    assert_eq!(r.status(), Status::INVALID_FIELD, "beyond MDTS");

    // Number of queues: 0's based, at most the limit.
    let r = c.ask(
        &c.host
            .set_features(9, feature::NUMBER_OF_QUEUES, 3 | (7 << 16)),
    );
    assert_eq!((r.status(), r.dw0()), (Status::SUCCESS, 3 | (3 << 16)));
    let r = c.ask(&c.host.get_features(10, feature::NUMBER_OF_QUEUES, 0));
    assert_eq!(r.dw0(), 3 | (3 << 16));
    let r = c.ask(&c.host.set_features(11, feature::NUMBER_OF_QUEUES, 0xffff));
    assert_eq!(r.status(), Status::INVALID_FIELD);
    let r = c.ask(&c.host.set_features(12, feature::KEEP_ALIVE_TIMER, 1500));
    assert_eq!(r.status(), Status::SUCCESS);
    assert_eq!(
        c.ask(&c.host.get_features(13, feature::KEEP_ALIVE_TIMER, 0))
            .dw0(),
        1500
    );
    assert_eq!(c.s.deadline_ns(), Some(1500 * MS));
    assert_eq!(
        c.ask(&c.host.get_features(14, feature::KEEP_ALIVE_TIMER, 3))
            .dw0(),
        4
    );
    let r = c.ask(&c.host.set_features(15, feature::ASYNC_EVENT_CONFIG, 0x1ff));
    assert_eq!(r.status(), Status::SUCCESS);
    assert_eq!(
        c.ask(&c.host.get_features(16, feature::ASYNC_EVENT_CONFIG, 0))
            .dw0(),
        0xff
    );
    let r = c.ask(&c.host.set_features(17, 0x80, 0));
    assert_eq!(r.status(), Status::INVALID_FIELD);
    let save = hypoll_nvme::spec::SubmissionEntry {
        opcode: hypoll_nvme::fabrics::admin::SET_FEATURES,
        cid: 18,
        cdw10: u32::from(feature::KEEP_ALIVE_TIMER) | 1 << 31,
        ..Default::default()
    };
    let r = c.ask(&c.host.command(&save, &[]));
    assert_eq!(r.status(), Status::FEATURE_NOT_SAVEABLE);
    let r = c.ask(&c.host.get_features(19, feature::ASYNC_EVENT_CONFIG, 4));
    assert_eq!(r.status(), Status::INVALID_FIELD);
}

#[test]
fn aers_are_held_up_to_the_limit_and_aborted_by_a_reset() {
    let t = target();
    let mut c = Conn::new(&t);
    c.admin(NQN, 0);
    for cid in 10..14 {
        let (steps, replies) = c.send(&c.host.async_event_request(cid));
        assert_eq!(steps[0], Step::Handled);
        assert!(replies.is_empty(), "held");
    }
    assert_eq!(c.s.commands_inflight(), 4);
    let r = c.ask(&c.host.async_event_request(14));
    assert_eq!(r.status(), Status::AER_LIMIT_EXCEEDED);
    let r = c.ask(&c.host.async_event_request(10));
    assert_eq!(r.status(), Status::COMMAND_ID_CONFLICT);
    // CC.EN cleared: the held requests come back aborted, then the property's answer.
    let (_, replies) = c.send(&c.host.property_set(20, property::CC, 0));
    let cids: Vec<_> = replies
        .iter()
        .map(|r| match r {
            Reply::Resp(c) => (c.cid, c.status()),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(cids.len(), 5);
    assert!(cids[..4]
        .iter()
        .all(|&(_, s)| s == Status::ABORTED_SQ_DELETION));
    assert_eq!(cids[4], (20, Status::SUCCESS));
    assert_eq!(c.s.commands_inflight(), 0);
    assert_eq!(
        c.ask(&c.host.property_get(21, property::CSTS, false)).dw0(),
        0
    );
}

#[test]
fn shutdown_completes_at_once() {
    let t = target();
    let mut c = Conn::new(&t);
    c.admin(NQN, 0);
    let v = cc::EN | (1 << cc::SHN_SHIFT) | (SQES_LOG2 << 16) | (CQES_LOG2 << 20);
    assert_eq!(
        c.ask(&c.host.property_set(3, property::CC, v)).status(),
        Status::SUCCESS
    );
    let csts_now = c.ask(&c.host.property_get(4, property::CSTS, false)).dw0();
    assert_eq!(csts_now & csts::SHST_MASK, csts::SHST_COMPLETE);
    // Entry sizes other than the fabrics ones make the controller fatal, not ready.
    let mut c = Conn::new(&t);
    c.init();
    c.ask(&c.host.connect(1, 0, 31, 0, CNTLID_DYNAMIC, NQN));
    c.ask(&c.host.property_set(2, property::CC, cc::EN));
    assert_eq!(
        c.ask(&c.host.property_get(3, property::CSTS, false)).dw0(),
        csts::CFS
    );
}

#[test]
fn keep_alive_resets_the_timer_and_its_expiry_ends_the_controller() {
    let t = target();
    let mut a = Conn::new(&t);
    let cntlid = a.admin(NQN, 1000);
    let mut q = Conn::new(&t);
    assert_eq!(q.io(cntlid, 1), Status::SUCCESS);
    a.now = 900 * MS;
    assert_eq!(a.s.poll(a.now), None);
    assert_eq!(a.ask(&a.host.keep_alive(3)).status(), Status::SUCCESS);
    assert_eq!(a.s.deadline_ns(), Some(1900 * MS));
    assert_eq!(a.s.poll(1899 * MS), None);
    assert_eq!(a.s.poll(1900 * MS), Some(Close::KeepAliveExpired));
    assert_eq!(t.controllers(), 0);
    // The I/O queue learns at its next step.
    let (steps, _) = q.send(&q.host.flush(5, 1));
    assert_eq!(steps, [Step::Close(Close::ControllerGone)]);
}

#[test]
fn discovery_controllers_list_the_subsystem() {
    let t = target();
    let mut c = Conn::new(&t);
    let cntlid = c.admin(DISCOVERY_NQN, 0);
    let id = c.data(&c.host.identify(3, cns::CONTROLLER, 0));
    assert_eq!(id[111], 2, "a discovery controller");
    assert_eq!(
        &id[768..768 + DISCOVERY_NQN.len()],
        DISCOVERY_NQN.as_bytes()
    );
    assert_eq!(
        c.ask(&c.host.identify(4, cns::NAMESPACE, 1)).status(),
        Status::INVALID_FIELD
    );
    let head = c.data(&c.host.get_log_page(5, log_page::DISCOVERY, 1024, 0));
    assert_eq!(
        u64::from_le_bytes(head[8..16].try_into().unwrap()),
        1,
        "NUMREC"
    );
    let rec = c.data(&c.host.get_log_page(6, log_page::DISCOVERY, 1024, 1024));
    assert_eq!(
        (rec[0], rec[1], rec[2]),
        (3, 1, 2),
        "TCP, IPv4, NVM subsystem"
    );
    assert_eq!(&rec[32..36], b"4420");
    assert_eq!(&rec[256..256 + NQN.len()], NQN.as_bytes());
    assert_eq!(&rec[512..521], b"127.0.0.1");
    assert_eq!(
        c.ask(&c.host.set_features(7, feature::NUMBER_OF_QUEUES, 0))
            .status(),
        Status::INVALID_FIELD
    );
    // No I/O queue joins a discovery controller.
    let mut q = Conn::new(&t);
    q.init();
    let r = q.ask(&q.host.connect(1, 1, 31, 0, cntlid, DISCOVERY_NQN));
    assert_eq!(r.status(), Status::CONNECT_INVALID_PARAMETERS);
    assert_eq!(
        r.dw0(),
        connect_invalid_parameter_dw0(CONNECT_QID_OFFSET, false)
    );
}
