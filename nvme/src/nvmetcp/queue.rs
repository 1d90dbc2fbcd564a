//! An NVMe/TCP I/O queue as a [`QueuePair`]: one TCP connection, non-blocking. `submit`
//! encodes a command capsule (a write's data in it when it fits the target's in-capsule
//! size); the next `process_completions` (or `arm_interrupt`) writes every capsule encoded
//! since in one system call, as a driver rings a doorbell once per batch, then reads what
//! arrived and decodes it: C2HData lands in the command's memory, an R2T is answered with
//! H2CData from it, a response completes it. A connection that breaks (the target
//! closed it, terminated it, sent what cannot be decoded) completes every command in flight
//! with an error, and refuses new ones.
//!
//! The command identifier is the slot's index, so an answer finds its command without a
//! search; a slot is free again once its completion is handed out.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::marker::PhantomData;
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;

use super::memory::{copy_in, copy_out, Place};
use super::sys::Line;
use super::wire::Wire;
use super::QueueIds;
use crate::qpair::{Command, Completion, QueuePair, Segment, SubmitError, SEGMENTS_MAX};
use crate::spec::{NamespaceInfo, Opcode, Status, SubmissionEntry};
use crate::spec::{CDW12_DEAC, CDW12_FUA, DSM_ATTR_DEALLOCATE};
use crate::tcp::decode::{Decode, Decoder};
use crate::tcp::encode::{self, Framing};
use crate::tcp::{DataHeader, Pdu, PduType, R2t, SglDescriptor};

/// Bytes asked of the kernel per read.
const READ_CHUNK_BYTES: usize = 256 << 10;
/// Output `submit` lets gather before it writes to the socket itself, instead of leaving
/// it to the next poll: a batch of large in-capsule writes is not held in memory whole.
const OUT_GATHER_BYTES_MAX: usize = 64 << 10;
/// Bytes of one Dataset Management range.
const DSM_RANGE_BYTES: usize = 16;
/// The status every command in flight gets when the connection breaks.
pub const CONNECTION_LOST: Status = Status::TRANSIENT_TRANSPORT_ERROR;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Idle,
    Read,
    /// Data to the target: a write, or a deallocate's range.
    Write,
    NoData,
}

/// One command in flight (or a free slot).
struct Slot {
    tag: u64,
    kind: Kind,
    place: Place,
    /// A vectored command's segments (room for `SEGMENTS_MAX`, made with the queue pair).
    segs: Vec<Segment>,
    /// Data the command moves, and a read's bytes received so far.
    bytes: u32,
    received: u32,
    /// A deallocate's range, sent from here.
    range: [u8; DSM_RANGE_BYTES],
    /// Its completion is in `done`, not yet handed out.
    completed: bool,
    /// Some of a read's data failed its digest: the command fails, whatever the target
    /// answers.
    corrupt: bool,
}

/// An NVMe/TCP I/O queue, owned by one thread.
pub struct NvmeTcpQueuePair {
    /// Dropped before the socket it watches.
    line: Line,
    stream: TcpStream,
    framing: Framing,
    decoder: Decoder,
    maxh2cdata: u32,
    /// Most write data a command capsule carries (the target's IOCCSZ less the entry).
    in_capsule_bytes: u32,
    ns: NamespaceInfo,
    slots: Box<[Slot]>,
    free: Vec<u16>,
    /// Completions decoded and not yet handed out (command identifier and status): at
    /// most one per slot.
    done: VecDeque<(u16, Status)>,
    /// Bytes to send: `out[out_sent..]`.
    out: Vec<u8>,
    out_sent: usize,
    /// Bytes received and not yet decoded: `input[in_start..in_end]`.
    input: Vec<u8>,
    in_start: usize,
    in_end: usize,
    /// A vectored in-capsule write's data, gathered.
    scratch: Vec<u8>,
    /// The interrupt line is armed (the socket watched).
    armed: bool,
    /// Why the connection broke, once it has.
    dead: Option<String>,
    qid: u16,
    queues: Arc<QueueIds>,
    _not_send: PhantomData<*const ()>,
}

