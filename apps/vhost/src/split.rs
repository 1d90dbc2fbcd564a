//! The avail and used rings of a split virtqueue, read and written through host pointers
//! resolved once per memory map (`host.rs`'s [`Span`]), with the orderings and fences the
//! virtio specification (2.7, "Split Virtqueues") asks of a device:
//!
//! - the avail index is loaded with Acquire, so the ring entries and descriptors the guest
//!   wrote before it are seen after it;
//! - a used element is written before the used index, which is stored with Release;
//! - a full fence separates the used index from the read of `used_event` (whether to
//!   signal), and the write of `avail_event` (notifications on) from the read of the avail
//!   index that follows it: the store-then-load pairs that a guest's own fence pairs with.
//!
//! The descriptor table is resolved here too, where it lies inside one region, for the
//! walker to read through ([`crate::host::RingView`]); a chain may still leave it for an
//! indirect table anywhere in guest memory, read by guest address, and a table that is
//! not resolved (across two regions, or misaligned) is read that way as well.

use std::num::Wrapping;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_ring::VRING_USED_F_NO_NOTIFY;

use crate::host::{HostMemory, Span};
use crate::walk::DESCRIPTOR_BYTES;

/// Bytes of the avail and used rings' headers (flags, index).
const RING_HEADER_BYTES: u64 = 4;
/// Bytes of an avail ring entry and a used ring element.
const AVAIL_ENTRY_BYTES: u64 = 2;
const USED_ELEM_BYTES: u64 = 8;
/// The alignment virtio requires of the descriptor table, the avail and used rings.
const DESC_ALIGN: usize = 16;
const AVAIL_ALIGN: usize = 2;
const USED_ALIGN: usize = 4;

/// Why a ring cannot be used with a memory map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SplitError {
    #[error("the avail ring at {0:#x} does not lie inside one region, 2-byte aligned")]
    Avail(u64),
    #[error("the used ring at {0:#x} does not lie inside one region, 4-byte aligned")]
    Used(u64),
}

/// The rings resolved against one memory map.
struct Areas {
    avail: Span,
    used: Span,
    /// The descriptor table, where it lies inside one region, 16-byte aligned (virtio's
    /// alignment for it).
    desc: Option<Span>,
}

/// The device's side of a split virtqueue's avail and used rings.
pub(crate) struct SplitRing {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    event_idx: bool,
    next_avail: Wrapping<u16>,
    next_used: Wrapping<u16>,
    /// Used elements pushed since the last `needs_notification`.
    added: Wrapping<u16>,
    areas: Option<Areas>,
}

impl SplitRing {
    /// A ring of `size` entries (a power of two) with its tables at guest addresses `desc`,
    /// `avail` and `used`, starting at index `base`.
    pub fn new(size: u16, desc: u64, avail: u64, used: u64, base: u16, event_idx: bool) -> Self {
        debug_assert!(size.is_power_of_two());
        SplitRing {
            size,
            desc,
            avail,
            used,
            event_idx,
            next_avail: Wrapping(base),
            next_used: Wrapping(base),
            added: Wrapping(0),
            areas: None,
        }
    }

    /// Resolves the rings in `memory` (none: the ring reads nothing until a map comes).
    pub fn map(&mut self, memory: Option<&Arc<HostMemory>>) -> Result<(), SplitError> {
        self.areas = None;
        let Some(memory) = memory else {
            return Ok(());
        };
        let size = u64::from(self.size);
        // Header, entries, and the event word after them.
        let avail_bytes = RING_HEADER_BYTES + AVAIL_ENTRY_BYTES * size + 2;
        let used_bytes = RING_HEADER_BYTES + USED_ELEM_BYTES * size + 2;
        let avail = memory
            .span(self.avail, avail_bytes, AVAIL_ALIGN)
            .ok_or(SplitError::Avail(self.avail))?;
        let used = memory
            .span(self.used, used_bytes, USED_ALIGN)
            .ok_or(SplitError::Used(self.used))?;
        let desc = memory.span(self.desc, DESCRIPTOR_BYTES * size, DESC_ALIGN);
        self.areas = Some(Areas { avail, used, desc });
        Ok(())
    }

