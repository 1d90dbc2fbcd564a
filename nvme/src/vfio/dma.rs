//! DMA memory: pinned, device-visible buffers at IOVAs the driver chooses.
//!
//! * [`IovaAllocator`] hands out ranges of the device's I/O virtual address space (pure
//!   bookkeeping, tested on the host).
//! * [`DmaRegion`] is anonymous memory mapped into the IOMMU container at such a range with
//!   `VFIO_IOMMU_MAP_DMA` (the kernel pins it); dropping it unmaps the IOVA range before the
//!   memory is freed.
//! * [`PagePool`] splits a region into 4 KiB pages handed to commands as bounce buffers.
//!   Pages need not be contiguous: PRP lists name each page separately, so the pool is a free
//!   stack of page numbers and never fragments.
//!
//! This module holds the driver's DMA `unsafe`: the device reads and writes a region at any
//! time while it is mapped, so the region hands out raw copies and volatile accesses, never
//! Rust references into the memory.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use parking_lot::Mutex;

use super::prp::PAGE_BYTES;
use super::sys::{self, Mapping};
use super::VfioError;

/// First IOVA the driver uses: page 0 stays unmapped so a zero pointer faults.
pub const IOVA_BASE: u64 = 1 << 20;
/// The IOVA space ends below x86's interrupt window (0xfee00000..0xfeefffff), which the
/// IOMMU reserves for MSI writes.
pub const IOVA_END: u64 = 0xfee0_0000;

/// Hands out page-aligned ranges of I/O virtual addresses: first fit from freed ranges,
/// then from the untouched top.
#[derive(Debug)]
pub struct IovaAllocator {
    next: u64,
    end: u64,
    /// Freed ranges (iova, size), sorted and merged.
    free: Vec<(u64, u64)>,
}

impl IovaAllocator {
    pub fn new(base: u64, end: u64) -> IovaAllocator {
        IovaAllocator {
            next: base,
            end,
            free: Vec::new(),
        }
    }

    /// A range of `size_bytes` rounded up to whole pages, or `None` when the space is used up.
    pub fn alloc(&mut self, size_bytes: u64) -> Option<u64> {
        let size = size_bytes.max(1).div_ceil(PAGE_BYTES as u64) * PAGE_BYTES as u64;
        if let Some(i) = self.free.iter().position(|&(_, s)| s >= size) {
            let (iova, s) = self.free[i];
            if s == size {
                self.free.remove(i);
            } else {
                self.free[i] = (iova + size, s - size);
            }
            return Some(iova);
        }
        let iova = self.next;
        let end = iova.checked_add(size)?;
        if end > self.end {
            return None;
        }
        self.next = end;
        Some(iova)
    }

    /// Gives back a range `alloc` returned (with the size asked for).
    pub fn free(&mut self, iova: u64, size_bytes: u64) {
        let size = size_bytes.max(1).div_ceil(PAGE_BYTES as u64) * PAGE_BYTES as u64;
        let at = self.free.partition_point(|&(i, _)| i < iova);
        self.free.insert(at, (iova, size));
        // Merge neighbours, then give a free tail back to the top.
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.free.len());
        for &(i, s) in &self.free {
            match merged.last_mut() {
                Some((li, ls)) if *li + *ls == i => *ls += s,
                _ => merged.push((i, s)),
            }
        }
        if let Some(&(i, s)) = merged.last() {
            if i + s == self.next {
                self.next = i;
                merged.pop();
            }
        }
        self.free = merged;
    }

    /// Bytes handed out and not freed.
    pub fn in_use_bytes(&self, base: u64) -> u64 {
        (self.next - base) - self.free.iter().map(|&(_, s)| s).sum::<u64>()
    }
}

/// The VFIO container: the IOMMU address space every DMA region is mapped into.
#[derive(Debug)]
pub struct Container {
    pub(super) fd: OwnedFd,
    iova: Mutex<IovaAllocator>,
}

impl Container {
    pub(super) fn new(fd: OwnedFd) -> Container {
        Container {
            fd,
            iova: Mutex::new(IovaAllocator::new(IOVA_BASE, IOVA_END)),
        }
    }
}

