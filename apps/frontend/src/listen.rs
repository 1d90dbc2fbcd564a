//! Where clients connect and how their sockets reach a reactor: the listening socket (TCP or
//! Unix) and the listener thread that accepts connections within the service's connection
//! limit and hands each to a reactor, round-robin. A connection then lives on that reactor
//! for good.

use std::fmt;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use hypoll_reactor::ReactorHandle;

use crate::config::UnixOwner;
use crate::loglimit::{suppressed_note, LogLimit};
use crate::protocol::{HasShard, Protocol};

use crate::stream::Stream;

/// How often the listener checks whether it should stop.
const ACCEPT_CHECK_MS: i32 = 50;
/// First pause after `accept()` fails. A failure for want of descriptors or memory
/// (EMFILE, ENFILE, ENOBUFS) leaves the connection queued and the listener readable, so
/// retrying at once would spin and log without end.
const ACCEPT_BACKOFF_MS_MIN: u64 = 1;
/// Longest pause between retries: a closing connection frees a descriptor, and the next
/// client should not wait much longer than this to be accepted.
const ACCEPT_BACKOFF_MS_MAX: u64 = 100;

const _: () = assert!(ACCEPT_BACKOFF_MS_MIN <= ACCEPT_BACKOFF_MS_MAX);

/// How long a connection accepted at the limit waits for a slot before it is refused. The
/// count of open connections falls only when a reactor has seen a close, a turn or so
/// after the client hung up: without this grace, clients that connect as others leave
/// are refused while the server is not full.
const FULL_GRACE_MS: u64 = 100;
/// How often the listener looks at the count during that grace.
const FULL_CHECK_MS: u64 = 1;

/// The pacing of `accept()` failures: each failure in a row pauses twice as long as the one
/// before (from [`ACCEPT_BACKOFF_MS_MIN`] to [`ACCEPT_BACKOFF_MS_MAX`]), and only the first
/// of a run is logged; a success ends the run.
#[derive(Debug, Default)]
struct AcceptBackoff {
    pause_ms: u64,
    failures: u64,
}

impl AcceptBackoff {
    /// A failure: how long to pause, and whether it is the first of its run (to log).
    fn failed(&mut self) -> (Duration, bool) {
        let first = self.failures == 0;
        self.failures += 1;
        self.pause_ms = if first {
            ACCEPT_BACKOFF_MS_MIN
        } else {
            (self.pause_ms * 2).min(ACCEPT_BACKOFF_MS_MAX)
        };
        assert!((ACCEPT_BACKOFF_MS_MIN..=ACCEPT_BACKOFF_MS_MAX).contains(&self.pause_ms));
        (Duration::from_millis(self.pause_ms), first)
    }

    /// A success: ends the run; returns how many failures it had (0: there was none).
    fn accepted(&mut self) -> u64 {
        self.pause_ms = 0;
        std::mem::take(&mut self.failures)
    }
}

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl std::str::FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<ListenAddr, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path, e.g. unix:/tmp/hypoll.sock".into());
            }
            return Ok(ListenAddr::Unix(path.into()));
        }
        s.parse()
            .map(ListenAddr::Tcp)
            .map_err(|_| format!("{s:?}: expected ADDR:PORT (127.0.0.1:10809) or unix:PATH"))
    }
}

