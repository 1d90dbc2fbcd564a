//! What a `uring` queue pair has registered with its ring, buffers and files: which
//! buffers lie in the pinned pool or in a region registered with the kernel (so a read or
//! write of one buffer goes as `READ_FIXED`/`WRITE_FIXED` and skips the kernel's per-I/O
//! page pinning), registering and unregistering regions in the ring's sparse buffer table,
//! O_DIRECT's rule for a vectored command's segments, and which fixed file a read or write
//! goes to (the second descriptor of `atime.rs` for a read that skips the access-time
//! check).

use io_uring::{squeue, types};

use super::super::atime::AtimeKeeper;
use super::{data_entry, InFlight, UringQueuePair};
use crate::qpair::{Command, Segment, SegmentError};
use crate::region::{MemoryRegion, RegisterError, UnregisterError};
use crate::spec::Opcode;

/// The main ring's fixed file for reads that skip the access-time check (`atime.rs`); the
/// queue pair's file is 0.
const NOATIME_FILE_INDEX: u32 = 1;

impl UringQueuePair {
    /// Reads from now on through `keeper`'s second descriptor but once a minute (see
    /// `atime.rs`): inline ones directly, the others as fixed file 1 of the main ring.
    pub(in super::super) fn keep_atime(&mut self, keeper: AtimeKeeper) {
        // A kernel that cannot replace a registered file (before 5.5) leaves the ordinary
        // one in slot 1: reads through the ring are then all checked, as with atime=kernel,
        // which changes nothing a reader can see.
        let _ = self
            .ring
            .submitter()
            .register_files_update(NOATIME_FILE_INDEX, &[keeper.noatime_fd()]);
        self.atime = Some(keeper);
    }

    /// Whether a command skips the kernel's access-time check: a read, while `atime` lets
    /// it (all but the first of each minute). Asked once per read, when it is made or
    /// pushed; the coarse clock is read from memory the kernel keeps, without a system call.
    pub(super) fn skips_atime(&mut self, opcode: Opcode) -> bool {
        match self.atime.as_mut() {
            Some(keeper) if opcode == Opcode::Read => {
                !keeper.check_read(crate::sys::monotonic_coarse_ns())
            }
            _ => false,
        }
    }

    /// The fixed file a Read or Write goes to: 0, the queue pair's file, but for a read that
    /// skips the access-time check.
    pub(super) fn data_file(&mut self, opcode: Opcode) -> types::Fixed {
        types::Fixed(if self.skips_atime(opcode) {
            NOATIME_FILE_INDEX
        } else {
            0
        })
    }

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