impl NvmeTcpQueuePair {
    /// Takes over a connected I/O queue (`wire`, Connect done) of `depth` commands.
    pub(crate) fn new(
        mut wire: Wire,
        depth: usize,
        ns: NamespaceInfo,
        in_capsule_bytes: u32,
        qid: u16,
        queues: Arc<QueueIds>,
    ) -> io::Result<NvmeTcpQueuePair> {
        assert!((1..=usize::from(u16::MAX)).contains(&depth));
        wire.stream.set_nonblocking(true)?;
        let line = Line::new(wire.stream.as_fd())?;
        let leftover = wire.take_input();
        let input_bytes = wire.decoder.pdu_bytes_max() + READ_CHUNK_BYTES;
        let mut input = vec![0u8; input_bytes.max(leftover.len())];
        input[..leftover.len()].copy_from_slice(&leftover);
        let slots = (0..depth)
            .map(|_| Slot {
                tag: 0,
                kind: Kind::Idle,
                place: Place::None,
                segs: Vec::with_capacity(SEGMENTS_MAX),
                bytes: 0,
                received: 0,
                range: [0; DSM_RANGE_BYTES],
                completed: false,
                corrupt: false,
            })
            .collect();
        Ok(NvmeTcpQueuePair {
            line,
            stream: wire.stream,
            framing: wire.framing,
            decoder: wire.decoder,
            maxh2cdata: wire.maxh2cdata,
            in_capsule_bytes,
            ns,
            slots,
            free: (0..depth as u16).rev().collect(),
            done: VecDeque::with_capacity(depth),
            out: Vec::new(),
            out_sent: 0,
            in_end: leftover.len(),
            input,
            in_start: 0,
            scratch: Vec::new(),
            armed: false,
            dead: None,
            qid,
            queues,
            _not_send: PhantomData,
        })
    }

    /// The queue's ID at the target.
    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// Why the connection broke, if it has.
    pub fn broken(&self) -> Option<&str> {
        self.dead.as_deref()
    }

    /// Ends the connection for `why`: every command in flight completes with
    /// [`CONNECTION_LOST`], and the line is raised so a waiting reactor reaps them.
    fn die(&mut self, why: String) {
        if self.dead.is_some() {
            return;
        }
        tracing::warn!(qid = self.qid, "nvme-tcp: {why}");
        self.dead = Some(why);
        self.line.forget_socket();
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        for (cid, slot) in self.slots.iter_mut().enumerate() {
            if slot.kind != Kind::Idle && !slot.completed {
                slot.completed = true;
                self.done.push_back((cid as u16, CONNECTION_LOST));
            }
        }
        self.line.raise();
    }

    /// Writes what the socket takes of the output.
    fn send(&mut self) {
        while self.out_sent < self.out.len() && self.dead.is_none() {
            match self.stream.write(&self.out[self.out_sent..]) {
                Ok(0) => self.die("the connection closed while sending".into()),
                Ok(n) => self.out_sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => self.die(format!("sending: {e}")),
            }
        }
        if self.out_sent == self.out.len() {
            self.out.clear();
            self.out_sent = 0;
        }
    }

