//! Commands on a connected queue, and the I/O path: Read, Write, Flush, Write Zeroes and
//! Dataset Management checked against their namespace, writes' data in-capsule or
//! solicited by R2T (bounded per connection), H2CData checked against its R2T, and
//! completions answered with a response capsule or, for reads, C2HData.

use std::ops::Range;

use hypoll_nvme::fabrics::OPCODE_FABRICS;
use hypoll_nvme::spec::{Status, SubmissionEntry, CDW12_DEAC, CDW12_FUA, DSM_ATTR_DEALLOCATE};
use hypoll_nvme::tcp::encode;
use hypoll_nvme::tcp::{digest, sgl::PSDT_MASK};
use hypoll_nvme::tcp::{field, DataHeader, Fes, PduType, R2t, SglDescriptor, SglKind};

use super::*;
use crate::identify::{ONCS_DSM, ONCS_WRITE_ZEROES};

/// NVM command set opcodes this target serves.
mod opcode {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DATASET_MANAGEMENT: u8 = 0x09;
}

/// Bytes of one Dataset Management range; a command names at most 256.
const DSM_RANGE_BYTES: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Read,
    Write,
    /// Flush, Write Zeroes: no data.
    NoData,
    /// Dataset Management with deallocate, its ranges gathered by the session.
    Deallocate {
        ns: usize,
    },
    Aer,
}

/// Where a command's host-to-controller data stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Recv {
    /// Nothing to receive (or all received): the command is the caller's.
    None,
    /// Waiting for its R2T.
    Waiting,
    Receiving {
        ttag: u16,
        received: u32,
        failed: bool,
    },
}

/// A command received and not yet answered.
#[derive(Debug)]
pub(crate) struct Cmd {
    kind: Kind,
    /// Data the command moves.
    bytes: u32,
    /// Bytes counted in the session's `held_bytes` for it.
    held: u32,
    /// Bytes counted in `solicited_bytes` for it.
    solicited: u32,
    recv: Recv,
    /// Dataset Management ranges arriving by H2CData.
    ranges: Vec<u8>,
}

impl Cmd {
    pub(crate) fn new(kind: Kind, bytes: u32) -> Cmd {
        Cmd {
            kind,
            bytes,
            held: 0,
            solicited: 0,
            recv: Recv::None,
            ranges: Vec::new(),
        }
    }
}

/// How a host-to-controller transfer travels.
enum DataIn {
    InCapsule,
    Solicited,
}

impl Session {
    /// A command capsule: bounds, identifier, then the queue's command set.
    pub(super) fn command(
        &mut self,
        sqe: &SubmissionEntry,
        data: &[u8],
        data_range: Range<usize>,
        digest_ok: bool,
        now_ns: u64,
        out: &mut Vec<u8>,
    ) -> Result<Step, Fatal> {
        let Some(q) = self.queue.as_mut() else {
            return Ok(self.connect(sqe, data, now_ns, out));
        };
        if self.cmds.len() >= usize::from(q.entries) {
            return Err(Fatal::new(
                Fes::PduSequenceError,
                0,
                format!("a command beyond the queue's {} entries", q.entries),
            ));
        }
        q.sq_head = (q.sq_head + 1) % q.entries;
        if self.cmds.contains_key(&sqe.cid) {
            self.respond(sqe.cid, Status::COMMAND_ID_CONFLICT, 0, out);
            return Ok(Step::Handled);
        }
        if !digest_ok {
            self.respond(sqe.cid, Status::TRANSIENT_TRANSPORT_ERROR, 0, out);
            return Ok(Step::Handled);
        }
        Ok(if sqe.opcode == OPCODE_FABRICS {
            self.fabrics(sqe, out)
        } else if self.admin.is_some() {
            self.admin_command(sqe, data, now_ns, out)
        } else {
            match self.io_command(sqe, data, data_range, out) {
                Ok(step) => step,
                Err(status) => {
                    self.respond(sqe.cid, status, 0, out);
                    Step::Handled
                }
            }
        })
    }

