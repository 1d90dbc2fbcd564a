//! `hypoll`: the command-line tool.
//!
//! Until the reactor and the policies land, `bench` drives one queue pair from the calling
//! thread with a plain spin (Linux's classic polling): a first, honest measurement of a
//! device and of the framework's cost per I/O. The side-by-side policy comparison replaces
//! it (issue 5).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use hdrhistogram::Histogram;
use hypoll_nvme::{
    emu::config::profile_descriptions, parse_size_bytes, Command, DeviceSpec, IoBuf, QueuePair,
};

#[derive(Parser)]
#[command(
    name = "hypoll",
    version,
    about = "Poll-mode storage I/O with hybrid polling"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a workload on one device and report IOPS, CPU and latency.
    Bench(BenchArgs),
    /// List the emulated device profiles.
    Devices,
}

#[derive(Parser)]
struct BenchArgs {
    /// Device spec: emu:<profile>[,key=value...] or null (see `hypoll devices`).
    #[arg(long, default_value = "emu:optane")]
    device: String,
    /// Workload: randread, randwrite, read or write.
    #[arg(long, default_value = "randread", value_parser = ["randread", "randwrite", "read", "write"])]
    rw: String,
    /// Block size of each I/O (e.g. 4k, 128k).
    #[arg(long, default_value = "4k", value_parser = parse_size_bytes)]
    bs: u64,
    /// Queue depth: I/Os kept in flight.
    #[arg(long, default_value_t = 1)]
    qd: usize,
    /// Measured run time in seconds.
    #[arg(long, default_value_t = 5.0)]
    runtime: f64,
    /// Span of the device the workload touches (e.g. 1G).
    #[arg(long, default_value = "1G", value_parser = parse_size_bytes)]
    size: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Bench(args) => bench(&args),
        Cmd::Devices => {
            println!("null        completes every command at once, moves no data");
            for (name, what) in profile_descriptions() {
                println!("emu:{name:<8} {what}");
            }
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hypoll: {e}");
            ExitCode::FAILURE
        }
    }
}

/// User + system CPU time of the calling thread, from the OS.
fn thread_cpu() -> Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a full rusage into the pointer it is given.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) };
    assert_eq!(rc, 0, "getrusage(RUSAGE_THREAD) failed");
    // SAFETY: initialised by the successful call above.
    let usage = unsafe { usage.assume_init() };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1_000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

