//! `hypoll bench` on the `nvme-tcp:` device, against hypoll's own NVMe/TCP target served in
//! this process: every policy that waits differently (spin, sleep, interrupt) runs, and
//! the verify pass reads back what it wrote through the network.

use std::process::Command;

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
