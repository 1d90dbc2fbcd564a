//! `IoBuf`: an owned, zero-initialised data buffer aligned for devices (4 KiB, enough for
//! NVMe's dword rule and for O_DIRECT on 4 KiB-sector devices).
//!
//! A buffer comes from the heap ([`IoBuf::zeroed`]) or from the process's pinned pool
//! ([`IoBuf::pinned`]): one region mapped once and never unmapped, so a device may register
//! it with the kernel once (io_uring fixed buffers) and use it for every I/O after, as SPDK
//! does with `spdk_dma_malloc` memory. The pool is `HYPOLL_PINNED_POOL` bytes (default
//! 32M, `0` disables it); when it is exhausted, `pinned` falls back to the heap.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

pub use crate::pool::{pinned_region, POOL_CHUNK_BYTES_MAX};

/// Alignment of every [`IoBuf`].
pub const IO_BUF_ALIGN_BYTES: usize = 4096;

/// An owned byte buffer aligned to [`IO_BUF_ALIGN_BYTES`].
#[repr(C)]
pub struct IoBuf {
    ptr: NonNull<u8>,
    len_bytes: usize,
    /// Taken from the pinned pool (and given back to it on drop), or from the heap.
    origin: Origin,
}

/// Where a buffer's memory came from. A word wide, not a `bool`: a buffer is then three
/// whole words with no padding, and the enums it travels in (`Option<IoBuf>`, a read's
/// `Result`) keep their tag in the third word's spare values. Every move of such a value
/// copies whole words, so a load of one never spans several narrower stores, which the
/// CPU cannot forward: an I/O path moves its buffer several times in quick succession,
/// and a byte-wide flag made those moves stall.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
enum Origin {
    Heap,
    Pool,
}

// No padding: the fields fill the buffer's three words (see `Origin`).
const _: () = assert!(
    std::mem::size_of::<IoBuf>()
        == std::mem::size_of::<NonNull<u8>>()
            + std::mem::size_of::<usize>()
            + std::mem::size_of::<Origin>()
);
// And the enums a buffer travels in take their tag from `Origin`'s spare values.
const _: () = assert!(std::mem::size_of::<Option<IoBuf>>() == std::mem::size_of::<IoBuf>());

// SAFETY: IoBuf owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for IoBuf {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for IoBuf {}

impl IoBuf {
    /// A zeroed buffer of `len_bytes` (0 is allowed and allocates nothing).
    pub fn zeroed(len_bytes: usize) -> IoBuf {
        if len_bytes == 0 {
            // A dangling pointer with the right alignment: never dereferenced for len 0.
            let ptr = NonNull::new(IO_BUF_ALIGN_BYTES as *mut u8).expect("non-null");
            return IoBuf {
                ptr,
                len_bytes,
                origin: Origin::Heap,
            };
        }
        let layout = Self::layout(len_bytes);
        // SAFETY: layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        IoBuf {
            ptr,
            len_bytes,
            origin: Origin::Heap,
        }
    }

    /// A zeroed buffer from the pinned pool, which devices register once (see the module
    /// docs); from the heap when the pool is disabled, exhausted, or `len_bytes` is over
    /// [`POOL_CHUNK_BYTES_MAX`].
    pub fn pinned(len_bytes: usize) -> IoBuf {
        match crate::pool::take(len_bytes) {
            Some(ptr) => IoBuf {
                ptr,
                len_bytes,
                origin: Origin::Pool,
            },
            None => IoBuf::zeroed(len_bytes),
        }
    }

    /// Whether this buffer lives in the pinned pool.
    pub fn is_pinned(&self) -> bool {
        self.origin == Origin::Pool
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> IoBuf {
        let mut buf = IoBuf::zeroed(data.len());
        buf.copy_from_slice(data);
        buf
    }

    fn layout(len_bytes: usize) -> Layout {
        Layout::from_size_align(len_bytes, IO_BUF_ALIGN_BYTES).expect("buffer size overflows")
    }
}

impl Deref for IoBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len_bytes initialised bytes (zeroed at allocation) and
        // aligned; for len 0 a dangling aligned pointer is allowed.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len_bytes) }
    }
}

impl DerefMut for IoBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len_bytes) }
    }
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        if self.origin == Origin::Pool {
            crate::pool::give_back(self.ptr, self.len_bytes);
        } else if self.len_bytes != 0 {
            // SAFETY: allocated in `zeroed` with exactly this layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len_bytes)) };
        }
    }
}

impl std::fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IoBuf({} bytes at {:p})", self.len_bytes, self.ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_writable() {
        for len in [0, 1, 512, 4096, 65536 + 3] {
            let mut buf = IoBuf::zeroed(len);
            assert_eq!(buf.len(), len);
            assert_eq!(buf.as_ptr() as usize % IO_BUF_ALIGN_BYTES, 0);
            assert!(buf.iter().all(|&b| b == 0));
            buf.fill(0xa5);
            assert!(buf.iter().all(|&b| b == 0xa5));
        }
        assert_eq!(&*IoBuf::from_slice(b"hypoll"), b"hypoll");
    }

    #[test]
    fn pinned_buffers_come_from_the_registered_region_and_are_zeroed_on_reuse() {
        let (base, len) = pinned_region().expect("the pool is on by default");
        let inside = |b: &IoBuf| {
            let at = b.as_ptr() as usize;
            at >= base as usize && at + b.len() <= base as usize + len
        };
        let mut a = IoBuf::pinned(8192);
        assert!(a.is_pinned() && inside(&a));
        assert_eq!(a.as_ptr() as usize % IO_BUF_ALIGN_BYTES, 0);
        a.fill(0xff);
        let at = a.as_ptr();
        drop(a);
        // The chunk is reused for the same size class, and handed out zeroed again.
        let b = IoBuf::pinned(5000);
        assert_eq!(b.as_ptr(), at);
        assert!(b.iter().all(|&x| x == 0));
        // Too large for the pool: the heap.
        let big = IoBuf::pinned(POOL_CHUNK_BYTES_MAX + 1);
        assert!(!big.is_pinned() && !inside(&big));
    }
}
