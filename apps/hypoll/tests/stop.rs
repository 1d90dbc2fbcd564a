//! How `hypoll serve` stops: SIGTERM, SIGINT, SIGHUP and SIGQUIT each stop it gracefully,
//! writes in flight complete and are on disk, and every reply it wrote reaches its client
//! before a clean end of stream.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use hypoll_nbd::client;
use hypoll_nbd::proto::*;
use support::nbd::{closed, handshake, simple_reply};
use support::serve::Serve;

/// A server of export `mem`, backed by `disk`, whose device is configured (`write_us`) with
/// writes slow enough to be still in flight when a test signals the server shortly after
/// sending them.
fn serve_slow_writes(disk: &Path) -> Serve {
    let spec = format!(
        "mem=emu:dram,backing=file:{},size=1M,write_us=300000,jitter=0",
        disk.display()
    );
    Serve::start(&[&spec])
}

#[test]
fn sigterm_finishes_in_flight_writes_flushes_and_exits() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk.bin");
    let s = serve_slow_writes(&disk);
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
        let mut got: Vec<(u64, u32)> = (0..4).map(|_| simple_reply(&mut c)).collect();
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
        let s = serve_slow_writes(&disk);
        let mut c = handshake(s.port, "mem");
        let mut m = client::request(CMD_WRITE, 0, 7, 0, 4096);
        m.extend([0x5a; 4096]);
        c.write_all(&m).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let reader = std::thread::spawn(move || simple_reply(&mut c));
        let (status, log) = s.signal_and_wait(signal);
        assert_eq!(reader.join().unwrap(), (7, 0), "signal {signal}: {log}");
        assert!(status.success(), "signal {signal}: {status}: {log}");
        assert!(log.contains(&format!("signal {signal}")), "{log}");
        assert!(log.contains("stopped cleanly"), "{log}");
        let data = std::fs::read(&disk).unwrap();
        assert!(data[..4096].iter().all(|&b| b == 0x5a), "signal {signal}");
    }
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
