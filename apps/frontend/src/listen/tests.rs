//! The listening socket and the accept loop: socket files and their modes and owners, the
//! connection limit and its grace, rate-limited refusals, the accept back-off.

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
            accept_loop::<Sender, _>(listener, &stop, open, connections_max, set.handles());
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
