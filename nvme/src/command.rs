//! One I/O command as a host builds it: its opcode, blocks and data (one buffer, or up to
//! [`SEGMENTS_MAX`] segments), and the checks every device makes before a command reaches
//! it. Building a command is safe; handing its memory to a device is
//! [`QueuePair::submit`], which is not.

use std::io::{IoSlice, IoSliceMut};
use std::marker::PhantomData;

#[cfg(doc)]
use crate::qpair::QueuePair;
use crate::qpair::{SubmitError, BUFFER_ALIGN_BYTES};
use crate::spec::Opcode;

/// Most segments one vectored command ([`Command::readv`], [`Command::writev`]) carries.
///
/// 128 is what Linux gives a request queue by default (`BLK_MAX_SEGMENTS`) and what its NVMe
/// PCIe driver takes per command (`NVME_MAX_SEGS`): a request a Linux initiator sends over
/// virtio-blk, NBD or NVMe/TCP, split at its guest's or socket buffer's page boundaries,
/// fits in one command. It covers the largest transfer a device here accepts (128 KiB MDTS
/// in 4 KiB pages is 32 segments, 33 when the first starts inside a page) with room for
/// sub-page pieces such as a group commit's staged records. Each queue pair reserves this
/// many segments per slot, so the bound is also a memory bound.
pub const SEGMENTS_MAX: usize = 128;

/// Why [`Command::check`] refuses a command of zero blocks.
pub const ZERO_NLB: &str = "zero-length transfer (nlb = 0)";
/// Why [`Command::check`] refuses a command of more blocks than NLB can encode.
pub const NLB_TOO_LARGE: &str = "nlb over 65536 cannot be encoded in one command";

/// One I/O command, as a host builds it. Building a command is safe; it borrows its data
/// buffer for `'buf` so the borrow checker sees the buffer in use while the command is
/// built. Handing the buffer to a device outlives that borrow, which is why
/// [`QueuePair::submit`] is `unsafe`.
///
/// The fields are private and only the constructors set the opcode: the direction of the
/// transfer must match how the buffer was borrowed. A `write` borrows `&[u8]`; were its
/// opcode changeable to `Read`, the device would write through a pointer taken from a
/// shared reference while the caller met every rule of `submit`:
///
/// ```compile_fail,E0616
/// let data = [0u8; 512];
/// let mut cmd = hypoll_nvme::Command::write(0, 1, &data);
/// cmd.opcode = hypoll_nvme::Opcode::Read; // error: field `opcode` is private
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Command<'buf> {
    opcode: Opcode,
    /// First logical block.
    slba: u64,
    /// Number of logical blocks, counted from 1 (0 is an invalid command).
    nlb: u32,
    /// Force Unit Access (writes reach non-volatile media before completing).
    fua: bool,
    /// Write Zeroes may deallocate the blocks (NVMe's DEAC).
    deallocate: bool,
    /// The one data buffer; null for commands without data and for vectored ones.
    buf_ptr: *mut u8,
    buf_len_bytes: usize,
    /// A vectored command's segments (borrowed for `'buf`); null for every other command.
    segs: *const Segment,
    segs_count: usize,
    _buf: PhantomData<&'buf mut [u8]>,
}

/// One piece of a vectored command's data: an address and a length, laid out as POSIX's
/// `struct iovec` (and so as [`IoSlice`] and [`IoSliceMut`], which std guarantees to be
/// iovec-compatible on Unix). Devices read a command's segments during
/// [`QueuePair::submit`] only and keep their own copy: the list itself may go once `submit`
/// returns, the memory it points at may not (see `submit`'s contract).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    ptr: *mut u8,
    len_bytes: usize,
}

const _: () = assert!(
    std::mem::size_of::<Segment>() == std::mem::size_of::<IoSlice<'_>>()
        && std::mem::align_of::<Segment>() == std::mem::align_of::<IoSlice<'_>>()
        && std::mem::size_of::<Segment>() == std::mem::size_of::<IoSliceMut<'_>>()
        && std::mem::size_of::<Segment>() == std::mem::size_of::<libc::iovec>()
        && std::mem::align_of::<Segment>() == std::mem::align_of::<libc::iovec>()
);

impl Segment {
    /// No segment: what a device's per-slot copy holds before use.
    pub const EMPTY: Segment = Segment {
        ptr: std::ptr::null_mut(),
        len_bytes: 0,
    };

