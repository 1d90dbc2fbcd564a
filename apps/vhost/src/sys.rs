//! The system calls the back end needs beyond std and the rust-vmm crates: making an
//! eventfd non-blocking, peeking at a socket's next bytes without taking them, and a memfd
//! for the inflight area.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Sets O_NONBLOCK on `fd`.
pub fn set_nonblocking(fd: &impl AsRawFd) -> io::Result<()> {
    let fd = fd.as_raw_fd();
    // SAFETY: F_GETFL and F_SETFL read and set the flags of an fd the caller holds open
    // (borrowed for the call); they touch no memory of ours.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Copies up to `buf.len()` of the bytes waiting on socket `fd` into `buf` without taking
/// them, and without waiting: `Ok(0)` is the peer's end of stream, `WouldBlock` nothing
/// waiting. File descriptors sent with the bytes stay queued with them.
pub fn peek(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for `buf.len()` bytes of writes for the call, and `fd` is open
    // (borrowed); MSG_PEEK leaves the data (and any SCM_RIGHTS fds) queued.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Whether the peer of socket `fd` has closed its end (or the socket failed), whether or
/// not bytes it sent before are still waiting to be read. Does not wait.
pub fn peer_closed(fd: BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid `pollfd` for the call, an open fd (borrowed), no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

/// A new anonymous memory file (memfd), closed on exec, of size 0.
pub fn memfd(name: &str) -> io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    let name = std::ffi::CString::new(name).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY: `name` is a NUL-terminated string that outlives the call; a non-negative
    // return is a new fd that nothing else owns.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}