    /// Checks a controller-to-host transfer of `bytes`: SGLs, a transport data block of
    /// exactly that length, no in-capsule data.
    pub(super) fn data_out_check(
        sqe: &SubmissionEntry,
        bytes: u32,
        capsule: &[u8],
    ) -> Result<(), Status> {
        if sqe.flags & PSDT_MASK == 0 || !capsule.is_empty() {
            return Err(Status::INVALID_FIELD);
        }
        let sgl = SglDescriptor::of(sqe);
        match sgl.kind() {
            SglKind::Transport if sgl.length == bytes => Ok(()),
            SglKind::Transport => Err(Status::DATA_SGL_LENGTH_INVALID),
            SglKind::InCapsule => Err(Status::INVALID_FIELD),
            SglKind::Other { .. } => Err(Status::SGL_DESCRIPTOR_TYPE_INVALID),
        }
    }

    /// Checks a host-to-controller transfer of `bytes`.
    fn data_in_check(sqe: &SubmissionEntry, bytes: u32, capsule: &[u8]) -> Result<DataIn, Status> {
        if sqe.flags & PSDT_MASK == 0 {
            return Err(Status::INVALID_FIELD);
        }
        let sgl = SglDescriptor::of(sqe);
        match sgl.kind() {
            SglKind::InCapsule if sgl.address != 0 => Err(Status::SGL_OFFSET_INVALID),
            SglKind::InCapsule if sgl.length == bytes && capsule.len() == bytes as usize => {
                Ok(DataIn::InCapsule)
            }
            SglKind::Transport if sgl.length == bytes && capsule.is_empty() => {
                Ok(DataIn::Solicited)
            }
            SglKind::Transport if sgl.length == bytes => Err(Status::INVALID_FIELD),
            SglKind::InCapsule | SglKind::Transport => Err(Status::DATA_SGL_LENGTH_INVALID),
            SglKind::Other { .. } => Err(Status::SGL_DESCRIPTOR_TYPE_INVALID),
        }
    }

