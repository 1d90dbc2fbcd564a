//! An NVMe/TCP host that connects and then does nothing, to measure what an idle host costs
//! a target (`scripts/nvmf-idle`): hypoll's initiator connects to DEVICE (an `nvme-tcp:`
//! device string, with `kato_ms=` for the keep-alive period it asks for), opens QUEUES I/O
//! queues and reads one block on each (so every queue has served a command), prints
//! `attached`, stays connected for SECONDS with its keep-alives flowing, prints `leaving`
//! and exits.
//!
//!   cargo run --release -p hypoll-nvmf --example idle_host -- DEVICE QUEUES SECONDS

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use hypoll_nvme::{Controller, DeviceConfig, NvmeTcpController, SyncIo};

/// Most queues asked for.
const QUEUES_MAX: usize = 64;
/// Longest idle spell asked for.
const SECONDS_MAX: u64 = 3600;

fn run(device: &str, queues: usize, seconds: u64) -> Result<(), String> {
    let DeviceConfig::NvmeTcp(cfg) = device.parse::<DeviceConfig>().map_err(|e| e.to_string())?
    else {
        return Err(format!("{device}: not an nvme-tcp: device string"));
    };
    let ctrl = NvmeTcpController::open(&cfg).map_err(|e| format!("connecting: {e}"))?;
    let nlb = (4096 / ctrl.namespace().lba_size_bytes).max(1);
    let mut held = Vec::with_capacity(queues);
    for i in 0..queues {
        let mut qp = ctrl
            .create_queue_pair(4)
            .map_err(|e| format!("queue {i}: {e}"))?;
        SyncIo::new(&mut *qp, Duration::from_secs(10))
            .read(0, nlb)
            .map_err(|e| format!("queue {i}: the read failed: {e}"))?;
        held.push(qp);
    }
    println!("attached");
    let _ = std::io::stdout().flush();
    std::thread::sleep(Duration::from_secs(seconds));
    println!("leaving");
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = match args.as_slice() {
        [device, queues, seconds] => queues
            .parse::<usize>()
            .ok()
            .filter(|q| (1..=QUEUES_MAX).contains(q))
            .zip(seconds.parse::<u64>().ok().filter(|s| *s <= SECONDS_MAX))
            .map(|(q, s)| (device.as_str(), q, s)),
        _ => None,
    };
    let Some((device, queues, seconds)) = parsed else {
        eprintln!(
            "usage: idle_host DEVICE QUEUES SECONDS (nvme-tcp:HOST:PORT/NQN[,kato_ms=N]; \
             1-{QUEUES_MAX} queues; at most {SECONDS_MAX} s)"
        );
        return ExitCode::from(2);
    };
    match run(device, queues, seconds) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idle_host: {e}");
            ExitCode::FAILURE
        }
    }
}
