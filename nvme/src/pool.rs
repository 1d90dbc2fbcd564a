//! The pinned buffer pool behind [`IoBuf::pinned`](crate::IoBuf::pinned): one anonymous
//! mapping, made on first use and never unmapped, carved into power-of-two chunks of 4 KiB
//! to 1 MiB with a free list per size. Because the region never moves or goes away, a device
//! may register it with the kernel once and trust the registration for the life of the
//! process: io_uring's fixed buffers pin its pages, and a page pinned there is never
//! replaced under the same address.
//!
//! Chunks are never split or merged: a freed chunk waits on its size's list. A mutex guards
//! the lists; taking and giving back cost one uncontended lock, and a reactor keeps its
//! buffers across I/Os, so neither is on the per-I/O path.

use std::ptr::NonNull;
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::config::parse_size_bytes;

/// Smallest chunk (and alignment of every chunk).
const CHUNK_BYTES_MIN: usize = 4096;
/// Largest chunk: bigger buffers come from the heap.
pub const POOL_CHUNK_BYTES_MAX: usize = 1 << 20;
/// Size classes: 4 KiB, 8 KiB, ..., 1 MiB.
const CLASSES: usize = (POOL_CHUNK_BYTES_MAX / CHUNK_BYTES_MIN).trailing_zeros() as usize + 1;
/// Pool size when `HYPOLL_PINNED_POOL` is unset.
const POOL_BYTES_DEFAULT: usize = 32 << 20;
/// Largest pool `HYPOLL_PINNED_POOL` may ask for (io_uring registers at most 1 GiB per
/// buffer).
const POOL_BYTES_MAX: usize = 1 << 30;

struct Pool {
    base: NonNull<u8>,
    len_bytes: usize,
    lists: Mutex<Lists>,
}

struct Lists {
    /// Bytes of the region handed out at least once.
    bump_bytes: usize,
    /// Offsets of free chunks, per size class.
    free: [Vec<usize>; CLASSES],
}

// SAFETY: the region is plain memory owned by the pool for the whole process; the lists
// are behind a mutex, and each chunk is owned by at most one IoBuf at a time.
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

static POOL: OnceLock<Option<Pool>> = OnceLock::new();

fn pool() -> Option<&'static Pool> {
    POOL.get_or_init(|| {
        let len_bytes = match std::env::var("HYPOLL_PINNED_POOL") {
            Ok(text) => match parse_size_bytes(&text) {
                Ok(n) => (n as usize).min(POOL_BYTES_MAX) / CHUNK_BYTES_MIN * CHUNK_BYTES_MIN,
                Err(e) => {
                    tracing::warn!("HYPOLL_PINNED_POOL: {e}; using the default");
                    POOL_BYTES_DEFAULT
                }
            },
            Err(_) => POOL_BYTES_DEFAULT,
        };
        if len_bytes == 0 {
            return None;
        }
        let base = map_region(len_bytes)?;
        Some(Pool {
            base,
            len_bytes,
            lists: Mutex::new(Lists {
                bump_bytes: 0,
                free: std::array::from_fn(|_| Vec::new()),
            }),
        })
    })
    .as_ref()
}

/// Maps `len_bytes` of zeroed anonymous memory, asking for huge pages (fewer pages to pin
/// and fewer to describe to a device). `None` if the kernel refuses.
fn map_region(len_bytes: usize) -> Option<NonNull<u8>> {
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches
    // no existing memory.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len_bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: advice on a mapping we own; failure only means no huge pages.
    unsafe { libc::madvise(addr, len_bytes, libc::MADV_HUGEPAGE) };
    NonNull::new(addr.cast())
}

fn class_of(len_bytes: usize) -> usize {
    let chunks = len_bytes.div_ceil(CHUNK_BYTES_MIN).next_power_of_two();
    chunks.trailing_zeros() as usize
}

/// A zeroed chunk of at least `len_bytes`, or `None` (pool off, exhausted, or too large).
pub(crate) fn take(len_bytes: usize) -> Option<NonNull<u8>> {
    if len_bytes == 0 || len_bytes > POOL_CHUNK_BYTES_MAX {
        return None;
    }
    let pool = pool()?;
    let class = class_of(len_bytes);
    let chunk_bytes = CHUNK_BYTES_MIN << class;
    let (offset, reused) = {
        let mut lists = pool.lists.lock();
        match lists.free[class].pop() {
            Some(offset) => (offset, true),
            None if lists.bump_bytes + chunk_bytes <= pool.len_bytes => {
                lists.bump_bytes += chunk_bytes;
                (lists.bump_bytes - chunk_bytes, false)
            }
            None => return None,
        }
    };
    // SAFETY: offset + chunk_bytes lies inside the region, so the pointer is in bounds.
    let ptr = unsafe { pool.base.add(offset) };
    if reused {
        // SAFETY: the chunk is ours alone (just taken off the free list) and at least
        // len_bytes long.
        unsafe { ptr.as_ptr().write_bytes(0, len_bytes) };
    }
    Some(ptr)
}

/// Returns a chunk that [`take`] handed out for `len_bytes`.
pub(crate) fn give_back(ptr: NonNull<u8>, len_bytes: usize) {
    let pool = pool().expect("a pooled buffer implies a pool");
    let offset = ptr.as_ptr() as usize - pool.base.as_ptr() as usize;
    debug_assert!(offset < pool.len_bytes);
    pool.lists.lock().free[class_of(len_bytes)].push(offset);
}

/// The pool's whole region as (start, length), creating the pool if needed, for a device
/// to register once; `None` when the pool is disabled or could not be mapped. The region
/// stays mapped until the process exits.
pub fn pinned_region() -> Option<(*mut u8, usize)> {
    pool().map(|p| (p.base.as_ptr(), p.len_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_round_up_to_powers_of_two_chunks() {
        assert_eq!(class_of(1), 0);
        assert_eq!(class_of(4096), 0);
        assert_eq!(class_of(4097), 1);
        assert_eq!(class_of(12288), 2);
        assert_eq!(class_of(POOL_CHUNK_BYTES_MAX), CLASSES - 1);
    }
}
