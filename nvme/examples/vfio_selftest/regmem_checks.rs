//! Memory the application owns, registered with a VFIO queue pair: an mmapped memfd mapped
//! for the device at an IOVA of its own, written from and read into with no bounce copy
//! (one buffer and vectored), unregistering refused while a command uses it and allowed
//! after, and the same memory bounced once unregistered.

use std::io::{IoSlice, IoSliceMut};

use hypoll_nvme::{Command, QueuePair, UnregisterError, VfioController};

use crate::{ensure, pattern, reap, Check, SEED};

const PAGE: usize = 4096;

/// An mmapped memfd of `pages` pages, unmapped on drop.
struct Memfd {
    ptr: *mut u8,
    len_bytes: usize,
}

impl Memfd {
    fn new(pages: usize) -> Result<Memfd, String> {
        let len_bytes = pages * PAGE;
        // SAFETY: memfd_create reads a NUL-terminated name; it touches no other memory.
        let fd = unsafe { libc::memfd_create(c"hypoll-regmem".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is the memfd just created, owned here.
        let sized = unsafe { libc::ftruncate(fd, len_bytes as libc::off_t) };
        // SAFETY: a new shared mapping of our own memfd at an address the kernel chooses.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        // SAFETY: the mapping (if any) holds the file; the descriptor is ours to close.
        unsafe { libc::close(fd) };
        if sized != 0 || ptr == libc::MAP_FAILED {
            return Err(format!(
                "memfd mapping: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Memfd {
            ptr: ptr.cast(),
            len_bytes,
        })
    }

    /// `len` bytes at page `page`. Callers take ranges no other live reference covers,
    /// and only while no command uses them.
    #[allow(clippy::mut_from_ref)]
    fn pages(&self, page: usize, len: usize) -> &mut [u8] {
        assert!(page * PAGE + len <= self.len_bytes);
        // SAFETY: inside the mapping; see above for exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(page * PAGE), len) }
    }
}

impl Drop for Memfd {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unregistered (or its queue pair dropped) by now.
        unsafe { libc::munmap(self.ptr.cast(), self.len_bytes) };
    }
}

pub fn registered_memory(ctrl: &VfioController) -> Check {
    let mem = Memfd::new(64)?;
    let mut qp = ctrl.queue_pair(4).map_err(|e| e.to_string())?;
    let lba = qp.namespace().lba_size_bytes as usize;
    // SAFETY: `mem` outlives the queue pair (declared before it, so dropped after).
    let region =
        unsafe { qp.register_memory(mem.ptr, mem.len_bytes) }.map_err(|e| e.to_string())?;

    // One buffer of 8 pages, out of the region and back into another part of it.
    let len = 8 * PAGE;
    let nlb = (len / lba) as u32;
    mem.pages(0, len).copy_from_slice(&pattern(SEED + 90, len));
    let before = qp.zero_copy_ios();
    // SAFETY: the region stays mapped and untouched until the completion is reaped.
    unsafe { qp.submit(&Command::write(5000, nlb, mem.pages(0, len)), 1) }
        .map_err(|e| e.to_string())?;
    let c = reap(&mut qp, 1)?;
    ensure(c[0].status.is_success(), || format!("write: {c:?}"))?;
    // SAFETY: as above.
    unsafe { qp.submit(&Command::read(5000, nlb, mem.pages(16, len)), 2) }
        .map_err(|e| e.to_string())?;
    let c = reap(&mut qp, 1)?;
    ensure(c[0].status.is_success(), || format!("read: {c:?}"))?;
    ensure(mem.pages(16, len) == mem.pages(0, len), || {
        "one buffer: bytes read back differ".into()
    })?;

    // Vectored: two whole pages from scattered places, gathered back elsewhere.
    mem.pages(32, PAGE)
        .copy_from_slice(&pattern(SEED + 91, PAGE));
    mem.pages(40, PAGE)
        .copy_from_slice(&pattern(SEED + 92, PAGE));
    let segs = [
        IoSlice::new(mem.pages(32, PAGE)),
        IoSlice::new(mem.pages(40, PAGE)),
    ];
    let vnlb = (2 * PAGE / lba) as u32;
    // SAFETY: as above.
    unsafe { qp.submit(&Command::writev(5100, vnlb, &segs), 3) }.map_err(|e| e.to_string())?;
    let c = reap(&mut qp, 1)?;
    ensure(c[0].status.is_success(), || format!("writev: {c:?}"))?;
    let mut segs = [
        IoSliceMut::new(mem.pages(48, PAGE)),
        IoSliceMut::new(mem.pages(56, PAGE)),
    ];
    // SAFETY: as above.
    unsafe { qp.submit(&Command::readv(5100, vnlb, &mut segs), 4) }.map_err(|e| e.to_string())?;
    let c = reap(&mut qp, 1)?;
    ensure(c[0].status.is_success(), || format!("readv: {c:?}"))?;
    ensure(
        mem.pages(48, PAGE) == mem.pages(32, PAGE) && mem.pages(56, PAGE) == mem.pages(40, PAGE),
        || "vectored: bytes read back differ".into(),
    )?;
    ensure(qp.zero_copy_ios() == before + 4, || {
        format!(
            "{} of 4 I/Os into registered memory went without a bounce copy",
            qp.zero_copy_ios() - before
        )
    })?;

    // Unregistering with a command outstanding is refused; after its completion, allowed.
    // SAFETY: as above.
    unsafe { qp.submit(&Command::write(5200, nlb, mem.pages(0, len)), 5) }
        .map_err(|e| e.to_string())?;
    let refused = qp.unregister_memory(region);
    ensure(
        refused == Err(UnregisterError::InUse { commands: 1 }),
        || format!("unregistering in use: {refused:?}"),
    )?;
    let c = reap(&mut qp, 1)?;
    ensure(c[0].status.is_success(), || format!("write: {c:?}"))?;
    qp.unregister_memory(region)
        .map_err(|e| format!("unregistering after completion: {e}"))?;

    // Unregistered, the same memory bounces, and the data is still right.
    let before = qp.zero_copy_ios();
    // SAFETY: as above.
    unsafe { qp.submit(&Command::read(5200, nlb, mem.pages(16, len)), 6) }
        .map_err(|e| e.to_string())?;
    let c = reap(&mut qp, 1)?;
    ensure(c[0].status.is_success(), || format!("read: {c:?}"))?;
    ensure(qp.zero_copy_ios() == before, || {
        "unregistered memory went zero-copy".into()
    })?;
    ensure(mem.pages(16, len) == mem.pages(0, len), || {
        "after unregistering: bytes read back differ".into()
    })
}
