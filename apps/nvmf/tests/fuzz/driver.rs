//! The fuzz test's caller: feeds a host's byte stream to a session in pieces, runs the I/O
//! commands it hands out (answering them a few steps later, as a device would), and checks
//! every step: what was consumed, what was sent, what is held.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use hypoll_nvme::fabrics::CNTLID_DYNAMIC;
use hypoll_nvme::spec::Status;
use hypoll_nvme::tcp::decode::{Decode, Decoder, Role};
use hypoll_nvme::tcp::{Digests, Pdu, PduType, COMMON_HEADER_BYTES};
use hypoll_nvmf::client::Host;
use hypoll_nvmf::{
    Close, IoCommand, IoOp, Limits, NamespaceConfig, Session, Step, Target, TargetConfig, WriteData,
};

pub const NQN: &str = "nqn.2026-12.io.hypoll:fuzz";
/// Small limits, so the fuzzer reaches them.
pub const LIMITS: Limits = Limits {
    controllers_max: 3,
    io_queues_max: 4,
    queue_entries_max: 16,
    in_capsule_bytes_max: 4096,
    maxh2cdata_bytes: 4096,
    transfer_bytes_max: 16 << 10,
    r2t_bytes_max: 32 << 10,
    r2ts_max: 2,
    aers_max: 2,
};
/// Completions the caller keeps waiting before it answers the oldest.
const DEFERRED_MAX: usize = 3;
/// Time that passes per event, for the keep-alive timer.
const EVENT_NS: u64 = 1_000_000;

pub fn target() -> Arc<Target> {
    let mut c = TargetConfig::new(NQN);
    let ns = |blocks, read_only| NamespaceConfig {
        block_bytes: 512,
        blocks,
        read_only,
        volatile_cache: true,
        write_zeroes: true,
        deallocate: true,
        uuid: NamespaceConfig::uuid_for("fuzz"),
    };
    c.namespaces = vec![ns(4096, false), ns(64, true)];
    c.discovery = vec![hypoll_nvmf::DiscoveryEntry {
        addr: "127.0.0.1:4420".parse().unwrap(),
        portid: 1,
    }];
    c.limits = LIMITS;
    Target::new(c).unwrap()
}

/// A ready controller (ID 1), for I/O queue streams to join; keep it while they run.
pub fn anchor(target: &Arc<Target>) -> Session {
    let h = Host::default();
    let mut s = Session::new(target.clone());
    let mut input = h.ic_req(0);
    input.extend(h.connect(1, 0, 15, 0, CNTLID_DYNAMIC, NQN));
    input.extend(h.enable(2));
    let mut out = Vec::new();
    let mut at = 0;
    while at < input.len() {
        let (used, step) = s.step(&input[at..], 0, &mut out);
        assert_eq!(step, Step::Handled);
        at += used;
    }
    assert_eq!(s.queue(), Some((1, 0)));
    s
}

/// Everything a session said, with the bytes it consumed for each event.
#[derive(Debug, PartialEq)]
pub struct Transcript {
    pub events: Vec<(usize, Step)>,
    pub out: Vec<u8>,
    pub consumed: usize,
}

/// The caller's side: commands handed out and not yet answered, and what the host has
/// sent that is still owed an answer.
struct Caller {
    target: Arc<Target>,
    /// Commands the caller may answer, oldest first.
    deferred: VecDeque<IoCommand>,
    /// Solicited writes: bytes expected and received so far.
    writes: HashMap<u16, (u32, u32)>,
    /// Command capsules consumed per identifier, not yet answered (a conflict counts
    /// twice, and is answered twice).
    owed: HashMap<u16, u32>,
}

fn io_bytes(cmd: &IoCommand, block_bytes: u32) -> u32 {
    match cmd.op {
        IoOp::Read { blocks, .. } | IoOp::Write { blocks, .. } => blocks * block_bytes,
        _ => 0,
    }
}

