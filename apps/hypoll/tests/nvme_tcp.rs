//! NVMe/TCP end to end: `hypoll bench` on the `nvme-tcp:` device against hypoll's own
//! target served in this process (every kind of wait, the verify pass), and `hypoll serve
//! --nvme-tcp` serving the same exports over NBD and NVMe/TCP on one set of reactors.

mod support;

use std::io::{Read, Write};
use std::process::Command;
use std::time::Duration;

use hypoll_nbd::client;
use hypoll_nbd::proto::*;
use hypoll_nvme::{Controller, DeviceConfig, IoError, NvmeTcpController, Status, SyncIo};
use support::nbd::{handshake, read_ok, simple_reply};
use support::serve::{metric, one_core, two_cores, Serve};

use hypoll_frontend::ListenAddr;
use hypoll_nvmf::{NvmfConfig, NvmfExport, NvmfServer};
use hypoll_reactor::Device;

const NQN: &str = "nqn.2026-12.io.hypoll:bench-test";

#[test]
fn bench_runs_every_kind_of_wait_against_an_nvme_tcp_target_and_verifies() {
    let export = NvmfExport {
        name: "mem".into(),
        device: Device::open("emu:dram,size=64M").unwrap(),
        read_only: false,
    };
    let mut cfg = NvmfConfig::new(vec![export], "127.0.0.1:0".parse().unwrap());
    cfg.subsystem_nqn = NQN.into();
    let server = NvmfServer::start(cfg).unwrap();
    let ListenAddr::Tcp(addr) = server.local_addr() else {
        panic!("a TCP server")
    };
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let device = format!("nvme-tcp:{addr}/{NQN}");
    let out = Command::new(env!("CARGO_BIN_EXE_hypoll"))
        .args([
            "bench",
            "--device",
            &device,
            "--rw",
            "randrw:50",
            "--qd",
            "8",
        ])
        .args([
            "--size",
            "32M",
            "--runtime",
            "0.3",
            "--ramp",
            "0.1",
            "--verify",
        ])
        .args([
            "--policy",
            "classic",
            "--policy",
            "hybrid",
            "--policy",
            "interrupt",
        ])
        .args(["--json", json.to_str().unwrap()])
        .output()
        .expect("hypoll runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(&device), "{stdout}");
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 3);
    for r in rows {
        assert!(r["ios"].as_u64().unwrap() > 0, "{r}");
        assert_eq!(r["errors"], 0, "{r}");
        assert_eq!(r["mismatches"], 0, "{r}");
    }
    let report = server.stop();
    assert_eq!(report.connections_left, 0);
}

fn open(port: u16, nqn: &str, ns: u32) -> NvmeTcpController {
    let text = format!("nvme-tcp:127.0.0.1:{port}/{nqn},ns={ns}");
    let DeviceConfig::NvmeTcp(cfg) = text.parse().unwrap() else {
        panic!("an nvme-tcp device string")
    };
    NvmeTcpController::open(&cfg).unwrap()
}

#[test]
fn serve_exports_the_same_disks_over_nbd_and_nvme_tcp_and_stops_cleanly() {
    let nqn = "nqn.2026-12.io.hypoll:serve-test";
    let serve = Serve::start_with(
        &["disk=emu:dram,size=16M", "ro=emu:dram,size=4M,ro"],
        &[
            "--cores",
            &two_cores(),
            "--nvme-tcp",
            "127.0.0.1:0",
            "--nvme-nqn",
            nqn,
        ],
    );
    let (port, printed) = serve.nvme.clone().expect("the NVMe/TCP line");
    assert_eq!(printed, nqn);
    // NBD writes a block and flushes.
    let mut nbd = handshake(serve.port, "disk");
    let mut w = client::request(CMD_WRITE, 0, 1, 1 << 20, 4096);
    w.extend([0x5a; 4096]);
    w.extend(client::request(CMD_FLUSH, 0, 2, 0, 0));
    nbd.write_all(&w).unwrap();
    assert_eq!(simple_reply(&mut nbd), (1, 0));
    assert_eq!(simple_reply(&mut nbd), (2, 0));

    // A host reads it over NVMe/TCP (namespace 1 is the first export), and writes another.
    let disk = open(port, nqn, 1);
    let lba = u64::from(disk.namespace().lba_size_bytes);
    assert_eq!(disk.namespace().capacity_bytes(), 16 << 20);
    let mut qp = disk.create_queue_pair(16).unwrap();
    let mut io = SyncIo::new(&mut *qp, Duration::from_secs(10));
    let nlb = (4096 / lba) as u32;
    let got = io.read((1 << 20) / lba, nlb).unwrap();
    assert!(
        got.iter().all(|&x| x == 0x5a),
        "NBD's write, read over NVMe/TCP"
    );
    io.write((2 << 20) / lba, &[0xa5; 4096]).unwrap();
    io.flush().unwrap();

    // NBD reads the host's write.
    let back = read_ok(&mut nbd, 3, 2 << 20, 4096);
    assert!(
        back.iter().all(|&x| x == 0xa5),
        "the host's write, read over NBD"
    );

    // The read-only export is namespace 2, and refuses writes.
    let ro = open(port, nqn, 2);
    let mut qp2 = ro.create_queue_pair(4).unwrap();
    let mut io2 = SyncIo::new(&mut *qp2, Duration::from_secs(10));
    assert_eq!(
        io2.write(0, &vec![1u8; ro.namespace().lba_size_bytes as usize]),
        Err(IoError::Status(Status::NAMESPACE_WRITE_PROTECTED))
    );

    // Hosts connected and idle (keep-alives flowing, each reactor's NVMe/TCP tick running):
    // the reactors park rather than spin.
    serve.assert_idle_parks("hosts connected");

    // A stop with both hosts still connected: every connection closes, the exports flush.
    drop(nbd);
    let (status, stderr) = serve.signal_and_wait(libc::SIGTERM);
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("stopped cleanly"), "{stderr}");
    drop((io, io2));
    drop((qp, qp2, disk, ro));
}

