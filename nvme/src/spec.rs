//! NVMe structures from the NVM Express Base and NVM Command Set specifications: the 64-byte
//! submission queue entry, the 16-byte completion queue entry, the I/O opcodes hypoll uses,
//! status codes, and the namespace facts a host needs.
//!
//! Field placement follows the specification (Base spec 2.0, figures "Common Command Format"
//! and "Common Completion Queue Entry Layout"; NVM Command Set spec for Read, Write, Write
//! Zeroes and Dataset Management). Everything here is plain data: building an entry is safe.

use std::fmt;

/// NVM command set I/O opcodes (NVM Command Set spec, "Opcodes for NVM Commands").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    Flush = 0x00,
    Write = 0x01,
    Read = 0x02,
    WriteZeroes = 0x08,
    DatasetManagement = 0x09,
}

impl Opcode {
    /// Decodes an opcode byte; `None` for opcodes hypoll's devices do not implement.
    pub fn from_u8(byte: u8) -> Option<Opcode> {
        Some(match byte {
            0x00 => Opcode::Flush,
            0x01 => Opcode::Write,
            0x02 => Opcode::Read,
            0x08 => Opcode::WriteZeroes,
            0x09 => Opcode::DatasetManagement,
            _ => return None,
        })
    }

    /// Whether the command moves data from host memory to the device.
    pub fn is_write_like(self) -> bool {
        !matches!(self, Opcode::Read)
    }
}

/// Command Dword 12 bit 30 of Read/Write: Force Unit Access.
pub const CDW12_FUA: u32 = 1 << 30;
/// Write Zeroes, CDW12 bit 25: Deallocate (DEAC): the host allows the controller to
/// deallocate the zeroed blocks (without it they stay allocated).
pub const CDW12_DEAC: u32 = 1 << 25;
/// Command Dword 11 bit 2 of Dataset Management: Attribute - Deallocate.
pub const DSM_ATTR_DEALLOCATE: u32 = 1 << 2;
/// Largest number of logical blocks one Read/Write/Write Zeroes can name (NLB is 16 bits,
/// 0-based).
pub const NLB_MAX: u32 = 1 << 16;

/// A 64-byte submission queue entry (Base spec, "Common Command Format").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct SubmissionEntry {
    /// CDW0: opcode (bits 7:0), fused/PSDT flags (15:8), command identifier (31:16).
    pub opcode: u8,
    pub flags: u8,
    pub cid: u16,
    /// Namespace identifier.
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    /// Metadata pointer.
    pub mptr: u64,
    /// Data pointer: PRP entry 1 and PRP entry 2.
    pub prp1: u64,
    pub prp2: u64,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
}

const _: () = assert!(std::mem::size_of::<SubmissionEntry>() == 64);

impl SubmissionEntry {
    /// Starting LBA of Read, Write, Write Zeroes (CDW10 low, CDW11 high).
    pub fn slba(&self) -> u64 {
        u64::from(self.cdw10) | (u64::from(self.cdw11) << 32)
    }

    pub fn set_slba(&mut self, slba: u64) {
        self.cdw10 = slba as u32;
        self.cdw11 = (slba >> 32) as u32;
    }

    /// Number of logical blocks, converted from the 0-based NLB field to a count.
    pub fn block_count(&self) -> u32 {
        (self.cdw12 & 0xffff) + 1
    }

    /// The entry as it travels (little-endian, the layout of the Base spec's figure): what
    /// a fabrics command capsule carries.
    pub fn to_le_bytes(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0] = self.opcode;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.cid.to_le_bytes());
        b[4..8].copy_from_slice(&self.nsid.to_le_bytes());
        b[8..12].copy_from_slice(&self.cdw2.to_le_bytes());
        b[12..16].copy_from_slice(&self.cdw3.to_le_bytes());
        b[16..24].copy_from_slice(&self.mptr.to_le_bytes());
        b[24..32].copy_from_slice(&self.prp1.to_le_bytes());
        b[32..40].copy_from_slice(&self.prp2.to_le_bytes());
        let dwords = [
            self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14, self.cdw15,
        ];
        for (i, d) in dwords.iter().enumerate() {
            b[40 + 4 * i..44 + 4 * i].copy_from_slice(&d.to_le_bytes());
        }
        b
    }

    /// The inverse of [`SubmissionEntry::to_le_bytes`].
    pub fn from_le_bytes(b: &[u8; 64]) -> SubmissionEntry {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from(u32_at(i)) | (u64::from(u32_at(i + 4)) << 32);
        SubmissionEntry {
            opcode: b[0],
            flags: b[1],
            cid: u16::from_le_bytes([b[2], b[3]]),
            nsid: u32_at(4),
            cdw2: u32_at(8),
            cdw3: u32_at(12),
            mptr: u64_at(16),
            prp1: u64_at(24),
            prp2: u64_at(32),
            cdw10: u32_at(40),
            cdw11: u32_at(44),
            cdw12: u32_at(48),
            cdw13: u32_at(52),
            cdw14: u32_at(56),
            cdw15: u32_at(60),
        }
    }
}

