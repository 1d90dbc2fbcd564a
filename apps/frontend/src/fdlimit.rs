//! The open-file limit against what a service needs: every connection holds a descriptor,
//! and past the limit `accept()` fails with EMFILE. A service raises its soft limit toward
//! the hard one at start, or warns that connections will wait in the listen backlog.

use std::io;

/// Descriptors a service needs beside its connections and its reactors: the standard
/// streams, the listener, the metrics endpoint and its scrapers, export files, the signal
/// pipe, with room for a library that opens one.
pub const FDS_SERVICE: u64 = 64;
/// Descriptors each reactor needs: its epoll set, wake-up and timer fds, a queue pair's
/// ring or file per export (an estimate with room; a few exports at most are usual).
pub const FDS_PER_REACTOR: u64 = 16;

/// What [`ensure`] found and did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FdLimit {
    /// The soft limit already covers what is needed.
    Enough,
    /// The soft limit was raised from `from` to `to`.
    Raised { from: u64, to: u64 },
    /// The hard limit (or the raise) leaves `soft`, under what is needed.
    Short { soft: u64, needed: u64 },
}

/// The soft limit to set, given the current `soft` and `hard` limits and the descriptors
/// `needed`: `None` to leave it. Never above `hard`, never lowered.
pub(crate) fn soft_to_set(soft: u64, hard: u64, needed: u64) -> Option<u64> {
    if soft >= needed {
        return None;
    }
    let to = needed.min(hard);
    (to > soft).then_some(to)
}

/// Raises this process's soft open-file limit to `needed` (at most the hard limit).
pub(crate) fn ensure(needed: u64) -> io::Result<FdLimit> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let (soft, hard) = (lim.rlim_cur, lim.rlim_max);
    let Some(to) = soft_to_set(soft, hard, needed) else {
        return Ok(if soft >= needed {
            FdLimit::Enough
        } else {
            FdLimit::Short { soft, needed }
        });
    };
    lim.rlim_cur = to;
    // SAFETY: setrlimit reads one rlimit from the struct it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(if to >= needed {
        FdLimit::Raised { from: soft, to }
    } else {
        FdLimit::Short { soft: to, needed }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_raised_toward_the_hard_one_and_never_lowered() {
        assert_eq!(soft_to_set(1024, 4096, 512), None);
        assert_eq!(soft_to_set(1024, 4096, 2000), Some(2000));
        assert_eq!(soft_to_set(64, 128, 2000), Some(128));
        assert_eq!(soft_to_set(128, 128, 2000), None);
        assert_eq!(soft_to_set(1024, u64::MAX, 1024), None);
    }
}