    fn io_command(
        &mut self,
        sqe: &SubmissionEntry,
        data: &[u8],
        data_range: Range<usize>,
        out: &mut Vec<u8>,
    ) -> Result<Step, Status> {
        let oncs = self.target.oncs();
        let transfer_bytes_max = self.target.config().limits.transfer_bytes_max;
        let op = sqe.opcode;
        let supported = match op {
            opcode::FLUSH | opcode::WRITE | opcode::READ => true,
            opcode::WRITE_ZEROES => oncs & ONCS_WRITE_ZEROES != 0,
            opcode::DATASET_MANAGEMENT => oncs & ONCS_DSM != 0,
            _ => false,
        };
        if !supported {
            return Err(Status::INVALID_OPCODE);
        }
        let index = self
            .namespace_index(sqe.nsid)
            .ok_or(Status::INVALID_NAMESPACE)?;
        if !self.target.namespace_ready(index) {
            return Err(Status::NAMESPACE_NOT_READY);
        }
        // A copy: the checks below change the session.
        let ns = self.target.config().namespaces[index];
        let writes = matches!(op, opcode::WRITE | opcode::WRITE_ZEROES)
            || (op == opcode::DATASET_MANAGEMENT && sqe.cdw11 & DSM_ATTR_DEALLOCATE != 0);
        if writes && ns.read_only {
            return Err(Status::NAMESPACE_WRITE_PROTECTED);
        }
        let cid = sqe.cid;
        let io = |op| {
            Ok(Step::Io(IoCommand {
                cid,
                nsid: sqe.nsid,
                op,
            }))
        };
        let slba = sqe.slba();
        let blocks = sqe.block_count();
        let fua = sqe.cdw12 & CDW12_FUA != 0;
        let in_range = slba
            .checked_add(u64::from(blocks))
            .is_some_and(|end| end <= ns.blocks);
        match op {
            opcode::FLUSH => {
                if !ns.volatile_cache {
                    self.respond(cid, Status::SUCCESS, 0, out);
                    return Ok(Step::Handled);
                }
                self.cmds.insert(cid, Cmd::new(Kind::NoData, 0));
                io(IoOp::Flush)
            }
            opcode::WRITE_ZEROES => {
                if !ns.write_zeroes {
                    return Err(Status::INVALID_OPCODE);
                }
                if !in_range {
                    return Err(Status::LBA_OUT_OF_RANGE);
                }
                self.cmds.insert(cid, Cmd::new(Kind::NoData, 0));
                io(IoOp::WriteZeroes {
                    slba,
                    blocks,
                    deallocate: sqe.cdw12 & CDW12_DEAC != 0,
                    fua,
                })
            }
            opcode::READ | opcode::WRITE => {
                if !in_range {
                    return Err(Status::LBA_OUT_OF_RANGE);
                }
                let bytes = u64::from(blocks) * u64::from(ns.block_bytes);
                if bytes > u64::from(transfer_bytes_max) {
                    return Err(Status::INVALID_FIELD);
                }
                let bytes = bytes as u32;
                if op == opcode::READ {
                    Self::data_out_check(sqe, bytes, data)?;
                    self.cmds.insert(cid, Cmd::new(Kind::Read, bytes));
                    return io(IoOp::Read { slba, blocks, fua });
                }
                let mut cmd = Cmd::new(Kind::Write, bytes);
                let data = match Self::data_in_check(sqe, bytes, data)? {
                    DataIn::InCapsule => {
                        cmd.held = bytes;
                        self.held_bytes += u64::from(bytes);
                        WriteData::InCapsule(data_range)
                    }
                    DataIn::Solicited => {
                        cmd.recv = Recv::Waiting;
                        self.r2t_waiting.push_back(cid);
                        WriteData::Solicited
                    }
                };
                self.cmds.insert(cid, cmd);
                self.solicit(out);
                io(IoOp::Write {
                    slba,
                    blocks,
                    fua,
                    data,
                })
            }
            _ => {
                let ranges = (sqe.cdw10 & 0xff) as usize + 1;
                let bytes = (ranges * DSM_RANGE_BYTES) as u32;
                let how = Self::data_in_check(sqe, bytes, data)?;
                if sqe.cdw11 & DSM_ATTR_DEALLOCATE == 0 || !ns.deallocate {
                    // Only hints, or a device that cannot deallocate: nothing to do.
                    self.respond(cid, Status::SUCCESS, 0, out);
                    return Ok(Step::Handled);
                }
                let mut cmd = Cmd::new(Kind::Deallocate { ns: index }, bytes);
                if let DataIn::InCapsule = how {
                    let ranges = Self::ranges(ns.blocks, data)?;
                    self.cmds.insert(cid, cmd);
                    return io(IoOp::Deallocate { ranges });
                }
                cmd.recv = Recv::Waiting;
                self.r2t_waiting.push_back(cid);
                self.cmds.insert(cid, cmd);
                self.solicit(out);
                Ok(Step::Handled)
            }
        }
    }

    /// Dataset Management ranges, each within a namespace of `blocks`; empty ones dropped.
    fn ranges(blocks: u64, data: &[u8]) -> Result<Vec<BlockRange>, Status> {
        let mut v = Vec::with_capacity(data.len() / DSM_RANGE_BYTES);
        for r in data.chunks_exact(DSM_RANGE_BYTES) {
            let n = u32::from_le_bytes(r[4..8].try_into().expect("16-byte range"));
            let slba = u64::from_le_bytes(r[8..16].try_into().expect("16-byte range"));
            if slba
                .checked_add(u64::from(n))
                .is_none_or(|end| end > blocks)
            {
                return Err(Status::LBA_OUT_OF_RANGE);
            }
            if n > 0 {
                v.push(BlockRange { slba, blocks: n });
            }
        }
        Ok(v)
    }