    /// The guest address of the descriptor table.
    pub fn desc_table(&self) -> u64 {
        self.desc
    }

    /// The descriptor table as resolved in the current memory map, where it could be.
    pub fn desc_span(&self) -> Option<&Span> {
        self.areas.as_ref()?.desc.as_ref()
    }

    pub fn next_avail(&self) -> u16 {
        self.next_avail.0
    }

    pub fn set_next_avail(&mut self, next: u16) {
        self.next_avail = Wrapping(next);
    }

    /// The used index this ring last published.
    pub fn next_used(&self) -> u16 {
        self.next_used.0
    }

    /// The used index as it is in the guest's memory (None: not mapped), for a ring that
    /// resumes where a back end that died left it.
    pub fn guest_used_idx(&self) -> Option<u16> {
        let areas = self.areas.as_ref()?;
        areas.used.load_u16(2, Ordering::Acquire)
    }

    /// Resumes at `next_avail` and `next_used` (after [`crate::inflight`] recovery).
    pub fn resume(&mut self, next_avail: u16, next_used: u16) {
        self.next_avail = Wrapping(next_avail);
        self.next_used = Wrapping(next_used);
        self.added = Wrapping(0);
    }

    /// The guest's avail index, loaded with Acquire (None: no memory map).
    #[inline]
    pub fn avail_idx(&self) -> Option<Wrapping<u16>> {
        self.avail_idx_with(Ordering::Acquire)
    }

    fn avail_idx_with(&self, order: Ordering) -> Option<Wrapping<u16>> {
        let areas = self.areas.as_ref()?;
        areas.avail.load_u16(2, order).map(Wrapping)
    }

    /// The head of the next chain the guest made available, which the caller saw to be
    /// before the avail index it loaded last.
    #[inline]
    pub fn pop(&mut self) -> Option<u16> {
        let areas = self.areas.as_ref()?;
        // The size is a power of two (virtio's rule, checked when the front end set it).
        let slot = u64::from(self.next_avail.0 & (self.size - 1));
        let offset = RING_HEADER_BYTES + AVAIL_ENTRY_BYTES * slot;
        // Ordered after the avail index by its Acquire load.
        let head = areas.avail.load_u16(offset as usize, Ordering::Relaxed)?;
        self.next_avail += 1;
        Some(head)
    }

    /// Hands chain `head` back to the guest with `len` bytes written into it. Returns false
    /// if the ring is not mapped (or `head` is outside the queue).
    #[inline]
    pub fn add_used(&mut self, head: u16, len: u32) -> bool {
        if head >= self.size {
            return false;
        }
        let Some(areas) = self.areas.as_ref() else {
            return false;
        };
        let slot = u64::from(self.next_used.0 & (self.size - 1));
        let offset = (RING_HEADER_BYTES + USED_ELEM_BYTES * slot) as usize;
        let wrote =
            areas.used.write_u32(offset, u32::from(head)) && areas.used.write_u32(offset + 4, len);
        if !wrote {
            return false;
        }
        self.next_used += 1;
        self.added += 1;
        // After the element: a guest that sees the index sees the element.
        areas.used.store_u16(2, self.next_used.0, Ordering::Release)
    }

