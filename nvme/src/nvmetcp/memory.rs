//! A command's data in the caller's memory, as `QueuePair::submit` handed it over: one
//! buffer or a list of segments, reached by raw pointer until the command completes. The
//! queue pair copies a read's received data into it and a write's data out of it; these
//! are the only places that touch it.

use crate::qpair::{Command, Segment};
use crate::spec::Opcode;

/// Where one command's data lies.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Place {
    /// No data in the caller's memory (flush, write zeroes; a deallocate's range lies in
    /// its slot).
    None,
    Buf {
        ptr: *mut u8,
        len: usize,
    },
    /// The command's segments, copied into its slot's list.
    Segments,
}

impl Place {
    /// Where `cmd`'s data of `bytes` lies; a vectored command's segments are copied into
    /// `segs` (cleared first; its capacity holds `SEGMENTS_MAX`, so nothing allocates).
    pub(crate) fn of(cmd: &Command<'_>, bytes: usize, segs: &mut Vec<Segment>) -> Place {
        if !matches!(cmd.opcode(), Opcode::Read | Opcode::Write) {
            return Place::None;
        }
        segs.clear();
        match cmd.segments() {
            Some(s) => {
                debug_assert!(s.len() <= segs.capacity());
                segs.extend_from_slice(s);
                Place::Segments
            }
            None => {
                debug_assert!(cmd.buf_len_bytes() >= bytes, "checked by Command::check");
                Place::Buf {
                    ptr: cmd.buf_ptr(),
                    len: bytes,
                }
            }
        }
    }
}

/// Calls `each` with the pieces of memory that hold bytes `offset..offset + len` of the
/// command's data, in order: a pointer and a length each. Returns false if the range does
/// not lie within the data.
fn pieces(
    place: Place,
    segs: &[Segment],
    offset: usize,
    len: usize,
    mut each: impl FnMut(*mut u8, usize),
) -> bool {
    let Some(end) = offset.checked_add(len) else {
        return false;
    };
    match place {
        Place::None => len == 0,
        Place::Buf { ptr, len: total } => {
            if end > total {
                return false;
            }
            if len > 0 {
                // Within the buffer: `end <= total`.
                each(ptr.wrapping_add(offset), len);
            }
            true
        }
        Place::Segments => {
            let mut at = 0usize;
            for s in segs {
                let (lo, hi) = (at, at + s.len_bytes());
                at = hi;
                if hi <= offset || lo >= end {
                    continue;
                }
                let from = offset.max(lo);
                let to = end.min(hi);
                each(s.ptr().wrapping_add(from - lo), to - from);
            }
            at >= end
        }
    }
}

/// Copies `src` into the command's data at byte `offset`. Returns false (copying nothing)
/// if it would not fit.
///
/// # Safety
/// The command's memory must still be the caller's loan to the queue pair: its command
/// submitted (so `submit`'s contract holds: valid, and not touched by anyone else) and not
/// yet completed.
pub(crate) unsafe fn copy_in(place: Place, segs: &[Segment], offset: usize, src: &[u8]) -> bool {
    if !pieces(place, segs, offset, src.len(), |_, _| {}) {
        return false;
    }
    let mut done = 0;
    pieces(place, segs, offset, src.len(), |ptr, n| {
        // SAFETY: `ptr..ptr + n` lies within the command's buffer or one of its segments
        // (`pieces` keeps to them), which the caller guarantees we may write; `src` is our
        // own input buffer, which cannot overlap memory lent to a device.
        unsafe { std::ptr::copy_nonoverlapping(src[done..].as_ptr(), ptr, n) };
        done += n;
    });
    debug_assert_eq!(done, src.len());
    true
}

/// Appends bytes `offset..offset + len` of the command's data to `out`. Returns false
/// (appending nothing) if the range does not lie within the data.
///
/// # Safety
/// As [`copy_in`]: the command is submitted and not yet completed.
pub(crate) unsafe fn copy_out(
    place: Place,
    segs: &[Segment],
    offset: usize,
    len: usize,
    out: &mut Vec<u8>,
) -> bool {
    if !pieces(place, segs, offset, len, |_, _| {}) {
        return false;
    }
    out.reserve(len);
    pieces(place, segs, offset, len, |ptr, n| {
        // SAFETY: `ptr..ptr + n` lies within memory the caller lent for this command
        // (see `copy_in`), valid for reads while it is outstanding.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(ptr, n) });
    });
    true
}

#[cfg(test)]
mod tests {
    use std::io::IoSliceMut;

    use super::*;

    #[test]
    fn data_lands_across_segments_at_its_offset_and_comes_back() {
        let (mut a, mut b) = ([0u8; 100], [0u8; 156]);
        let data: Vec<u8> = (0..256).map(|i| i as u8).collect();
        {
            let mut segs = [IoSliceMut::new(&mut a[..]), IoSliceMut::new(&mut b[..])];
            let cmd = Command::readv(0, 1, &mut segs);
            let mut list = Vec::with_capacity(crate::qpair::SEGMENTS_MAX);
            let place = Place::of(&cmd, 256, &mut list);
            // SAFETY: the arrays outlive the calls and nothing else touches them meanwhile.
            unsafe {
                assert!(copy_in(place, &list, 90, &data[90..120]));
                assert!(!copy_in(place, &list, 250, &data[..10]), "past the end");
                let mut out = Vec::new();
                assert!(copy_out(place, &list, 95, 10, &mut out));
                assert_eq!(out, data[95..105]);
            }
        }
        assert_eq!(a[90..100], data[90..100]);
        assert_eq!(b[..20], data[100..120]);
        assert!(a[..90].iter().chain(&b[20..]).all(|&x| x == 0));
    }
}