    /// Sends R2Ts for the waiting writes while the connection's limits allow.
    fn solicit(&mut self, out: &mut Vec<u8>) {
        let l = self.target.config().limits;
        while let Some(&cid) = self.r2t_waiting.front() {
            let cmd = self
                .cmds
                .get_mut(&cid)
                .expect("a waiting write is in flight");
            debug_assert_eq!(cmd.recv, Recv::Waiting);
            let bytes = u64::from(cmd.bytes);
            if self.r2ts_active >= l.r2ts_max
                || self.solicited_bytes + bytes > u64::from(l.r2t_bytes_max)
            {
                break;
            }
            self.r2t_waiting.pop_front();
            let ttag = self.next_ttag;
            self.next_ttag = self.next_ttag.wrapping_add(1);
            cmd.recv = Recv::Receiving {
                ttag,
                received: 0,
                failed: false,
            };
            cmd.solicited = cmd.bytes;
            self.solicited_bytes += bytes;
            if cmd.kind == Kind::Write {
                cmd.held += cmd.bytes;
                self.held_bytes += bytes;
            }
            self.r2ts_active += 1;
            let r = R2t {
                cccid: cid,
                ttag,
                r2to: 0,
                r2tl: cmd.bytes,
            };
            encode::r2t(out, &self.framing, &r);
        }
    }

