//! `hypoll serve` driven by NBD clients nobody here wrote (qemu-io, qemu-img, nbdinfo,
//! nbdcopy, fio's nbd engine; `scripts/test` installs them), by a raw client that misbehaves
//! on purpose, and by signals. Every server runs on a free port and is killed if a test
//! fails.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hypoll_nbd::client;
use hypoll_nbd::proto::*;

/// How long a server may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long any one client command may run.
const CLIENT_TIMEOUT_S: &str = "120";

/// A running `hypoll serve`, killed when dropped.
struct Serve {
    child: Child,
    port: u16,
    metrics_port: u16,
    stderr: mpsc::Receiver<String>,
}

impl Serve {
    fn start(exports: &[&str]) -> Serve {
        Serve::start_with(exports, &[])
    }

    fn start_with(exports: &[&str], extra: &[&str]) -> Serve {
        Serve::spawn(Serve::command("127.0.0.1:0", exports, extra))
    }

    /// The command line of a server listening on `listen` (a free port) with its metrics
    /// on a free port of the loopback.
    fn command(listen: &str, exports: &[&str], extra: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hypoll"));
        cmd.args(["serve", "--listen", listen, "--metrics", "127.0.0.1:0"]);
        for e in exports {
            cmd.args(["--export", e]);
        }
        cmd.args(extra);
        cmd
    }

    /// Runs `cmd` (from [`Serve::command`]) and waits until it listens.
    fn spawn(mut cmd: Command) -> Serve {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("hypoll starts");
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let (etx, erx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = etx.send(line);
            }
        });
        let mut serve = Serve {
            child,
            port: 0,
            metrics_port: 0,
            stderr: erx,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        while serve.port == 0 || serve.metrics_port == 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx.recv_timeout(left).unwrap_or_else(|_| {
                panic!(
                    "hypoll serve did not start listening; stderr:\n{}",
                    serve.stderr_text()
                )
            });
            let port = |l: &str| -> u16 {
                l.rsplit(':')
                    .next()
                    .unwrap()
                    .trim_end_matches("/metrics")
                    .parse()
                    .unwrap()
            };
            if let Some(addr) = line.strip_prefix("listening on ") {
                serve.port = port(addr);
            } else if let Some(addr) = line.strip_prefix("metrics on ") {
                serve.metrics_port = port(addr);
            }
        }
        serve
    }

    fn uri(&self, export: &str) -> String {
        format!("nbd://127.0.0.1:{}/{export}", self.port)
    }

    fn stderr_text(&self) -> String {
        let mut s = String::new();
        while let Ok(line) = self.stderr.try_recv() {
            s.push_str(&line);
            s.push('\n');
        }
        s
    }

    fn metrics(&self) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", self.metrics_port)).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
        text
    }

    /// Sends `signal` and waits (bounded) for the exit; returns the status and stderr.
    fn signal_and_wait(mut self, signal: libc::c_int) -> (std::process::ExitStatus, String) {
        // SAFETY: kill on our own child's pid, which has not been reaped yet.
        unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(100));
                return (status, self.stderr_text());
            }
            assert!(Instant::now() < deadline, "hypoll serve did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a client tool under a timeout; panics with its output unless it succeeds.
fn run(tool: &str, args: &[&str]) -> Output {
    let which = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .unwrap();
    assert!(
        which.status.success(),
        "{tool} is not installed: scripts/test installs it (apt: qemu-utils, libnbd-bin, fio)"
    );
    let out = Command::new("timeout")
        .arg(CLIENT_TIMEOUT_S)
        .arg(tool)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{tool} {args:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn random_file(path: &Path, bytes: usize, seed: u64) {
    let mut x = seed | 1;
    let data: Vec<u8> = (0..bytes)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(path, data).unwrap();
}

/// The value of one metric line, as a number.
fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} in:\n{text}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn qemu_io_writes_patterns_and_reads_them_back() {
    let s = Serve::start(&["mem=emu:dram,size=64M"]);
    let out = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0xa5 0 1M",
            "-c",
            "write -P 0x5a 1M 3M",
            "-c",
            "write -f -P 0x3c 8M 64k",
            "-c",
            "write -z 1M 512k",
            "-c",
            "discard 4M 1M",
            "-c",
            "flush",
            "-c",
            "read -P 0xa5 0 1M",
            "-c",
            "read -P 0 1M 512k",
            "-c",
            "read -P 0x5a 1536k 2560k",
            "-c",
            "read -P 0x3c 8M 64k",
            "-c",
            "read -P 0 4M 1M",
            "-c",
            "read -P 0 63M 1M",
            &s.uri("mem"),
        ],
    );
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!text.contains("failed"), "{text}");
    assert_eq!(text.matches("read ").count(), 6, "{text}");
    // Past the end: qemu-io refuses or the server answers with an error, never data.
    let past = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read 64M 4k", &s.uri("mem")])
        .output()
        .unwrap();
    let past =
        String::from_utf8_lossy(&past.stdout).to_string() + &String::from_utf8_lossy(&past.stderr);
    assert!(!past.contains("read 4096/4096"), "{past}");
}

#[test]
fn qemu_img_convert_and_compare_round_trip_an_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("in.img");
    let back = dir.path().join("back.img");
    random_file(&img, 16 << 20, 7);
    // An io_uring export on a file (through the page cache: the test's file system may not
    // take O_DIRECT).
    let disk = dir.path().join("disk.bin");
    random_file(&disk, 16 << 20, 3);
    let spec = format!("disk=uring:{},direct=0", disk.display());
    let s = Serve::start(&[&spec]);
    let img_s = img.to_str().unwrap();
    run(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            img_s,
            &s.uri("disk"),
        ],
    );
    run(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", img_s, &s.uri("disk")],
    );
    run(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &s.uri("disk"),
            back.to_str().unwrap(),
        ],
    );
    assert!(std::fs::read(&img).unwrap() == std::fs::read(&back).unwrap());
    // A different image must not compare equal: compare really reads.
    random_file(&img, 16 << 20, 8);
    let differ = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw", img_s, &s.uri("disk")])
        .output()
        .unwrap();
    assert_eq!(differ.status.code(), Some(1), "{differ:?}");
}