/// Host memory the driver did not allocate, mapped for the device at an IOVA so PRPs point
/// straight at it, with no bounce copy (SPDK's rule: I/O buffers come from DMA-able
/// memory): the process's pinned buffer pool ([`IoBuf::pinned`](crate::IoBuf::pinned)),
/// mapped once per controller, or a region an application registered with a queue pair
/// ([`QueuePair::register_memory`](crate::QueuePair::register_memory)).
#[derive(Debug)]
pub struct PoolWindow {
    base: usize,
    len_bytes: usize,
    iova: u64,
    container: Arc<Container>,
    /// The application's memory, which it may free once the window is gone: an IOVA range
    /// that cannot be unmapped must stop the process rather than outlive it.
    application: bool,
    /// Unmapped already (by [`PoolWindow::unmap`]).
    unmapped: bool,
}

impl PoolWindow {
    /// Maps the pinned pool into `container`; `None` when the pool is off or the kernel
    /// will not pin it (a memlock limit), in which case every transfer bounces.
    pub fn map(container: &Arc<Container>) -> Result<PoolWindow, String> {
        let (base, len_bytes) = crate::buf::pinned_region().ok_or("the pinned pool is off")?;
        // SAFETY: the pinned pool's region is mapped for the life of the process and never
        // remapped, so the pages the IOMMU maps stay the ones at these addresses; Drop
        // unmaps the IOVA range before the container goes.
        let window = unsafe { PoolWindow::map_memory(container, base, len_bytes, false) };
        window.map_err(|e| match e {
            VfioError::IovaExhausted { .. } => "no IOVA space left for it".to_string(),
            e => e.to_string(),
        })
    }

    /// Maps `len_bytes` (whole pages) of memory at `base` into `container` at an IOVA of
    /// its own. `application`: the memory is the application's (see the field).
    ///
    /// # Safety
    /// The memory must stay mapped, at these addresses, until the window has been unmapped
    /// ([`PoolWindow::unmap`] returned `Ok`, or Drop ran): the device may write it at any
    /// time until then.
    pub unsafe fn map_memory(
        container: &Arc<Container>,
        base: *mut u8,
        len_bytes: usize,
        application: bool,
    ) -> Result<PoolWindow, VfioError> {
        debug_assert!(
            len_bytes.is_multiple_of(PAGE_BYTES) && (base as usize).is_multiple_of(PAGE_BYTES)
        );
        let iova = container
            .iova
            .lock()
            .alloc(len_bytes as u64)
            .ok_or(VfioError::IovaExhausted { len_bytes })?;
        // SAFETY: the caller keeps the memory mapped until the window is unmapped.
        let mapped = unsafe { sys::map_dma(&container.fd, base as u64, iova, len_bytes as u64) };
        if let Err(source) = mapped {
            container.iova.lock().free(iova, len_bytes as u64);
            return Err(VfioError::PinFailed {
                len_bytes,
                memlock_limit_bytes: sys::memlock_limit_bytes(),
                source,
            });
        }
        Ok(PoolWindow {
            base: base as usize,
            len_bytes,
            iova,
            container: container.clone(),
            application,
            unmapped: false,
        })
    }

    /// The IOVA of `len_bytes` at `ptr`, when they lie inside the pool and start on a page.
    pub fn iova_of(&self, ptr: *const u8, len_bytes: usize) -> Option<u64> {
        iova_in(
            self.base,
            self.len_bytes,
            self.iova,
            ptr as usize,
            len_bytes,
            true,
        )
    }

    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// The IOVA of `len_bytes` at `ptr`, when they lie inside the pool, wherever they start:
    /// for a vectored command's segments, whose PRP rules are checked apart.
    pub fn iova_of_bytes(&self, ptr: *const u8, len_bytes: usize) -> Option<u64> {
        iova_in(
            self.base,
            self.len_bytes,
            self.iova,
            ptr as usize,
            len_bytes,
            false,
        )
    }

    /// Unmaps the IOVA range, after which the device cannot reach the memory; on failure
    /// the window stays mapped (and is given back with the error).
    pub fn unmap(mut self) -> Result<(), (PoolWindow, std::io::Error)> {
        match sys::unmap_dma(&self.container.fd, self.iova, self.len_bytes as u64) {
            Ok(()) => {
                self.unmapped = true;
                self.container
                    .iova
                    .lock()
                    .free(self.iova, self.len_bytes as u64);
                Ok(())
            }
            Err(e) => Err((self, e)),
        }
    }
}