    /// Reads what the socket has, while the input buffer has room.
    fn receive(&mut self) -> usize {
        let mut total = 0;
        while self.dead.is_none() {
            if self.in_start == self.in_end {
                self.in_start = 0;
                self.in_end = 0;
            } else if self.input.len() - self.in_end < READ_CHUNK_BYTES && self.in_start > 0 {
                self.input.copy_within(self.in_start..self.in_end, 0);
                self.in_end -= self.in_start;
                self.in_start = 0;
            }
            if self.in_end == self.input.len() {
                break;
            }
            match self.stream.read(&mut self.input[self.in_end..]) {
                Ok(0) => self.die("the target closed the connection".into()),
                Ok(n) => {
                    self.in_end += n;
                    total += n;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => self.die(format!("receiving: {e}")),
            }
        }
        total
    }

    /// Decodes and handles every whole PDU received.
    fn decode_all(&mut self) {
        while self.dead.is_none() && self.in_start < self.in_end {
            let input = &self.input[self.in_start..self.in_end];
            let p = match self.decoder.decode(input) {
                Ok(Decode::NeedMore(_)) => break,
                Ok(Decode::Pdu(p)) => p,
                Err(e) => {
                    // The termination request the transport specification prescribes,
                    // best effort: the connection ends either way.
                    let mut t = Vec::new();
                    let echo = &input[..input.len().min(crate::tcp::COMMON_HEADER_BYTES)];
                    if let Some(fes) = e.fes() {
                        encode::term_req(&mut t, PduType::H2CTermReq, fes, e.fei(), echo);
                        let _ = self.stream.write(&t);
                    }
                    self.die(format!("the target sent a bad PDU: {e}"));
                    break;
                }
            };
            let (len, data, digest_ok) = (p.len, p.data.clone(), p.data_digest_ok);
            let fault = match p.pdu {
                Pdu::CapsuleResp(c) => self.answered(c.cid, c.status()),
                Pdu::C2HData(h) => self.data_in(&h, data, digest_ok),
                Pdu::R2T(r) => self.solicited(&r),
                Pdu::C2HTermReq(t) => Some(format!(
                    "the target terminated the connection (FES {:#x})",
                    t.fes
                )),
                other => Some(format!("the target sent {:?}", other.pdu_type())),
            };
            self.in_start += len;
            if let Some(why) = fault {
                self.die(why);
            }
        }
    }

    /// Command `cid` answered with `status`. Returns why the connection must end, if it
    /// must.
    fn answered(&mut self, cid: u16, mut status: Status) -> Option<String> {
        let Some(slot) = self.slots.get_mut(usize::from(cid)) else {
            return Some(format!(
                "a response for command {cid}, which was never sent"
            ));
        };
        if slot.kind == Kind::Idle || slot.completed {
            return Some(format!(
                "a response for command {cid}, which is not in flight"
            ));
        }
        if status.is_success() && slot.kind == Kind::Read {
            if slot.corrupt {
                // A host may retry: the data was damaged on the way, not at the device.
                status = Status::TRANSIENT_TRANSPORT_ERROR;
            } else if slot.received != slot.bytes {
                // The target said success without sending all the data.
                status = Status::DATA_TRANSFER_ERROR;
            }
        }
        slot.completed = true;
        self.done.push_back((cid, status));
        None
    }

    fn data_in(
        &mut self,
        h: &DataHeader,
        data: std::ops::Range<usize>,
        ok: bool,
    ) -> Option<String> {
        let cid = h.cccid;
        let Some(slot) = self.slots.get_mut(usize::from(cid)) else {
            return Some(format!("data for command {cid}, which was never sent"));
        };
        if slot.kind != Kind::Read || slot.completed || h.datao != slot.received {
            return Some(format!("data for command {cid} out of place"));
        }
        let bytes = &self.input[self.in_start..][data];
        if ok {
            // SAFETY: the slot's command is in flight (not completed), so its memory is
            // still lent to this queue pair.
            if !unsafe { copy_in(slot.place, &slot.segs, h.datao as usize, bytes) } {
                return Some(format!("data for command {cid} past its length"));
            }
        }
        slot.received += h.datal;
        slot.corrupt |= !ok;
        if h.success {
            return self.answered(cid, Status::SUCCESS);
        }
        None
    }

    /// An R2T: the data it asks for, in H2CData PDUs of at most MAXH2CDATA.
    fn solicited(&mut self, r: &R2t) -> Option<String> {
        let cid = r.cccid;
        let Some(slot) = self.slots.get(usize::from(cid)) else {
            return Some(format!("an R2T for command {cid}, which was never sent"));
        };
        let end = u64::from(r.r2to) + u64::from(r.r2tl);
        if slot.kind != Kind::Write || slot.completed || end > u64::from(slot.bytes) || r.r2tl == 0
        {
            return Some(format!("an R2T for command {cid} out of place"));
        }
        let mut at = r.r2to;
        while at < end as u32 {
            let n = (end as u32 - at).min(self.maxh2cdata);
            let h = DataHeader {
                cccid: cid,
                ttag: r.ttag,
                datao: at,
                datal: n,
                last: at + n == end as u32,
                success: false,
            };
            self.scratch.clear();
            if matches!(slot.place, Place::None) {
                self.scratch
                    .extend_from_slice(&slot.range[at as usize..(at + n) as usize]);
            } else {
                // SAFETY: the slot's command is in flight, its memory lent to us.
                let within = unsafe {
                    copy_out(
                        slot.place,
                        &slot.segs,
                        at as usize,
                        n as usize,
                        &mut self.scratch,
                    )
                };
                debug_assert!(within, "checked against the command's length");
            }
            encode::data_pdu(
                &mut self.out,
                &self.framing,
                PduType::H2CData,
                &h,
                &self.scratch,
            );
            at += n;
        }
        None
    }

    /// Hands out up to `max` completions decoded; their slots are free again.
    fn deliver(&mut self, max: usize, out: &mut dyn FnMut(Completion)) -> usize {
        let mut n = 0;
        while n < max {
            let Some((cid, status)) = self.done.pop_front() else {
                break;
            };
            let slot = &mut self.slots[usize::from(cid)];
            debug_assert!(slot.completed && slot.kind != Kind::Idle);
            let tag = slot.tag;
            slot.kind = Kind::Idle;
            slot.completed = false;
            slot.corrupt = false;
            slot.place = Place::None;
            slot.segs.clear();
            self.free.push(cid);
            out(Completion { tag, status });
            n += 1;
        }
        n
    }

    /// Builds command `cid`'s entry and records it in its slot. Returns the data that goes
    /// in the capsule, if it does (gathered in `scratch` for a vectored write).
    fn prepare(&mut self, cmd: &Command<'_>, cid: u16, tag: u64) -> (SubmissionEntry, bool) {
        let lba = self.ns.lba_size_bytes as usize;
        let op = cmd.opcode();
        let data_bytes = match op {
            Opcode::Read | Opcode::Write => cmd.nlb() as usize * lba,
            Opcode::DatasetManagement => DSM_RANGE_BYTES,
            _ => 0,
        };
        let mut sqe = SubmissionEntry {
            opcode: op as u8,
            cid,
            nsid: self.ns.nsid,
            ..Default::default()
        };
        let slot = &mut self.slots[usize::from(cid)];
        slot.tag = tag;
        slot.bytes = data_bytes as u32;
        slot.received = 0;
        slot.place = Place::of(cmd, data_bytes, &mut slot.segs);
        slot.kind = match op {
            Opcode::Read => Kind::Read,
            Opcode::Write | Opcode::DatasetManagement => Kind::Write,
            Opcode::Flush | Opcode::WriteZeroes => Kind::NoData,
        };
        match op {
            Opcode::Read | Opcode::Write | Opcode::WriteZeroes => {
                sqe.set_slba(cmd.slba());
                sqe.cdw12 = (cmd.nlb() - 1) & 0xffff;
                if cmd.fua() {
                    sqe.cdw12 |= CDW12_FUA;
                }
                if op == Opcode::WriteZeroes && cmd.may_deallocate() {
                    sqe.cdw12 |= CDW12_DEAC;
                }
            }
            Opcode::DatasetManagement => {
                // One range: context attributes 0, its length in blocks (not 0's based),
                // its first block.
                sqe.cdw10 = 0;
                sqe.cdw11 = DSM_ATTR_DEALLOCATE;
                slot.range[4..8].copy_from_slice(&cmd.nlb().to_le_bytes());
                slot.range[8..16].copy_from_slice(&cmd.slba().to_le_bytes());
            }
            Opcode::Flush => {}
        }
        let in_capsule = slot.kind == Kind::Write && data_bytes <= self.in_capsule_bytes as usize;
        let sgl = if in_capsule {
            SglDescriptor::in_capsule(data_bytes as u32)
        } else {
            SglDescriptor::transport(data_bytes as u32)
        };
        sgl.store(&mut sqe);
        if in_capsule {
            self.scratch.clear();
            if matches!(slot.place, Place::None) {
                self.scratch.extend_from_slice(&slot.range);
            } else {
                // SAFETY: `submit`'s caller lent the command's memory from now until its
                // completion.
                let within =
                    unsafe { copy_out(slot.place, &slot.segs, 0, data_bytes, &mut self.scratch) };
                debug_assert!(within, "checked by Command::check");
            }
        }
        (sqe, in_capsule)
    }
}

impl QueuePair for NvmeTcpQueuePair {
    unsafe fn submit(&mut self, cmd: &Command<'_>, tag: u64) -> Result<(), SubmitError> {
        if self.dead.is_some() {
            return Err(SubmitError::Disabled);
        }
        let Some(&cid) = self.free.last() else {
            return Err(SubmitError::QueueFull {
                depth: self.slots.len(),
            });
        };
        cmd.check(self.ns.lba_size_bytes)?;
        let (sqe, in_capsule) = self.prepare(cmd, cid, tag);
        self.free.pop();
        let data: &[u8] = if in_capsule { &self.scratch } else { &[] };
        encode::capsule_cmd(&mut self.out, &self.framing, &sqe, data);
        if self.out.len() - self.out_sent >= OUT_GATHER_BYTES_MAX {
            self.send();
        }
        Ok(())
    }

