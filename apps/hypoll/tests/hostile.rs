//! Clients of `hypoll serve` that misbehave on purpose: bytes that are not NBD, requests out
//! of range or over the limit, more connections than allowed or than the server has
//! descriptors for, handshakes and requests that stop half way, and idle connections. Each
//! gets an error reply or a clean close, and changes nothing for anyone else.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hypoll_nbd::client;
use hypoll_nbd::proto::*;
use support::nbd::{closed, handshake, simple_reply};
use support::run_ok;
use support::serve::{metric, Serve};

#[test]
fn bad_input_gets_an_error_reply_or_a_clean_close_and_changes_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let s = Serve::start(&["mem=emu:dram,size=1M"]);
    // Known contents everywhere first.
    run_ok(
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
    let mut replies: Vec<(u64, u32)> = (0..5).map(|_| simple_reply(&mut c)).collect();
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
    assert_eq!(simple_reply(&mut c), (6, 0));

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
    let out = run_ok(
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
    assert_eq!(simple_reply(&mut ok), (9, 0));
    assert!(s.stderr_text().contains("handshake not finished"));
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
        assert_eq!(simple_reply(&mut busy), (100 + i, 0));
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
    let pid = s.pid();
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