/// A 16-byte completion queue entry (Base spec, "Common Completion Queue Entry Layout").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct CompletionEntry {
    /// Command specific (DW0) and reserved (DW1).
    pub dw0: u32,
    pub dw1: u32,
    /// DW2: SQ head pointer (15:0) and SQ identifier (31:16).
    pub sq_head: u16,
    pub sq_id: u16,
    /// DW3: command identifier (15:0), then phase tag (bit 16) and status field (31:17).
    pub cid: u16,
    pub status_phase: u16,
}

const _: () = assert!(std::mem::size_of::<CompletionEntry>() == 16);

impl CompletionEntry {
    /// The phase tag: flips each time the controller wraps the completion queue.
    pub fn phase(&self) -> bool {
        self.status_phase & 1 == 1
    }

    pub fn status(&self) -> Status {
        Status::from_field(self.status_phase >> 1)
    }

    /// Packs status and phase as the controller writes them.
    pub fn pack_status(status: Status, phase: bool) -> u16 {
        (status.to_field() << 1) | u16::from(phase)
    }

    /// The entry as it travels (little-endian): what a fabrics response capsule carries.
    pub fn to_le_bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&self.dw0.to_le_bytes());
        b[4..8].copy_from_slice(&self.dw1.to_le_bytes());
        b[8..10].copy_from_slice(&self.sq_head.to_le_bytes());
        b[10..12].copy_from_slice(&self.sq_id.to_le_bytes());
        b[12..14].copy_from_slice(&self.cid.to_le_bytes());
        b[14..16].copy_from_slice(&self.status_phase.to_le_bytes());
        b
    }

    /// The inverse of [`CompletionEntry::to_le_bytes`].
    pub fn from_le_bytes(b: &[u8; 16]) -> CompletionEntry {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        CompletionEntry {
            dw0: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            dw1: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            sq_head: u16_at(8),
            sq_id: u16_at(10),
            cid: u16_at(12),
            status_phase: u16_at(14),
        }
    }
}

/// Status Code Type values (Base spec, "Status Code Type Values").
pub mod sct {
    pub const GENERIC: u8 = 0x0;
    pub const COMMAND_SPECIFIC: u8 = 0x1;
    pub const MEDIA: u8 = 0x2;
}

/// A completion status: status code type and status code, plus Do Not Retry.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status {
    pub sct: u8,
    pub sc: u8,
    pub dnr: bool,
}

