//! The system calls a reactor makes: epoll for parking, timer slack, thread CPU time and the
//! process's allowed cores. One of the few modules with `unsafe`; each block is a plain FFI
//! call on values this module owns or borrows for the call.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Most events one `epoll_wait` returns; the rest stay ready for the next call.
pub const EPOLL_EVENTS_MAX: usize = 32;

/// A level-triggered epoll set.
pub struct Epoll {
    fd: OwnedFd,
    events: Vec<libc::epoll_event>,
    /// Whether the kernel has `epoll_pwait2` (until it says ENOSYS).
    pwait2: bool,
}

impl Epoll {
    pub fn new() -> io::Result<Epoll> {
        // SAFETY: plain syscall; on success the descriptor is ours alone.
        let raw = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        Ok(Epoll {
            // SAFETY: `raw` is a fresh descriptor nobody else owns.
            fd: unsafe { OwnedFd::from_raw_fd(raw) },
            events: vec![libc::epoll_event { events: 0, u64: 0 }; EPOLL_EVENTS_MAX],
            pwait2: true,
        })
    }

    /// Watches `fd` for readability, reporting `token` when it is.
    pub fn add(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: token,
        };
        // SAFETY: both descriptors are live for the call; `ev` is a valid epoll_event.
        cvt(unsafe {
            libc::epoll_ctl(
                self.fd.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                fd.as_raw_fd(),
                &mut ev,
            )
        })?;
        Ok(())
    }

    /// Stops watching `fd`.
    pub fn remove(&self, fd: RawFd) -> io::Result<()> {
        // SAFETY: a null event pointer is allowed for EPOLL_CTL_DEL; a stale fd is an error,
        // not undefined behaviour.
        cvt(unsafe {
            libc::epoll_ctl(
                self.fd.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                fd,
                std::ptr::null_mut(),
            )
        })?;
        Ok(())
    }

    /// Blocks until a watched fd is readable or `timeout` passes (`None`: no timeout), and
    /// returns the tokens of the ready fds. EINTR returns no tokens. The timeout has
    /// nanosecond resolution (`epoll_pwait2`, Linux 5.11); on an older kernel it is rounded
    /// up to whole milliseconds.
    pub fn wait(
        &mut self,
        timeout: Option<Duration>,
    ) -> io::Result<impl Iterator<Item = u64> + '_> {
        let rc = match timeout {
            None => self.wait_ms(-1),
            Some(d) if self.pwait2 => {
                let ts = libc::timespec {
                    tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
                    tv_nsec: d.subsec_nanos() as libc::c_long,
                };
                // SAFETY: `events` holds EPOLL_EVENTS_MAX initialised entries the kernel may
                // write; `ts` lives across the call; a null sigmask leaves the mask alone.
                let rc = unsafe {
                    libc::epoll_pwait2(
                        self.fd.as_raw_fd(),
                        self.events.as_mut_ptr(),
                        EPOLL_EVENTS_MAX as libc::c_int,
                        &ts,
                        std::ptr::null(),
                    )
                };
                if rc < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
                    self.pwait2 = false;
                    self.wait_ms(millis_rounded_up(d))
                } else {
                    rc
                }
            }
            Some(d) => self.wait_ms(millis_rounded_up(d)),
        };
        let n = match cvt(rc) {
            Ok(n) => n as usize,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
            Err(e) => return Err(e),
        };
        Ok(self.events[..n].iter().map(|ev| ev.u64))
    }

    fn wait_ms(&mut self, timeout_ms: libc::c_int) -> libc::c_int {
        // SAFETY: `events` holds EPOLL_EVENTS_MAX initialised entries the kernel may write.
        unsafe {
            libc::epoll_wait(
                self.fd.as_raw_fd(),
                self.events.as_mut_ptr(),
                EPOLL_EVENTS_MAX as libc::c_int,
                timeout_ms,
            )
        }
    }
}