/// The IOVA of `len_bytes` at address `at`, for a window of `window_bytes` at `base` mapped
/// at `iova`: `None` unless they lie wholly inside it (and, with `page_start`, start on a
/// page, as a one-buffer command's PRPs without an offset need).
fn iova_in(
    base: usize,
    window_bytes: usize,
    iova: u64,
    at: usize,
    len_bytes: usize,
    page_start: bool,
) -> Option<u64> {
    let offset = at.checked_sub(base)?;
    let inside = offset.checked_add(len_bytes)? <= window_bytes;
    (inside && (!page_start || offset.is_multiple_of(PAGE_BYTES))).then(|| iova + offset as u64)
}

impl Drop for PoolWindow {
    fn drop(&mut self) {
        if self.unmapped {
            return;
        }
        if sys::unmap_dma(&self.container.fd, self.iova, self.len_bytes as u64).is_ok() {
            self.container
                .iova
                .lock()
                .free(self.iova, self.len_bytes as u64);
        } else if self.application {
            // The application may free this memory once its queue pair is gone, and the
            // device could still write it: stop here rather than corrupt it.
            tracing::error!(
                "vfio: unmapping {} bytes of registered memory at IOVA {:#x} failed; \
                 aborting rather than let the device write freed memory",
                self.len_bytes,
                self.iova
            );
            std::process::abort();
        }
        // The pool's memory stays mapped in the process for its whole life: an IOVA range
        // left mapped into it harms nothing.
    }
}

/// Pinned memory the device can reach at [`DmaRegion::iova`].
#[derive(Debug)]
pub struct DmaRegion {
    /// `None` once leaked.
    map: Option<Mapping>,
    iova: u64,
    len_bytes: usize,
    container: Arc<Container>,
}

impl DmaRegion {
    /// Allocates `len_bytes` (rounded up to pages) of zeroed memory and maps it for the
    /// device. Fails with [`VfioError::PinFailed`] when the kernel will not pin it.
    pub fn new(container: &Arc<Container>, len_bytes: usize) -> Result<DmaRegion, VfioError> {
        let len_bytes = len_bytes.max(1).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let map = Mapping::anonymous(len_bytes).map_err(|e| VfioError::Os {
            what: "allocating DMA memory (mmap)",
            source: e,
        })?;
        let iova = container
            .iova
            .lock()
            .alloc(len_bytes as u64)
            .ok_or(VfioError::IovaExhausted { len_bytes })?;
        // SAFETY: `map` is memory we own; it stays mapped until Drop has unmapped the IOVA
        // range (or forever, if unmapping fails: see Drop).
        let mapped =
            unsafe { sys::map_dma(&container.fd, map.as_ptr() as u64, iova, len_bytes as u64) };
        if let Err(e) = mapped {
            container.iova.lock().free(iova, len_bytes as u64);
            return Err(VfioError::PinFailed {
                len_bytes,
                memlock_limit_bytes: sys::memlock_limit_bytes(),
                source: e,
            });
        }
        Ok(DmaRegion {
            map: Some(map),
            iova,
            len_bytes,
            container: container.clone(),
        })
    }

    pub fn iova(&self) -> u64 {
        self.iova
    }

    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    fn ptr(&self) -> *mut u8 {
        self.map
            .as_ref()
            .expect("DMA region used after leak")
            .as_ptr()
    }

    /// Zeroes the whole region. Only while the device does not use it (a queue not yet
    /// created, or deleted by a reset).
    pub fn zero(&mut self) {
        // SAFETY: the region is `len_bytes` of our memory; `&mut self` rules out other host
        // accesses, and the caller's contract rules out the device.
        unsafe { std::ptr::write_bytes(self.ptr(), 0, self.len_bytes) };
    }

    /// Copies `data` into the region at `offset`.
    pub fn write_bytes(&mut self, offset: usize, data: &[u8]) {
        assert!(
            offset + data.len() <= self.len_bytes,
            "DMA write out of bounds"
        );
        // SAFETY: in bounds (checked); the bytes are ours and the device only reads memory
        // of a command once it is submitted, after this copy.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr().add(offset), data.len()) };
    }

