//! Idle I/O buffers a reactor keeps for its next requests. Taking one from the pinned pool
//! zeroes it and takes the pool's lock, and a reactor under load takes one or more per
//! request; the cache hands back one of the same length instead.
//!
//! A recycled buffer keeps old bytes, which is safe only because every use overwrites it
//! whole: a write's payload is copied in, and a read's data only goes out when the device
//! filled all of it (a short read is an error). A device that does not write its read
//! buffers (`Controller::reads_fill_buffer` false) must have them zeroed by the caller.

use hypoll_nvme::IoBuf;

/// Bytes of idle buffers kept.
const BUF_CACHE_BYTES_MAX: usize = 8 << 20;
/// Distinct buffer lengths kept.
const BUF_CACHE_SIZES_MAX: usize = 8;

/// Idle pinned buffers, by length, within `BUF_CACHE_BYTES_MAX` bytes and
/// `BUF_CACHE_SIZES_MAX` lengths.
#[derive(Default)]
pub struct BufCache {
    /// (buffer length, idle buffers of that length).
    sizes: Vec<(usize, Vec<IoBuf>)>,
    bytes: usize,
}

impl BufCache {
    /// A buffer of `len_bytes` whose contents the caller overwrites.
    pub fn take(&mut self, len_bytes: usize) -> IoBuf {
        self.debug_assert_bounded();
        if let Some((_, bufs)) = self.sizes.iter_mut().find(|(len, _)| *len == len_bytes) {
            if let Some(buf) = bufs.pop() {
                self.bytes -= len_bytes;
                self.debug_assert_bounded();
                return buf;
            }
        }
        IoBuf::pinned(len_bytes)
    }

    /// Keeps `buf` for reuse, within the cache's bounds; drops it otherwise.
    pub fn give(&mut self, buf: IoBuf) {
        self.debug_assert_bounded();
        let len_bytes = buf.len();
        if !buf.is_pinned() || self.bytes + len_bytes > BUF_CACHE_BYTES_MAX {
            return;
        }
        let i = match self.sizes.iter().position(|(len, _)| *len == len_bytes) {
            Some(i) => i,
            None if self.sizes.len() < BUF_CACHE_SIZES_MAX => {
                self.sizes.push((len_bytes, Vec::new()));
                self.sizes.len() - 1
            }
            None => return,
        };
        self.sizes[i].1.push(buf);
        self.bytes += len_bytes;
        self.debug_assert_bounded();
    }

    /// The cache counts exactly what it holds, within its bounds.
    fn debug_assert_bounded(&self) {
        debug_assert!(self.bytes <= BUF_CACHE_BYTES_MAX);
        debug_assert!(self.sizes.len() <= BUF_CACHE_SIZES_MAX);
        debug_assert_eq!(
            self.bytes,
            self.sizes
                .iter()
                .map(|(len, bufs)| len * bufs.len())
                .sum::<usize>()
        );
    }
}
