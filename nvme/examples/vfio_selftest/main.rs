//! The VFIO driver's tests against a real NVMe controller: QEMU's, inside the guest that
//! scripts/vfio-guest boots. Needs a function bound to vfio-pci, so it is an example (run by
//! the guest) rather than a `cargo test`.
//!
//!   vfio_selftest <bdf> [--expect-bytes N] [--serial S] [--nonviable <bdf>] [--io-only]
//!                 [--skip-reset]
//!
//! `--io-only` runs the I/O checks and skips the error checks (which unbind the function);
//! `--skip-reset` skips the controller reset (QEMU 7.2 can crash on a reset with I/O in
//! flight, so the suite runs it on one controller only: docs/vfio.md).
//!
//! Prints one line per check, `ok <name>` or `FAILED <name>: <why>`, and exits non-zero if
//! any failed. Every check is bounded in time (IO_TIMEOUT per command, a fixed number of
//! commands). Data patterns come from a seeded generator; the seed is printed.
//!
//! Layout: `io_checks` (the I/O path on an open controller), `regmem_checks` (memory the
//! application registers), `error_checks` (opening errors a user can act on); this file holds
//! the shared helpers and the runner.

mod error_checks;
mod io_checks;
mod regmem_checks;

use std::sync::Arc;
use std::time::{Duration, Instant};

use hypoll_nvme::{Completion, QueuePair, VfioConfig, VfioController};

use error_checks::{nonviable, not_bound, pin_child, pin_failure};
use io_checks::{
    deep_queue, full_queue, identify, interrupts, out_of_range, parallel_queue_pairs, queue_wrap,
    reset_mid_workload, round_trips, zero_copy,
};

const IO_TIMEOUT: Duration = Duration::from_secs(10);
const SEED: u64 = 0x5eed_0010;

type Check = Result<(), String>;

fn ensure(cond: bool, why: impl FnOnce() -> String) -> Check {
    if cond {
        Ok(())
    } else {
        Err(why())
    }
}

/// xorshift64*: a reproducible byte pattern per (seed, block).
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

/// Reaps until `want` completions arrived or IO_TIMEOUT passed.
fn reap(qp: &mut dyn QueuePair, want: usize) -> Result<Vec<Completion>, String> {
    let mut got = Vec::with_capacity(want);
    let deadline = Instant::now() + IO_TIMEOUT;
    while got.len() < want {
        qp.process_completions(want - got.len(), &mut |c| got.push(c));
        if Instant::now() > deadline {
            return Err(format!(
                "only {} of {want} completions within {IO_TIMEOUT:?}",
                got.len()
            ));
        }
    }
    Ok(got)
}

fn open(cfg: &VfioConfig) -> Result<Arc<VfioController>, String> {
    VfioController::open(cfg)
        .map(Arc::new)
        .map_err(|e| format!("open: {e}"))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(bdf) = args.first() else {
        eprintln!(
            "usage: vfio_selftest <bdf> [--expect-bytes N] [--serial S] [--nonviable <bdf>] \
             [--io-only] [--skip-reset]"
        );
        std::process::exit(2);
    };
    let cfg = VfioConfig::parse(bdf).unwrap_or_else(|e| {
        eprintln!("{bdf:?}: expected {e}");
        std::process::exit(2)
    });
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    if args.iter().any(|a| a == "--pin-child") {
        match pin_child(&cfg) {
            Ok(()) => std::process::exit(0),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(1)
            }
        }
    }
    if let Some(n) = flag("--stress-reset").and_then(|v| v.parse::<u32>().ok()) {
        // Soak: the reset check `n` times on one controller (not part of the suite).
        let ctrl = open(&cfg).unwrap_or_else(|e| panic!("{e}"));
        for i in 0..n {
            if let Err(e) = reset_mid_workload(&ctrl) {
                println!("FAILED reset {i}: {e}");
                std::process::exit(1);
            }
        }
        println!("{n} resets passed");
        std::process::exit(0);
    }
    let expect_bytes = flag("--expect-bytes").and_then(|v| v.parse().ok());
    let serial = flag("--serial").unwrap_or_else(|| "hypoll0".to_string());
    let io_only = args.iter().any(|a| a == "--io-only");
    let skip_reset = args.iter().any(|a| a == "--skip-reset");
    println!("vfio_selftest on {} (pattern seed {SEED:#x})", cfg.bdf);
    let mut failed = 0;
    let mut run = |name: &str, check: &mut dyn FnMut() -> Check| {
        let start = Instant::now();
        match check() {
            Ok(()) => println!("ok {name} ({:.2} s)", start.elapsed().as_secs_f64()),
            Err(why) => {
                failed += 1;
                println!("FAILED {name}: {why}");
            }
        }
    };
    match open(&cfg) {
        Ok(ctrl) => {
            run("identify", &mut || identify(&ctrl, expect_bytes, &serial));
            run(
                "round trips (1 block to 32 pages, flush, write zeroes, FUA)",
                &mut || round_trips(&ctrl),
            );
            run("zero-copy pinned buffers", &mut || zero_copy(&ctrl));
            run(
                "registered memory (memfd, mapped at its own IOVA)",
                &mut || regmem_checks::registered_memory(&ctrl),
            );
            run("out-of-range LBA", &mut || out_of_range(&ctrl));
            run("queue wrap", &mut || queue_wrap(&ctrl));
            run("full queue", &mut || full_queue(&ctrl));
            run("64 in flight, over-MDTS", &mut || deep_queue(&ctrl));
            run("MSI-X interrupts", &mut || interrupts(&ctrl));
            run("parallel queue pairs", &mut || parallel_queue_pairs(&ctrl));
            if !skip_reset {
                run("controller reset mid-workload", &mut || {
                    reset_mid_workload(&ctrl)
                });
            }
        }
        Err(e) => run("open", &mut || Err(e.clone())),
    }
    // These need the group closed: the controller above is dropped by now.
    if !io_only {
        run("error: not bound to vfio-pci", &mut || not_bound(&cfg));
        run("error: cannot pin memory", &mut || pin_failure(&cfg));
    }
    if let Some(other) = flag("--nonviable") {
        run("error: group not viable", &mut || nonviable(&other));
    }
    if failed > 0 {
        println!("vfio_selftest: {failed} check(s) FAILED");
        std::process::exit(1);
    }
    println!("vfio_selftest: all checks passed");
}
