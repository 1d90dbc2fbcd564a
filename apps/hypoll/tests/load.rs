//! The load test: 64 clients of `hypoll serve` over two reactors write and verify patterns
//! while a `qemu-io` process is killed in mid-write and another socket is reset in the
//! middle of a write's payload; none of the others sees an error, and the export is
//! consistent afterwards.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hypoll_nbd::client;
use hypoll_nbd::proto::*;
use support::nbd::{handshake, simple_reply};
use support::serve::{metric, two_cores, Serve};

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
            let (cookie, error) = simple_reply(&mut c);
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
            let (cookie, error) = simple_reply(&mut c);
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

/// Passes the victim makes over its region (see below).
const VICTIM_PASSES: u64 = 64;

#[test]
fn sixty_four_clients_verify_their_patterns_while_one_is_killed_mid_write() {
    let region_end = LOAD_CLIENTS as u64 * LOAD_REGION_BYTES;
    let victim_base = region_end;
    let victim_bytes: u64 = 16 << 20;
    let cores = two_cores();
    let s = Serve::start_with(&["mem=emu:dram,size=48M"], &["--cores", &cores]);
    let started = Instant::now();

    // A victim process: qemu-io writing 64 KiB at a time, killed while it writes. It goes
    // over its region many times (the same bytes each time), so that it is still writing
    // when it is killed however fast the machine is: one pass can end within the wait.
    let mut victim_cmd = Command::new("qemu-io");
    victim_cmd.args(["-f", "raw"]);
    for _pass in 0..VICTIM_PASSES {
        for i in 0..victim_bytes / (64 << 10) {
            victim_cmd.args([
                "-c",
                &format!("write -P 0xee {} 64k", victim_base + i * (64 << 10)),
            ]);
        }
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
        assert_eq!(simple_reply(&mut c), (9, 0));
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
    assert_eq!(simple_reply(&mut c), (10, 0));
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
