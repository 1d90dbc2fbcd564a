//! The operating-system calls the devices need: the monotonic clock, timerfd (the emulated
//! controller's interrupt line), eventfd (the null device's) and fallocate (the emulated
//! controller's file backing). This is one of the few modules with `unsafe`; each call is a
//! plain FFI call on values this module owns or borrows for the call.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// CLOCK_MONOTONIC in nanoseconds, the time base of every deadline in this crate and of
/// timerfd's absolute timers.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// CLOCK_MONOTONIC_COARSE in nanoseconds: the time of the last clock tick, read without
/// the hardware clock, for choices that need to be right to a tick, not to a nanosecond.
pub fn monotonic_coarse_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC_COARSE)
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; both clocks this module reads exist on
    // every Linux this crate runs on (CLOCK_MONOTONIC_COARSE since 2.6.32).
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    debug_assert_eq!(rc, 0);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A CLOCK_MONOTONIC timerfd armed with absolute deadlines: readable once the deadline has
/// passed, until disarmed or re-armed.
#[derive(Debug)]
pub struct TimerFd {
    fd: OwnedFd,
}

impl TimerFd {
    pub fn new() -> io::Result<TimerFd> {
        // SAFETY: plain syscall; on success the returned descriptor is ours alone.
        let raw = cvt(unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        })?;
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(TimerFd { fd })
    }

    /// Fires at `deadline_ns` on CLOCK_MONOTONIC (at once if it has passed). Re-arming
    /// clears a pending expiry, so the fd is readable only for the newest deadline.
    pub fn arm_at(&self, deadline_ns: u64) -> io::Result<()> {
        // An all-zero it_value disarms the timer, so the earliest deadline we can set is 1 ns.
        self.settime(deadline_ns.max(1))
    }

    pub fn disarm(&self) -> io::Result<()> {
        self.settime(0)
    }

    fn settime(&self, deadline_ns: u64) -> io::Result<()> {
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
                tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: the fd is a live timerfd we own; `spec` is a valid itimerspec and the old
        // value pointer may be null.
        cvt(unsafe {
            libc::timerfd_settime(
                self.fd.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        })?;
        Ok(())
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A non-blocking eventfd used as a level-triggered "something is ready" line.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: plain syscall; on success the returned descriptor is ours alone.
        let raw = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(EventFd { fd })
    }

    /// Makes the fd readable.
    pub fn signal(&self) -> io::Result<()> {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own.
        let n = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if n == 8 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        // A counter at its maximum is still readable: nothing is lost.
        if err.kind() == io::ErrorKind::WouldBlock {
            Ok(())
        } else {
            Err(err)
        }
    }

    /// Makes the fd unreadable again; returns whether it was readable.
    pub fn drain(&self) -> bool {
        let mut value: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from an eventfd we own (non-blocking).
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&mut value as *mut u64).cast(), 8) };
        n == 8
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// `fallocate(2)` on `fd`: `mode` (`FALLOC_FL_*`) over `len_bytes` at `offset`.
pub fn fallocate(
    fd: BorrowedFd<'_>,
    mode: libc::c_int,
    offset: u64,
    len_bytes: u64,
) -> io::Result<()> {
    let (Ok(offset), Ok(len)) = (
        libc::off_t::try_from(offset),
        libc::off_t::try_from(len_bytes),
    ) else {
        return Err(io::Error::from_raw_os_error(libc::EFBIG));
    };
    loop {
        // SAFETY: plain syscall on a descriptor borrowed for the whole call; no memory is
        // passed.
        let rc = unsafe { libc::fallocate(fd.as_raw_fd(), mode, offset, len) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Whether `fd` is readable right now (poll with a zero timeout), or within `timeout_ms`.
pub fn wait_readable(fd: BorrowedFd<'_>, timeout_ms: i32) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd for a descriptor borrowed for the whole call.
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if rc >= 0 {
            return Ok(rc == 1 && pfd.revents & libc::POLLIN != 0);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timerfd_fires_at_its_deadline_and_disarms() {
        let timer = TimerFd::new().unwrap();
        assert!(!wait_readable(timer.as_fd(), 0).unwrap());
        timer.arm_at(monotonic_ns() + 2_000_000).unwrap();
        assert!(!wait_readable(timer.as_fd(), 0).unwrap());
        assert!(wait_readable(timer.as_fd(), 1_000).unwrap());
        timer.disarm().unwrap();
        assert!(!wait_readable(timer.as_fd(), 0).unwrap());
        // A deadline in the past fires at once.
        timer.arm_at(1).unwrap();
        assert!(wait_readable(timer.as_fd(), 1_000).unwrap());
    }

    #[test]
    fn eventfd_signals_and_drains() {
        let ev = EventFd::new().unwrap();
        assert!(!ev.drain());
        ev.signal().unwrap();
        assert!(wait_readable(ev.as_fd(), 0).unwrap());
        assert!(ev.drain());
        assert!(!wait_readable(ev.as_fd(), 0).unwrap());
    }

    #[test]
    fn monotonic_clock_moves_forward() {
        let a = monotonic_ns();
        let b = monotonic_ns();
        assert!(b >= a);
    }
}