    fn process_completions(&mut self, max: usize, out: &mut dyn FnMut(Completion)) -> usize {
        if self.armed {
            // A wake-up: back to polling, the socket unwatched until the next wait.
            self.armed = false;
            let _ = self.line.watch(false, false);
            self.line.lower();
        }
        // Submitted commands go out even when completions are left to hand out.
        self.send();
        if self.dead.is_none() && self.done.len() < max {
            self.receive();
            self.decode_all();
            // R2Ts answered while decoding.
            self.send();
        }
        self.deliver(max, out)
    }

    fn interrupt_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.line.fd())
    }

    fn arm_interrupt(&mut self) {
        // What was submitted since the last poll goes out before the wait.
        self.send();
        self.armed = true;
        let whole_pdu = matches!(
            self.decoder.decode(&self.input[self.in_start..self.in_end]),
            Ok(Decode::Pdu(_)) | Err(_)
        );
        if self.dead.is_some() || !self.done.is_empty() || whole_pdu {
            self.line.raise();
            return;
        }
        // Readable when an answer arrives; writable when output waits for room.
        let waiting_out = self.out_sent < self.out.len();
        if let Err(e) = self.line.watch(true, waiting_out) {
            self.die(format!("watching the socket: {e}"));
        }
    }

    fn disarm_interrupt(&mut self) {
        self.armed = false;
        let _ = self.line.watch(false, false);
        self.line.lower();
    }

    fn outstanding(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    fn depth(&self) -> usize {
        self.slots.len()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.ns
    }
}

impl Drop for NvmeTcpQueuePair {
    fn drop(&mut self) {
        // Closing the socket ends the queue at the target; this end touches no command's
        // memory after this returns (it does only inside its own calls).
        self.queues.release(self.qid);
    }
}
