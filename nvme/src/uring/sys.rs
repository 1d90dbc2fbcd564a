//! The few raw system calls the io_uring device needs that the io-uring crate does not wrap:
//! creating a ring with `IORING_SETUP_HYBRID_IOPOLL` (Linux 6.13), the block-device
//! ioctls that give a device's size and logical block size, finding a file's first data,
//! what file system a file lives in and whether it takes non-blocking reads, and the
//! reactor's own reads and writes (`inline=`). The device's raw system calls live here;
//! the rest of its `unsafe` is the io-uring crate's entries and registrations.

use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};

use io_uring::IoUring;

use super::SqPoll;

/// `IORING_SETUP_IOPOLL`: completions are found by polling the device, not by interrupt.
const SETUP_IOPOLL: u32 = 1 << 0;
/// `IORING_SETUP_SQPOLL`: a kernel thread takes submissions from the ring.
const SETUP_SQPOLL: u32 = 1 << 1;
/// `IORING_SETUP_SQ_AFF`: that thread is pinned to `sq_thread_cpu`.
const SETUP_SQ_AFF: u32 = 1 << 2;
/// `IORING_SETUP_HYBRID_IOPOLL`: the kernel sleeps before it polls (needs IOPOLL).
const SETUP_HYBRID_IOPOLL: u32 = 1 << 17;

/// `struct io_sqring_offsets` from `<linux/io_uring.h>`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SqRingOffsets {
    head: u32,
    tail: u32,
    ring_mask: u32,
    ring_entries: u32,
    flags: u32,
    dropped: u32,
    array: u32,
    resv1: u32,
    user_addr: u64,
}

/// `struct io_cqring_offsets` from `<linux/io_uring.h>`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CqRingOffsets {
    head: u32,
    tail: u32,
    ring_mask: u32,
    ring_entries: u32,
    overflow: u32,
    cqes: u32,
    flags: u32,
    resv1: u32,
    user_addr: u64,
}

/// `struct io_uring_params` from `<linux/io_uring.h>`: the kernel's ABI, 120 bytes.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Params {
    sq_entries: u32,
    cq_entries: u32,
    flags: u32,
    sq_thread_cpu: u32,
    sq_thread_idle: u32,
    features: u32,
    wq_fd: u32,
    resv: [u32; 3],
    sq_off: SqRingOffsets,
    cq_off: CqRingOffsets,
}

const _: () = assert!(std::mem::size_of::<Params>() == 120);
const _: () = assert!(std::mem::size_of::<Params>() == std::mem::size_of::<io_uring::Parameters>());

/// Creates a ring whose completions the kernel finds by hybrid polling: it sleeps for about
/// half of the device's observed runtime, then polls. Fails with `EINVAL` on kernels older
/// than 6.13. With `sqpoll`, a submission thread takes its entries (and polls the device).
pub fn hybrid_iopoll_ring(entries: u32, sqpoll: Option<SqPoll>) -> io::Result<IoUring> {
    let mut params = Params {
        flags: SETUP_IOPOLL | SETUP_HYBRID_IOPOLL,
        ..Params::default()
    };
    if let Some(sq) = sqpoll {
        params.flags |= SETUP_SQPOLL;
        params.sq_thread_idle = sq.idle_ms;
        if let Some(cpu) = sq.cpu {
            params.flags |= SETUP_SQ_AFF;
            params.sq_thread_cpu = cpu;
        }
    }
    // SAFETY: io_uring_setup reads and fills `params`, a valid, exclusively borrowed
    // `struct io_uring_params` (layout checked above) for the duration of the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_io_uring_setup,
            entries,
            std::ptr::from_mut(&mut params),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a successful io_uring_setup returns a new file descriptor that nothing else
    // owns.
    let fd = unsafe { OwnedFd::from_raw_fd(ret as i32) };
    // SAFETY: `io_uring::Parameters` is a transparent wrapper of the kernel's
    // `io_uring_params`, whose layout `Params` reproduces field for field (same size,
    // asserted above); `params` is what the kernel filled in for this very ring, as
    // `IoUring::from_fd` requires, and `fd` is an owned ring descriptor handed over to it.
    unsafe {
        let parameters: io_uring::Parameters = std::mem::transmute(params);
        IoUring::from_fd(fd.into_raw_fd(), parameters)
    }
}

/// `BLKGETSIZE64`: `_IOR(0x12, 114, size_t)`.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
/// `BLKSSZGET`: `_IO(0x12, 104)`.
const BLKSSZGET: libc::c_ulong = 0x1268;

