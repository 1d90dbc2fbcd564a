//! The interrupt line of an NVMe/TCP queue pair: an epoll set holding its socket and an
//! eventfd. The set's own fd is what the reactor waits on; it is readable when the socket
//! is (while armed) or when the queue pair signals the eventfd (a completion already
//! waiting, a dead connection), so arming and disarming need not touch the reactor's set.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::sys::EventFd;

/// Token of the eventfd in the set (the socket's is 0).
const TOKEN_EVENT: u64 = 1;

pub(crate) struct Line {
    epoll: OwnedFd,
    event: EventFd,
    socket: i32,
    /// The socket's interest now (EPOLLIN, EPOLLOUT bits), or `None` once it left the set.
    interest: Option<u32>,
}

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

impl Line {
    /// A line for `socket`, which starts in the set with no interest (disarmed).
    pub(crate) fn new(socket: BorrowedFd<'_>) -> io::Result<Line> {
        // SAFETY: plain syscall; on success the returned descriptor is ours alone.
        let raw = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(raw) };
        let event = EventFd::new()?;
        let line = Line {
            epoll,
            event,
            socket: socket.as_raw_fd(),
            interest: Some(0),
        };
        line.ctl(libc::EPOLL_CTL_ADD, line.socket, 0, 0)?;
        let fd = line.event.as_fd().as_raw_fd();
        line.ctl(libc::EPOLL_CTL_ADD, fd, libc::EPOLLIN as u32, TOKEN_EVENT)?;
        Ok(line)
    }

    fn ctl(&self, op: libc::c_int, fd: i32, events: u32, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: `ev` is a live epoll_event; the set and `fd` are open descriptors (the
        // socket outlives the line: the queue pair drops the line first).
        cvt(unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, fd, &mut ev) })?;
        Ok(())
    }

    /// Watches the socket for `read` and `write` readiness (neither: disarmed). A change
    /// costs a system call; asking for what is already set costs nothing.
    pub(crate) fn watch(&mut self, read: bool, write: bool) -> io::Result<()> {
        let want = if read { libc::EPOLLIN as u32 } else { 0 }
            | if write { libc::EPOLLOUT as u32 } else { 0 };
        match self.interest {
            Some(now) if now != want => {
                self.ctl(libc::EPOLL_CTL_MOD, self.socket, want, 0)?;
                self.interest = Some(want);
            }
            _ => {}
        }
        Ok(())
    }

    /// Takes the socket out of the set for good (a dead connection would be readable, or
    /// hung up, forever).
    pub(crate) fn forget_socket(&mut self) {
        if self.interest.take().is_some() {
            let _ = self.ctl(libc::EPOLL_CTL_DEL, self.socket, 0, 0);
        }
    }

    /// Makes the line readable now.
    pub(crate) fn raise(&self) {
        self.event
            .signal()
            .expect("nvme-tcp: writing our own eventfd cannot fail");
    }

    /// Takes back what [`Line::raise`] did.
    pub(crate) fn lower(&self) {
        self.event.drain();
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}
