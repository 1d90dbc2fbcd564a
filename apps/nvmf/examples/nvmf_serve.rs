//! A standalone NVMe/TCP server, for measurements and manual tests until `hypoll serve`
//! runs NVMe/TCP beside NBD on its reactors: every export a namespace of one subsystem.
//! Prints where it listens and the NQN, then serves until stdin closes (or `--seconds`).
//!
//! ```sh
//! cargo run --release -p hypoll-nvmf --example nvmf_serve -- \
//!     --listen 127.0.0.1:4420 --export mem=null,size=1G --cores 0 --policy adaptive
//! hypoll bench --device nvme-tcp:127.0.0.1:4420/nqn.2026-12.io.hypoll:serve --qd 32
//! ```

use std::io::{BufRead, Write};
use std::time::Duration;

use hypoll_frontend::ListenAddr;
use hypoll_nvmf::{NvmfConfig, NvmfExport, NvmfServer};
use hypoll_reactor::{CoreList, Device};

fn main() {
    let mut listen: ListenAddr = "127.0.0.1:4420".parse().unwrap();
    let mut exports = Vec::new();
    let mut cores = None;
    let mut policy = "adaptive".to_string();
    let mut nqn = None;
    let mut seconds = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" => listen = value.parse().expect("--listen ADDR:PORT"),
            "--export" => {
                let (name, spec) = value.split_once('=').expect("--export NAME=DEVICE");
                exports.push(NvmfExport {
                    name: name.into(),
                    device: Device::open(spec).expect("opening the export's device"),
                    read_only: false,
                });
            }
            "--cores" => cores = Some(CoreList::parse(&value).expect("--cores 0, 0-1")),
            "--policy" => policy = value,
            "--nqn" => nqn = Some(value),
            "--seconds" => seconds = Some(value.parse::<f64>().expect("--seconds N")),
            other => panic!("unknown flag {other}"),
        }
    }
    if exports.is_empty() {
        exports.push(NvmfExport {
            name: "null".into(),
            device: Device::open("null,size=1G").unwrap(),
            read_only: false,
        });
    }
    let mut cfg = NvmfConfig::new(exports, listen);
    if let Some(nqn) = nqn {
        cfg.subsystem_nqn = nqn;
    }
    cfg.service.cores = cores;
    cfg.service.policy = policy;
    let server = NvmfServer::start(cfg).expect("starting the server");
    println!(
        "nvme-tcp listening on {}, subsystem {}",
        server.local_addr(),
        server.subsystem_nqn()
    );
    let _ = std::io::stdout().flush();
    match seconds {
        Some(s) => std::thread::sleep(Duration::from_secs_f64(s)),
        None => {
            // Until stdin closes.
            for _ in std::io::stdin().lock().lines() {}
        }
    }
    let report = server.stop();
    eprintln!(
        "stopped: {} connections cut, {} failed I/Os",
        report.connections_left, report.failed_ios
    );
}
