//! The access time of a file read through the page cache (`direct=0`), under `atime=`.
//!
//! Every read through an ordinary file descriptor asks the kernel whether the file's access
//! time must move (`touch_atime`). On a `relatime` mount, the usual one, it moves only when
//! it is not later than the file's last change or is a day old; but the asking (the clock,
//! the inode's times, its owner mapped through the mount) runs on every read, and for a 4 KiB
//! read of a file in memory it is a share of the read worth saving (docs/results.md).
//!
//! With `atime=coarse` (the default) reads go through a second descriptor of the same file,
//! opened with `O_NOATIME`, which skips the asking (inline, or as the ring's fixed file 1),
//! and the first read of each minute goes through the ordinary descriptor instead, so the
//! kernel still applies the mount's rule. A queue pair that read without the asking since
//! its last ordinary read makes one more, of one byte, when it is dropped. What can go
//! uncounted is the reads since the last checked one, at most a minute of them, until the
//! next read or the drop (for good if the process is killed): `relatime` itself lets the
//! access time trail the reads by a day, and those who go by it (cleaners of /tmp) count in
//! days. `atime=kernel` keeps every read on the ordinary descriptor. With `direct=1`
//! nothing changes: a read that waits for the disk takes far longer than the check.
//!
//! Only on a `relatime` mount: under `strictatime` every read is meant to move the access
//! time, and under `noatime` the kernel skips the asking already. `O_NOATIME` needs the
//! file's owner or CAP_FOWNER; without either, reads stay on the ordinary descriptor.

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::sync::Arc;

/// How long reads go without the kernel's access-time check before one goes through it.
pub(super) const ATIME_TOUCH_INTERVAL_NS: u64 = 60 * 1_000_000_000;

/// Whether the kernel checks the access time on each read through the page cache (see the
/// module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtimeMode {
    /// Once a minute, on a `relatime` mount, where the file's owner opens it; otherwise on
    /// every read.
    Coarse,
    /// On every read, as for any reader.
    Kernel,
}

impl AtimeMode {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            AtimeMode::Coarse => "coarse",
            AtimeMode::Kernel => "kernel",
        }
    }
}

/// A second descriptor of `file` that reads without moving its access time, where `atime=
/// coarse` applies to it (see the module documentation); otherwise why not, for `describe`.
pub(super) fn noatime_reader(file: &File) -> Result<File, String> {
    if !relatime_mount(file)? {
        return Err("strictatime or noatime mount".into());
    }
    // Through /proc, the same file even if its path has been renamed or replaced since.
    let reopened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOATIME | libc::O_CLOEXEC)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(|e| match e.raw_os_error() {
            Some(libc::EPERM) => "O_NOATIME needs the file's owner or CAP_FOWNER".to_string(),
            _ => format!("no second descriptor through /proc ({e})"),
        })?;
    let (a, b) = (
        file.metadata().map_err(|e| e.to_string())?,
        reopened.metadata().map_err(|e| e.to_string())?,
    );
    if (a.dev(), a.ino()) != (b.dev(), b.ino()) {
        return Err("the second descriptor is another file".into());
    }
    Ok(reopened)
}

/// Whether `file`'s mount updates access times by the `relatime` rule.
pub(super) fn relatime_mount(file: &File) -> Result<bool, String> {
    // SAFETY: a zeroed statvfs is a valid value to be overwritten; the call writes only it.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor, borrowed for the call, and a writable statvfs.
    if unsafe { libc::fstatvfs(file.as_raw_fd(), &mut st) } != 0 {
        return Err(format!(
            "the mount cannot be asked ({})",
            std::io::Error::last_os_error()
        ));
    }
    Ok(st.f_flag & libc::ST_RELATIME != 0 && st.f_flag & libc::ST_NOATIME == 0)
}

/// A queue pair's choice, read by read, between the two descriptors.
#[derive(Debug)]
pub(super) struct AtimeKeeper {
    /// The ordinary descriptor (the queue pair's file).
    plain: Arc<File>,
    noatime: Arc<File>,
    /// When the next read goes through `plain` (CLOCK_MONOTONIC_COARSE, ns); 0 at first.
    touch_due_ns: u64,
    /// A read went through `noatime` since the last one through `plain`.
    touch_owed: bool,
}

impl AtimeKeeper {
    pub(super) fn new(plain: Arc<File>, noatime: Arc<File>) -> AtimeKeeper {
        AtimeKeeper {
            plain,
            noatime,
            touch_due_ns: 0,
            touch_owed: false,
        }
    }

    /// Whether a read made at `now_ns` goes through the ordinary descriptor, where the kernel
    /// checks the access time (the first of each minute), or through the second one.
    pub(super) fn check_read(&mut self, now_ns: u64) -> bool {
        if now_ns >= self.touch_due_ns {
            self.touch_due_ns = now_ns.saturating_add(ATIME_TOUCH_INTERVAL_NS);
            self.touch_owed = false;
            true
        } else {
            self.touch_owed = true;
            false
        }
    }

    /// Makes the next read a checked one: the one just chosen as checked was not made (its
    /// entry found no room). A checked read that fails or is aborted counts all the same.
    pub(super) fn check_next_read(&mut self) {
        self.touch_due_ns = 0;
    }

    /// The second descriptor, without access-time updates.
    pub(super) fn noatime_fd(&self) -> RawFd {
        self.noatime.as_raw_fd()
    }
}

impl Drop for AtimeKeeper {
    fn drop(&mut self) {
        if self.touch_owed {
            // One byte through the ordinary descriptor, so that the last reads count. A
            // failure changes no data and has no one to tell: the access time stays behind.
            let _ = self.plain.read_at(&mut [0u8; 1], 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keeper() -> AtimeKeeper {
        let file = Arc::new(tempfile::tempfile().unwrap());
        let other = Arc::new(tempfile::tempfile().unwrap());
        AtimeKeeper::new(file, other)
    }

    #[test]
    fn one_read_a_minute_goes_through_the_ordinary_descriptor() {
        let mut k = keeper();
        let start = 5_000_000_000;
        assert!(k.check_read(start), "the first read is checked");
        assert!(!k.touch_owed);
        assert!(!k.check_read(start + 1));
        assert!(!k.check_read(start + ATIME_TOUCH_INTERVAL_NS - 1));
        assert!(k.touch_owed, "reads went unchecked");
        assert!(k.check_read(start + ATIME_TOUCH_INTERVAL_NS));
        assert!(!k.touch_owed);
        // After a long quiet spell the first read is checked at once.
        let later = start + 10 * ATIME_TOUCH_INTERVAL_NS;
        assert!(k.check_read(later));
        assert!(!k.check_read(later + 1));
        // A read chosen as checked and then not made hands the check to the next.
        k.check_next_read();
        assert!(k.check_read(later + 2));
        assert!(!k.check_read(later + 3));
    }
}