/// Feeds `stream` in pieces of the given sizes (cycled), as a server would after each
/// read, and checks the invariants of every step.
pub fn drive(stream: &[u8], cuts: &[usize]) -> Transcript {
    let target = target();
    let _anchor = anchor(&target);
    let mut s = Session::new(target.clone());
    let mut c = Caller {
        target: target.clone(),
        deferred: VecDeque::new(),
        writes: HashMap::new(),
        owed: HashMap::new(),
    };
    let mut t = Transcript {
        events: Vec::new(),
        out: Vec::new(),
        consumed: 0,
    };
    let (mut available, mut cut, mut closed) = (0, 0, false);
    while !closed && available < stream.len() {
        let piece = cuts
            .get(cut % cuts.len().max(1))
            .copied()
            .unwrap_or(7)
            .max(1);
        cut += 1;
        available = (available + piece).min(stream.len());
        loop {
            let input = &stream[t.consumed..available];
            let before = t.out.len();
            let now = t.events.len() as u64 * EVENT_NS;
            let (used, step) = s.step(input, now, &mut t.out);
            assert!(used <= input.len() && used <= s.pdu_bytes_max());
            match &step {
                Step::NeedMore(n) => {
                    assert_eq!((used, t.out.len()), (0, before), "no progress, no output");
                    assert!(input.len() + n <= s.pdu_bytes_max().max(COMMON_HEADER_BYTES));
                    break;
                }
                Step::Close(_) => closed = true,
                other => assert!(used > 0, "{other:?} consumed nothing"),
            }
            let pdu = &input[..used];
            if pdu.first() == Some(&(PduType::CapsuleCmd as u8)) {
                *c.owed
                    .entry(u16::from_le_bytes([pdu[10], pdu[11]]))
                    .or_default() += 1;
            }
            c.check_step(&step, pdu, &target);
            check_output(&s, &mut c.owed, &t.out[before..], &step);
            check_bounds(&s, &target);
            t.consumed += used;
            t.events.push((used, step));
            if closed {
                break;
            }
            if c.deferred.len() > DEFERRED_MAX {
                c.answer_oldest(&mut s, &mut t.out);
            }
        }
    }
    if closed {
        let (used, step) = s.step(&stream[t.consumed..], 0, &mut t.out);
        assert_eq!(used, 0);
        assert!(matches!(step, Step::Close(_)));
    }
    while !c.deferred.is_empty() {
        c.answer_oldest(&mut s, &mut t.out);
    }
    if !s.is_closed() {
        // What is still owed: held AERs and writes whose data never came.
        let owed: u32 = c.owed.values().sum();
        assert_eq!(owed as usize, s.commands_inflight());
    }
    t
}

impl Caller {
    fn check_step(&mut self, step: &Step, pdu: &[u8], target: &Target) {
        match step {
            Step::Io(cmd) => {
                let cfg = target.config();
                let ns = &cfg.namespaces[cmd.nsid as usize - 1];
                let end = |slba: u64, blocks: u32| slba + u64::from(blocks);
                match &cmd.op {
                    IoOp::Read { slba, blocks, .. } | IoOp::Write { slba, blocks, .. } => {
                        assert!(end(*slba, *blocks) <= ns.blocks);
                        assert!(blocks * ns.block_bytes <= LIMITS.transfer_bytes_max);
                    }
                    IoOp::WriteZeroes { slba, blocks, .. } => {
                        assert!(end(*slba, *blocks) <= ns.blocks)
                    }
                    IoOp::Deallocate { ranges } => {
                        assert!(ranges.len() <= 256);
                        for r in ranges {
                            assert!(r.blocks > 0 && end(r.slba, r.blocks) <= ns.blocks);
                        }
                    }
                    IoOp::Flush => {}
                }
                if ns.read_only {
                    assert!(
                        matches!(cmd.op, IoOp::Read { .. } | IoOp::Flush),
                        "{cmd:?} on a read-only namespace"
                    );
                }
                match &cmd.op {
                    IoOp::Write {
                        data: WriteData::InCapsule(r),
                        ..
                    } => {
                        assert_eq!(r.len() as u32, io_bytes(cmd, ns.block_bytes));
                        assert!(r.end <= pdu.len());
                        self.deferred.push_back(cmd.clone());
                    }
                    IoOp::Write {
                        data: WriteData::Solicited,
                        ..
                    } => {
                        let prior = self.writes.insert(cmd.cid, (io_bytes(cmd, 512), 0));
                        assert!(prior.is_none(), "two writes with one identifier");
                    }
                    _ => self.deferred.push_back(cmd.clone()),
                }
            }
            Step::WriteData {
                cid,
                offset,
                data,
                last,
            } => {
                let (bytes, got) = self
                    .writes
                    .get_mut(cid)
                    .expect("data for a solicited write");
                assert_eq!(*offset, *got, "in order");
                assert!(data.end <= pdu.len() && !data.is_empty());
                *got += data.len() as u32;
                assert_eq!(*last, *got == *bytes);
                if *last {
                    self.writes.remove(cid);
                    self.deferred.push_back(IoCommand {
                        cid: *cid,
                        nsid: 1,
                        op: IoOp::Flush,
                    });
                }
            }
            Step::WriteAborted { cid } => {
                assert!(self.writes.remove(cid).is_some());
            }
            Step::Close(Close::Fatal { why, .. } | Close::Protocol(why)) => {
                assert!(!why.contains('\n'), "one log line");
            }
            _ => {}
        }
    }

