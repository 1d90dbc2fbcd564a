//! What a `uring` queue pair knows of fixed buffers and registered memory: which buffers
//! lie in the pinned pool or in a region registered with the kernel (so a read or write of
//! one buffer goes as `READ_FIXED`/`WRITE_FIXED` and skips the kernel's per-I/O page
//! pinning), registering and unregistering regions in the ring's sparse buffer table, and
//! O_DIRECT's rule for a vectored command's segments.

use io_uring::squeue;

use super::{data_entry, InFlight, UringQueuePair};
use crate::qpair::{Command, Segment, SegmentError};
use crate::region::{MemoryRegion, RegisterError, UnregisterError};

impl UringQueuePair {
    /// O_DIRECT's rule for a vectored command: each segment's address and length are
    /// multiples of the block size (the kernel would fail the whole I/O with EINVAL).
    pub(super) fn check_direct(&self, segs: &[Segment]) -> Result<(), SegmentError> {
        let block_bytes = self.ns.lba_size_bytes;
        let block = block_bytes as usize;
        match segs.iter().enumerate().find(|(_, s)| {
            !(s.ptr() as usize).is_multiple_of(block) || !s.len_bytes().is_multiple_of(block)
        }) {
            Some((index, s)) => Err(SegmentError::NotBlockAligned {
                index,
                addr: s.ptr() as usize,
                len_bytes: s.len_bytes(),
                block_bytes,
            }),
            None => Ok(()),
        }
    }

    /// Whether the pinned buffer pool is registered with this ring.
    pub fn has_fixed_buffers(&self) -> bool {
        self.fixed_region.is_some()
    }

    /// Reads and writes so far whose buffer lay in the registered pool.
    pub fn fixed_ios(&self) -> u64 {
        self.fixed_ios
    }

    /// Whether `len` bytes at `ptr` lie inside the registered region.
    fn in_fixed_region(&self, ptr: *mut u8, len: u64) -> bool {
        self.fixed_region.is_some_and(|(base, region_len)| {
            let at = ptr as usize;
            at >= base && (at - base) as u64 + len <= region_len as u64
        })
    }

    /// Whether `region` is registered with the kernel as a fixed buffer (else its I/O goes
    /// as plain buffers and iovecs).
    pub fn region_is_fixed(&self, region: &MemoryRegion) -> bool {
        self.regions_fixed & (1 << region.index()) != 0
    }

    /// The fixed buffer `len` bytes at `ptr` lie in: 0 for the pinned pool, a registered
    /// region's index + 1; `None` for plain memory.
    fn fixed_index(&self, ptr: *mut u8, len: u64) -> Option<u16> {
        if self.in_fixed_region(ptr, len) {
            return Some(0);
        }
        if self.regions_fixed == 0 {
            return None;
        }
        let index = self.regions.find(ptr, len as usize).ok().flatten()?;
        (self.regions_fixed & (1 << index) != 0).then_some(index as u16 + 1)
    }

    /// The entry of a read or write of the one buffer at `buf_ptr`: fixed where it lies in the
    /// pinned pool or in a region registered as a fixed buffer.
    pub(super) fn one_buffer_entry(
        &mut self,
        cmd: &Command<'_>,
        buf_ptr: *mut u8,
        flight: &InFlight,
        slot: u32,
    ) -> squeue::Entry {
        let fixed = self.fixed_index(buf_ptr, flight.len_bytes);
        self.fixed_ios += u64::from(fixed.is_some());
        let file = self.data_file(flight.opcode);
        data_entry(cmd, buf_ptr, flight, slot, fixed, file)
    }

    /// Registers the region as a fixed buffer (slot index + 1 of the sparse table), so a
    /// read or write of one buffer inside it skips the kernel's per-I/O page pinning;
    /// where the kernel has no sparse table, or refuses to pin (a memlock limit), the
    /// region is kept for bookkeeping and its I/O goes as plain buffers and iovecs. Vectored
    /// commands always go as iovecs: io_uring's fixed vectored reads and writes are too new
    /// (Linux 6.15) to rely on.
    /// # Safety
    ///
    /// As [`crate::QueuePair::register_memory`]: the memory stays mapped at these addresses until
    /// it is unregistered or the queue pair is dropped.
    pub(super) unsafe fn register_region(
        &mut self,
        ptr: *mut u8,
        len_bytes: usize,
    ) -> Result<MemoryRegion, RegisterError> {
        let region = self.regions.add(ptr, len_bytes)?;
        if self.sparse_table {
            let iov = libc::iovec {
                iov_base: ptr.cast(),
                iov_len: len_bytes,
            };
            // SAFETY: the caller keeps the memory mapped, at these addresses, until it is
            // unregistered or the queue pair (and with it the ring and its pins) is gone.
            let fixed = unsafe {
                self.ring.submitter().register_buffers_update(
                    1 + region.index() as u32,
                    &[iov],
                    None,
                )
            };
            match fixed {
                Ok(()) => self.regions_fixed |= 1 << region.index(),
                Err(e) => tracing::debug!(
                    "io_uring: region of {len_bytes} bytes not registered as a fixed buffer \
                     ({e}); its I/O goes as plain buffers"
                ),
            }
        }
        Ok(region)
    }

    pub(super) fn unregister_region(
        &mut self,
        region: MemoryRegion,
    ) -> Result<(), UnregisterError> {
        self.regions.check_remove(&region)?;
        if self.region_is_fixed(&region) {
            self.regions_fixed &= !(1 << region.index());
            let empty = Segment::EMPTY.to_iovec();
            // SAFETY: an empty entry (null, 0) points at no memory. No command uses the
            // region (checked above), and none will be submitted as fixed into it again.
            let cleared = unsafe {
                self.ring.submitter().register_buffers_update(
                    1 + region.index() as u32,
                    &[empty],
                    None,
                )
            };
            if let Err(e) = cleared {
                // The kernel keeps its pins on the pages until the ring goes, which keeps
                // them alive, not the mapping: nothing is submitted into them again.
                tracing::warn!(
                    "io_uring: clearing fixed buffer {} failed: {e}",
                    region.index() + 1
                );
            }
        }
        self.regions.remove(&region);
        Ok(())
    }
}