impl Status {
    pub const SUCCESS: Status = Status::generic(0x00);
    pub const INVALID_OPCODE: Status = Status::generic(0x01).no_retry();
    pub const INVALID_FIELD: Status = Status::generic(0x02).no_retry();
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04);
    pub const INTERNAL_ERROR: Status = Status::generic(0x06);
    pub const ABORT_REQUESTED: Status = Status::generic(0x07);
    /// What a controller reset does to every outstanding command: its queue is deleted.
    pub const ABORTED_SQ_DELETION: Status = Status::generic(0x08);
    pub const COMMAND_ID_CONFLICT: Status = Status::generic(0x03).no_retry();
    pub const INVALID_NAMESPACE: Status = Status::generic(0x0b).no_retry();
    /// A command the controller's state does not allow yet (an admin command before
    /// CC.EN, a command before Connect).
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::generic(0x0c).no_retry();
    pub const DATA_SGL_LENGTH_INVALID: Status = Status::generic(0x0f).no_retry();
    pub const SGL_DESCRIPTOR_TYPE_INVALID: Status = Status::generic(0x11).no_retry();
    pub const SGL_OFFSET_INVALID: Status = Status::generic(0x16).no_retry();
    pub const NAMESPACE_WRITE_PROTECTED: Status = Status::generic(0x20).no_retry();
    /// What NVMe/TCP answers a command whose data failed its digest: worth a retry.
    pub const TRANSIENT_TRANSPORT_ERROR: Status = Status::generic(0x22);
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80).no_retry();
    pub const CAPACITY_EXCEEDED: Status = Status::generic(0x81).no_retry();
    pub const NAMESPACE_NOT_READY: Status = Status::generic(0x82);
    pub const AER_LIMIT_EXCEEDED: Status = Status::command_specific(0x05).no_retry();
    pub const INVALID_LOG_PAGE: Status = Status::command_specific(0x09).no_retry();
    pub const FEATURE_NOT_SAVEABLE: Status = Status::command_specific(0x0d).no_retry();
    /// NVMe over Fabrics' Connect statuses (command specific).
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = Status::command_specific(0x80).no_retry();
    pub const CONNECT_CONTROLLER_BUSY: Status = Status::command_specific(0x81).no_retry();
    pub const CONNECT_INVALID_PARAMETERS: Status = Status::command_specific(0x82).no_retry();
    pub const CONNECT_INVALID_HOST: Status = Status::command_specific(0x84).no_retry();
    pub const WRITE_FAULT: Status = Status::media(0x80);
    pub const UNRECOVERED_READ_ERROR: Status = Status::media(0x81);

    pub const fn generic(sc: u8) -> Status {
        Status {
            sct: sct::GENERIC,
            sc,
            dnr: false,
        }
    }

    pub const fn command_specific(sc: u8) -> Status {
        Status {
            sct: sct::COMMAND_SPECIFIC,
            sc,
            dnr: false,
        }
    }

    pub const fn media(sc: u8) -> Status {
        Status {
            sct: sct::MEDIA,
            sc,
            dnr: false,
        }
    }

    const fn no_retry(self) -> Status {
        Status { dnr: true, ..self }
    }

    pub fn is_success(self) -> bool {
        self.sct == sct::GENERIC && self.sc == 0
    }

    /// Decodes the 15-bit status field (CQE DW3 bits 31:17, shifted down by 17).
    pub fn from_field(field: u16) -> Status {
        Status {
            sc: (field & 0xff) as u8,
            sct: ((field >> 8) & 0x7) as u8,
            dnr: field & (1 << 14) != 0,
        }
    }

    pub fn to_field(self) -> u16 {
        u16::from(self.sc) | (u16::from(self.sct & 0x7) << 8) | (u16::from(self.dnr) << 14)
    }

    /// The specification's name for this status, where hypoll knows it.
    pub fn name(self) -> &'static str {
        match (self.sct, self.sc) {
            (sct::GENERIC, 0x00) => "Successful Completion",
            (sct::GENERIC, 0x01) => "Invalid Command Opcode",
            (sct::GENERIC, 0x02) => "Invalid Field in Command",
            (sct::GENERIC, 0x04) => "Data Transfer Error",
            (sct::GENERIC, 0x06) => "Internal Error",
            (sct::GENERIC, 0x07) => "Command Abort Requested",
            (sct::GENERIC, 0x08) => "Command Aborted due to SQ Deletion",
            (sct::GENERIC, 0x03) => "Command ID Conflict",
            (sct::GENERIC, 0x0b) => "Invalid Namespace or Format",
            (sct::GENERIC, 0x0c) => "Command Sequence Error",
            (sct::GENERIC, 0x0f) => "Data SGL Length Invalid",
            (sct::GENERIC, 0x11) => "SGL Descriptor Type Invalid",
            (sct::GENERIC, 0x16) => "SGL Offset Invalid",
            (sct::GENERIC, 0x20) => "Namespace is Write Protected",
            (sct::GENERIC, 0x22) => "Transient Transport Error",
            (sct::GENERIC, 0x80) => "LBA Out of Range",
            (sct::GENERIC, 0x81) => "Capacity Exceeded",
            (sct::GENERIC, 0x82) => "Namespace Not Ready",
            (sct::COMMAND_SPECIFIC, 0x05) => "Asynchronous Event Request Limit Exceeded",
            (sct::COMMAND_SPECIFIC, 0x09) => "Invalid Log Page",
            (sct::COMMAND_SPECIFIC, 0x0d) => "Feature Identifier Not Saveable",
            (sct::COMMAND_SPECIFIC, 0x80) => "Connect Incompatible Format",
            (sct::COMMAND_SPECIFIC, 0x81) => "Connect Controller Busy",
            (sct::COMMAND_SPECIFIC, 0x82) => "Connect Invalid Parameters",
            (sct::COMMAND_SPECIFIC, 0x84) => "Connect Invalid Host",
            (sct::MEDIA, 0x80) => "Write Fault",
            (sct::MEDIA, 0x81) => "Unrecovered Read Error",
            _ => "unknown status",
        }
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (sct {:#x}, sc {:#04x}",
            self.name(),
            self.sct,
            self.sc
        )?;
        if self.dnr {
            write!(f, ", do not retry")?;
        }
        write!(f, ")")
    }
}