#[test]
fn nbdinfo_lists_exports_and_sizes() {
    let s = Serve::start(&["a=emu:dram,size=64M", "b=null,size=1G,lba=4096"]);
    let out = run("nbdinfo", &["--list", &s.uri("")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("export=\"a\""), "{text}");
    assert!(text.contains("export=\"b\""), "{text}");
    let size = |export: &str| {
        let out = run("nbdinfo", &["--size", &s.uri(export)]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(size("a"), (64u64 << 20).to_string());
    assert_eq!(size("b"), (1u64 << 30).to_string());
    // The default export (empty name) is the first.
    assert_eq!(size(""), (64u64 << 20).to_string());
    let out = run("nbdinfo", &[&s.uri("b")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("block_size_minimum: 4096"), "{text}");
    assert!(text.contains("can_multi_conn: true"), "{text}");
    let missing = Command::new("nbdinfo").arg(s.uri("nope")).output().unwrap();
    assert!(!missing.status.success());
}

#[test]
fn nbdcopy_copies_random_data_in_and_out() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let dst = dir.path().join("dst.img");
    random_file(&src, 32 << 20, 11);
    // Two reactors when the machine has two cores, and several connections: the copy
    // spreads over both.
    let cores = hypoll_reactor::allowed_cores().unwrap();
    let cores = if cores.len() >= 2 {
        format!("{},{}", cores[0], cores[1])
    } else {
        cores[0].to_string()
    };
    let s = Serve::start_with(&["mem=emu:dram,size=32M"], &["--cores", &cores]);
    run(
        "nbdcopy",
        &["--connections=4", src.to_str().unwrap(), &s.uri("mem")],
    );
    run(
        "nbdcopy",
        &["--connections=4", &s.uri("mem"), dst.to_str().unwrap()],
    );
    run("cmp", &[src.to_str().unwrap(), dst.to_str().unwrap()]);
}

/// fio's nbd engine writes `size` of 4 KiB random blocks to export `mem` at `iodepth`,
/// then reads them back and checks each one's crc32c; asserts it found no error.
fn fio_writes_and_verifies(s: &Serve, size: &str, iodepth: u32) {
    let out = run(
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={}", s.uri("mem")),
            "--rw=randwrite",
            "--bs=4k",
            &format!("--size={size}"),
            &format!("--iodepth={iodepth}"),
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            // No verify state file left in the working directory.
            "--verify_state_save=0",
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("err= 0"), "{text}");
}

#[test]
fn fio_nbd_engine_verifies_crc32c() {
    let s = Serve::start(&["mem=emu:dram,size=64M"]);
    fio_writes_and_verifies(&s, "32M", 16);
    let m = s.metrics();
    // fio wrote 32 MiB and read it all back to verify.
    let written = metric(
        &m,
        "hypoll_nbd_bytes_total{reactor=\"0\",export=\"mem\",op=\"write\"}",
    );
    let read = metric(
        &m,
        "hypoll_nbd_bytes_total{reactor=\"0\",export=\"mem\",op=\"read\"}",
    );
    assert_eq!(written, (32u64 << 20) as f64);
    assert_eq!(read, (32u64 << 20) as f64);
}

/// Requests a reactor read at the end of coalescing windows, and the windows.
fn coalescing(s: &Serve) -> (f64, f64) {
    let m = s.metrics();
    (
        metric(&m, "hypoll_nbd_coalesced_requests_total{reactor=\"0\"}"),
        metric(&m, "hypoll_nbd_coalesce_windows_total{reactor=\"0\"}"),
    )
}

#[test]
fn a_pipelining_client_is_coalesced_and_its_data_verifies() {
    // A long window, so even a debug build finishes a batch well within it.
    let s = Serve::start_with(&["mem=emu:dram,size=64M"], &["--coalesce-us", "1000"]);
    fio_writes_and_verifies(&s, "16M", 32);
    let (gathered, windows) = coalescing(&s);
    // 4096 requests: the trial at 1024 gathers many, and coalescing stays on.
    assert!(windows >= 1.0, "no coalescing window at queue depth 32");
    assert!(
        gathered > 2.0 * windows,
        "{gathered} requests in {windows} windows: not pipelined"
    );
}

#[test]
fn a_client_at_queue_depth_one_is_not_coalesced() {
    let s = Serve::start_with(&["mem=emu:dram,size=64M"], &["--coalesce-us", "1000"]);
    run(
        "fio",
        &[
            "--name=qd1",
            "--ioengine=nbd",
            &format!("--uri={}", s.uri("mem")),
            "--rw=randread",
            "--bs=4k",
            "--size=10M",
            "--iodepth=1",
        ],
    );
    let (gathered, windows) = coalescing(&s);
    // 2560 requests: one trial window per 1024, each gathering at most the one request
    // the client sends after its reply; coalescing never turns on.
    assert!(
        windows <= 2.0,
        "{windows} windows for 2560 requests at QD 1"
    );
    assert!(
        gathered <= windows,
        "{gathered} requests in {windows} windows"
    );
}

#[test]
fn metrics_count_requests_bytes_errors_and_connections() {
    let s = Serve::start(&["mem=emu:dram,size=8M"]);
    run(
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
    assert_eq!(reply(&mut c), (1, EINVAL));
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

/// Connects and negotiates `export` with NBD_OPT_GO; returns the socket in transmission.
fn handshake(port: u16, export: &str) -> TcpStream {
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; GREETING_BYTES];
    c.read_exact(&mut greeting).unwrap();
    c.write_all(&client::handshake_go(export)).unwrap();
    // Option replies until the ACK of GO.
    loop {
        let mut h = [0u8; 20];
        c.read_exact(&mut h).unwrap();
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut data = vec![0u8; len];
        c.read_exact(&mut data).unwrap();
        assert!(kind & (1 << 31) == 0, "option error {kind:#x}");
        if kind == REP_ACK {
            return c;
        }
    }
}

/// Reads one simple reply header: (cookie, error).
fn reply(c: &mut TcpStream) -> (u64, u32) {
    let mut h = [0u8; REPLY_HEADER_BYTES];
    c.read_exact(&mut h).unwrap();
    assert_eq!(
        u32::from_be_bytes(h[0..4].try_into().unwrap()),
        SIMPLE_REPLY_MAGIC
    );
    (
        u64::from_be_bytes(h[8..16].try_into().unwrap()),
        u32::from_be_bytes(h[4..8].try_into().unwrap()),
    )
}

/// True once the server closed the connection (end of stream or reset).
fn closed(c: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(c.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn bad_input_gets_an_error_reply_or_a_clean_close_and_changes_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let s = Serve::start(&["mem=emu:dram,size=1M"]);
    // Known contents everywhere first.
    run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x77 0 1M", &s.uri("mem")],
    );

    // Garbage instead of a handshake: closed.
    let mut c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; GREETING_BYTES];
    c.read_exact(&mut greeting).unwrap();
    c.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert!(closed(&mut c));

    // An unknown option: NBD_REP_ERR_UNSUP, and the handshake goes on.
    let mut c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.read_exact(&mut greeting).unwrap();
    let mut m = client::client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    m.extend(client::option(0x4242, b"junk"));
    c.write_all(&m).unwrap();
    let mut h = [0u8; 20];
    c.read_exact(&mut h).unwrap();
    assert_eq!(
        u32::from_be_bytes(h[12..16].try_into().unwrap()),
        REP_ERR_UNSUP
    );
    drop(c);

    // Requests out of range, unaligned, unknown: error replies; the connection lives on.
    let mut c = handshake(s.port, "mem");
    let mut m = client::request(CMD_WRITE, 0, 1, (1 << 20) - 512, 1024);
    m.extend([0xee; 1024]);
    m.extend(client::request(CMD_READ, 0, 2, 100, 512));
    m.extend(client::request(CMD_TRIM, 0, 3, u64::MAX - 511, 512));
    m.extend(client::request(77, 0, 4, 0, 512));
    m.extend(client::request(CMD_READ, 0, 5, 0, 64 << 20));
    c.write_all(&m).unwrap();
    let mut replies: Vec<(u64, u32)> = (0..5).map(|_| reply(&mut c)).collect();
    replies.sort();
    assert_eq!(
        replies,
        [
            (1, ENOSPC),
            (2, EINVAL),
            (3, ENOSPC),
            (4, EINVAL),
            (5, EINVAL)
        ]
    );
    // Still usable.
    c.write_all(&client::request(CMD_FLUSH, 0, 6, 0, 0))
        .unwrap();
    assert_eq!(reply(&mut c), (6, 0));

    // A write over the request limit: the stream cannot be followed; closed.
    c.write_all(&client::request(CMD_WRITE, 0, 7, 0, 64 << 20))
        .unwrap();
    assert!(closed(&mut c));

    // A client that disconnects in the middle of a write's payload.
    let mut c = handshake(s.port, "mem");
    let mut m = client::request(CMD_WRITE, 0, 8, 4096, 8192);
    m.extend([0x11; 3000]);
    c.write_all(&m).unwrap();
    drop(c);

    // Nothing changed: every byte still reads 0x77.
    std::thread::sleep(Duration::from_millis(200));
    let out = run(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x77 0 1M", &s.uri("mem")],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("failed"), "{text}");
    let log = s.stderr_text();
    assert!(log.contains("protocol error"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    let m = s.metrics();
    assert!(
        metric(
            &m,
            "hypoll_nbd_connections_closed_on_error_total{reactor=\"0\"}"
        ) >= 2.0
    );
    // Each failure is one line: no line is a multi-line dump.
    for line in log.lines() {
        assert!(line.starts_with("hypoll serve: "), "{line}");
    }
    drop(dir);
}

#[test]
fn too_many_connections_are_refused_and_the_rest_still_work() {
    let s = Serve::start_with(&["mem=emu:dram,size=1M"], &["--max-connections", "2"]);
    let a = handshake(s.port, "mem");
    let b = handshake(s.port, "mem");
    let mut c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert!(closed(&mut c), "a third connection is closed at once");
    drop((a, b));
    std::thread::sleep(Duration::from_millis(300));
    let _ = handshake(s.port, "mem");
    assert!(s.stderr_text().contains("--max-connections"));
}

#[test]
fn sigterm_finishes_in_flight_writes_flushes_and_exits() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk.bin");
    // The export is configured with 300 ms writes: they are surely in flight when the
    // signal lands.
    let spec = format!(
        "mem=emu:dram,backing=file:{},size=1M,write_us=300000,jitter=0",
        disk.display()
    );
    let s = Serve::start(&[&spec]);
    let mut c = handshake(s.port, "mem");
    let mut m = Vec::new();
    for i in 0..4u64 {
        m.extend(client::request(CMD_WRITE, 0, i, i * 4096, 4096));
        m.extend([0x40 + i as u8; 4096]);
    }
    c.write_all(&m).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let port = s.port;
    let reader = std::thread::spawn(move || {
        let mut got: Vec<(u64, u32)> = (0..4).map(|_| reply(&mut c)).collect();
        got.sort();
        (got, closed(&mut c))
    });
    let (status, log) = s.signal_and_wait(libc::SIGTERM);
    let (got, was_closed) = reader.join().unwrap();
    assert_eq!(got, [(0, 0), (1, 0), (2, 0), (3, 0)], "{log}");
    assert!(was_closed);
    assert!(status.success(), "{status}: {log}");
    assert!(log.contains("stopped cleanly"), "{log}");
    let data = std::fs::read(&disk).unwrap();
    for i in 0..4usize {
        assert!(data[i * 4096..(i + 1) * 4096]
            .iter()
            .all(|&b| b == 0x40 + i as u8));
    }
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "not accepting"
    );
}

#[test]
fn sigint_stops_an_idle_server() {
    let s = Serve::start(&["mem=null"]);
    let (status, log) = s.signal_and_wait(libc::SIGINT);
    assert!(status.success(), "{log}");
    assert!(log.contains("signal 2"), "{log}");
}

/// A closed terminal (SIGHUP) or Ctrl-\ (SIGQUIT) stops the server as SIGTERM does: a
/// write in flight completes, is flushed and is on disk, and the exit is clean.
#[test]
fn sighup_and_sigquit_stop_gracefully_like_sigterm() {
    for signal in [libc::SIGHUP, libc::SIGQUIT] {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("disk.bin");
        // The export is configured with 300 ms writes: this one is surely in flight when the
        // signal lands.
        let spec = format!(
            "mem=emu:dram,backing=file:{},size=1M,write_us=300000,jitter=0",
            disk.display()
        );
        let s = Serve::start(&[&spec]);
        let mut c = handshake(s.port, "mem");
        let mut m = client::request(CMD_WRITE, 0, 7, 0, 4096);
        m.extend([0x5a; 4096]);
        c.write_all(&m).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let reader = std::thread::spawn(move || reply(&mut c));
        let (status, log) = s.signal_and_wait(signal);
        assert_eq!(reader.join().unwrap(), (7, 0), "signal {signal}: {log}");
        assert!(status.success(), "signal {signal}: {status}: {log}");
        assert!(log.contains(&format!("signal {signal}")), "{log}");
        assert!(log.contains("stopped cleanly"), "{log}");
        let data = std::fs::read(&disk).unwrap();
        assert!(data[..4096].iter().all(|&b| b == 0x5a), "signal {signal}");
    }
}

/// Clients of the load test, each on its own region of the export.
const LOAD_CLIENTS: usize = 64;
/// Bytes of each client's region.
const LOAD_REGION_BYTES: u64 = 256 << 10;
/// Rounds each client runs: write its region in pieces (pipelined), read it back, verify.
const LOAD_ROUNDS: u64 = 8;
/// Bytes per request.
const LOAD_IO_BYTES: u64 = 16 << 10;

fn pattern(client: usize, round: u64, at: u64) -> u8 {
    (client as u64 * 31 + round * 7 + at / 512) as u8 | 1
}

/// Writes its region with every piece in flight at once, reads it back, checks it.
fn load_client(port: u16, client: usize) -> Result<(), String> {
    let base = client as u64 * LOAD_REGION_BYTES;
    let mut c = handshake(port, "mem");
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let pieces = LOAD_REGION_BYTES / LOAD_IO_BYTES;
    for round in 0..LOAD_ROUNDS {
        let mut m = Vec::new();
        for p in 0..pieces {
            let at = base + p * LOAD_IO_BYTES;
            let fua = if p == 0 { CMD_FLAG_FUA } else { 0 };
            m.extend(client::request(CMD_WRITE, fua, p, at, LOAD_IO_BYTES as u32));
            m.extend((0..LOAD_IO_BYTES).map(|i| pattern(client, round, at + i)));
        }
        c.write_all(&m)
            .map_err(|e| format!("client {client}: {e}"))?;
        for _ in 0..pieces {
            let (cookie, error) = reply(&mut c);
            if error != 0 || cookie >= pieces {
                return Err(format!("client {client}: write {cookie} error {error}"));
            }
        }
        let mut m = Vec::new();
        for p in 0..pieces {
            m.extend(client::request(
                CMD_READ,
                0,
                p,
                base + p * LOAD_IO_BYTES,
                LOAD_IO_BYTES as u32,
            ));
        }
        c.write_all(&m)
            .map_err(|e| format!("client {client}: {e}"))?;
        for _ in 0..pieces {
            let (cookie, error) = reply(&mut c);
            if error != 0 {
                return Err(format!("client {client}: read {cookie} error {error}"));
            }
            let mut data = vec![0u8; LOAD_IO_BYTES as usize];
            c.read_exact(&mut data).unwrap();
            let at = base + cookie * LOAD_IO_BYTES;
            if let Some(i) =
                (0..LOAD_IO_BYTES).find(|&i| data[i as usize] != pattern(client, round, at + i))
            {
                return Err(format!(
                    "client {client}: round {round}: byte {} differs",
                    at + i
                ));
            }
        }
    }
    c.write_all(&client::request(CMD_DISC, 0, 0, 0, 0)).unwrap();
    Ok(())
}

#[test]
fn sixty_four_clients_verify_their_patterns_while_one_is_killed_mid_write() {
    let region_end = LOAD_CLIENTS as u64 * LOAD_REGION_BYTES;
    let victim_base = region_end;
    let victim_bytes: u64 = 16 << 20;
    let cores = hypoll_reactor::allowed_cores().unwrap();
    let cores = if cores.len() >= 2 {
        format!("{},{}", cores[0], cores[1])
    } else {
        cores[0].to_string()
    };
    let s = Serve::start_with(&["mem=emu:dram,size=48M"], &["--cores", &cores]);
    let started = Instant::now();

    // A victim process: qemu-io writing 64 KiB at a time, killed while it writes.
    let mut victim_cmd = Command::new("qemu-io");
    victim_cmd.args(["-f", "raw"]);
    for i in 0..victim_bytes / (64 << 10) {
        victim_cmd.args([
            "-c",
            &format!("write -P 0xee {} 64k", victim_base + i * (64 << 10)),
        ]);
    }
    let mut victim = victim_cmd
        .arg(s.uri("mem"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-io runs");

    let port = s.port;
    let clients: Vec<_> = (0..LOAD_CLIENTS)
        .map(|i| std::thread::spawn(move || load_client(port, i)))
        .collect();

    // A raw client torn down with a reset in the middle of a write's payload.
    let torn_at = victim_base + victim_bytes;
    {
        let c = handshake(port, "mem");
        let mut m = client::request(CMD_WRITE, 0, 1, torn_at, 65536);
        m.extend([0xdd; 30000]);
        (&c).write_all(&m).unwrap();
        linger_zero(&c);
        drop(c);
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        victim.try_wait().unwrap().is_none(),
        "the victim finished before it could be killed: give it more to write"
    );
    victim.kill().unwrap();
    victim.wait().unwrap();

    let failures: Vec<String> = clients
        .into_iter()
        .filter_map(|t| t.join().unwrap().err())
        .collect();
    assert!(failures.is_empty(), "{failures:#?}\n{}", s.stderr_text());

    // The export is consistent: every client's region holds its last round; the victim's
    // blocks hold the old or the new value, nothing else; the torn write changed nothing.
    let mut c = handshake(port, "mem");
    for client in 0..LOAD_CLIENTS {
        let base = client as u64 * LOAD_REGION_BYTES;
        c.write_all(&client::request(
            CMD_READ,
            0,
            9,
            base,
            LOAD_REGION_BYTES as u32,
        ))
        .unwrap();
        assert_eq!(reply(&mut c), (9, 0));
        let mut data = vec![0u8; LOAD_REGION_BYTES as usize];
        c.read_exact(&mut data).unwrap();
        for (i, &b) in data.iter().enumerate() {
            assert_eq!(
                b,
                pattern(client, LOAD_ROUNDS - 1, base + i as u64),
                "client {client}"
            );
        }
    }
    c.write_all(&client::request(
        CMD_READ,
        0,
        10,
        victim_base,
        (victim_bytes + 65536) as u32,
    ))
    .unwrap();
    assert_eq!(reply(&mut c), (10, 0));
    let mut data = vec![0u8; (victim_bytes + 65536) as usize];
    c.read_exact(&mut data).unwrap();
    for block in data[..victim_bytes as usize].chunks(512) {
        assert!(
            block.iter().all(|&b| b == 0) || block.iter().all(|&b| b == 0xee),
            "a victim block holds a mix"
        );
    }
    assert!(
        data[victim_bytes as usize..].iter().all(|&b| b == 0),
        "the torn write landed"
    );
    drop(c);

    std::thread::sleep(Duration::from_millis(300));
    let m = s.metrics();
    let errors: f64 = m
        .lines()
        .filter(|l| l.starts_with("hypoll_nbd_errors_total"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(errors, 0.0, "no request failed at the device");
    let open: f64 = m
        .lines()
        .filter(|l| l.starts_with("hypoll_nbd_connections_open"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(open, 0.0, "every connection closed");
    if cores.contains(',') {
        // Round-robin: both reactors carried about half the connections.
        for reactor in ["0", "1"] {
            let n = metric(
                &m,
                &format!("hypoll_nbd_connections_total{{reactor=\"{reactor}\"}}"),
            );
            assert!(n >= 32.0, "reactor {reactor} adopted {n} connections");
        }
    }
    let log = s.stderr_text();
    assert!(!log.contains("panicked"), "{log}");
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "the load test is bounded"
    );
}

/// Makes closing `c` send a reset (SO_LINGER 0), as a killed process's socket with unread
/// data does.
fn linger_zero(c: &TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket fd and a linger struct of the size given.
    let rc = unsafe {
        libc::setsockopt(
            c.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
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
    let out = run("nbdinfo", &["--size", &uri]);
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

/// The server's resident memory, from /proc.
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status");
    kb * 1024
}

#[test]
fn a_client_that_pipelines_large_reads_and_never_reads_holds_bounded_memory() {
    let s = Serve::start(&["mem=emu:dram,size=64M"]);
    let mut c = handshake(s.port, "mem");
    let before = rss_bytes(s.child.id());
    // 128 reads of 16 MiB: 2 GiB of replies if the server took them all in.
    let mut burst = Vec::new();
    for i in 0..128u64 {
        burst.extend(client::request(
            CMD_READ,
            0,
            i,
            (i % 4) * (16 << 20),
            16 << 20,
        ));
    }
    c.write_all(&burst).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let grown = rss_bytes(s.child.id()).saturating_sub(before);
    // 64 MiB of replies and in-flight reads, one more request, and the allocator's slack.
    assert!(
        grown < 160 << 20,
        "the server grew by {} MiB for one client that does not read",
        grown >> 20
    );
    // The client is served once it reads: every reply arrives, in full.
    let mut data = vec![0u8; 16 << 20];
    for _ in 0..128 {
        let (_, error) = reply(&mut c);
        assert_eq!(error, 0);
        c.read_exact(&mut data).unwrap();
    }
}

#[test]
fn requests_held_back_by_the_connection_bound_are_served_once_its_replies_drain() {
    // Against a bound of 64 KiB: 64 reads of 16 KiB (four are taken at a time), or 1000
    // reads past the end (each refusal holds its 16 bytes and 128 of overhead, so about 450
    // at a time). The rest wait in the server's input buffer, already read off the socket.
    // The replies fit the socket's buffers, so they drain in one write and no socket event
    // follows: the waiting requests must still be parsed then, their replies sent (a
    // refusal has no device completion to send it), and, from a client that has shut down
    // its side, every one answered before the connection closes.
    let s = Serve::start_with(
        &["mem=emu:dram,size=16M"],
        &["--max-connection-bytes", "64K"],
    );
    for (requests, refused) in [(64u64, false), (1000, true)] {
        for shut_down in [false, true] {
            let case = format!("{requests} requests, refused: {refused}, shut down: {shut_down}");
            let mut c = handshake(s.port, "mem");
            let mut burst = Vec::new();
            for i in 0..requests {
                let (offset, length) = if refused {
                    (32 << 20, 4096)
                } else {
                    (i * (16 << 10), 16 << 10)
                };
                burst.extend(client::request(CMD_READ, 0, i, offset, length));
            }
            c.write_all(&burst).unwrap();
            if shut_down {
                c.shutdown(std::net::Shutdown::Write).unwrap();
            }
            // The first replies reach the socket before the client reads any.
            std::thread::sleep(Duration::from_millis(300));
            let mut data = vec![0u8; 16 << 10];
            let mut cookies = Vec::new();
            for _ in 0..requests {
                let (cookie, error) = reply(&mut c);
                if refused {
                    assert_eq!(error, EINVAL, "{case}");
                } else {
                    assert_eq!(error, 0, "{case}");
                    c.read_exact(&mut data).unwrap();
                }
                cookies.push(cookie);
            }
            cookies.sort_unstable();
            assert_eq!(cookies, (0..requests).collect::<Vec<u64>>(), "{case}");
            if shut_down {
                assert!(
                    closed(&mut c),
                    "{case}: closed once every request is answered"
                );
            }
        }
    }
}

#[test]
fn a_read_from_a_device_that_moves_no_data_never_returns_another_requests_bytes() {
    // One reactor serves both exports and recycles I/O buffers between them. The `null`
    // device completes a read without writing its buffer: the server must zero it, or the
    // reply would carry what a request on the other export left there.
    let s = Serve::start(&["disk=emu:dram,size=1M", "nul=null,size=1M"]);
    let secret = vec![0x5au8; 4096];
    let mut c = handshake(s.port, "disk");
    for cookie in 0..8u64 {
        let mut m = client::request(CMD_WRITE, 0, cookie, 0, 4096);
        m.extend_from_slice(&secret);
        c.write_all(&m).unwrap();
        assert_eq!(reply(&mut c), (cookie, 0));
        c.write_all(&client::request(CMD_READ, 0, 100 + cookie, 0, 4096))
            .unwrap();
        assert_eq!(reply(&mut c), (100 + cookie, 0));
        let mut data = vec![0u8; 4096];
        c.read_exact(&mut data).unwrap();
        assert_eq!(data, secret);
    }
    let mut n = handshake(s.port, "nul");
    for cookie in 0..8u64 {
        n.write_all(&client::request(CMD_READ, 0, cookie, 0, 4096))
            .unwrap();
        assert_eq!(reply(&mut n), (cookie, 0));
        let mut data = vec![0xffu8; 4096];
        n.read_exact(&mut data).unwrap();
        assert!(
            data.iter().all(|&b| b == 0),
            "read {cookie} carried old bytes"
        );
    }
}

#[test]
fn a_client_that_never_finishes_its_handshake_is_closed() {
    let s = Serve::start_with(&["mem=emu:dram,size=1M"], &["--handshake-timeout-s", "0.5"]);
    let mut silent = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut greeting = [0u8; GREETING_BYTES];
    silent.read_exact(&mut greeting).unwrap();
    let started = Instant::now();
    // A client that did finish is left alone.
    let mut ok = handshake(s.port, "mem");
    assert!(closed(&mut silent), "the silent client is closed");
    assert!(started.elapsed() < Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(800));
    ok.write_all(&client::request(CMD_READ, 0, 9, 0, 4096))
        .unwrap();
    assert_eq!(reply(&mut ok), (9, 0));
    assert!(s.stderr_text().contains("handshake not finished"));
}

#[test]
fn write_zeroes_keeps_blocks_allocated_unless_the_client_allows_a_hole() {
    // tmpfs has no zero-range: the uring export zeroes by punching a hole, then allocates
    // the range again, unless the client allows a hole (qemu-io's `write -z -u` sends no
    // NO_HOLE flag; plain `write -z` does). Skipped where /dev/shm is absent.
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        return;
    };
    let path = dir.path().join("disk.img");
    random_file(&path, 16 << 20, 11);
    let s = Serve::start(&[&format!("shm=uring:{},direct=0", path.display())]);
    let allocated_bytes = || {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&path).unwrap().blocks() * 512
    };
    let full = allocated_bytes();
    let zero = |cmd: &str, at: &str| {
        let out = run(
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                &format!("{cmd} {at} 1M"),
                "-c",
                &format!("read -P 0 {at} 1M"),
                &s.uri("shm"),
            ],
        );
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(!text.contains("failed"), "{text}");
    };
    zero("write -z", "1M");
    assert_eq!(allocated_bytes(), full, "NO_HOLE write zeroes left a hole");
    zero("write -z -u", "4M");
    assert!(
        allocated_bytes() <= full - (1 << 20),
        "write zeroes allowed to unmap punched no hole: {} of {full} bytes allocated",
        allocated_bytes()
    );
}

#[test]
fn a_client_that_shuts_down_its_side_gets_every_reply_it_asked_for() {
    // More requests than a connection may have in flight (256), then shutdown(SHUT_WR): the
    // server reads end of stream with requests still waiting in its buffer. It must serve
    // every one and send its reply, then close. Slow reads keep the first 256 in flight while
    // the rest wait.
    let s = Serve::start(&["mem=emu:dram,size=64M,read_us=2000"]);
    let mut c = handshake(s.port, "mem");
    let mut write = client::request(CMD_WRITE, 0, 1_000, 0, 4096);
    write.extend(vec![0xab; 4096]);
    c.write_all(&write).unwrap();
    assert_eq!(reply(&mut c), (1_000, 0));
    const READS: u64 = 600;
    let mut burst = Vec::new();
    for cookie in 0..READS {
        burst.extend(client::request(CMD_READ, 0, cookie, 0, 4096));
    }
    c.write_all(&burst).unwrap();
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let mut seen = vec![false; READS as usize];
    let mut data = vec![0u8; 4096];
    for _ in 0..READS {
        let (cookie, error) = reply(&mut c);
        assert_eq!(error, 0, "request {cookie}");
        c.read_exact(&mut data).unwrap();
        assert!(data.iter().all(|&b| b == 0xab), "request {cookie}");
        assert!(
            !std::mem::replace(&mut seen[cookie as usize], true),
            "{cookie} twice"
        );
    }
    // Then the server closes.
    let mut rest = Vec::new();
    c.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "{} bytes after the replies", rest.len());
}

/// CPU seconds (user + system) the process has used, from /proc.
fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name, which ends at the last ')'; utime and stime are
    // fields 14 and 15 of the whole line, 12 and 13 after it.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks / hz
}

/// Under an open-file limit that `--max-connections` cannot fit in, the server says so at
/// start; clients past the limit wait, costing the server neither a spinning core nor a
/// flood of log lines, and are served once descriptors free up.
#[test]
fn out_of_file_descriptors_the_listener_backs_off_and_warns_at_start() {
    use std::os::unix::process::CommandExt;
    /// The server's open-file limit, soft and hard: under the default --max-connections.
    const FDS_MAX: libc::rlim_t = 64;
    /// Connections the test opens: more than the server has descriptors for.
    const CLIENTS: usize = 100;
    let mut cmd = Serve::command("127.0.0.1:0", &["mem=emu:dram,size=8M"], &[]);
    // SAFETY: the closure only calls setrlimit, which is async-signal-safe, and allocates
    // nothing.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: FDS_MAX,
                rlim_max: FDS_MAX,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let s = Serve::spawn(cmd);
    let pid = s.child.id();
    let clients: Vec<TcpStream> = (0..CLIENTS)
        .map(|_| TcpStream::connect(("127.0.0.1", s.port)).unwrap())
        .collect();
    // Let the server run out of descriptors, then watch it.
    std::thread::sleep(Duration::from_millis(300));
    let start_log = s.stderr_text();
    let cpu0 = cpu_s(pid);
    std::thread::sleep(Duration::from_millis(1500));
    let cpu = cpu_s(pid) - cpu0;
    let log = s.stderr_text();
    assert!(
        start_log.contains("open-file limit is 64") && start_log.contains("--max-connections"),
        "{start_log}"
    );
    assert!(
        start_log.contains("accept failed"),
        "the server ran out of descriptors: {start_log}"
    );
    assert!(cpu < 0.3, "{cpu} CPU seconds in 1.5 s");
    assert!(
        log.lines().count() < 10,
        "{} lines:\n{log}",
        log.lines().count()
    );
    drop(clients);
    // Closed clients free their descriptors; a new client is served.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut greeting = [0u8; GREETING_BYTES];
        if c.read_exact(&mut greeting).is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "no client is served again");
    }
}

/// What a client sees of an export names it and nothing of the server's machine: not the
/// device string, its backing file's path or its kind.
#[test]
fn clients_see_an_export_by_name_never_its_device_string() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("secret-disk.bin");
    let spec = format!("mem=emu:dram,backing=file:{},size=1M", disk.display());
    let s = Serve::start(&[&spec]);
    for args in [vec!["--list", "--json"], vec!["--json"]] {
        let uri = s.uri(if args.len() == 2 { "" } else { "mem" });
        let mut all = args.clone();
        all.push(&uri);
        let out = run("nbdinfo", &all);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("\"export-name\": \"mem\""), "{text}");
        for leak in ["secret-disk", "backing", "emu:", "file:"] {
            assert!(!text.contains(leak), "{leak:?} in {text}");
        }
    }
}

/// Listening on every interface is warned about (no TLS, no authentication yet); listening
/// on the loopback is not.
#[test]
fn a_wildcard_address_is_warned_about() {
    let log_within = |s: &Serve, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut log = String::new();
        while !log.contains(what) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            log.push_str(&s.stderr_text());
        }
        log
    };
    let s = Serve::spawn(Serve::command("0.0.0.0:0", &["mem=null"], &[]));
    let _ = handshake(s.port, "mem");
    let log = log_within(&s, "every interface");
    assert!(
        log.contains("every interface (0.0.0.0:0)") && log.contains("no TLS"),
        "{log}"
    );
    let quiet = Serve::start(&["mem=null"]);
    let _ = handshake(quiet.port, "mem");
    let log = log_within(&quiet, "every interface");
    assert!(!log.contains("every interface"), "{log}");
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
    run("nbdinfo", &["--size", &uri]);
    let refused = serve_unix(&sock, &[], 0o022)
        .err()
        .expect("a live socket is kept");
    assert!(refused.contains("another server is listening"), "{refused}");
    run("nbdinfo", &["--size", &uri]);
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

/// A graceful stop under a pipelining client that is slow to read: every reply the server
/// wrote reaches the client, then a clean end of stream, though requests the server never
/// read are still in its socket. (Closing such a socket resets the connection, and the
/// replies still queued in the server's kernel are dropped.)
#[test]
fn a_graceful_stop_delivers_every_reply_though_requests_remain_unread() {
    const READS: u64 = 8;
    const LEN: u32 = 1 << 20;
    let s = Serve::start(&["mem=emu:dram,size=16M"]);
    let mut c = handshake(s.port, "mem");
    // A small receive buffer: most of what the server writes waits in the server's kernel.
    let rcvbuf: libc::c_int = 16 << 10;
    // SAFETY: setsockopt on a socket we own, with a c_int option value of the size given.
    let set = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&c),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&rcvbuf as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(set, 0);
    let mut m = Vec::new();
    for i in 0..READS {
        m.extend(client::request(CMD_READ, 0, i, i * u64::from(LEN), LEN));
    }
    c.write_all(&m).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let reader = std::thread::spawn(move || -> Result<u64, String> {
        // The stop has begun: the server reads no more requests. These stay in its socket.
        std::thread::sleep(Duration::from_millis(300));
        let mut more = Vec::new();
        for i in 0..64u64 {
            more.extend(client::request(CMD_READ, 0, 100 + i, 0, 4096));
        }
        c.write_all(&more).map_err(|e| format!("sending: {e}"))?;
        std::thread::sleep(Duration::from_millis(500));
        let mut data = vec![0u8; LEN as usize];
        let mut replies = 0;
        loop {
            let mut h = [0u8; REPLY_HEADER_BYTES];
            match c.read_exact(&mut h) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(replies),
                Err(e) => return Err(format!("after {replies} replies: {e}")),
            }
            let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
            if error != 0 {
                return Err(format!("reply {replies}: error {error}"));
            }
            c.read_exact(&mut data)
                .map_err(|e| format!("data of reply {replies}: {e}"))?;
            replies += 1;
        }
    });
    let (status, log) = s.signal_and_wait(libc::SIGTERM);
    let replies = reader.join().unwrap();
    assert_eq!(replies, Ok(READS), "{log}");
    assert!(status.success(), "{status}: {log}");
}

