//! One NVMe/TCP connection (one queue) as a state machine over bytes: no sockets, no clock,
//! no devices. The caller feeds it what it read ([`Session::step`]) and sends what it appends
//! to `out`; valid I/O commands come out as [`Step::Io`] for the caller to run, and their
//! results go back in ([`Session::complete`], [`Session::complete_read`]).
//!
//! `step` consumes one whole PDU at a time from the front of its input (the caller keeps
//! the rest and calls again after its next read; [`Session::pdu_bytes_max`] is the buffer a
//! whole PDU needs). Everything the protocol itself answers (ICResp, Connect, properties,
//! Identify, log pages, features, refusals, R2Ts, termination requests) is appended to
//! `out` by the session.
//!
//! The conversation: ICReq/ICResp, then Connect (admin queue: a new controller; I/O queue:
//! a queue of an existing one), then commands. A malformed or out-of-sequence PDU gets the
//! C2HTermReq the transport specification prescribes and ends the session
//! ([`Close::Fatal`]); a bad command gets an NVMe status in its completion and the session
//! goes on.
//!
//! `connect.rs` serves Connect, `admin.rs` the admin queue's commands (properties,
//! Identify, logs, features, keep-alive, AER), `io.rs` the I/O commands, R2T/H2CData and
//! completions.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::Range;
use std::sync::Arc;

use hypoll_nvme::spec::{CompletionEntry, Status};
use hypoll_nvme::tcp::decode::{Decode, Decoder, PduError, Role};
use hypoll_nvme::tcp::encode::{self, Framing};
use hypoll_nvme::tcp::pdu::Decoded;
use hypoll_nvme::tcp::{pda_bytes, Fes, IcResp, Pdu, PduType, COMMON_HEADER_BYTES, PFV_1_0};

use crate::config::ADMIN_IN_CAPSULE_BYTES;
use crate::target::{Link, Target};

mod admin;
mod connect;
mod io;

/// A contiguous run of blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockRange {
    pub slba: u64,
    pub blocks: u32,
}

/// Where a write's data is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteData {
    /// In the capsule: this range of the input given to the `step` that returned it.
    InCapsule(Range<usize>),
    /// Solicited: it arrives in [`Step::WriteData`] events, ending with `last` (or
    /// [`Step::WriteAborted`]).
    Solicited,
}

/// What a valid I/O command asks of a namespace's device. Blocks are the namespace's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IoOp {
    Read {
        slba: u64,
        blocks: u32,
        fua: bool,
    },
    Write {
        slba: u64,
        blocks: u32,
        fua: bool,
        data: WriteData,
    },
    Flush,
    WriteZeroes {
        slba: u64,
        blocks: u32,
        /// The host allows the blocks to be deallocated rather than written.
        deallocate: bool,
        fua: bool,
    },
    /// Dataset Management's deallocate: the ranges (in range, non-empty, at most 256).
    Deallocate {
        ranges: Vec<BlockRange>,
    },
}

/// A command for the caller to run, then answer with [`Session::complete`] (or
/// [`Session::complete_read`] for a successful read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoCommand {
    /// The command's identifier: the caller's handle for it.
    pub cid: u16,
    pub nsid: u32,
    pub op: IoOp,
}

/// Why a session ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Close {
    /// The host sent a termination request (its FES).
    HostTerminated { fes: u16 },
    /// The host broke the transport protocol: a C2HTermReq with `fes` was appended to
    /// `out`. Send it, then close.
    Fatal { fes: Fes, why: String },
    /// The host broke the protocol where the specification says to close without a word.
    Protocol(String),
    /// The admin queue's keep-alive timer ran out: the controller is gone.
    KeepAliveExpired,
    /// The queue's controller ended (its admin queue closed, reset it or timed out).
    ControllerGone,
    /// The host disconnected the queue (fabrics Disconnect): send the reply in `out`, then
    /// close once the commands in flight are answered.
    Disconnect,
}

