//! The SGL descriptor a fabrics command carries in its data pointer (SQE bytes 24..40), in
//! the two forms NVMe/TCP uses: a data block with offset for in-capsule data, and a
//! transport SGL data block for data that travels in data PDUs (C2HData, or H2CData after
//! an R2T).

use crate::spec::SubmissionEntry;

/// Bytes of one SGL descriptor.
pub const SGL_DESCRIPTOR_BYTES: usize = 16;

/// SGL descriptor types (byte 15, bits 7:4).
pub const SGL_TYPE_DATA_BLOCK: u8 = 0x0;
pub const SGL_TYPE_TRANSPORT_DATA_BLOCK: u8 = 0x5;
/// SGL descriptor subtypes (byte 15, bits 3:0).
pub const SGL_SUBTYPE_ADDRESS: u8 = 0x0;
pub const SGL_SUBTYPE_OFFSET: u8 = 0x1;
pub const SGL_SUBTYPE_TRANSPORT: u8 = 0xa;

/// CDW0's PSDT field (the flags byte, bits 7:6): 00b means PRPs, which fabrics do not use.
pub const PSDT_SHIFT: u8 = 6;
pub const PSDT_MASK: u8 = 0b11 << PSDT_SHIFT;
/// PSDT 01b: SGLs for data, metadata in one buffer (what hosts send over fabrics).
pub const PSDT_SGL: u8 = 0b01 << PSDT_SHIFT;

/// What a descriptor names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SglKind {
    /// Data block with offset: the data is in the capsule, at `address` from its start.
    InCapsule,
    /// Transport SGL data block: the data travels in data PDUs.
    Transport,
    /// Anything else (keyed RDMA blocks, segments, bit buckets...): not for NVMe/TCP.
    Other { sgl_type: u8, subtype: u8 },
}

/// One SGL descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SglDescriptor {
    pub address: u64,
    pub length: u32,
    /// Byte 15: type (7:4) and subtype (3:0).
    pub identifier: u8,
}

impl SglDescriptor {
    /// An in-capsule data descriptor for `length` bytes at the capsule's data start.
    pub fn in_capsule(length: u32) -> SglDescriptor {
        SglDescriptor {
            address: 0,
            length,
            identifier: (SGL_TYPE_DATA_BLOCK << 4) | SGL_SUBTYPE_OFFSET,
        }
    }

    /// A transport data block descriptor for `length` bytes moved in data PDUs (length 0
    /// for a command without data).
    pub fn transport(length: u32) -> SglDescriptor {
        SglDescriptor {
            address: 0,
            length,
            identifier: (SGL_TYPE_TRANSPORT_DATA_BLOCK << 4) | SGL_SUBTYPE_TRANSPORT,
        }
    }

    pub fn kind(&self) -> SglKind {
        let sgl_type = self.identifier >> 4;
        let subtype = self.identifier & 0xf;
        match (sgl_type, subtype) {
            (SGL_TYPE_DATA_BLOCK, SGL_SUBTYPE_OFFSET) => SglKind::InCapsule,
            (SGL_TYPE_TRANSPORT_DATA_BLOCK, SGL_SUBTYPE_TRANSPORT) => SglKind::Transport,
            _ => SglKind::Other { sgl_type, subtype },
        }
    }

    /// SGL1 of a command: the data pointer, where PRP1 and PRP2 would be.
    pub fn of(sqe: &SubmissionEntry) -> SglDescriptor {
        SglDescriptor {
            address: sqe.prp1,
            length: sqe.prp2 as u32,
            identifier: (sqe.prp2 >> 56) as u8,
        }
    }

    /// Puts the descriptor in a command's data pointer and marks the command as using SGLs.
    pub fn store(&self, sqe: &mut SubmissionEntry) {
        sqe.prp1 = self.address;
        sqe.prp2 = u64::from(self.length) | (u64::from(self.identifier) << 56);
        sqe.flags = (sqe.flags & !PSDT_MASK) | PSDT_SGL;
    }

    pub fn to_bytes(&self) -> [u8; SGL_DESCRIPTOR_BYTES] {
        let mut b = [0u8; SGL_DESCRIPTOR_BYTES];
        b[..8].copy_from_slice(&self.address.to_le_bytes());
        b[8..12].copy_from_slice(&self.length.to_le_bytes());
        b[15] = self.identifier;
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_sit_in_the_data_pointer_as_the_spec_lays_them() {
        let mut sqe = SubmissionEntry::default();
        SglDescriptor::in_capsule(4096).store(&mut sqe);
        let b = sqe.to_le_bytes();
        assert_eq!(&b[24..40], &SglDescriptor::in_capsule(4096).to_bytes());
        assert_eq!(b[39], 0x01, "data block, offset subtype");
        assert_eq!(&b[32..36], &4096u32.to_le_bytes());
        assert_eq!(sqe.flags & PSDT_MASK, PSDT_SGL);
        let d = SglDescriptor::of(&SubmissionEntry::from_le_bytes(&b));
        assert_eq!(
            (d.kind(), d.length, d.address),
            (SglKind::InCapsule, 4096, 0)
        );

        SglDescriptor::transport(1 << 20).store(&mut sqe);
        assert_eq!(sqe.to_le_bytes()[39], 0x5a);
        assert_eq!(SglDescriptor::of(&sqe).kind(), SglKind::Transport);

        // A keyed data block (type 4, RDMA's) is not NVMe/TCP's.
        sqe.prp2 = 4096 | (0x40u64 << 56);
        assert_eq!(
            SglDescriptor::of(&sqe).kind(),
            SglKind::Other {
                sgl_type: 4,
                subtype: 0
            }
        );
    }
}