/// NVMe/TCP has no TLS here, so it cannot serve an export only to the clients named for
/// it: refused before anything starts.
#[test]
fn serve_refuses_nvme_tcp_for_an_export_restricted_to_named_clients() {
    let out = Command::new(env!("CARGO_BIN_EXE_hypoll"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(["--nvme-tcp", "127.0.0.1:0"])
        .args(["--export", "secret=null,clients=alice.test"])
        .output()
        .expect("hypoll runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let named = stderr.contains("secret") && stderr.contains("clients=");
    assert!(named, "{stderr}");
}

/// The `--nvme-*` limit flags reach the target: a host's ICReq is answered with the
/// MAXH2CDATA asked for, and a controller past `--nvme-max-controllers` is refused while
/// the first one lives.
#[test]
fn serve_applies_the_nvme_tcp_limit_flags() {
    let nqn = "nqn.2026-12.io.hypoll:limits-test";
    let serve = Serve::start_with(
        &["disk=emu:dram,size=4M"],
        &[
            "--nvme-tcp",
            "127.0.0.1:0",
            "--nvme-nqn",
            nqn,
            "--nvme-maxh2cdata-bytes",
            "8K",
            "--nvme-max-controllers",
            "1",
        ],
    );
    let (port, _) = serve.nvme.clone().expect("the NVMe/TCP line");

    // ICReq: PDU type 0, HLEN 128, PLEN 128, PFV 0, no digests; ICResp carries MAXH2CDATA
    // at bytes 12..16.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut icreq = [0u8; 128];
    icreq[2] = 128;
    icreq[4..8].copy_from_slice(&128u32.to_le_bytes());
    s.write_all(&icreq).unwrap();
    let mut icresp = [0u8; 128];
    s.read_exact(&mut icresp).unwrap();
    assert_eq!(icresp[0], 1, "an ICResp");
    let maxh2cdata = u32::from_le_bytes(icresp[12..16].try_into().unwrap());
    assert_eq!(maxh2cdata, 8192);
    drop(s);

    // One controller at most: a second host's Connect is refused while the first lives,
    // and the first still reads.
    let first = open(port, nqn, 1);
    let second = format!("nvme-tcp:127.0.0.1:{port}/{nqn}");
    let DeviceConfig::NvmeTcp(cfg) = second.parse().unwrap() else {
        panic!("an nvme-tcp device string")
    };
    assert!(
        NvmeTcpController::open(&cfg).is_err(),
        "a second controller past --nvme-max-controllers 1"
    );
    let mut qp = first.create_queue_pair(4).unwrap();
    let mut io = SyncIo::new(&mut *qp, Duration::from_secs(10));
    io.read(0, 1).unwrap();
    drop(io);
    drop((qp, first));
    let (status, stderr) = serve.signal_and_wait(libc::SIGTERM);
    assert!(status.success(), "{stderr}");
}

/// A limit the target cannot serve is a usage error naming its flag, before anything
/// starts.
#[test]
fn serve_refuses_an_nvme_tcp_limit_out_of_range() {
    for (flag, value) in [
        ("--nvme-in-capsule-bytes", "100"),
        ("--nvme-maxh2cdata-bytes", "1K"),
        ("--nvme-queue-entries", "1"),
        ("--nvme-max-io-queues", "0"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_hypoll"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(["--nvme-tcp", "127.0.0.1:0", "--export", "m=null"])
            .args([flag, value])
            .output()
            .expect("hypoll runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {stderr}");
        assert!(stderr.contains(flag), "{flag} {value}: {stderr}");
    }
}

/// `--metrics` serves NVMe/TCP's counters beside NBD's, in one exposition (one `# EOF`).
#[test]
fn serve_metrics_count_nvme_tcp_requests_beside_nbd() {
    let nqn = "nqn.2026-12.io.hypoll:metrics-test";
    let serve = Serve::start_with(
        &["disk=emu:dram,size=4M"],
        &[
            "--cores",
            &one_core(),
            "--nvme-tcp",
            "127.0.0.1:0",
            "--nvme-nqn",
            nqn,
        ],
    );
    let (port, _) = serve.nvme.clone().expect("the NVMe/TCP line");
    let disk = open(port, nqn, 1);
    let lba = disk.namespace().lba_size_bytes;
    let mut qp = disk.create_queue_pair(4).unwrap();
    let mut io = SyncIo::new(&mut *qp, Duration::from_secs(10));
    for i in 0..3 {
        io.read(i, 4096 / lba).unwrap();
    }
    io.write(8, &[7u8; 4096]).unwrap();
    drop(io);

    let m = serve.metrics();
    let labels = |op: &str| format!("{{reactor=\"0\",export=\"disk\",op=\"{op}\"}}");
    let reads = metric(&m, &format!("hypoll_nvmf_requests_total{}", labels("read")));
    let writes = metric(
        &m,
        &format!("hypoll_nvmf_requests_total{}", labels("write")),
    );
    assert_eq!((reads, writes), (3.0, 1.0), "{m}");
    assert_eq!(
        metric(&m, &format!("hypoll_nvmf_bytes_total{}", labels("read"))),
        3.0 * 4096.0
    );
    // NBD's own families are still there, and the exposition ends once.
    assert!(m.contains("hypoll_nbd_requests"), "{m}");
    assert_eq!(m.matches("# EOF").count(), 1, "{m}");
    assert!(m.trim_end().ends_with("# EOF"), "{m}");
    drop((qp, disk));
}