    /// Answers the oldest command: a read with data, anything else with success.
    fn answer_oldest(&mut self, s: &mut Session, out: &mut Vec<u8>) {
        let cmd = self.deferred.pop_front().expect("something to answer");
        let before = out.len();
        let r = match cmd.op {
            IoOp::Read { blocks, .. } => {
                let data = vec![0x5a; (blocks * 512) as usize];
                s.complete_read(cmd.cid, &[&data], out)
            }
            _ => s.complete(cmd.cid, Status::SUCCESS, out),
        };
        match r {
            Ok(()) => check_output(s, &mut self.owed, &out[before..], &Step::Handled),
            Err(e) => assert!(s.is_closed(), "{e}"),
        }
        check_bounds(s, &self.target);
    }
}

/// The bytes a step sent must be whole PDUs a host accepts; every answer must be owed.
fn check_output(s: &Session, owed: &mut HashMap<u16, u32>, mut out: &[u8], step: &Step) {
    let f = s.framing();
    let d = Decoder {
        digests: f.digests,
        pda_bytes: f.pda_bytes,
        ..Decoder::new(Role::Host, 0, LIMITS.transfer_bytes_max)
    };
    fn answer(owed: &mut HashMap<u16, u32>, cid: u16) {
        let n = owed.get_mut(&cid).filter(|n| **n > 0);
        *n.unwrap_or_else(|| panic!("an answer to command {cid}, which is not owed one")) -= 1;
    }
    while !out.is_empty() {
        let p = match d.decode(out) {
            Ok(Decode::Pdu(p)) => p,
            other => panic!("the target sent something a host cannot parse: {other:?}"),
        };
        assert!(p.data_digest_ok);
        match p.pdu {
            Pdu::CapsuleResp(c) => answer(owed, c.cid),
            Pdu::C2HData(h) => {
                assert!(owed.get(&h.cccid).is_some_and(|n| *n > 0));
                if h.success {
                    answer(owed, h.cccid);
                }
            }
            Pdu::R2T(r) => assert!(owed.get(&r.cccid).is_some_and(|n| *n > 0)),
            Pdu::C2HTermReq(_) => {
                assert_eq!(p.len, out.len(), "a termination request comes last");
                assert!(matches!(step, Step::Close(Close::Fatal { .. })));
            }
            Pdu::IcResp(r) => assert!(r.maxh2cdata == LIMITS.maxh2cdata_bytes),
            other => panic!("{other:?} from a controller"),
        }
        out = &out[p.len..];
    }
}

/// What a host can make the target hold stays within the limits.
fn check_bounds(s: &Session, target: &Target) {
    let l = LIMITS;
    assert!(target.controllers() <= usize::from(l.controllers_max));
    assert!(s.commands_inflight() <= usize::from(l.queue_entries_max));
    assert!(
        s.held_bytes()
            <= u64::from(l.queue_entries_max) * u64::from(l.in_capsule_bytes_max)
                + u64::from(l.r2t_bytes_max)
    );
}

/// Whether any digest is on (for seeds that ask for them).
pub fn digests() -> Digests {
    Digests {
        header: true,
        data: true,
    }
}