impl ListenAddr {
    /// Whether it binds every interface of the machine (`0.0.0.0`, `[::]`).
    pub fn is_wildcard(&self) -> bool {
        matches!(self, ListenAddr::Tcp(a) if a.ip().is_unspecified())
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Tcp(a) => write!(f, "{a}"),
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// A bound, non-blocking listening socket. A Unix socket's file is removed when it drops.
pub(crate) enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Listener {
    /// Binds `addr`, non-blocking; a Unix socket's file gets permissions `unix_mode` and,
    /// if given, owner and group `owner`.
    pub(crate) fn bind(
        addr: &ListenAddr,
        unix_mode: u32,
        owner: Option<UnixOwner>,
    ) -> io::Result<Listener> {
        let l = match addr {
            ListenAddr::Tcp(a) => {
                let l = TcpListener::bind(a)?;
                l.set_nonblocking(true)?;
                Listener::Tcp(l)
            }
            ListenAddr::Unix(p) => {
                let l = bind_unix(p, unix_mode, owner)?;
                l.set_nonblocking(true)?;
                Listener::Unix(l, p.clone())
            }
        };
        Ok(l)
    }

    /// Where clients connect (the real port when port 0 was asked for).
    pub(crate) fn local_addr(&self) -> io::Result<ListenAddr> {
        match self {
            Listener::Tcp(l) => Ok(ListenAddr::Tcp(l.local_addr()?)),
            Listener::Unix(_, p) => Ok(ListenAddr::Unix(p.clone())),
        }
    }

    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Tcp(l) => l.as_fd(),
            Listener::Unix(l, _) => l.as_fd(),
        }
    }

    /// A new client's non-blocking stream (TCP without Nagle's delay) and a name for logs.
    fn accept(&self) -> io::Result<(Stream, String)> {
        match self {
            Listener::Tcp(l) => l.accept().and_then(|(s, peer)| {
                s.set_nonblocking(true)?;
                s.set_nodelay(true)?;
                Ok((Stream::Tcp(s), peer.to_string()))
            }),
            Listener::Unix(l, _) => l.accept().and_then(|(s, _)| {
                s.set_nonblocking(true)?;
                Ok((Stream::Unix(s), "unix client".to_string()))
            }),
        }
    }
}

/// Binds a Unix socket at `path` whose file has permissions `mode`. A socket file left by
/// a server that died (nothing answers a connect) is replaced; a socket where a server
/// still listens, or a file that is not a socket, is left alone and is an error.
fn bind_unix(path: &Path, mode: u32, owner: Option<UnixOwner>) -> io::Result<UnixListener> {
    match bind_unix_with_mode(path, mode, owner) {
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            remove_stale_socket(path)?;
            bind_unix_with_mode(path, mode, owner)
        }
        bound => bound,
    }
}

/// Private directories tried beside a socket while binding it (each is removed after).
const STAGING_DIRS_MAX: usize = 64;

fn bind_unix_with_mode(
    path: &Path,
    mode: u32,
    owner: Option<UnixOwner>,
) -> io::Result<UnixListener> {
    assert!(mode <= 0o777);
    // bind() creates the socket file with the umask's permissions: under a permissive umask
    // any user could connect before a later chmod. So the socket is bound in a fresh
    // directory only this user may enter, given its mode there, and only then linked to
    // its name: no moment exists at which the name reaches a more open socket, and the
    // process's umask (shared with every thread of an embedding program) is left alone.
    // A link, unlike a rename, never replaces what is at the name.
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    // Short names, so the staged path is no longer than `path` itself for any socket name
    // of six bytes or more: a socket's path is bounded (`sun_path`, 108 bytes).
    let private = (0..STAGING_DIRS_MAX)
        .map(|n| parent.join(format!(".h{n}")))
        .find_map(
            |dir| match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => Some(Ok(dir)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => None,
                Err(e) => Some(Err(e)),
            },
        )
        .unwrap_or_else(|| {
            Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "no free name for a private directory beside the socket",
            ))
        })?;
    let staged = private.join("s");
    let bound = UnixListener::bind(&staged).and_then(|listener| {
        // Exactly `mode`, whatever the platform's bits for a new socket file.
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode))?;
        if let Some(o) = owner {
            // Owned as asked before the name reaches it, like its mode.
            std::os::unix::fs::chown(&staged, o.uid, o.gid).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "giving the socket owner {:?} and group {:?}: {e}",
                        o.uid, o.gid
                    ),
                )
            })?;
        }
        std::fs::hard_link(&staged, path).map_err(|e| match e.kind() {
            io::ErrorKind::AlreadyExists => io::Error::new(io::ErrorKind::AddrInUse, e),
            _ => e,
        })?;
        Ok(listener)
    });
    // The listener stays bound to the socket, now reached by `path` alone.
    let _ = std::fs::remove_file(&staged);
    let _ = std::fs::remove_dir(&private);
    bound
}