    /// H2CData: solicited data for a write (or Dataset Management's ranges).
    pub(super) fn h2c_data(
        &mut self,
        h: &DataHeader,
        data: Range<usize>,
        digest_ok: bool,
        input: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<Step, Fatal> {
        let bad = |offset, what: &str| Fatal::new(Fes::InvalidHeaderField, offset, what);
        let Some(cmd) = self.cmds.get_mut(&h.cccid) else {
            return Err(bad(field::CCCID, "H2CData for no command in flight"));
        };
        let Recv::Receiving {
            ttag,
            received,
            failed,
        } = cmd.recv
        else {
            return Err(bad(
                field::CCCID,
                "H2CData for a command not asking for data",
            ));
        };
        if h.ttag != ttag {
            return Err(bad(field::TTAG, "H2CData with an unknown transfer tag"));
        }
        if u64::from(h.datao) + u64::from(h.datal) > u64::from(cmd.bytes) {
            return Err(Fatal::new(Fes::DataOutOfRange, 0, "H2CData past its R2T"));
        }
        let done = received + h.datal == cmd.bytes;
        if h.datao != received || h.last != done {
            return Err(Fatal::new(
                Fes::PduSequenceError,
                0,
                "H2CData out of order or mislabelled as last",
            ));
        }
        let failed = failed || !digest_ok;
        cmd.recv = Recv::Receiving {
            ttag,
            received: received + h.datal,
            failed,
        };
        if let (Kind::Deallocate { .. }, false) = (cmd.kind, failed) {
            cmd.ranges.extend_from_slice(&input[data.clone()]);
        }
        let kind = cmd.kind;
        if !done {
            // Dataset Management's ranges are the session's: the caller sees no data; a
            // write whose data failed a digest gets no more.
            return Ok(if failed || kind != Kind::Write {
                Step::Handled
            } else {
                Step::WriteData {
                    cid: h.cccid,
                    offset: h.datao,
                    data,
                    last: false,
                }
            });
        }
        cmd.recv = Recv::None;
        self.r2ts_active -= 1;
        let cid = h.cccid;
        let step = if failed {
            self.finish(cid, Status::TRANSIENT_TRANSPORT_ERROR, 0, out);
            match kind {
                Kind::Write => Step::WriteAborted { cid },
                _ => Step::Handled,
            }
        } else if let Kind::Deallocate { ns } = kind {
            let cmd = self.cmds.get_mut(&cid).expect("in flight");
            let ranges = std::mem::take(&mut cmd.ranges);
            let blocks = self.target.config().namespaces[ns].blocks;
            match Self::ranges(blocks, &ranges) {
                Ok(ranges) => Step::Io(IoCommand {
                    cid,
                    nsid: ns as u32 + 1,
                    op: IoOp::Deallocate { ranges },
                }),
                Err(status) => {
                    self.finish(cid, status, 0, out);
                    Step::Handled
                }
            }
        } else {
            Step::WriteData {
                cid,
                offset: h.datao,
                data,
                last: true,
            }
        };
        self.solicit(out);
        Ok(step)
    }

    /// Forgets command `cid` and answers it.
    fn finish(&mut self, cid: u16, status: Status, dw0: u32, out: &mut Vec<u8>) {
        let cmd = self
            .cmds
            .remove(&cid)
            .expect("answering a command in flight");
        self.held_bytes -= u64::from(cmd.held);
        self.solicited_bytes -= u64::from(cmd.solicited);
        self.respond(cid, status, dw0, out);
    }

    /// The command `cid` the caller may answer now.
    fn callers(&self, cid: u16) -> Result<&Cmd, CompleteError> {
        if self.is_closed() {
            return Err(CompleteError::Closed);
        }
        match self.cmds.get(&cid) {
            Some(c) if c.recv == Recv::None && c.kind != Kind::Aer => Ok(c),
            _ => Err(CompleteError::Unknown(cid)),
        }
    }

    /// Answers an I/O command with `status` (a read only with a failure: a successful read
    /// is answered with its data by [`Session::complete_read`]). May append R2Ts for
    /// writes that were waiting for room.
    pub fn complete(
        &mut self,
        cid: u16,
        status: Status,
        out: &mut Vec<u8>,
    ) -> Result<(), CompleteError> {
        let cmd = self.callers(cid)?;
        if cmd.kind == Kind::Read && status.is_success() {
            return Err(CompleteError::ReadNeedsData(cid));
        }
        self.finish(cid, status, 0, out);
        self.solicit(out);
        debug_assert!(self.invariants());
        Ok(())
    }

    /// Answers a successful read with its data, given in pieces in order: appends the
    /// C2HData PDU and the completion to `out`.
    pub fn complete_read(
        &mut self,
        cid: u16,
        data: &[&[u8]],
        out: &mut Vec<u8>,
    ) -> Result<(), CompleteError> {
        let mut tail = Vec::new();
        self.complete_read_framed(cid, data, out, &mut tail)?;
        for piece in data {
            out.extend_from_slice(piece);
        }
        out.extend_from_slice(&tail);
        Ok(())
    }

    /// [`Session::complete_read`] for a caller that sends the data from its own buffers:
    /// appends to `head` what goes before the data (the C2HData header) and to `tail`
    /// what goes after it (the data digest and the completion). Send head, the pieces of
    /// `data`, then tail.
    pub fn complete_read_framed(
        &mut self,
        cid: u16,
        data: &[&[u8]],
        head: &mut Vec<u8>,
        tail: &mut Vec<u8>,
    ) -> Result<(), CompleteError> {
        let cmd = self.callers(cid)?;
        let given: u64 = data.iter().map(|p| p.len() as u64).sum();
        if cmd.kind != Kind::Read {
            return Err(CompleteError::Unknown(cid));
        }
        if given != u64::from(cmd.bytes) {
            return Err(CompleteError::Length {
                cid,
                expected: cmd.bytes,
                given,
            });
        }
        self.cmds.remove(&cid);
        self.data_reply_framed(cid, data, head, tail);
        Ok(())
    }

    /// Sends `data` for command `cid` (already forgotten) and its successful completion.
    pub(super) fn data_reply(&mut self, cid: u16, data: &[&[u8]], out: &mut Vec<u8>) {
        let mut tail = Vec::new();
        self.data_reply_framed(cid, data, out, &mut tail);
        for piece in data {
            out.extend_from_slice(piece);
        }
        out.extend_from_slice(&tail);
    }

    fn data_reply_framed(
        &mut self,
        cid: u16,
        data: &[&[u8]],
        head: &mut Vec<u8>,
        tail: &mut Vec<u8>,
    ) {
        let datal: usize = data.iter().map(|p| p.len()).sum();
        // Without SQ flow control the last data PDU may stand for the completion.
        let success = self.queue.as_ref().is_some_and(|q| !q.flow_control);
        let h = DataHeader {
            cccid: cid,
            ttag: 0,
            datao: 0,
            datal: datal as u32,
            last: true,
            success,
        };
        encode::data_pdu_head(head, &self.framing, PduType::C2HData, &h);
        if self.framing.digests.data {
            let d = digest::crc32c_pieces(data.iter().copied());
            tail.extend_from_slice(&d.to_le_bytes());
        }
        if !success {
            self.respond(cid, Status::SUCCESS, 0, tail);
        }
    }
}