    /// Copies `len` bytes from the region at `offset` to `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for `len` bytes of writes and not overlap the region.
    pub unsafe fn read_to(&self, offset: usize, dst: *mut u8, len: usize) {
        assert!(offset + len <= self.len_bytes, "DMA read out of bounds");
        // SAFETY: the source is in bounds (checked); the caller vouches for `dst`.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr().add(offset), dst, len) };
    }

    /// Copies bytes out into a slice.
    pub fn read_bytes(&self, offset: usize, out: &mut [u8]) {
        // SAFETY: `out` is a live, exclusive slice of exactly that length.
        unsafe { self.read_to(offset, out.as_mut_ptr(), out.len()) };
    }

    /// Writes a plain-data value at `offset` with a volatile store (a queue entry).
    pub fn write_volatile<T: Copy>(&mut self, offset: usize, value: T) {
        assert!(offset + std::mem::size_of::<T>() <= self.len_bytes);
        assert!(offset.is_multiple_of(std::mem::align_of::<T>()));
        // SAFETY: in bounds and aligned (checked; the mapping is page-aligned); T is Copy
        // plain data (queue entries, PRP entries).
        unsafe { self.ptr().add(offset).cast::<T>().write_volatile(value) };
    }

    /// Reads a plain-data value at `offset` with a volatile load (the device may write it at
    /// any time).
    pub fn read_volatile<T: Copy>(&self, offset: usize) -> T {
        assert!(offset + std::mem::size_of::<T>() <= self.len_bytes);
        assert!(offset.is_multiple_of(std::mem::align_of::<T>()));
        // SAFETY: in bounds and aligned (checked); every bit pattern is a valid T for the
        // integer-only structures this is used with.
        unsafe { self.ptr().add(offset).cast::<T>().read_volatile() }
    }

    /// Gives up the memory without unmapping or freeing it: for when the device may still
    /// use it (a queue whose deletion failed). Reported by the caller.
    pub fn leak(&mut self) {
        if let Some(map) = self.map.take() {
            std::mem::forget(map);
        }
    }
}

impl Drop for DmaRegion {
    fn drop(&mut self) {
        let Some(map) = self.map.take() else {
            return;
        };
        match sys::unmap_dma(&self.container.fd, self.iova, self.len_bytes as u64) {
            Ok(()) => {
                drop(map);
                self.container
                    .iova
                    .lock()
                    .free(self.iova, self.len_bytes as u64);
            }
            // The device may still reach the memory: keep it (and its IOVA range) forever.
            Err(_) => std::mem::forget(map),
        }
    }
}

/// A fixed set of pages handed to commands and given back on completion.
#[derive(Debug)]
pub struct PagePool {
    free: Vec<u32>,
    pages: u32,
}

impl PagePool {
    pub fn new(pages: u32) -> PagePool {
        PagePool {
            free: (0..pages).rev().collect(),
            pages,
        }
    }

    /// Takes `out.len()` pages, or none if fewer are free. Never allocates.
    pub fn take(&mut self, out: &mut [u32]) -> bool {
        if self.free.len() < out.len() {
            return false;
        }
        let from = self.free.len() - out.len();
        out.copy_from_slice(&self.free[from..]);
        self.free.truncate(from);
        true
    }