/// Removes the socket file at `path` if no server listens on it (nothing answers a
/// connect), before a new one is bound there. A socket where a server still listens
/// (`AddrInUse`), and a file that is not a socket (`AlreadyExists`), are left alone.
pub fn remove_stale_socket(path: &Path) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(path)?;
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "the path exists and is not a socket; it is left alone",
        ));
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "another server is listening on this socket",
        )),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            tracing::info!("{}: replacing a stale socket file", path.display());
            std::fs::remove_file(path)
        }
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("the socket file exists and connecting to it to see whether it is stale failed: {e}"),
        )),
    }
}

/// The listener thread's loop: accepts until `stop`, refuses past `connections_max` open
/// connections (counted in `open`, which the reactors decrement as connections close), and
/// hands each accepted stream to the next reactor's shard of protocol `P`.
pub(crate) fn accept_loop<P: Protocol, S: HasShard<P>>(
    listener: Listener,
    stop: &AtomicBool,
    open: &AtomicUsize,
    connections_max: usize,
    handles: &[ReactorHandle<S>],
) {
    assert!(!handles.is_empty());
    let mut next = 0usize;
    let mut backoff = AcceptBackoff::default();
    let refusals = LogLimit::default();
    while !stop.load(Ordering::Acquire) {
        match hypoll_nvme::wait_readable(listener.fd(), ACCEPT_CHECK_MS) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                tracing::error!("waiting for connections: {e}; no longer accepting");
                return;
            }
        }
        let (stream, peer) = match listener.accept() {
            Ok(a) => a,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                let (pause, first) = backoff.failed();
                if first {
                    tracing::warn!(
                        "accept failed: {e}; retrying after pauses of up to \
                         {ACCEPT_BACKOFF_MS_MAX} ms, logging again once an accept succeeds"
                    );
                }
                std::thread::sleep(pause);
                continue;
            }
        };
        let failures = backoff.accepted();
        if failures > 0 {
            tracing::warn!("accepting again after {failures} failed accepts");
        }
        if !wait_for_slot(open, connections_max, stop) {
            // The setting by its name: the front end that took it from its user (a flag,
            // a file) says how the user wrote it.
            if let Some(suppressed) = refusals.admit(std::time::Instant::now()) {
                tracing::warn!(
                    setting = "connections_max",
                    "{peer}: refused: {connections_max} connections are open{}",
                    suppressed_note(suppressed)
                );
            }
            continue;
        }
        open.fetch_add(1, Ordering::AcqRel);
        let h = &handles[next % handles.len()];
        next = next.wrapping_add(1);
        let index = h.index();
        // A refused send drops the message, and the stream in it, here: closed.
        let sent = h.send(move |r, state: &mut S| state.shard().adopt(r, stream, peer));
        if let Err(e) = sent {
            open.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("connection dropped: reactor {index}: {e}");
        }
    }
}

/// Whether fewer than `connections_max` connections are open, now or within
/// [`FULL_GRACE_MS`] (or until `stop`).
fn wait_for_slot(open: &AtomicUsize, connections_max: usize, stop: &AtomicBool) -> bool {
    let mut waited_ms = 0;
    while open.load(Ordering::Acquire) >= connections_max {
        if waited_ms >= FULL_GRACE_MS || stop.load(Ordering::Acquire) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(FULL_CHECK_MS));
        waited_ms += FULL_CHECK_MS;
    }
    true
}

#[cfg(test)]
mod tests;