    /// A segment of `len_bytes` at `ptr`, for a device's own bookkeeping and its tests;
    /// commands take their segments from [`IoSlice`]s and [`IoSliceMut`]s.
    #[cfg(test)]
    pub(crate) fn from_raw(ptr: *mut u8, len_bytes: usize) -> Segment {
        Segment { ptr, len_bytes }
    }

    /// The segment's first byte.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// The segment as the kernel's `iovec`.
    pub fn to_iovec(self) -> libc::iovec {
        libc::iovec {
            iov_base: self.ptr.cast(),
            iov_len: self.len_bytes,
        }
    }
}

impl<'buf> Command<'buf> {
    fn new(opcode: Opcode, slba: u64, nlb: u32, buf_ptr: *mut u8, buf_len_bytes: usize) -> Self {
        Command {
            opcode,
            slba,
            nlb,
            fua: false,
            deallocate: false,
            buf_ptr,
            buf_len_bytes,
            segs: std::ptr::null(),
            segs_count: 0,
            _buf: PhantomData,
        }
    }

    fn vectored(opcode: Opcode, slba: u64, nlb: u32, segs: *const Segment, count: usize) -> Self {
        Command {
            segs,
            segs_count: count,
            ..Self::new(opcode, slba, nlb, std::ptr::null_mut(), 0)
        }
    }

    /// Reads `nlb` blocks starting at `slba` into `buf`.
    pub fn read(slba: u64, nlb: u32, buf: &'buf mut [u8]) -> Self {
        Self::new(Opcode::Read, slba, nlb, buf.as_mut_ptr(), buf.len())
    }

    /// Writes `nlb` blocks starting at `slba` from `buf`.
    pub fn write(slba: u64, nlb: u32, buf: &'buf [u8]) -> Self {
        // The device only reads a write's buffer; the pointer is stored as `*mut` so one
        // field serves both directions.
        Self::new(Opcode::Write, slba, nlb, buf.as_ptr().cast_mut(), buf.len())
    }

