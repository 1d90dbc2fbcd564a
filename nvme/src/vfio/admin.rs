//! The admin queue and the admin commands the driver sends: Identify (and the decoding of
//! its controller and namespace data), and the creation and deletion of I/O queues. Admin
//! commands run one at a time, under the controller's admin lock, polled to completion.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::prp::PAGE_BYTES;
use super::{dma, regs, Inner, VfioError, ADMIN_QUEUE_ENTRIES, ADMIN_TIMEOUT_MS};
use crate::spec::{CompletionEntry, Opcode, SubmissionEntry};

/// Admin opcodes (Base spec, "Opcodes for Admin Commands").
pub(super) mod admin_op {
    pub const DELETE_IO_SQ: u8 = 0x00;
    pub const CREATE_IO_SQ: u8 = 0x01;
    pub const DELETE_IO_CQ: u8 = 0x04;
    pub const CREATE_IO_CQ: u8 = 0x05;
    pub const IDENTIFY: u8 = 0x06;
    pub const SET_FEATURES: u8 = 0x09;
}
pub(super) const CNS_NAMESPACE: u32 = 0x00;
pub(super) const CNS_CONTROLLER: u32 = 0x01;
pub(super) const FEATURE_NUMBER_OF_QUEUES: u32 = 0x07;

/// Identify Controller fields the driver uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControllerIdentity {
    pub model: String,
    pub serial: String,
    pub firmware: String,
    /// MDTS in bytes (`None`: no limit).
    pub mdts_bytes: Option<u64>,
    /// Number of namespaces (NN).
    pub namespaces: u32,
    /// Optional NVM Command Support (ONCS): bit 2 Dataset Management, bit 3 Write Zeroes.
    pub oncs: u16,
}

impl ControllerIdentity {
    /// Whether the controller carries out `opcode` (see [`ControllerIdentity::oncs`]).
    pub fn supports(&self, opcode: Opcode) -> bool {
        match opcode {
            Opcode::DatasetManagement => self.oncs & (1 << 2) != 0,
            Opcode::WriteZeroes => self.oncs & (1 << 3) != 0,
            Opcode::Read | Opcode::Write | Opcode::Flush => true,
        }
    }

    /// Decodes a 4096-byte Identify Controller data structure.
    pub fn parse(data: &[u8], mpsmin_bytes: u64) -> ControllerIdentity {
        // Space-padded by the spec; some controllers pad with NULs.
        let text = |r: std::ops::Range<usize>| {
            String::from_utf8_lossy(&data[r])
                .trim_end_matches([' ', '\0'])
                .to_string()
        };
        let mdts = data[77];
        ControllerIdentity {
            serial: text(4..24),
            model: text(24..64),
            firmware: text(64..72),
            mdts_bytes: (mdts != 0).then(|| mpsmin_bytes << mdts),
            namespaces: u32::from_le_bytes(data[516..520].try_into().expect("4 bytes")),
            oncs: u16::from_le_bytes(data[520..522].try_into().expect("2 bytes")),
        }
    }
}

/// Decodes Identify Namespace: (capacity in blocks, block size in bytes).
pub fn parse_identify_namespace(data: &[u8]) -> Result<(u64, u32), String> {
    let nsze = u64::from_le_bytes(data[0..8].try_into().expect("8 bytes"));
    let nlbaf = data[25];
    let flbas = (data[26] & 0xf) as usize;
    if flbas > nlbaf as usize {
        return Err(format!("FLBAS {flbas} names a format past NLBAF {nlbaf}"));
    }
    let lbaf = u32::from_le_bytes(
        data[128 + 4 * flbas..132 + 4 * flbas]
            .try_into()
            .expect("4"),
    );
    let lbads = (lbaf >> 16) & 0xff;
    let metadata_bytes = lbaf & 0xffff;
    if !(9..=16).contains(&lbads) {
        return Err(format!("LBA data size 2^{lbads} is not a block size"));
    }
    if metadata_bytes != 0 {
        return Err(format!(
            "the namespace's format carries {metadata_bytes} bytes of metadata per block, which \
             this driver does not handle; format it without metadata"
        ));
    }
    if nsze == 0 {
        return Err("namespace 1 has no blocks (NSZE 0)".into());
    }
    Ok((nsze, 1 << lbads))
}

/// The admin queue pair, driven one command at a time under the controller's lock.
#[derive(Debug)]
pub(super) struct AdminQueue {
    pub(super) sq: dma::DmaRegion,
    pub(super) cq: dma::DmaRegion,
    /// 4 KiB of data for Identify.
    pub(super) data: dma::DmaRegion,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
    next_cid: u16,
}

impl AdminQueue {
    pub(super) fn new(container: &Arc<dma::Container>) -> Result<AdminQueue, VfioError> {
        let entries = usize::from(ADMIN_QUEUE_ENTRIES);
        Ok(AdminQueue {
            sq: dma::DmaRegion::new(container, entries * 64)?,
            cq: dma::DmaRegion::new(container, entries * 16)?,
            data: dma::DmaRegion::new(container, PAGE_BYTES)?,
            sq_tail: 0,
            cq_head: 0,
            phase: true,
            next_cid: 0,
        })
    }