    /// Returns pages taken before. Giving back a page twice is a broken invariant.
    pub fn give(&mut self, pages: &[u32]) {
        for &p in pages {
            assert!(p < self.pages, "page {p} is not from this pool");
            debug_assert!(!self.free.contains(&p), "page {p} given back twice");
            self.free.push(p);
        }
        assert!(
            self.free.len() <= self.pages as usize,
            "more pages given back than taken"
        );
    }

    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    pub fn total_pages(&self) -> u32 {
        self.pages
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = PAGE_BYTES as u64;

    #[test]
    fn iova_ranges_are_page_aligned_disjoint_and_reused() {
        let mut a = IovaAllocator::new(IOVA_BASE, IOVA_BASE + 16 * P);
        let x = a.alloc(1).unwrap();
        let y = a.alloc(P + 1).unwrap();
        let z = a.alloc(4 * P).unwrap();
        assert_eq!((x, y, z), (IOVA_BASE, IOVA_BASE + P, IOVA_BASE + 3 * P));
        assert_eq!(a.in_use_bytes(IOVA_BASE), 7 * P);
        a.free(y, P + 1);
        // A one-page request reuses the freed two-page hole, first fit.
        assert_eq!(a.alloc(P), Some(y));
        assert_eq!(a.alloc(P), Some(y + P));
        // Exhaustion is None, not a wrap-around.
        assert_eq!(a.alloc(10 * P), None);
        assert_eq!(a.alloc(9 * P), Some(IOVA_BASE + 7 * P));
        assert_eq!(a.alloc(1), None);
    }

    #[test]
    fn freed_neighbours_merge_and_the_top_shrinks() {
        let mut a = IovaAllocator::new(0, 8 * P);
        let r: Vec<u64> = (0..4).map(|_| a.alloc(P).unwrap()).collect();
        a.free(r[1], P);
        a.free(r[2], P);
        // Two merged pages serve a two-page request.
        assert_eq!(a.alloc(2 * P), Some(r[1]));
        a.free(r[1], 2 * P);
        a.free(r[3], P);
        a.free(r[0], P);
        assert_eq!(a.in_use_bytes(0), 0);
        // Everything merged back into the top: the whole space is one range again.
        assert_eq!(a.alloc(8 * P), Some(0));
    }

    #[test]
    fn window_iovas_cover_only_what_lies_inside() {
        let (base, len, iova) = (0x10_0000usize, 4 * PAGE_BYTES, IOVA_BASE + 8 * P);
        assert_eq!(iova_in(base, len, iova, base, len, true), Some(iova));
        assert_eq!(
            iova_in(base, len, iova, base + PAGE_BYTES, 2 * PAGE_BYTES, true),
            Some(iova + P)
        );
        // Inside but off the page: only for segments.
        assert_eq!(iova_in(base, len, iova, base + 100, 512, true), None);
        assert_eq!(
            iova_in(base, len, iova, base + 100, 512, false),
            Some(iova + 100)
        );
        // Before, past the end, or overflowing: none.
        assert_eq!(iova_in(base, len, iova, base - 1, 2, false), None);
        assert_eq!(iova_in(base, len, iova, base + len - 4, 8, false), None);
        assert_eq!(iova_in(base, len, iova, base + 8, usize::MAX, false), None);
    }

    /// A queue pair's registered regions each take an IOVA range of their own, and give it
    /// back when unregistered: the allocator hands the same space to the next region, and
    /// a region larger than what is left is refused, not wrapped.
    #[test]
    fn registered_regions_take_and_give_back_iova_ranges() {
        let mut a = IovaAllocator::new(IOVA_BASE, IOVA_BASE + 64 * P);
        let pool = a.alloc(32 * P).unwrap();
        let r1 = a.alloc(16 * P).unwrap();
        let r2 = a.alloc(8 * P).unwrap();
        assert!(r1 >= pool + 32 * P && r2 >= r1 + 16 * P);
        assert_eq!(a.alloc(16 * P), None, "8 pages left");
        a.free(r1, 16 * P);
        assert_eq!(a.alloc(16 * P), Some(r1));
        a.free(r2, 8 * P);
        a.free(r1, 16 * P);
        assert_eq!(a.in_use_bytes(IOVA_BASE), 32 * P);
    }

    #[test]
    fn page_pool_hands_out_each_page_once() {
        let mut pool = PagePool::new(8);
        let mut a = [0u32; 3];
        let mut b = [0u32; 5];
        assert!(pool.take(&mut a));
        assert!(pool.take(&mut b));
        let mut all: Vec<u32> = a.iter().chain(b.iter()).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        let mut c = [0u32; 1];
        assert!(!pool.take(&mut c), "an empty pool refuses");
        pool.give(&a);
        assert_eq!(pool.free_pages(), 3);
        let mut d = [0u32; 4];
        assert!(!pool.take(&mut d), "all or nothing");
        assert_eq!(pool.free_pages(), 3);
        assert!(pool.take(&mut c));
        assert!(a.contains(&c[0]));
    }

    #[test]
    #[should_panic(expected = "not from this pool")]
    fn page_pool_rejects_foreign_pages() {
        PagePool::new(2).give(&[2]);
    }
}
