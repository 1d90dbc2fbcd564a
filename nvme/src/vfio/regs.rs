//! NVMe controller registers in BAR0 (NVMe Base spec, "Controller Registers") and the
//! doorbells after them, reached through the BAR's mmap with volatile 32-bit accesses.

use super::sys::{self, Mapping};

pub const CAP: usize = 0x00;
pub const VS: usize = 0x08;
pub const CC: usize = 0x14;
pub const CSTS: usize = 0x1c;
pub const AQA: usize = 0x24;
pub const ASQ: usize = 0x28;
pub const ACQ: usize = 0x30;
/// Doorbells start here; each queue has an SQ tail and a CQ head doorbell,
/// `4 << CAP.DSTRD` bytes apart.
pub const DOORBELL_BASE: usize = 0x1000;

pub const CC_EN: u32 = 1 << 0;
/// I/O submission queue entries are 2^6 = 64 bytes.
pub const CC_IOSQES_64: u32 = 6 << 16;
/// I/O completion queue entries are 2^4 = 16 bytes.
pub const CC_IOCQES_16: u32 = 4 << 20;
/// CC.SHN = 01b: normal shutdown notification.
pub const CC_SHN_NORMAL: u32 = 1 << 14;
pub const CC_SHN_MASK: u32 = 3 << 14;
pub const CSTS_RDY: u32 = 1 << 0;
/// CSTS.SHST = 10b: shutdown processing complete.
pub const CSTS_SHST_COMPLETE: u32 = 2 << 2;
pub const CSTS_SHST_MASK: u32 = 3 << 2;
pub const CSTS_CFS: u32 = 1 << 1;

/// The fields of CAP the driver uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cap {
    /// Maximum Queue Entries Supported, as a count (the register is 0-based).
    pub mqes_entries: u32,
    /// Worst-case time to become ready or not ready after CC.EN changes.
    pub timeout_ms: u64,
    /// Doorbell stride: doorbells are `4 << dstrd` bytes apart.
    pub dstrd: u32,
    /// Whether the NVM command set is supported (CSS bit 0).
    pub nvm_css: bool,
    /// Smallest memory page size, as log2 bytes.
    pub mpsmin_shift: u32,
}

impl Cap {
    pub fn parse(cap: u64) -> Cap {
        Cap {
            mqes_entries: (cap & 0xffff) as u32 + 1,
            timeout_ms: ((cap >> 24) & 0xff) * 500,
            dstrd: ((cap >> 32) & 0xf) as u32,
            nvm_css: (cap >> 37) & 1 == 1,
            mpsmin_shift: 12 + ((cap >> 48) & 0xf) as u32,
        }
    }
}

/// BAR0, mapped: controller registers and doorbells.
#[derive(Debug)]
pub struct Bar {
    map: Mapping,
    doorbell_stride_bytes: usize,
}

impl Bar {
    /// Wraps a mapping of BAR0 that covers at least the registers and one page of doorbells.
    pub fn new(map: Mapping) -> Bar {
        assert!(
            map.len_bytes() >= DOORBELL_BASE + 8,
            "BAR0 mapping too small"
        );
        Bar {
            map,
            doorbell_stride_bytes: 4,
        }
    }

    pub fn set_doorbell_stride(&mut self, dstrd: u32) {
        self.doorbell_stride_bytes = 4 << dstrd;
    }

    /// Queue ids whose doorbells lie inside the mapping (queue 0 is the admin queue).
    pub fn queues_mapped(&self) -> usize {
        (self.map.len_bytes() - DOORBELL_BASE) / (2 * self.doorbell_stride_bytes)
    }

    pub fn read32(&self, reg: usize) -> u32 {
        assert!(reg + 4 <= DOORBELL_BASE && reg.is_multiple_of(4));
        // SAFETY: a 4-aligned controller register inside the mapping (checked); reading a
        // register has no side effects in NVMe.
        unsafe { sys::mmio_read32(&self.map, reg) }
    }

    pub fn read64(&self, reg: usize) -> u64 {
        u64::from(self.read32(reg)) | (u64::from(self.read32(reg + 4)) << 32)
    }

    pub fn write32(&self, reg: usize, value: u32) {
        assert!(reg + 4 <= DOORBELL_BASE && reg.is_multiple_of(4));
        // SAFETY: a 4-aligned controller register inside the mapping (checked); the driver
        // writes the registers in the order the spec's initialisation sequence asks for.
        unsafe { sys::mmio_write32(&self.map, reg, value) }
    }

    /// Writes a 64-bit register as two dword writes, low half first.
    pub fn write64(&self, reg: usize, value: u64) {
        self.write32(reg, value as u32);
        self.write32(reg + 4, (value >> 32) as u32);
    }

    fn doorbell_offset(&self, qid: u16, cq: bool) -> usize {
        let off = DOORBELL_BASE + (2 * qid as usize + usize::from(cq)) * self.doorbell_stride_bytes;
        assert!(
            off + 4 <= self.map.len_bytes(),
            "doorbell of queue {qid} is not mapped"
        );
        off
    }

    /// Rings queue `qid`'s submission queue tail doorbell.
    pub fn ring_sq(&self, qid: u16, tail: u16) {
        let off = self.doorbell_offset(qid, false);
        // Queue entries are written with plain stores before this: order them first.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: the doorbell lies inside the mapping (checked in doorbell_offset).
        unsafe { sys::mmio_write32(&self.map, off, u32::from(tail)) }
    }

    /// Rings queue `qid`'s completion queue head doorbell.
    pub fn ring_cq(&self, qid: u16, head: u16) {
        let off = self.doorbell_offset(qid, true);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: as in ring_sq.
        unsafe { sys::mmio_write32(&self.map, off, u32::from(head)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_fields_decode_as_the_spec_lays_them_out() {
        // QEMU's NVMe: MQES 0x7ff, CQR, TO 0xf, DSTRD 0, NSSRS, CSS NVM, MPSMIN 0, MPSMAX 4.
        let cap: u64 = 0x7ff | (1 << 16) | (0xf << 24) | (1 << 36) | (1 << 37) | (4 << 52);
        let c = Cap::parse(cap);
        assert_eq!(c.mqes_entries, 2048);
        assert_eq!(c.timeout_ms, 7500);
        assert_eq!(c.dstrd, 0);
        assert!(c.nvm_css);
        assert_eq!(c.mpsmin_shift, 12);
        let c = Cap::parse((3 << 32) | (2 << 48));
        assert_eq!((c.dstrd, c.mpsmin_shift, c.nvm_css), (3, 14, false));
    }
}