/// The outcome of one [`Session::step`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing until at least this many more bytes have arrived.
    NeedMore(usize),
    /// A PDU was handled; replies (if any) were appended to `out`.
    Handled,
    /// A valid I/O command.
    Io(IoCommand),
    /// Data of a solicited write: copy this range of the input to `offset` in the write's
    /// data. After the `last` piece, run the write.
    WriteData {
        cid: u16,
        offset: u32,
        data: Range<usize>,
        last: bool,
    },
    /// A solicited write's data failed its digest: drop what was gathered for it; its
    /// completion (a transient transport error) was appended to `out`.
    WriteAborted { cid: u16 },
    /// The session ended; send what `out` holds, then close.
    Close(Close),
}

/// Why a completion was not taken. Each is a caller's mistake (or a late answer for a
/// session that ended); the session is unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CompleteError {
    #[error("no command {0} is waiting for the caller")]
    Unknown(u16),
    #[error("command {0} is a read: a success carries its data")]
    ReadNeedsData(u16),
    #[error("command {cid}'s data is {expected} bytes, {given} given")]
    Length { cid: u16, expected: u32, given: u64 },
    #[error("the session is closed")]
    Closed,
}

/// A fatal transport error: the termination request to send.
#[derive(Debug)]
pub(crate) struct Fatal {
    fes: Fes,
    fei: u32,
    why: String,
}