    /// Reads `nlb` blocks starting at `slba` into `segs`, filled in order: the first bytes
    /// into the first segment. A segment may end inside a block; the segments together must
    /// hold exactly `nlb` blocks, and there may be at most [`SEGMENTS_MAX`] of them. What
    /// else a device asks of them is checked at submission (see [`SegmentError`]).
    ///
    /// The command borrows the segment list, and through it every segment, for as long as
    /// it lives, as [`Command::read`] borrows its buffer:
    ///
    /// ```compile_fail,E0506
    /// use std::io::IoSliceMut;
    /// let (mut a, mut b) = ([0u8; 256], [0u8; 256]);
    /// let mut segs = [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)];
    /// let cmd = hypoll_nvme::Command::readv(0, 1, &mut segs);
    /// b[0] = 1; // error: `b` is borrowed by the command
    /// let _ = cmd.nlb();
    /// ```
    pub fn readv<'data: 'buf>(slba: u64, nlb: u32, segs: &'buf mut [IoSliceMut<'data>]) -> Self {
        // IoSliceMut is iovec-compatible (std guarantees it on Unix), as Segment is (the
        // layout assertion above); taking the list `&mut` keeps it, and so its memory,
        // exclusively borrowed for as long as the command lives.
        Self::vectored(Opcode::Read, slba, nlb, segs.as_ptr().cast(), segs.len())
    }

    /// Writes `nlb` blocks starting at `slba` from `segs`, taken in order. Segments follow
    /// the rules of [`Command::readv`].
    pub fn writev<'data: 'buf>(slba: u64, nlb: u32, segs: &'buf [IoSlice<'data>]) -> Self {
        Self::vectored(Opcode::Write, slba, nlb, segs.as_ptr().cast(), segs.len())
    }

    /// Makes every completed write durable.
    pub fn flush() -> Self {
        Self::new(Opcode::Flush, 0, 0, std::ptr::null_mut(), 0)
    }

    /// Sets `nlb` blocks starting at `slba` to zero, without a data buffer. The blocks stay
    /// allocated unless [`Command::with_deallocate`] allows otherwise.
    pub fn write_zeroes(slba: u64, nlb: u32) -> Self {
        Self::new(Opcode::WriteZeroes, slba, nlb, std::ptr::null_mut(), 0)
    }

    /// Deallocates (trims) `nlb` blocks starting at `slba`: a Dataset Management command with
    /// one range and the Deallocate attribute. Deallocated blocks read back as zeroes.
    pub fn deallocate(slba: u64, nlb: u32) -> Self {
        Self::new(
            Opcode::DatasetManagement,
            slba,
            nlb,
            std::ptr::null_mut(),
            0,
        )
    }

    /// Sets Force Unit Access: the command completes only once its data is on non-volatile
    /// media.
    pub fn with_fua(mut self, fua: bool) -> Self {
        self.fua = fua;
        self
    }

    /// For Write Zeroes: allows the device to deallocate the zeroed blocks (NVMe's DEAC,
    /// Linux's Write Zeroes without `REQ_NOUNMAP`), which reads the same and may be faster.
    /// Without it (NBD's `NO_HOLE`) they stay allocated. Other commands ignore it.
    pub fn with_deallocate(mut self, deallocate: bool) -> Self {
        self.deallocate = deallocate;
        self
    }

    pub fn opcode(&self) -> Opcode {
        self.opcode
    }

    /// First logical block (0 for Flush).
    pub fn slba(&self) -> u64 {
        self.slba
    }

    /// Number of logical blocks, counted from 1 (0 for Flush).
    pub fn nlb(&self) -> u32 {
        self.nlb
    }

    /// Whether Force Unit Access is set.
    pub fn fua(&self) -> bool {
        self.fua
    }

    /// Whether a Write Zeroes may deallocate its blocks.
    pub fn may_deallocate(&self) -> bool {
        self.deallocate
    }

    /// The data buffer handed to the device: null for commands without data and for
    /// vectored commands (see [`Command::segments`]).
    pub fn buf_ptr(&self) -> *mut u8 {
        self.buf_ptr
    }

    pub fn buf_len_bytes(&self) -> usize {
        self.buf_len_bytes
    }

    /// A vectored command's segments ([`Command::readv`], [`Command::writev`]); `None` for
    /// every other command, whose data (if any) is [`Command::buf_ptr`].
    #[inline]
    pub fn segments(&self) -> Option<&[Segment]> {
        if self.segs.is_null() {
            return None;
        }
        // SAFETY: `segs` and `segs_count` come from a slice of iovec-compatible entries
        // borrowed for `'buf`, which outlives `&self`.
        Some(unsafe { std::slice::from_raw_parts(self.segs, self.segs_count) })
    }

    /// Checks what the host side can check before a command reaches a device: a length the
    /// NVMe encoding can carry and a buffer that is aligned and large enough. Range and
    /// transfer-size checks belong to the device, which answers them with a status.
    pub fn check(&self, lba_size_bytes: u32) -> Result<(), SubmitError> {
        let needs_range = !matches!(self.opcode, Opcode::Flush);
        if needs_range && self.nlb == 0 {
            return Err(SubmitError::InvalidField(ZERO_NLB));
        }
        let encodable = match self.opcode {
            Opcode::Flush | Opcode::DatasetManagement => true,
            _ => self.nlb <= crate::spec::NLB_MAX,
        };
        if !encodable {
            return Err(SubmitError::InvalidField(NLB_TOO_LARGE));
        }
        if matches!(self.opcode, Opcode::Read | Opcode::Write) {
            debug_assert!(lba_size_bytes > 0, "a namespace has blocks of some size");
            let need_bytes = u64::from(self.nlb) * u64::from(lba_size_bytes);
            if (self.buf_len_bytes as u64) < need_bytes {
                // A vectored command has no buffer of its own (length 0, and nlb >= 1 was
                // checked above), so it always lands here: the single-buffer path pays no
                // test for segments.
                if let Some(segs) = self.segments() {
                    return check_segments(segs, need_bytes).map_err(SubmitError::Segment);
                }
                return Err(SubmitError::BufferTooSmall {
                    need_bytes,
                    have_bytes: self.buf_len_bytes as u64,
                });
            }
            let addr = self.buf_ptr as usize;
            if !addr.is_multiple_of(BUFFER_ALIGN_BYTES) {
                return Err(SubmitError::MisalignedBuffer {
                    addr,
                    align_bytes: BUFFER_ALIGN_BYTES,
                });
            }
        }
        Ok(())
    }
}

/// The rules every device applies to a vectored command's segments: at most
/// [`SEGMENTS_MAX`], none empty, each starting [`BUFFER_ALIGN_BYTES`]-aligned (NVMe's dword
/// rule for data pointers, as for a single buffer), `need_bytes` in all.
#[cold]
#[inline(never)]
fn check_segments(segs: &[Segment], need_bytes: u64) -> Result<(), SegmentError> {
    if segs.len() > SEGMENTS_MAX {
        return Err(SegmentError::TooMany {
            count: segs.len(),
            max: SEGMENTS_MAX,
        });
    }
    let mut have_bytes = 0u64;
    for (index, seg) in segs.iter().enumerate() {
        if seg.len_bytes == 0 {
            return Err(SegmentError::Empty { index });
        }
        let addr = seg.ptr as usize;
        if !addr.is_multiple_of(BUFFER_ALIGN_BYTES) {
            return Err(SegmentError::Misaligned {
                index,
                addr,
                align_bytes: BUFFER_ALIGN_BYTES,
            });
        }
        have_bytes = have_bytes.saturating_add(seg.len_bytes as u64);
    }
    if have_bytes != need_bytes {
        return Err(SegmentError::LengthMismatch {
            need_bytes,
            have_bytes,
        });
    }
    Ok(())
}