fn bench(args: &BenchArgs) -> Result<(), String> {
    let spec: DeviceSpec = args.device.parse().map_err(|e| format!("--device: {e}"))?;
    let ctrl = spec
        .open()
        .map_err(|e| format!("opening {}: {e}", args.device))?;
    let ns = ctrl.namespace();
    let lba = u64::from(ns.lba_size_bytes);
    if args.bs == 0 || !args.bs.is_multiple_of(lba) {
        return Err(format!(
            "--bs {} is not a multiple of the {lba}-byte block",
            args.bs
        ));
    }
    let span_blocks = args.size.min(ns.capacity_bytes()) / args.bs;
    if span_blocks == 0 {
        return Err("--size is smaller than one block".into());
    }
    let mut qp = ctrl
        .create_queue_pair(args.qd)
        .map_err(|e| format!("--qd {}: {e}", args.qd))?;
    let nlb = (args.bs / lba) as u32;
    let write = args.rw.ends_with("write");
    let random = args.rw.starts_with("rand");
    let mut bufs: Vec<IoBuf> = (0..args.qd)
        .map(|_| IoBuf::zeroed(args.bs as usize))
        .collect();
    let mut submitted_ns = vec![0u64; args.qd];
    let mut rng_state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next_seq = 0u64;
    let mut next_block = |rng: &mut u64| -> u64 {
        let i = if random {
            // xorshift64: cheap, and the workload only needs spread, not quality.
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            *rng % span_blocks
        } else {
            next_seq = (next_seq + 1) % span_blocks;
            next_seq
        };
        i * u64::from(nlb)
    };
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
    let mut errors = 0u64;
    let mut done = Vec::with_capacity(args.qd);

    let submit = |qp: &mut Box<dyn QueuePair>, bufs: &mut [IoBuf], slot: usize, slba: u64| {
        let cmd = if write {
            Command::write(slba, nlb, &bufs[slot])
        } else {
            Command::read(slba, nlb, &mut bufs[slot])
        };
        // SAFETY: `bufs[slot]` is not touched again until the completion tagged `slot` is
        // reaped, and `bufs` outlives the queue pair's use of it: all I/O is drained below,
        // and what never completes is abandoned with the queue pair, which is declared after
        // `bufs` and so dropped first (a dropped queue pair touches no buffer).
        unsafe { qp.submit(&cmd, slot as u64) }
    };

    eprintln!(
        "hypoll bench: {} {} bs={} qd={} for {}s (one thread, classic spin)",
        ctrl.describe(),
        args.rw,
        args.bs,
        args.qd,
        args.runtime
    );
    let start = Instant::now();
    let cpu_start = thread_cpu();
    let end_ns = hypoll_nvme::monotonic_ns() + (args.runtime * 1e9) as u64;
    for (slot, submitted) in submitted_ns.iter_mut().enumerate() {
        *submitted = hypoll_nvme::monotonic_ns();
        let slba = next_block(&mut rng_state);
        submit(&mut qp, &mut bufs, slot, slba).map_err(|e| format!("submit: {e}"))?;
    }
    let mut ios = 0u64;
    let mut stopping = false;
    // A device may lose commands (emu's lost_pct): the drain gives up this long after the
    // run ends, and what is still outstanding then counts as failed.
    let give_up_ns = end_ns.saturating_add(DRAIN_LIMIT.as_nanos() as u64);
    let mut idle_polls = 0u32;
    let mut never_completed = 0u64;
    while qp.outstanding() > 0 {
        done.clear();
        if qp.process_completions(args.qd, &mut |c| done.push(c)) == 0 {
            // Look at the clock only every IDLE_POLLS_PER_CLOCK_CHECK idle polls, to keep
            // the spin as cheap as before.
            idle_polls += 1;
            if idle_polls == IDLE_POLLS_PER_CLOCK_CHECK {
                idle_polls = 0;
                if hypoll_nvme::monotonic_ns() >= give_up_ns {
                    never_completed = qp.outstanding() as u64;
                    break;
                }
            }
            std::hint::spin_loop();
            continue;
        }
        // One timestamp per poll batch.
        let now_ns = hypoll_nvme::monotonic_ns();
        stopping |= now_ns >= end_ns;
        for c in &done {
            let slot = c.tag as usize;
            hist.saturating_record(now_ns - submitted_ns[slot]);
            ios += 1;
            if !c.status.is_success() {
                errors += 1;
            }
            if !stopping {
                submitted_ns[slot] = now_ns;
                let slba = next_block(&mut rng_state);
                submit(&mut qp, &mut bufs, slot, slba).map_err(|e| format!("submit: {e}"))?;
            }
        }
    }
    errors += never_completed;
    let wall = start.elapsed();
    let cpu = thread_cpu() - cpu_start;
    let secs = wall.as_secs_f64();
    let cpu_pct = 100.0 * cpu.as_secs_f64() / secs;
    let iops = ios as f64 / secs;
    println!(
        "{:<10} {:>10} {:>7} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "policy",
        "IOPS",
        "CPU%",
        "IOPS/CPU%",
        "mean_us",
        "p50_us",
        "p99_us",
        "p9999_us",
        "max_us",
        "errors"
    );
    let us = |ns: u64| ns as f64 / 1_000.0;
    println!(
        "{:<10} {:>10.0} {:>7.1} {:>12.0} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>7}",
        "classic",
        iops,
        cpu_pct,
        iops / cpu_pct.max(0.01),
        hist.mean() / 1_000.0,
        us(hist.value_at_quantile(0.5)),
        us(hist.value_at_quantile(0.99)),
        us(hist.value_at_quantile(0.9999)),
        us(hist.max()),
        errors
    );
    if never_completed > 0 {
        return Err(format!(
            "{never_completed} I/Os never completed: still outstanding {} s after the run \
             ended (lost by the device?); counted as errors ({errors} I/Os failed in all)",
            DRAIN_LIMIT.as_secs()
        ));
    }
    if errors > 0 {
        return Err(format!("{errors} I/Os failed"));
    }
    Ok(())
}

/// How long the bench waits, after its run time, for outstanding I/Os to complete.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);
/// Idle polls between two looks at the clock while waiting for completions.
const IDLE_POLLS_PER_CLOCK_CHECK: u32 = 1024;