/// The first core this process may run on, as `--cores` takes it.
fn one_core() -> String {
    hypoll_reactor::allowed_cores().unwrap()[0].to_string()
}

/// Clients that each send most of a large write and then stop hold a bounded amount of the
/// server's memory (a reactor receives at most `LARGE_INPUTS_PER_REACTOR` large requests at
/// once; the others wait unread), not a whole request's buffer each; and once they finish
/// sending, every write completes and its data is there.
#[test]
fn clients_that_send_most_of_a_large_write_and_stop_hold_bounded_memory() {
    const CLIENTS: u64 = 16;
    const LEN: u32 = 32 << 20;
    const SENT: usize = 31 << 20;
    let s = Serve::start_with(
        &["mem=emu:dram,size=512M"],
        &["--cores", &one_core(), "--max-connection-bytes", "64K"],
    );
    let before = rss_bytes(s.child.id());
    let (go_on_tx, go_on_rx) = std::sync::mpsc::channel::<()>();
    let go_on = std::sync::Arc::new(std::sync::Mutex::new(go_on_rx));
    let port = s.port;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let go_on = go_on.clone();
            std::thread::spawn(move || -> Result<(), String> {
                let mut c = handshake(port, "mem");
                c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                let mut m = client::request(CMD_WRITE, 0, i, i * u64::from(LEN), LEN);
                m.extend(vec![i as u8 + 1; LEN as usize]);
                c.write_all(&m[..SENT])
                    .map_err(|e| format!("client {i}: {e}"))?;
                // Wait for the word, then send the rest.
                go_on.lock().unwrap().recv().unwrap();
                c.write_all(&m[SENT..])
                    .map_err(|e| format!("client {i}: {e}"))?;
                let mut h = [0u8; REPLY_HEADER_BYTES];
                c.read_exact(&mut h)
                    .map_err(|e| format!("client {i}: reading its reply: {e}"))?;
                let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
                let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
                if (cookie, error) != (i, 0) {
                    return Err(format!("client {i}: reply {cookie} error {error}"));
                }
                Ok(())
            })
        })
        .collect();
    // Each client's send blocks once the kernel's buffers are full: what the server holds is
    // what it took in.
    std::thread::sleep(Duration::from_secs(3));
    let grown = rss_bytes(s.child.id()).saturating_sub(before);
    eprintln!(
        "{CLIENTS} half-sent writes: the server grew by {} MiB",
        grown >> 20
    );
    // Four large requests in full, sixteen standing 1 MiB buffers, and the allocator's slack;
    // one buffer per client would be 512 MiB.
    assert!(
        grown < 200 << 20,
        "the server grew by {} MiB for {CLIENTS} half-sent writes",
        grown >> 20
    );
    for _ in 0..CLIENTS {
        go_on_tx.send(()).unwrap();
    }
    let failed: Vec<String> = clients
        .into_iter()
        .filter_map(|c| c.join().unwrap().err())
        .collect();
    assert!(failed.is_empty(), "{failed:?}: {}", s.stderr_text());
    let out = run(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x10 480M 32M", &s.uri("mem")],
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("failed"));
}