/// Round up: a timer due in 0.2 ms must not become a busy 0 ms timeout.
fn millis_rounded_up(d: Duration) -> libc::c_int {
    d.as_micros().div_ceil(1_000).min(i32::MAX as u128) as libc::c_int
}

/// Sets the calling thread's timer slack: the kernel may fire its timers this much late to
/// batch wake-ups; at Linux's default of 50 us, a sleep of a few microseconds may last many
/// times longer than asked.
pub fn set_timer_slack_ns(slack_ns: u64) -> io::Result<()> {
    // SAFETY: PR_SET_TIMERSLACK takes one unsigned long and touches no memory of ours.
    cvt(unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, slack_ns as libc::c_ulong, 0, 0, 0) })?;
    Ok(())
}

/// The calling thread's timer slack.
pub fn timer_slack_ns() -> io::Result<u64> {
    // SAFETY: PR_GET_TIMERSLACK takes no pointer and returns the slack.
    let rc = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) };
    cvt(rc).map(|v| v as u64)
}

/// Sleeps until CLOCK_MONOTONIC reaches `deadline_ns` (at once if it has passed).
pub fn sleep_until_ns(deadline_ns: u64) {
    let ts = libc::timespec {
        tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
    };
    loop {
        // SAFETY: `ts` is a valid timespec; the remaining-time pointer may be null with
        // TIMER_ABSTIME.
        let rc = unsafe {
            libc::clock_nanosleep(
                libc::CLOCK_MONOTONIC,
                libc::TIMER_ABSTIME,
                &ts,
                std::ptr::null_mut(),
            )
        };
        // clock_nanosleep returns the error number; EINTR means sleep again until the
        // (absolute) deadline.
        if rc != libc::EINTR {
            return;
        }
    }
}

/// A clock that reads one thread's CPU time (user + system), from any thread.
#[derive(Clone, Copy, Debug)]
pub struct ThreadCpuClock(libc::clockid_t);

impl ThreadCpuClock {
    /// The calling thread's CPU clock.
    pub fn current() -> io::Result<ThreadCpuClock> {
        let mut id: libc::clockid_t = 0;
        // SAFETY: pthread_self is always valid for the calling thread; `id` is writable.
        let rc = unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut id) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(ThreadCpuClock(id))
    }

    /// CPU time consumed so far; `None` once the thread has exited.
    pub fn cpu_ns(&self) -> Option<u64> {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; an exited thread's clock is EINVAL.
        let rc = unsafe { libc::clock_gettime(self.0, &mut ts) };
        (rc == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
    }
}

/// The cores this process may run on (its main thread's affinity mask, as a cgroup cpuset
/// or taskset leaves it), ascending.
pub fn allowed_cores() -> io::Result<Vec<usize>> {
    // SAFETY: getpid cannot fail.
    let pid = unsafe { libc::getpid() };
    affinity_of(pid)
}

/// The cores the calling thread may run on (a pinned reactor: just its core).
pub fn thread_cores() -> io::Result<Vec<usize>> {
    affinity_of(0)
}

fn affinity_of(pid: libc::pid_t) -> io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain bits; all-zero is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is this process or 0 (the calling thread); the size matches the set.
    cvt(unsafe { libc::sched_getaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) })?;
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: CPU_ISSET reads a bit inside the set for indices below CPU_SETSIZE.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timer_slack_can_be_set_to_one_ns() {
        std::thread::spawn(|| {
            set_timer_slack_ns(1).unwrap();
            assert_eq!(timer_slack_ns().unwrap(), 1);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn thread_cpu_clock_counts_work() {
        let clock = ThreadCpuClock::current().unwrap();
        let before = clock.cpu_ns().unwrap();
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_add(std::hint::black_box(i));
        }
        std::hint::black_box(x);
        assert!(clock.cpu_ns().unwrap() > before);
    }

    #[test]
    fn the_process_may_use_at_least_one_core() {
        assert!(!allowed_cores().unwrap().is_empty());
    }
}
