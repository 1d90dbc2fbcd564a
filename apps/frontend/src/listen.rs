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
use crate::protocol::Protocol;
use crate::shard::Shard;
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

/// Removes the socket file at `path` if no server listens on it.
fn remove_stale_socket(path: &Path) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(path)?;
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
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
pub(crate) fn accept_loop<P: Protocol>(
    listener: Listener,
    stop: &AtomicBool,
    open: &AtomicUsize,
    connections_max: usize,
    handles: &[ReactorHandle<Shard<P>>],
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
        let sent = h.send(move |r, shard| shard.adopt(r, stream, peer));
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
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use hypoll_reactor::{allowed_cores, CoreList, ReactorConfig, ReactorSet};

    use super::*;

    /// A socket's file gets the owner and group asked for before clients can reach it; a
    /// server without the privilege to give them away says so and binds nothing.
    #[test]
    fn a_socket_gets_the_owner_asked_for_or_a_clear_refusal() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("owned.sock");
        // 65534: `nobody` and `nogroup` on Debian, present on every Linux system.
        let owner = UnixOwner {
            uid: Some(65534),
            gid: Some(65534),
        };
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        match bind_unix(&path, 0o660, Some(owner)) {
            Ok(listener) => {
                assert!(root, "only root can give a file away");
                let meta = std::fs::symlink_metadata(&path).unwrap();
                assert_eq!((meta.uid(), meta.gid()), (65534, 65534));
                assert_eq!(meta.permissions().mode() & 0o777, 0o660);
                drop(listener);
            }
            Err(e) => {
                assert!(!root, "root may give it away: {e}");
                assert!(e.to_string().contains("giving the socket owner"), "{e}");
                assert!(!path.exists(), "nothing is left at the name");
            }
        }
    }

    /// A socket path near the kernel's bound still binds: the private directory it is
    /// staged in adds no length to it.
    #[test]
    fn a_long_socket_path_binds_with_its_mode() {
        let base = std::env::temp_dir().join(format!("hypoll-long-{}", std::process::id()));
        // `sun_path` holds 108 bytes with the terminating NUL.
        let pad = 107 - base.as_os_str().len() - "/".len() - "/nbd.sock".len();
        let dir = base.join("d".repeat(pad));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("nbd.sock");
        assert_eq!(path.as_os_str().len(), 107);
        let listener = bind_unix(&path, 0o640, None).unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o640);
        UnixStream::connect(&path).unwrap();
        drop(listener);
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            left,
            vec![std::ffi::OsString::from("nbd.sock")],
            "no staging directory left"
        );
        std::fs::remove_dir_all(&base).unwrap();
    }
    use crate::conn::tests::Sender;

    /// What a `tracing` subscriber wrote.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Runs the accept loop with `open` connections counted open of `connections_max`,
    /// while `clients` connects to it; returns what was logged. The loop stops once
    /// `clients` returns.
    fn listen_while(
        open: &Arc<AtomicUsize>,
        connections_max: usize,
        clients: impl FnOnce(SocketAddr) + Send,
    ) -> String {
        let listener = Listener::bind(&"127.0.0.1:0".parse().unwrap(), 0o600, None).unwrap();
        let Ok(ListenAddr::Tcp(addr)) = listener.local_addr() else {
            panic!("a TCP listener");
        };
        let cfg = ReactorConfig {
            cores: Some(CoreList::new(vec![allowed_cores().unwrap()[0]])),
            ..ReactorConfig::default()
        };
        let metrics = crate::metrics::Metrics::new("test", "test");
        let service = crate::ServiceConfig::new(ListenAddr::Tcp(addr));
        let shards_open = open.clone();
        let set = ReactorSet::start(cfg, move |r| {
            let conns = metrics.conns(r.index());
            let open = shards_open.clone();
            Ok(crate::shard::build(r, Sender, &service, conns, open, None)?)
        })
        .unwrap();
        let stop = AtomicBool::new(false);
        let log = Captured::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        std::thread::scope(|s| {
            s.spawn(|| {
                clients(addr);
                stop.store(true, Ordering::Release);
            });
            tracing::subscriber::with_default(subscriber, || {
                accept_loop::<Sender>(listener, &stop, open, connections_max, set.handles());
            });
        });
        assert!(set.shutdown().panics.is_empty());
        let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        text
    }

    /// Connects and waits for the server to close the connection; returns the bytes read.
    fn connect_and_read(addr: SocketAddr) -> io::Result<usize> {
        let mut c = TcpStream::connect(addr)?;
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        c.read(&mut [0u8; 1])
    }

    /// A connection past the limit is closed, and the warning names the setting by its
    /// field (`connections_max`), never a flag: the binary maps the one to the other.
    #[test]
    fn a_connection_past_the_limit_is_refused_with_a_warning_naming_the_setting() {
        let open = Arc::new(AtomicUsize::new(1));
        let text = listen_while(&open, 1, |addr| {
            assert_eq!(connect_and_read(addr).unwrap(), 0, "closed at once");
        });
        assert_eq!(open.load(Ordering::Acquire), 1, "and not counted");
        assert!(text.contains("WARN"), "{text}");
        assert!(text.contains("refused: 1 connections are open"), "{text}");
        assert!(text.contains("setting=\"connections_max\""), "{text}");
        assert!(!text.contains("--"), "{text}");
    }

    /// A client that connects just as another leaves, before a reactor has seen the close
    /// and counted it, is not refused: the listener waits a little for the slot.
    #[test]
    fn a_slot_freed_a_moment_later_takes_the_connection_instead_of_a_refusal() {
        let open = Arc::new(AtomicUsize::new(1));
        let text = listen_while(&open, 1, |addr| {
            std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(FULL_GRACE_MS / 5));
                    open.fetch_sub(1, Ordering::AcqRel);
                });
                let c = TcpStream::connect(addr).unwrap();
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                while open.load(Ordering::Acquire) != 1 && std::time::Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                drop(c);
            });
        });
        assert!(!text.contains("refused"), "{text}");
    }

    /// A client connecting in a loop against a full server is refused each time, but the
    /// log gets a bounded number of lines, not one per attempt.
    #[test]
    fn a_connect_loop_against_a_full_server_logs_a_bounded_number_of_lines() {
        let open = Arc::new(AtomicUsize::new(1));
        let mut attempts = 0;
        let text = listen_while(&open, 1, |addr| {
            let until = std::time::Instant::now() + Duration::from_millis(1_500);
            while std::time::Instant::now() < until {
                // Closed by the server, or still waiting in its backlog: either way, again.
                if let Ok(c) = TcpStream::connect(addr) {
                    drop(c);
                }
                attempts += 1;
            }
        });
        let lines = text.matches("refused: 1 connections are open").count();
        assert!(
            lines <= 2 * crate::LOG_LINES_PER_WINDOW_MAX as usize,
            "{lines} lines for {attempts} attempts"
        );
    }

    /// Failures in a row pause longer and longer, up to the bound, and only the first of a
    /// run is logged; a success starts over.
    #[test]
    fn accept_failures_back_off_to_a_bound_and_log_once_per_run() {
        let mut b = AcceptBackoff::default();
        let run: Vec<(Duration, bool)> = (0..20).map(|_| b.failed()).collect();
        assert_eq!(run[0], (Duration::from_millis(ACCEPT_BACKOFF_MS_MIN), true));
        assert!(run[1..].iter().all(|&(_, log)| !log));
        assert!(run.windows(2).all(|w| w[0].0 <= w[1].0));
        assert_eq!(run[19].0, Duration::from_millis(ACCEPT_BACKOFF_MS_MAX));
        assert_eq!(b.accepted(), 20);
        assert_eq!(b.accepted(), 0);
        assert_eq!(
            b.failed(),
            (Duration::from_millis(ACCEPT_BACKOFF_MS_MIN), true)
        );
    }

    #[test]
    fn listen_addresses_parse() {
        assert_eq!(
            "127.0.0.1:10809".parse::<ListenAddr>(),
            Ok(ListenAddr::Tcp("127.0.0.1:10809".parse().unwrap()))
        );
        assert_eq!(
            "unix:/tmp/x.sock".parse::<ListenAddr>(),
            Ok(ListenAddr::Unix("/tmp/x.sock".into()))
        );
        assert!("unix:".parse::<ListenAddr>().is_err());
        let wildcard = |s: &str| s.parse::<ListenAddr>().unwrap().is_wildcard();
        assert!(wildcard("0.0.0.0:10809") && wildcard("[::]:10809"));
        assert!(!wildcard("127.0.0.1:10809") && !wildcard("[::1]:0"));
        assert!(!wildcard("192.168.1.2:0") && !wildcard("unix:/tmp/x.sock"));
        assert!("localhost".parse::<ListenAddr>().is_err());
        assert_eq!(
            ListenAddr::Unix("/a".into()).to_string(),
            "unix:/a".to_string()
        );
    }
}
