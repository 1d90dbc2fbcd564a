//! Where `hypoll serve` listens, and what it tells: a warning for a wildcard address, a Unix
//! socket (its mode, its owner where run as root, a stale one replaced, a live one kept,
//! removed on stop), and the metrics endpoint (what it counts, and clients that are slow or
//! idle, which never hold a scrape up).

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hypoll_nbd::client;
use hypoll_nbd::proto::*;
use support::nbd::{handshake, simple_reply};
use support::run_ok;
use support::serve::{metric, Serve};

/// Listening on every interface is warned about (no TLS, no authentication yet); listening
/// on the loopback is not.
#[test]
fn a_wildcard_address_is_warned_about() {
    let s = Serve::spawn(Serve::command("0.0.0.0:0", &["mem=null"], &[]));
    let _ = handshake(s.port, "mem");
    let log = s.log_until("every interface", Duration::from_secs(5));
    assert!(
        log.contains("every interface (0.0.0.0:0)") && log.contains("no TLS"),
        "{log}"
    );
    let quiet = Serve::start(&["mem=null"]);
    let _ = handshake(quiet.port, "mem");
    let log = quiet.log_until("every interface", Duration::from_secs(5));
    assert!(!log.contains("every interface"), "{log}");
}

/// `--verbose` logs each NBD and NVMe/TCP client as it connects and as it leaves, as
/// nbdkit's -v does; without it a clean session logs nothing.
#[test]
fn verbose_logs_clients_connecting_and_leaving() {
    let nvme = ["--nvme-tcp", "127.0.0.1:0"];
    for verbose in [true, false] {
        let mut extra = nvme.to_vec();
        if verbose {
            extra.push("-v");
        }
        let s = Serve::start_with(&["mem=null"], &extra);
        let (nvme_port, _) = s.nvme.clone().expect("the NVMe/TCP line");
        let mut c = handshake(s.port, "mem");
        c.write_all(&client::request(CMD_DISC, 0, 0, 0, 0)).unwrap();
        assert!(support::nbd::closed(&mut c), "NBD_CMD_DISC closes");
        // An NVMe/TCP host that says nothing and hangs up.
        drop(TcpStream::connect(("127.0.0.1", nvme_port)).unwrap());
        // Until the server has taken both connections and closed both (its metrics say
        // so), then what it logged by then.
        let done = |m: &str| {
            ["nbd", "nvmf"].iter().all(|p| {
                let line = |name: &str| {
                    let prefix = format!("hypoll_{p}_connections_{name}{{reactor=\"0\"}}");
                    m.lines()
                        .find(|l| l.starts_with(&prefix))
                        .map(|l| metric(l, &prefix))
                };
                line("total") == Some(1.0) && line("open") == Some(0.0)
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done(&s.metrics()) {
            assert!(
                Instant::now() < deadline,
                "both connections closed within 10 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // A line is written just after the count it follows: wait for both (or, without
        // --verbose, a while, for none).
        let deadline = Instant::now() + Duration::from_secs(if verbose { 5 } else { 1 });
        let mut log = String::new();
        while log.matches("client left").count() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            log.push_str(&s.stderr_text());
        }
        let lines = |what: &str| log.lines().filter(|l| l.contains(what)).count();
        if verbose {
            assert_eq!(lines("NBD client connected"), 1, "{log}");
            assert_eq!(lines("NVMe/TCP client connected"), 1, "{log}");
            assert_eq!(lines("NBD client left"), 1, "{log}");
            assert_eq!(lines("NVMe/TCP client left"), 1, "{log}");
        } else {
            assert!(
                !log.contains("connected") && !log.contains("left") && !log.contains("closed"),
                "{log}"
            );
        }
    }
}

#[test]
fn a_unix_socket_serves_and_is_removed_on_stop() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    // As root, the socket is given away too (by name and by number: `nobody` is 65534 on
    // Debian); without the privilege, that is refused at start (the unit test checks).
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let owner: &[&str] = if root {
        &["--unix-owner", "nobody:65534", "--unix-mode", "660"]
    } else {
        &[]
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_hypoll"))
        .args(["serve", "--export", "mem=emu:dram,size=8M", "--listen"])
        .arg(format!("unix:{}", sock.display()))
        .args(owner)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    struct Kill(Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let mut child = Kill(child);
    assert_eq!(
        first.trim(),
        format!("listening on unix:{}", sock.display())
    );
    if root {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::symlink_metadata(&sock).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o777),
            (65534, 65534, 0o660)
        );
    }
    let uri = format!("nbd+unix:///mem?socket={}", sock.display());
    let out = run_ok("nbdinfo", &["--size", &uri]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "8388608");
    // SAFETY: kill on our own child's pid, not reaped yet.
    unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!sock.exists(), "the socket file is removed");
}

/// A server on a Unix socket, killed when dropped.
struct UnixServe(Child);

impl Drop for UnixServe {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `hypoll serve` on the Unix socket `sock` with `extra` flags, under `umask`;
/// returns the server once it listens, or its stderr if it exited instead.
fn serve_unix(sock: &Path, extra: &[&str], umask: libc::mode_t) -> Result<UnixServe, String> {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hypoll"));
    cmd.args(["serve", "--export", "mem=emu:dram,size=8M", "--listen"])
        .arg(format!("unix:{}", sock.display()))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: the closure only calls umask, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            libc::umask(umask);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    if first.trim() == format!("listening on unix:{}", sock.display()) {
        return Ok(UnixServe(child));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    Err(String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A socket file left by a server that died is replaced at start; one where a server still
/// listens, and a file that is not a socket, are left alone and refused with a clear error.
#[test]
fn a_stale_unix_socket_is_replaced_and_a_live_one_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    // A dead server's socket: bound, then closed without removing its file.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    assert!(sock.exists());
    let first = serve_unix(&sock, &[], 0o022).expect("the stale socket is replaced");
    let uri = format!("nbd+unix:///mem?socket={}", sock.display());
    run_ok("nbdinfo", &["--size", &uri]);
    let refused = serve_unix(&sock, &[], 0o022)
        .err()
        .expect("a live socket is kept");
    assert!(refused.contains("another server is listening"), "{refused}");
    run_ok("nbdinfo", &["--size", &uri]);
    drop(first);
    let file = dir.path().join("not-a-socket");
    std::fs::write(&file, b"data").unwrap();
    let refused = serve_unix(&file, &[], 0o022).err().expect("a file is kept");
    assert!(refused.contains("not a socket"), "{refused}");
    assert_eq!(std::fs::read(&file).unwrap(), b"data");
}

/// The socket file's permissions are the server's (600 unless --unix-mode says), never the
/// umask's: under umask 000 other users must not be able to connect.
#[test]
fn a_unix_sockets_mode_is_set_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    for (extra, mode) in [(&[][..], 0o600), (&["--unix-mode", "660"][..], 0o660)] {
        let sock = dir.path().join(format!("nbd-{mode:o}.sock"));
        let _s = serve_unix(&sock, extra, 0o000).unwrap();
        let got = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
        assert_eq!(got, mode, "{:o} for {extra:?}", got);
    }
    let bad = serve_unix(&dir.path().join("x.sock"), &["--unix-mode", "1777"], 0o022);
    assert!(bad.err().unwrap().contains("--unix-mode"));
}

#[test]
fn metrics_count_requests_bytes_errors_and_connections() {
    let s = Serve::start(&["mem=emu:dram,size=8M"]);
    run_ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write 0 4k",
            "-c",
            "write 8k 4k",
            "-c",
            "write 1M 8k",
            "-c",
            "read 0 64k",
            &s.uri("mem"),
        ],
    );
    // A raw client asks for a read past the end: refused, counted.
    let mut c = handshake(s.port, "mem");
    c.write_all(&client::request(CMD_READ, 0, 1, 8 << 20, 4096))
        .unwrap();
    assert_eq!(simple_reply(&mut c), (1, EINVAL));
    drop(c);
    std::thread::sleep(Duration::from_millis(200));
    let m = s.metrics();
    let labels = |op: &str| format!("{{reactor=\"0\",export=\"mem\",op=\"{op}\"}}");
    assert_eq!(
        metric(&m, &format!("hypoll_nbd_bytes_total{}", labels("write"))),
        16384.0
    );
    assert_eq!(
        metric(&m, &format!("hypoll_nbd_requests_total{}", labels("write"))),
        3.0
    );
    assert_eq!(
        metric(&m, &format!("hypoll_nbd_bytes_total{}", labels("read"))),
        65536.0
    );
    assert_eq!(
        metric(
            &m,
            &format!(
                "hypoll_nbd_request_latency_seconds_count{}",
                labels("write")
            )
        ),
        3.0
    );
    assert_eq!(
        metric(&m, "hypoll_nbd_connections_total{reactor=\"0\"}"),
        2.0
    );
    assert_eq!(
        metric(&m, "hypoll_nbd_connections_open{reactor=\"0\"}"),
        0.0
    );
    assert_eq!(
        metric(
            &m,
            "hypoll_nbd_export_connections_total{reactor=\"0\",export=\"mem\"}"
        ),
        2.0
    );
    assert_eq!(
        metric(&m, "hypoll_nbd_requests_refused_total{reactor=\"0\"}"),
        1.0
    );
    assert!(metric(&m, "hypoll_nbd_reactor_ios{reactor=\"0\"}") >= 4.0);
    assert!(m.contains("hypoll_nbd_reactor_cpu_seconds{reactor=\"0\"}"));
}

/// A metrics client that sends its request a byte every 1.5 s neither holds the endpoint
/// (another scrape is answered at once) nor its own connection past the scrape deadline.
#[test]
fn a_slow_metrics_client_does_not_block_a_scrape() {
    let s = Serve::start(&["mem=null"]);
    let port = s.metrics_port;
    let slow = std::thread::spawn(move || {
        let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let started = Instant::now();
        for b in b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" {
            if c.write_all(&[*b]).is_err() || Instant::now() - started > Duration::from_secs(8) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1500));
        }
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = c.read_to_end(&mut Vec::new());
        Instant::now() - started
    });
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..3 {
        let started = Instant::now();
        let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut text = String::new();
        let got = c.read_to_string(&mut text);
        assert!(got.is_ok(), "the scrape waited: {got:?}");
        assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
        assert!(Instant::now() - started < Duration::from_secs(1));
        std::thread::sleep(Duration::from_millis(700));
    }
    let held = slow.join().unwrap();
    assert!(
        held < Duration::from_secs(5),
        "the slow client held on for {held:?}"
    );
}

/// Many metrics clients that connect and send nothing hold a bounded number of the
/// endpoint's threads, each at most the scrape deadline: a scrape meanwhile is answered at
/// once (503 while every slot is held), and with metrics once they are closed.
#[test]
fn idle_metrics_clients_hold_the_endpoint_boundedly() {
    let s = Serve::start(&["mem=null"]);
    let idle: Vec<TcpStream> = (0..16)
        .map(|_| TcpStream::connect(("127.0.0.1", s.metrics_port)).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let scrape = || {
        let mut c = TcpStream::connect(("127.0.0.1", s.metrics_port)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut text = String::new();
        c.read_to_string(&mut text).map(|_| text)
    };
    // Answered at once: 503, or closed (when the request arrived after the answer).
    let started = Instant::now();
    match scrape() {
        Ok(busy) => assert!(busy.starts_with("HTTP/1.1 503"), "{busy}"),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
    assert!(Instant::now() - started < Duration::from_secs(1));
    std::thread::sleep(Duration::from_millis(2500));
    let text = scrape().unwrap();
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    drop(idle);
}