impl Fatal {
    pub(crate) fn new(fes: Fes, fei: u32, why: impl Into<String>) -> Fatal {
        Fatal {
            fes,
            fei,
            why: why.into(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    AwaitIcReq,
    AwaitConnect,
    Connected,
    Closed(Close),
}

/// The queue a Connect made this connection.
#[derive(Debug)]
pub(crate) struct Queue {
    pub(crate) qid: u16,
    pub(crate) link: Arc<Link>,
    /// Entries (SQSIZE + 1): the commands it may hold.
    pub(crate) entries: u16,
    pub(crate) sq_head: u16,
    /// The host left SQ flow control on (a read's last data PDU then cannot stand in for
    /// its completion).
    pub(crate) flow_control: bool,
    pub(crate) discovery: bool,
}

/// A hasher for command identifiers: they are small integers a host picks, so a multiply
/// spreads them well enough, and costs less than the default hasher on every command.
#[derive(Default)]
pub(crate) struct CidHasher(u64);

impl Hasher for CidHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u16(&mut self, v: u16) {
        self.0 = u64::from(v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

pub(crate) type CmdMap = HashMap<u16, io::Cmd, BuildHasherDefault<CidHasher>>;

/// One connection's protocol state.
#[derive(Debug)]
pub struct Session {
    target: Arc<Target>,
    phase: Phase,
    decoder: Decoder,
    /// How this end frames what it sends.
    framing: Framing,
    pdu_bytes_max: usize,
    queue: Option<Queue>,
    /// The controller's state, on its admin queue's session only.
    admin: Option<Box<admin::AdminState>>,
    /// Commands received and not yet answered.
    cmds: CmdMap,
    /// Solicited writes waiting for their R2T, in arrival order.
    r2t_waiting: VecDeque<u16>,
    /// R2Ts sent whose data has not all arrived.
    r2ts_active: u16,
    /// Bytes solicited by R2T and not yet answered.
    solicited_bytes: u64,
    /// Write data the caller may hold: in-capsule and solicited, until answered.
    held_bytes: u64,
    next_ttag: u16,
}

impl Session {
    /// A session for a new connection to `target`.
    pub fn new(target: Arc<Target>) -> Session {
        let l = target.config().limits;
        let decoder = Decoder::new(
            Role::Controller,
            ADMIN_IN_CAPSULE_BYTES.max(l.in_capsule_bytes_max),
            l.maxh2cdata_bytes,
        );
        Session {
            target,
            phase: Phase::AwaitIcReq,
            pdu_bytes_max: decoder.pdu_bytes_max(),
            decoder,
            framing: Framing::default(),
            queue: None,
            admin: None,
            cmds: CmdMap::default(),
            r2t_waiting: VecDeque::new(),
            r2ts_active: 0,
            solicited_bytes: 0,
            held_bytes: 0,
            next_ttag: 0,
        }
    }

    /// The longest PDU the session accepts: the caller's input buffer must hold one.
    pub fn pdu_bytes_max(&self) -> usize {
        self.pdu_bytes_max
    }

    /// How the session frames what it sends (digests, the host's data alignment): what a
    /// reader of its output decodes with.
    pub fn framing(&self) -> Framing {
        self.framing
    }

    /// The controller and queue ID, once connected.
    pub fn queue(&self) -> Option<(u16, u16)> {
        self.queue.as_ref().map(|q| (q.link.cntlid, q.qid))
    }

    /// Whether the ICReq/ICResp exchange and Connect are done.
    pub fn connected(&self) -> bool {
        self.phase == Phase::Connected
    }

    pub fn is_closed(&self) -> bool {
        matches!(self.phase, Phase::Closed(_))
    }

    /// Commands received and not yet answered (held AERs included): at most the queue's
    /// entries.
    pub fn commands_inflight(&self) -> usize {
        self.cmds.len()
    }

    /// Bytes of write data the caller may hold for this connection (in-capsule writes not
    /// yet answered, and solicited data): at most the queue's entries times the in-capsule
    /// limit, plus the R2T limit.
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// When [`Session::poll`] must next run (the keep-alive deadline), if ever.
    pub fn deadline_ns(&self) -> Option<u64> {
        self.admin.as_ref().and_then(|a| a.keep_alive_deadline_ns)
    }

    /// Checks what time and the other queues can change: the keep-alive deadline (admin
    /// queue) and whether the controller still lives (I/O queue). Returns why the session
    /// ended, if it has.
    pub fn poll(&mut self, now_ns: u64) -> Option<Close> {
        if let Phase::Closed(why) = &self.phase {
            return Some(why.clone());
        }
        if self.queue.as_ref().is_some_and(|q| !q.link.is_live()) {
            return Some(self.close(Close::ControllerGone));
        }
        if self.deadline_ns().is_some_and(|d| now_ns >= d) {
            return Some(self.close(Close::KeepAliveExpired));
        }
        None
    }

    /// Consumes at most one PDU from the front of `input`; returns the bytes consumed and
    /// what happened. `now_ns` is a monotonic clock (the keep-alive timer counts in it).
    /// After `Step::Close` every later call returns `(0, Close)` again.
    pub fn step(&mut self, input: &[u8], now_ns: u64, out: &mut Vec<u8>) -> (usize, Step) {
        if let Some(why) = self.poll(now_ns) {
            return (0, Step::Close(why));
        }
        let p = match self.decoder.decode(input) {
            Ok(Decode::NeedMore(n)) => return (0, Step::NeedMore(n)),
            Ok(Decode::Pdu(p)) => p,
            Err(e) => return (0, self.pdu_error(e, input, out)),
        };
        let len = p.len;
        match self.handle(p, input, now_ns, out) {
            Ok(step) => {
                debug_assert!(self.invariants());
                (len, step)
            }
            Err(fatal) => (0, self.fatal(fatal, &input[..len], out)),
        }
    }

    fn handle(
        &mut self,
        p: Decoded<'_>,
        input: &[u8],
        now_ns: u64,
        out: &mut Vec<u8>,
    ) -> Result<Step, Fatal> {
        let sequence = |what: &str| Fatal::new(Fes::PduSequenceError, 0, what);
        match (&self.phase, p.pdu) {
            (_, Pdu::H2CTermReq(t)) => Ok(Step::Close(
                self.close(Close::HostTerminated { fes: t.fes }),
            )),
            (Phase::AwaitIcReq, Pdu::IcReq(req)) => {
                let allowed = self.target.config().digests_allowed;
                self.framing.digests.header = req.digests.header && allowed.header;
                self.framing.digests.data = req.digests.data && allowed.data;
                self.framing.pda_bytes = pda_bytes(req.hpda);
                let resp = IcResp {
                    pfv: PFV_1_0,
                    cpda: 0,
                    digests: self.framing.digests,
                    maxh2cdata: self.target.config().limits.maxh2cdata_bytes,
                };
                encode::ic_resp(out, &resp);
                self.decoder.digests = self.framing.digests;
                self.decoder.pda_bytes = pda_bytes(resp.cpda);
                self.phase = Phase::AwaitConnect;
                Ok(Step::Handled)
            }
            (Phase::AwaitIcReq, _) => Err(sequence("a PDU before ICReq")),
            (_, Pdu::IcReq(_)) => Err(sequence("a second ICReq")),
            (_, Pdu::CapsuleCmd(sqe)) => {
                let data = &input[p.data.clone()];
                self.command(&sqe, data, p.data, p.data_digest_ok, now_ns, out)
            }
            (_, Pdu::H2CData(h)) => self.h2c_data(&h, p.data, p.data_digest_ok, input, out),
            (_, other) => Err(sequence(other.pdu_type().name())),
        }
    }

    /// Answers command `cid` with `status` (and command-specific `dw0`).
    pub(crate) fn respond(&mut self, cid: u16, status: Status, dw0: u32, out: &mut Vec<u8>) {
        let (sq_head, sq_id) = self.queue.as_ref().map_or((0, 0), |q| (q.sq_head, q.qid));
        let cqe = CompletionEntry {
            dw0,
            dw1: 0,
            sq_head,
            sq_id,
            cid,
            status_phase: CompletionEntry::pack_status(status, false),
        };
        encode::capsule_resp(out, &self.framing, &cqe);
    }

    fn pdu_error(&mut self, e: PduError, input: &[u8], out: &mut Vec<u8>) -> Step {
        let pdu = if e.in_common_header() {
            &input[..COMMON_HEADER_BYTES]
        } else {
            input
        };
        match e.fes() {
            Some(fes) => self.fatal(Fatal::new(fes, e.fei(), e.to_string()), pdu, out),
            None => Step::Close(self.close(Close::Protocol(e.to_string()))),
        }
    }

    /// Ends the session with a C2HTermReq that carries the start of the PDU in error.
    fn fatal(&mut self, f: Fatal, pdu: &[u8], out: &mut Vec<u8>) -> Step {
        let hlen = pdu.get(2).map_or(COMMON_HEADER_BYTES, |&h| usize::from(h));
        let echo = &pdu[..pdu.len().min(hlen.max(COMMON_HEADER_BYTES))];
        encode::term_req(out, PduType::C2HTermReq, f.fes, f.fei, echo);
        Step::Close(self.close(Close::Fatal {
            fes: f.fes,
            why: f.why,
        }))
    }

    /// Ends the session: its controller or queue is released at once, so the other queues
    /// see the change without waiting for the caller to drop it.
    fn close(&mut self, why: Close) -> Close {
        self.release();
        self.r2t_waiting.clear();
        self.phase = Phase::Closed(why.clone());
        why
    }

    fn release(&mut self) {
        if let Some(q) = self.queue.take() {
            if q.qid == 0 {
                self.target.release_admin(&q.link);
            } else {
                self.target.release_io(&q.link, q.qid);
            }
        }
    }

    /// What must hold between steps.
    fn invariants(&self) -> bool {
        let l = self.target.config().limits;
        // A closed session keeps the commands of the queue it was.
        let entries = self
            .queue
            .as_ref()
            .map_or(usize::from(l.queue_entries_max), |q| usize::from(q.entries));
        self.cmds.len() <= entries
            && self.r2ts_active <= l.r2ts_max
            && self.solicited_bytes <= u64::from(l.r2t_bytes_max)
            && self.held_bytes
                <= entries as u64 * u64::from(l.in_capsule_bytes_max) + u64::from(l.r2t_bytes_max)
            && self.r2t_waiting.len() <= self.cmds.len()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests;