/// Size in bytes of the block device open as `file`.
pub fn block_device_size_bytes(file: &File) -> io::Result<u64> {
    let mut size_bytes: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid and
    // exclusively borrowed for the call.
    let ret = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            BLKGETSIZE64,
            std::ptr::from_mut(&mut size_bytes),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size_bytes)
}

/// Logical block size in bytes of the block device open as `file`.
pub fn block_device_lba_bytes(file: &File) -> io::Result<u32> {
    let mut lba_bytes: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which is valid and exclusively
    // borrowed for the call.
    let ret = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            BLKSSZGET,
            std::ptr::from_mut(&mut lba_bytes),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    u32::try_from(lba_bytes).map_err(|_| io::Error::other("BLKSSZGET returned a negative size"))
}

/// Offset of the first byte of `file` that holds data (`lseek(SEEK_DATA)`), or `None` when
/// it is all holes. A block device is all data.
pub fn data_offset_bytes(file: &File) -> io::Result<Option<u64>> {
    // SAFETY: lseek on a descriptor we hold open moves its file position and touches no
    // memory; io_uring reads and writes give their own offsets and never use the position.
    let ret = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_DATA) };
    if ret < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(e),
        };
    }
    Ok(Some(ret as u64))
}

/// `RAMFS_MAGIC` from `<linux/magic.h>` (the libc crate names only `TMPFS_MAGIC`).
const RAMFS_MAGIC: u32 = 0x8584_58f6;

/// Whether `file` lives in a file system held in memory (tmpfs, ramfs), whose reads copy
/// pages that are already there rather than wait for a disk (short of swap).
pub fn in_memory_fs(file: &File) -> io::Result<bool> {
    let mut st = MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: fstatfs writes one struct statfs through the pointer, which is valid and
    // exclusively borrowed for the call.
    let ret = unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: zeroed, then filled by the successful call.
    let st = unsafe { st.assume_init() };
    // `f_type`'s integer type differs between architectures (and from the magic's); the
    // magics are 32-bit values, some above i32::MAX, so compare the low 32 bits unsigned.
    #[allow(clippy::unnecessary_cast)]
    let (f_type, tmpfs) = (st.f_type as u32, libc::TMPFS_MAGIC as u32);
    Ok(f_type == tmpfs || f_type == RAMFS_MAGIC)
}

/// Whether the kernel refuses a non-blocking buffered read of `file` (`preadv2` with
/// `RWF_NOWAIT` fails with EOPNOTSUPP). io_uring then cannot try a read in the submitting
/// thread and hands every one to a worker thread. Reads one byte at offset 0.
pub fn nowait_read_refused(file: &File) -> bool {
    let mut byte = 0u8;
    let iov = libc::iovec {
        iov_base: std::ptr::from_mut(&mut byte).cast(),
        iov_len: 1,
    };
    // SAFETY: reads at most one byte into `byte`, which outlives the call.
    let ret = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, 0, libc::RWF_NOWAIT) };
    ret < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP)
}

/// Reads into (or with `write`, writes from) the buffers `iov` describes, at `offset_bytes`
/// of the file open as `fd`, in the calling thread (`preadv2`/`pwritev2` with `flags`; one
/// buffer and no flags by `pread`/`pwrite`, which spare the kernel copying in and checking
/// an iovec array on every call). The result as io_uring would post it: the bytes moved, or
/// a negative errno. A call that a signal interrupted before any byte moved is made again.
///
/// # Safety
/// Every iovec must describe memory that stays valid for the call: writable for a read,
/// readable for a write. Their lengths must sum to at most `i32::MAX` bytes.
pub unsafe fn transfer_inline(
    fd: RawFd,
    write: bool,
    iov: &[libc::iovec],
    offset_bytes: u64,
    flags: libc::c_int,
) -> i32 {
    let count = iov.len() as libc::c_int;
    let offset = offset_bytes as libc::off_t;
    loop {
        // SAFETY: the caller's guarantee on the buffers; `iov` itself is borrowed for the call.
        let ret = unsafe {
            if let ([one], 0) = (iov, flags) {
                if write {
                    libc::pwrite(fd, one.iov_base, one.iov_len, offset)
                } else {
                    libc::pread(fd, one.iov_base, one.iov_len, offset)
                }
            } else if write {
                libc::pwritev2(fd, iov.as_ptr(), count, offset, flags)
            } else {
                libc::preadv2(fd, iov.as_ptr(), count, offset, flags)
            }
        };
        if ret >= 0 {
            return ret as i32;
        }
        let errno = io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        if errno != libc::EINTR {
            return -errno;
        }
    }
}
