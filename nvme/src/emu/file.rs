//! The emulated namespace kept in a file (`backing=file:PATH`): opening it under rules that
//! refuse whatever the operator did not ask for, and zeroing ranges of it with `fallocate`.
//!
//! Opening never changes a file that already exists: a symbolic link (as the last component
//! of the path) is refused rather than followed, so a link planted at the path cannot hand
//! a client some other file; anything but a regular file is refused; a file smaller than
//! the namespace is refused, not grown; a larger one is used for its first `size` bytes and
//! the rest is left alone. A missing file is created, exclusively and readable and writable
//! by its owner alone (mode 0600 before the umask), and sized to the namespace. A read-only
//! device (a read-only export) opens the file without write access and never creates one.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::AtomicU64;

use crate::sys;

/// Mode of a file the emulator creates, before the umask: the data a client writes is
/// nobody else's to read.
pub const CREATED_FILE_MODE: u32 = 0o600;

/// Why a file backing could not be opened. Each message names the path and says what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileBackingError {
    #[error(
        "{path} is a symbolic link: backing=file: does not follow links, so a link cannot \
         hand clients another file; give the path of the file itself"
    )]
    Symlink { path: String },
    #[error(
        "{path} is {kind}, not a regular file: backing=file: keeps the namespace in a \
         regular file (for a block device use uring:{path})"
    )]
    NotRegularFile { path: String, kind: &'static str },
    #[error(
        "{path} holds {file_bytes} bytes, fewer than size={size_bytes}: an existing file is \
         never grown; give size= no larger than {file_bytes}, or grow the file yourself \
         (truncate -s {size_bytes} {path})"
    )]
    TooSmall {
        path: String,
        file_bytes: u64,
        size_bytes: u64,
    },
    #[error("{path}: permission denied: the emulator needs to {access} it (check the file's mode and owner, or its directory's)")]
    PermissionDenied { path: String, access: &'static str },
    #[error(
        "{path} does not exist: a read-only device is never created, since it would hold \
         nothing but zeroes; give an existing file, or export it writable once to create it"
    )]
    Missing { path: String },
    #[error("{path}: {what}: {source}")]
    Os {
        path: String,
        what: &'static str,
        source: io::Error,
    },
}

impl From<FileBackingError> for io::Error {
    fn from(e: FileBackingError) -> io::Error {
        let kind = match &e {
            FileBackingError::PermissionDenied { .. } => io::ErrorKind::PermissionDenied,
            FileBackingError::Os { source, .. } => source.kind(),
            _ => io::ErrorKind::InvalidInput,
        };
        io::Error::new(kind, e)
    }
}

pub struct FileStore {
    pub(super) file: File,
    /// `sync_data` calls so far (flushes and FUA writes).
    pub(super) syncs: AtomicU64,
}

impl FileStore {
    /// Opens the file at `path` for a namespace of `size_bytes`, or creates it (see the
    /// module documentation for what is refused).
    pub(super) fn open(
        path: &Path,
        size_bytes: u64,
        read_only: bool,
    ) -> Result<FileStore, FileBackingError> {
        let display = path.display().to_string();
        let os = |what: &'static str| {
            let path = display.clone();
            move |source: io::Error| FileBackingError::Os { path, what, source }
        };
        // Something that is not a file is refused before it is opened: opening a device
        // can have effects of its own. (Checked again on the descriptor below, which is
        // what counts.)
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            let t = meta.file_type();
            if t.is_symlink() {
                return Err(FileBackingError::Symlink { path: display });
            }
            if !t.is_file() {
                return Err(FileBackingError::NotRegularFile {
                    path: display,
                    kind: kind_of(t),
                });
            }
        }
        // Open it, or create it where it is missing. Another process creating or removing
        // the file in between costs one more round; racing us twice in a row is an error.
        let mut created = false;
        let mut file = None;
        for _ in 0..2 {
            match open_existing(path, read_only) {
                Ok(f) => {
                    file = Some(f);
                    break;
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) && read_only => {
                    return Err(FileBackingError::Missing { path: display });
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(refusal(path, e, read_only)),
            }
            match create_new(path) {
                Ok(f) => {
                    created = true;
                    file = Some(f);
                    break;
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => return Err(refusal(path, e, read_only)),
            }
        }
        let Some(file) = file else {
            return Err(os("opening it")(io::Error::from_raw_os_error(libc::EEXIST)));
        };
        // The descriptor's own type, not the path's: the path may have changed since.
        let meta = file.metadata().map_err(os("reading its size"))?;
        if !meta.file_type().is_file() {
            return Err(FileBackingError::NotRegularFile {
                path: display,
                kind: kind_of(meta.file_type()),
            });
        }
        if created {
            if let Err(e) = file.set_len(size_bytes) {
                // Ours alone, and empty: leave nothing behind.
                let _ = std::fs::remove_file(path);
                return Err(os("sizing the new file")(e));
            }
        } else if meta.len() < size_bytes {
            return Err(FileBackingError::TooSmall {
                path: display,
                file_bytes: meta.len(),
                size_bytes,
            });
        }
        Ok(FileStore {
            file,
            syncs: AtomicU64::new(0),
        })
    }

    /// Zeroes `len_bytes` at `offset`. Deallocating punches a hole, giving the space back;
    /// otherwise the range reads as zeroes and stays allocated. Either way the file system
    /// does it in its metadata, without zeroes through the page cache that a later
    /// `fdatasync` would have to write; where it cannot, zeroes are written.
    pub(super) fn zero(&self, offset: u64, len_bytes: u64, deallocate: bool) -> io::Result<()> {
        let mode = if deallocate {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        };
        match sys::fallocate(self.file.as_fd(), mode, offset, len_bytes) {
            Ok(()) => return Ok(()),
            // The file system lacks the mode (tmpfs has no ZERO_RANGE; some have neither).
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL)
                ) => {}
            Err(e) => return Err(e),
        }
        static ZEROES: [u8; 64 << 10] = [0; 64 << 10];
        let mut done = 0;
        while done < len_bytes {
            let n = (len_bytes - done).min(ZEROES.len() as u64) as usize;
            self.file.write_all_at(&ZEROES[..n], offset + done)?;
            done += n as u64;
        }
        Ok(())
    }
}

/// Opens an existing file, read-write unless `read_only`, without following a symbolic
/// link at the path.
fn open_existing(path: &Path, read_only: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Creates the file, failing if anything (a dangling link included) is already there.
fn create_new(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(CREATED_FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Explains why opening or creating `path` failed.
fn refusal(path: &Path, e: io::Error, read_only: bool) -> FileBackingError {
    let display = path.display().to_string();
    let lstat = std::fs::symlink_metadata(path);
    match e.raw_os_error() {
        // O_NOFOLLOW answers ELOOP for a link at the path.
        Some(libc::ELOOP) if lstat.as_ref().is_ok_and(|m| m.file_type().is_symlink()) => {
            FileBackingError::Symlink { path: display }
        }
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => {
            let access = if read_only { "read" } else { "read and write" };
            FileBackingError::PermissionDenied {
                path: display,
                access,
            }
        }
        // Opening a directory for writing answers EISDIR; a socket, ENXIO.
        Some(libc::EISDIR | libc::ENXIO) if lstat.is_ok() => FileBackingError::NotRegularFile {
            path: display,
            kind: kind_of(lstat.expect("checked").file_type()),
        },
        _ => FileBackingError::Os {
            path: display,
            what: "opening it",
            source: e,
        },
    }
}

/// What a file type is, in words.
fn kind_of(t: std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

#[cfg(test)]
mod tests;
