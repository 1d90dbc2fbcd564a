//! An NVMe command as an io_uring operation, and an io_uring result as an NVMe status. The
//! queue pair keeps one [`InFlight`] per command in the kernel, whose slot index is the
//! operation's user data.

use io_uring::{opcode, squeue, types};

use crate::qpair::Command;
use crate::spec::{Opcode, Status};

/// A command in the kernel's hands: what its completion must be checked against.
#[derive(Clone, Copy, Debug)]
pub(super) struct InFlight {
    pub(super) tag: u64,
    pub(super) opcode: Opcode,
    /// Bytes the command covers; a read or write that moves fewer is an error.
    pub(super) len_bytes: u64,
    pub(super) offset_bytes: u64,
    /// For Write Zeroes: whether the blocks may be deallocated, and which `fallocate` is in
    /// the kernel.
    pub(super) may_deallocate: bool,
    pub(super) zeroing: Zeroing,
    /// On the side ring (see [`SideRing`](super::queue::SideRing)).
    pub(super) side: bool,
}

/// How a Write Zeroes is carried out. Zero-range first; where the file system has none
/// (tmpfs), punch-hole, which zeroes by deallocating, and then, unless the command allows
/// deallocation, a plain `fallocate` to allocate the blocks again (as zeroes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Zeroing {
    ZeroRange,
    PunchHole,
    Allocate,
}

/// The operation for a Read or a Write of the one buffer at `buf_ptr`, on the fixed file
/// `file`, with `slot` as its user data: through the fixed buffer `fixed` names when the
/// buffer lies in a registered one (the pinned pool is 0, an application's regions follow);
/// a Write with FUA is written with `RWF_DSYNC`.
pub(super) fn data_entry(
    cmd: &Command<'_>,
    buf_ptr: *mut u8,
    flight: &InFlight,
    slot: u32,
    fixed: Option<u16>,
    file: types::Fixed,
) -> squeue::Entry {
    let len_bytes = flight.len_bytes as u32;
    let entry = match (flight.opcode, fixed) {
        (Opcode::Read, Some(index)) => opcode::ReadFixed::new(file, buf_ptr, len_bytes, index)
            .offset(flight.offset_bytes)
            .build(),
        (Opcode::Write, Some(index)) => opcode::WriteFixed::new(file, buf_ptr, len_bytes, index)
            .offset(flight.offset_bytes)
            .rw_flags(if cmd.fua() { libc::RWF_DSYNC } else { 0 })
            .build(),
        (Opcode::Read, None) => opcode::Read::new(file, buf_ptr, len_bytes)
            .offset(flight.offset_bytes)
            .build(),
        (Opcode::Write, None) => opcode::Write::new(file, buf_ptr, len_bytes)
            .offset(flight.offset_bytes)
            .rw_flags(if cmd.fua() { libc::RWF_DSYNC } else { 0 })
            .build(),
        _ => unreachable!("only reads and writes carry a buffer"),
    };
    entry.user_data(u64::from(slot))
}

/// The operation for a vectored Read or Write (`readv`/`writev`) over the `count` iovecs at
/// `iov`, which the queue pair keeps until the completion is reaped; the file and FUA as in
/// [`data_entry`].
pub(super) fn vectored_entry(
    cmd: &Command<'_>,
    iov: *const libc::iovec,
    count: u32,
    flight: &InFlight,
    slot: u32,
    file: types::Fixed,
) -> squeue::Entry {
    let entry = match flight.opcode {
        Opcode::Read => opcode::Readv::new(file, iov, count)
            .offset(flight.offset_bytes)
            .build(),
        Opcode::Write => opcode::Writev::new(file, iov, count)
            .offset(flight.offset_bytes)
            .rw_flags(if cmd.fua() { libc::RWF_DSYNC } else { 0 })
            .build(),
        _ => unreachable!("only reads and writes carry segments"),
    };
    entry.user_data(u64::from(slot))
}

impl InFlight {
    /// The operation for a command without a buffer, on fixed file 0, with `slot` as its
    /// user data: Flush as `fdatasync`, Write Zeroes as its current step (see [`Zeroing`]),
    /// Deallocate as `fallocate(PUNCH_HOLE)`.
    pub(super) fn entry(&self, slot: u32) -> squeue::Entry {
        let file = types::Fixed(0);
        let entry = match self.opcode {
            Opcode::Read | Opcode::Write => unreachable!("reads and writes carry a buffer"),
            Opcode::Flush => opcode::Fsync::new(file)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Opcode::WriteZeroes if self.zeroing == Zeroing::ZeroRange => {
                opcode::Fallocate::new(file, self.len_bytes)
                    .offset(self.offset_bytes)
                    .mode(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE)
                    .build()
            }
            Opcode::WriteZeroes if self.zeroing == Zeroing::Allocate => {
                opcode::Fallocate::new(file, self.len_bytes)
                    .offset(self.offset_bytes)
                    .mode(libc::FALLOC_FL_KEEP_SIZE)
                    .build()
            }
            Opcode::WriteZeroes | Opcode::DatasetManagement => {
                opcode::Fallocate::new(file, self.len_bytes)
                    .offset(self.offset_bytes)
                    .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                    .build()
            }
        };
        entry.user_data(u64::from(slot))
    }
}

/// The NVMe status an io_uring result stands for.
pub(super) fn status_of(result: i32, flight: &InFlight) -> Status {
    status_for(result, flight.opcode, flight.len_bytes)
}

/// The NVMe status of a command of `opcode` over `len_bytes` whose system call returned
/// `result` (bytes moved, or a negative errno).
pub(super) fn status_for(result: i32, opcode: Opcode, len_bytes: u64) -> Status {
    if result >= 0 {
        let short = matches!(opcode, Opcode::Read | Opcode::Write) && result as u64 != len_bytes;
        return if short {
            Status::DATA_TRANSFER_ERROR
        } else {
            Status::SUCCESS
        };
    }
    match -result {
        libc::EIO | libc::ENODATA | libc::EBADMSG | libc::EILSEQ => match opcode {
            Opcode::Read => Status::UNRECOVERED_READ_ERROR,
            _ => Status::WRITE_FAULT,
        },
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => Status::CAPACITY_EXCEEDED,
        libc::EINVAL => Status::INVALID_FIELD,
        libc::EOPNOTSUPP => Status::INVALID_OPCODE,
        libc::ECANCELED | libc::EINTR => Status::ABORT_REQUESTED,
        _ => Status::INTERNAL_ERROR,
    }
}