/// A client that sends part of a request and then nothing is closed after the request
/// stall timeout; with an idle timeout, a connection that sends nothing with nothing in
/// flight is closed too, while a busy one is not.
#[test]
fn stalled_requests_and_idle_connections_are_closed_busy_ones_are_not() {
    let s = Serve::start_with(
        &["mem=emu:dram,size=1M"],
        &["--request-timeout-s", "0.5", "--idle-timeout-s", "1"],
    );
    let mut stalled = handshake(s.port, "mem");
    let mut m = client::request(CMD_WRITE, 0, 1, 0, 8192);
    m.extend([7u8; 4096]);
    stalled.write_all(&m).unwrap();
    let mut idle = handshake(s.port, "mem");
    let mut busy = handshake(s.port, "mem");
    let started = Instant::now();
    for i in 0..8u64 {
        busy.write_all(&client::request(CMD_READ, 0, 100 + i, 0, 512))
            .unwrap();
        assert_eq!(reply(&mut busy), (100 + i, 0));
        let mut data = [0u8; 512];
        busy.read_exact(&mut data).unwrap();
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(started.elapsed() >= Duration::from_secs(2));
    assert!(closed(&mut stalled), "the stalled client is closed");
    assert!(closed(&mut idle), "the idle client is closed");
    let log = s.stderr_text();
    assert!(log.contains("request stall timeout"), "{log}");
}