/// Why a vectored command's segments were refused at submission.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SegmentError {
    #[error("{count} segments: one command carries at most {max}")]
    TooMany { count: usize, max: usize },
    #[error("segment {index} is empty")]
    Empty { index: usize },
    #[error("segment {index} at {addr:#x} is not aligned to {align_bytes} bytes")]
    Misaligned {
        index: usize,
        addr: usize,
        align_bytes: usize,
    },
    #[error("the segments hold {have_bytes} bytes, the command moves {need_bytes}")]
    LengthMismatch { need_bytes: u64, have_bytes: u64 },
    /// O_DIRECT (a `uring` device with `direct=1`) moves whole blocks between the device and
    /// memory: each segment's address and length must be multiples of the block size.
    #[error(
        "segment {index} ({len_bytes} bytes at {addr:#x}) is not block-aligned: O_DIRECT \
         needs address and length multiples of {block_bytes} bytes"
    )]
    NotBlockAligned {
        index: usize,
        addr: usize,
        len_bytes: usize,
        block_bytes: u32,
    },
    /// NVMe PRP lists name whole pages after the first: every segment but the first must
    /// start on a page boundary, every segment but the last must end on one.
    #[error(
        "segment {index} at {addr:#x} starts inside a {page_bytes}-byte page: only the first \
         segment may (NVMe PRP rules)"
    )]
    StartsInsidePage {
        index: usize,
        addr: usize,
        page_bytes: usize,
    },
    #[error(
        "segment {index} ends at {end:#x}, inside a {page_bytes}-byte page: only the last \
         segment may (NVMe PRP rules)"
    )]
    EndsInsidePage {
        index: usize,
        end: usize,
        page_bytes: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_side_checks_catch_what_cannot_be_encoded() {
        let mut buf = vec![0u8; 8192];
        assert_eq!(
            Command::read(0, 0, &mut buf).check(512),
            Err(SubmitError::InvalidField("zero-length transfer (nlb = 0)"))
        );
        assert!(matches!(
            Command::write_zeroes(0, crate::spec::NLB_MAX + 1).check(512),
            Err(SubmitError::InvalidField(_))
        ));
        assert_eq!(
            Command::read(0, 3, &mut buf).check(4096),
            Err(SubmitError::BufferTooSmall {
                need_bytes: 12288,
                have_bytes: 8192
            })
        );
        let misaligned = &mut buf[1..4098];
        assert!(matches!(
            Command::read(0, 1, misaligned).check(4096),
            Err(SubmitError::MisalignedBuffer { align_bytes: 4, .. })
        ));
        assert_eq!(Command::flush().check(512), Ok(()));
        assert_eq!(Command::read(0, 2, &mut buf).check(4096), Ok(()));
    }

    #[test]
    fn vectored_commands_carry_their_segments_and_single_ones_none() {
        let mut buf = crate::IoBuf::zeroed(4096);
        let (a, b) = buf.split_at_mut(100);
        let (a_ptr, b_ptr) = (a.as_mut_ptr(), b.as_mut_ptr());
        let mut segs = [IoSliceMut::new(a), IoSliceMut::new(&mut b[..924])];
        let cmd = Command::readv(3, 2, &mut segs);
        assert_eq!((cmd.opcode(), cmd.slba(), cmd.nlb()), (Opcode::Read, 3, 2));
        assert!(cmd.buf_ptr().is_null());
        let got = cmd.segments().expect("vectored");
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].ptr(), got[0].len_bytes()), (a_ptr, 100));
        assert_eq!((got[1].ptr(), got[1].len_bytes()), (b_ptr, 924));
        assert_eq!(cmd.check(512), Ok(()));
        assert_eq!(
            cmd.check(4096),
            Err(SubmitError::Segment(SegmentError::LengthMismatch {
                need_bytes: 8192,
                have_bytes: 1024
            }))
        );
        let mut one = [0u8; 512];
        assert!(Command::read(0, 1, &mut one).segments().is_none());
        assert!(Command::flush().segments().is_none());
    }
}
