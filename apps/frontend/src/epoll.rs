//! The one system interface a front end needs beyond std: a level-triggered epoll set over
//! a reactor's sockets, whose own fd the reactor watches (readable when any socket is
//! ready), so a parked reactor wakes for its connections. Each `unsafe` block is one FFI
//! call on descriptors this module owns or borrows for the call.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Most readiness events one poll takes; the rest stay ready (level-triggered) for the next.
pub const EVENTS_MAX: usize = 64;
const _: () = assert!(EVENTS_MAX <= libc::c_int::MAX as usize);

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// What a socket is watched for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Interest {
    pub read: bool,
    pub write: bool,
}

impl Interest {
    fn bits(self) -> u32 {
        // Hang-ups and errors are always reported; a half-closed socket shows as readable
        // (an end of stream), so replies can still go out.
        let mut bits = 0;
        if self.read {
            bits |= libc::EPOLLIN as u32;
        }
        if self.write {
            bits |= libc::EPOLLOUT as u32;
        }
        bits
    }
}

/// A level-triggered epoll set.
pub struct Epoll {
    fd: OwnedFd,
}

impl Epoll {
    pub fn new() -> io::Result<Epoll> {
        // SAFETY: plain syscall; on success the descriptor is ours alone.
        let raw = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        Ok(Epoll {
            // SAFETY: `raw` is a fresh descriptor nobody else owns.
            fd: unsafe { OwnedFd::from_raw_fd(raw) },
        })
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, interest: Interest, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: interest.bits(),
            u64: token,
        };
        // SAFETY: both descriptors are live for the call; `ev` is a valid epoll_event.
        cvt(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev) })?;
        Ok(())
    }

    pub fn add(&self, fd: BorrowedFd<'_>, interest: Interest, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd.as_raw_fd(), interest, token)
    }

    pub fn modify(&self, fd: BorrowedFd<'_>, interest: Interest, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd.as_raw_fd(), interest, token)
    }

    pub fn remove(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd.as_raw_fd(), Interest::default(), 0)
    }

    /// The ready sockets, as (token, event bits), without blocking.
    pub fn ready(&self, ready: &mut Vec<(u64, u32)>) -> io::Result<usize> {
        ready.clear();
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; EVENTS_MAX];
        // SAFETY: `events` holds EVENTS_MAX initialised entries the kernel may write.
        let rc = unsafe {
            libc::epoll_wait(
                self.fd.as_raw_fd(),
                events.as_mut_ptr(),
                EVENTS_MAX as libc::c_int,
                0,
            )
        };
        let n = match cvt(rc) {
            Ok(n) => n as usize,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
            Err(e) => return Err(e),
        };
        ready.extend(events[..n].iter().map(|ev| (ev.u64, ev.events)));
        Ok(n)
    }
}

impl AsFd for Epoll {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Event bits that mean the peer hung up or the socket failed.
pub const HANGUP_BITS: u32 = (libc::EPOLLHUP | libc::EPOLLERR) as u32;
/// The socket has data (or an end of stream) to read.
pub const READ_BITS: u32 = libc::EPOLLIN as u32;
/// The socket has room to write.
pub const WRITE_BITS: u32 = libc::EPOLLOUT as u32;
