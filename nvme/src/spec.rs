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
    pub const INVALID_NAMESPACE: Status = Status::generic(0x0b).no_retry();
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80).no_retry();
    pub const CAPACITY_EXCEEDED: Status = Status::generic(0x81).no_retry();
    pub const WRITE_FAULT: Status = Status::media(0x80);
    pub const UNRECOVERED_READ_ERROR: Status = Status::media(0x81);

    pub const fn generic(sc: u8) -> Status {
        Status {
            sct: sct::GENERIC,
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
            (sct::GENERIC, 0x0b) => "Invalid Namespace or Format",
            (sct::GENERIC, 0x80) => "LBA Out of Range",
            (sct::GENERIC, 0x81) => "Capacity Exceeded",
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