    /// Whether the guest asked to be signalled for what was pushed since the last call
    /// (always, without the event index).
    pub fn needs_notification(&mut self) -> bool {
        let Some(areas) = self.areas.as_ref() else {
            return false;
        };
        // The used index stored before `used_event` is read: the guest writes
        // `used_event`, fences, then reads the used index, and one of the two sides must see
        // the other's write.
        fence(Ordering::SeqCst);
        let used = self.next_used;
        let old = used - self.added;
        self.added = Wrapping(0);
        if !self.event_idx {
            return true;
        }
        let offset = (RING_HEADER_BYTES + AVAIL_ENTRY_BYTES * u64::from(self.size)) as usize;
        let Some(event) = areas.avail.load_u16(offset, Ordering::Relaxed) else {
            return true;
        };
        // Whether `event` lies in `old..used` (virtio's vring_need_event).
        used - Wrapping(event) - Wrapping(1) < used - old
    }

    /// Turns the guest's notifications on; returns whether requests came meanwhile (the
    /// caller must look again rather than wait), None if the ring is not mapped.
    pub fn enable_notification(&mut self) -> Option<bool> {
        let areas = self.areas.as_ref()?;
        let stored = if self.event_idx {
            // Kick when the guest makes the next entry available.
            let offset = (RING_HEADER_BYTES + USED_ELEM_BYTES * u64::from(self.size)) as usize;
            areas
                .used
                .store_u16(offset, self.next_avail.0, Ordering::Relaxed)
        } else {
            areas.used.store_u16(0, 0, Ordering::Relaxed)
        };
        if !stored {
            return None;
        }
        // The store before the avail index is read again: a guest that posted before it saw
        // notifications on is seen here.
        fence(Ordering::SeqCst);
        let idx = self.avail_idx_with(Ordering::Relaxed)?;
        Some(idx != self.next_avail)
    }

    /// Turns the guest's notifications off (with the event index the avail event is simply
    /// left behind). Returns false if the ring is not mapped.
    pub fn disable_notification(&mut self) -> bool {
        let Some(areas) = self.areas.as_ref() else {
            return false;
        };
        if self.event_idx {
            return true;
        }
        areas
            .used
            .store_u16(0, VRING_USED_F_NO_NOTIFY as u16, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::RingView;
    use crate::testkit::{guest, put_desc, TABLE};
    use crate::walk::GuestView;

    /// Guest memory with descriptor 0 of the table at `TABLE` pointing at `addr`.
    fn memory(addr: u64) -> Arc<HostMemory> {
        let g = guest();
        put_desc(&g, TABLE, 0, addr, 16, 0, 0);
        Arc::new(HostMemory::new(Arc::new(g)))
    }

    #[test]
    fn the_table_is_resolved_again_in_each_memory_map() {
        let mut ring = SplitRing::new(8, TABLE, 0x800, 0xa00, 0, true);
        let first = memory(0x1111);
        ring.map(Some(&first)).unwrap();
        let view = RingView::new(&first, ring.desc_table(), ring.desc_span());
        assert_eq!(view.descriptor(TABLE, 0).unwrap()[0], 0x1111);
        // The front end sends another map: the ring's view reads the new one only.
        let second = memory(0x2222);
        ring.map(Some(&second)).unwrap();
        let view = RingView::new(&second, ring.desc_table(), ring.desc_span());
        assert_eq!(view.descriptor(TABLE, 0).unwrap()[0], 0x2222);
        ring.map(None).unwrap();
        assert!(ring.desc_span().is_none());
    }

    #[test]
    fn a_table_that_cannot_be_resolved_is_read_by_address() {
        // Misaligned: virtio asks 16 bytes, the walker reads it all the same (as it did
        // before the table was resolved), through the memory map.
        let g = guest();
        put_desc(&g, TABLE + 8, 1, 0x3333, 16, 0, 0);
        let m = Arc::new(HostMemory::new(Arc::new(g)));
        let mut ring = SplitRing::new(8, TABLE + 8, 0x800, 0xa00, 0, true);
        ring.map(Some(&m)).unwrap();
        assert!(ring.desc_span().is_none());
        let view = RingView::new(&m, ring.desc_table(), ring.desc_span());
        assert_eq!(view.descriptor(TABLE + 8, 1).unwrap()[0], 0x3333);
    }
}