    /// Empties both rings, for a controller that is disabled.
    pub(super) fn clear(&mut self) {
        self.sq.zero();
        self.cq.zero();
        self.sq_tail = 0;
        self.cq_head = 0;
        self.phase = true;
    }

    /// Runs one admin command to completion.
    pub(super) fn run(
        &mut self,
        bar: &regs::Bar,
        what: &'static str,
        mut cmd: SubmissionEntry,
    ) -> Result<CompletionEntry, VfioError> {
        let entries = ADMIN_QUEUE_ENTRIES;
        cmd.cid = self.next_cid;
        self.next_cid = self.next_cid.wrapping_add(1);
        self.sq.write_volatile(usize::from(self.sq_tail) * 64, cmd);
        self.sq_tail = (self.sq_tail + 1) % entries;
        bar.ring_sq(0, self.sq_tail);
        let deadline = Instant::now() + Duration::from_millis(ADMIN_TIMEOUT_MS);
        loop {
            let off = usize::from(self.cq_head) * 16;
            let cqe: CompletionEntry = self.cq.read_volatile(off);
            if cqe.phase() == self.phase {
                std::sync::atomic::fence(Ordering::Acquire);
                let cqe: CompletionEntry = self.cq.read_volatile(off);
                self.cq_head = (self.cq_head + 1) % entries;
                if self.cq_head == 0 {
                    self.phase = !self.phase;
                }
                bar.ring_cq(0, self.cq_head);
                if cqe.cid != cmd.cid {
                    // A completion for an earlier command that timed out: skip it.
                    continue;
                }
                let status = cqe.status();
                if !status.is_success() {
                    return Err(VfioError::AdminStatus { what, status });
                }
                return Ok(cqe);
            }
            if Instant::now() > deadline {
                return Err(VfioError::AdminTimeout { what });
            }
            std::hint::spin_loop();
        }
    }

    /// Identify with `cns` for `nsid`; the 4 KiB result is left in `self.data`.
    pub(super) fn identify(
        &mut self,
        bar: &regs::Bar,
        cns: u32,
        nsid: u32,
    ) -> Result<Vec<u8>, VfioError> {
        let cmd = SubmissionEntry {
            opcode: admin_op::IDENTIFY,
            nsid,
            prp1: self.data.iova(),
            cdw10: cns,
            ..Default::default()
        };
        let what = if cns == CNS_CONTROLLER {
            "Identify Controller"
        } else {
            "Identify Namespace"
        };
        self.data.zero();
        self.run(bar, what, cmd)?;
        let mut out = vec![0u8; PAGE_BYTES];
        self.data.read_bytes(0, &mut out);
        Ok(out)
    }
}

impl Inner {
    fn admin_run(&self, what: &'static str, cmd: SubmissionEntry) -> Result<(), VfioError> {
        self.admin.lock().run(&self.bar, what, cmd).map(drop)
    }

    /// Creates I/O completion queue and submission queue `qid`, `entries` each. Returns the
    /// generation of the controller they were created on, read under the admin lock that a
    /// reset holds while it bumps it: read before, a reset between the read and the
    /// creation would pass for one the new queues had missed.
    pub(super) fn create_io_queues(
        &self,
        qid: u16,
        entries: u16,
        cq_iova: u64,
        sq_iova: u64,
        vector: Option<u16>,
    ) -> Result<u64, VfioError> {
        let size = u32::from(qid) | ((u32::from(entries) - 1) << 16);
        let (ien, iv) = match vector {
            Some(v) => (1 << 1, u32::from(v) << 16),
            None => (0, 0),
        };
        let mut admin = self.admin.lock();
        admin.run(
            &self.bar,
            "Create I/O Completion Queue",
            SubmissionEntry {
                opcode: admin_op::CREATE_IO_CQ,
                prp1: cq_iova,
                cdw10: size,
                // Physically contiguous (bit 0), interrupts enabled (bit 1), vector.
                cdw11: 1 | ien | iv,
                ..Default::default()
            },
        )?;
        admin.run(
            &self.bar,
            "Create I/O Submission Queue",
            SubmissionEntry {
                opcode: admin_op::CREATE_IO_SQ,
                prp1: sq_iova,
                cdw10: size,
                // Physically contiguous, its completion queue id in bits 31:16.
                cdw11: 1 | (u32::from(qid) << 16),
                ..Default::default()
            },
        )?;
        Ok(self.generation.load(Ordering::SeqCst))
    }

    /// Deletes I/O queues `qid` (submission queue first, as the spec requires).
    pub(super) fn delete_io_queues(&self, qid: u16) -> Result<(), VfioError> {
        self.admin_run(
            "Delete I/O Submission Queue",
            SubmissionEntry {
                opcode: admin_op::DELETE_IO_SQ,
                cdw10: u32::from(qid),
                ..Default::default()
            },
        )?;
        self.admin_run(
            "Delete I/O Completion Queue",
            SubmissionEntry {
                opcode: admin_op::DELETE_IO_CQ,
                cdw10: u32::from(qid),
                ..Default::default()
            },
        )
    }
}