/// A Dataset Management range (NVM Command Set spec, "Dataset Management - Range
/// Definition"): 16 bytes each, in host memory, pointed to by PRP1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct DsmRange {
    pub context_attributes: u32,
    /// Length in logical blocks (a count, not 0-based).
    pub nlb: u32,
    pub slba: u64,
}

const _: () = assert!(std::mem::size_of::<DsmRange>() == 16);

/// What a host needs to know about a namespace (from Identify Namespace and Identify
/// Controller: LBA format, NSZE, MDTS).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NamespaceInfo {
    /// Namespace identifier (1-based).
    pub nsid: u32,
    /// Logical block size: 512 or 4096 bytes.
    pub lba_size_bytes: u32,
    /// Capacity in logical blocks (NSZE).
    pub capacity_lbas: u64,
    /// Largest data transfer of one command (MDTS), in bytes.
    pub transfer_bytes_max: u32,
}

impl NamespaceInfo {
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_lbas * u64::from(self.lba_size_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_field_round_trips_through_completion_entry() {
        for status in [
            Status::SUCCESS,
            Status::INVALID_FIELD,
            Status::LBA_OUT_OF_RANGE,
            Status::UNRECOVERED_READ_ERROR,
            Status::ABORTED_SQ_DELETION,
        ] {
            for phase in [false, true] {
                let cqe = CompletionEntry {
                    status_phase: CompletionEntry::pack_status(status, phase),
                    ..Default::default()
                };
                assert_eq!(cqe.phase(), phase);
                assert_eq!(cqe.status(), status);
            }
        }
    }

    #[test]
    fn status_bits_sit_where_the_spec_puts_them() {
        // LBA Out of Range with DNR: SC 0x80 in bits 7:0, SCT 0 in 10:8, DNR in bit 14 of
        // the status field; as the CQE's upper 16 bits of DW3 that is bit 15 with phase 0.
        let packed = CompletionEntry::pack_status(Status::LBA_OUT_OF_RANGE, false);
        assert_eq!(packed, (0x80 << 1) | (1 << 15));
        let media = CompletionEntry::pack_status(Status::UNRECOVERED_READ_ERROR, true);
        assert_eq!(media, (0x81 << 1) | (0x2 << 9) | 1);
    }

    #[test]
    fn slba_and_block_count_use_the_spec_encoding() {
        let mut sqe = SubmissionEntry::default();
        sqe.set_slba(0x1_2345_6789);
        sqe.cdw12 = 7 | CDW12_FUA;
        assert_eq!(sqe.cdw10, 0x2345_6789);
        assert_eq!(sqe.cdw11, 0x1);
        assert_eq!(sqe.slba(), 0x1_2345_6789);
        assert_eq!(sqe.block_count(), 8);
    }

    #[test]
    fn entries_travel_little_endian_in_the_spec_layout() {
        let mut sqe = SubmissionEntry {
            opcode: 0x02,
            flags: 0x40,
            cid: 0x1234,
            nsid: 1,
            prp1: 0x1122_3344_5566_7788,
            prp2: 0x5a00_0000_0000_1000,
            cdw15: 0xdead_beef,
            ..Default::default()
        };
        sqe.set_slba(0x0102_0304_0506);
        let b = sqe.to_le_bytes();
        assert_eq!(&b[..4], &[0x02, 0x40, 0x34, 0x12]);
        assert_eq!(b[24], 0x88, "SGL1/PRP1 starts at byte 24");
        assert_eq!(
            b[39], 0x5a,
            "the SGL identifier is the descriptor's last byte"
        );
        assert_eq!(&b[40..44], &[0x06, 0x05, 0x04, 0x03], "CDW10 at byte 40");
        assert_eq!(&b[60..], &0xdead_beef_u32.to_le_bytes());
        assert_eq!(SubmissionEntry::from_le_bytes(&b), sqe);

        let cqe = CompletionEntry {
            dw0: 7,
            dw1: 0,
            sq_head: 3,
            sq_id: 1,
            cid: 0xabcd,
            status_phase: CompletionEntry::pack_status(Status::LBA_OUT_OF_RANGE, false),
        };
        let b = cqe.to_le_bytes();
        assert_eq!(&b[12..14], &[0xcd, 0xab]);
        assert_eq!(CompletionEntry::from_le_bytes(&b), cqe);
    }

    #[test]
    fn opcodes_decode() {
        for op in [
            Opcode::Flush,
            Opcode::Write,
            Opcode::Read,
            Opcode::WriteZeroes,
            Opcode::DatasetManagement,
        ] {
            assert_eq!(Opcode::from_u8(op as u8), Some(op));
        }
        assert_eq!(Opcode::from_u8(0x7f), None);
    }
}
