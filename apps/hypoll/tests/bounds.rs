//! What a client can make `hypoll serve` hold is bounded: clients that never read their
//! replies, or send most of a large write and stop, cost the server a bounded amount of
//! memory; requests held back by a bound, or left in the buffer when a client shuts down its
//! side, are still served, each reply sent.

mod support;

use std::io::{Read, Write};
use std::time::Duration;

use hypoll_nbd::client;
use hypoll_nbd::proto::*;
use support::nbd::{closed, handshake, simple_reply};
use support::run_ok;
use support::serve::{one_core, Serve};

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
    let before = rss_bytes(s.pid());
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
    let grown = rss_bytes(s.pid()).saturating_sub(before);
    // 64 MiB of replies and in-flight reads, one more request, and the allocator's slack.
    assert!(
        grown < 160 << 20,
        "the server grew by {} MiB for one client that does not read",
        grown >> 20
    );
    // The client is served once it reads: every reply arrives, in full.
    let mut data = vec![0u8; 16 << 20];
    for _ in 0..128 {
        let (_, error) = simple_reply(&mut c);
        assert_eq!(error, 0);
        c.read_exact(&mut data).unwrap();
    }
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
    let before = rss_bytes(s.pid());
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
    let grown = rss_bytes(s.pid()).saturating_sub(before);
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
    let out = run_ok(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x10 480M 32M", &s.uri("mem")],
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("failed"));
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
                let (cookie, error) = simple_reply(&mut c);
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
    assert_eq!(simple_reply(&mut c), (1_000, 0));
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
        let (cookie, error) = simple_reply(&mut c);
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
