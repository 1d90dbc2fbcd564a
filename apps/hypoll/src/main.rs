//! `hypoll`: the command-line tool.
//!
//! - `hypoll bench`: every policy side by side on one device and workload (the main job:
//!   `cargo run --release -- bench` runs it on the emulated Optane-class device).
//! - `hypoll policies`: every policy with a one-line description.
//! - `hypoll devices`: the emulated device profiles.
//! - `hypoll serve`: exports devices over NBD and vhost-user-blk on per-core reactors
//!   (docs/serve.md).
//! - `hypoll sim`: the seeded fault simulation (`--seeds 10000` runs many, `--seed N` one).

mod alternate;
mod bench;
mod bench_alternate;
mod bench_async;
mod bench_verify;
mod report;
mod serve;
mod serve_log;
mod serve_running;
mod serve_state;
mod serve_vhost;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use hypoll_nvme::{emu::config::profile_descriptions, parse_size_bytes, DeviceConfig};
use hypoll_reactor::CoreList;
use indicatif::{ProgressBar, ProgressStyle};

use bench::{Api, RunResult, Rw, Workload};

/// Policies `bench` compares when no `--policy` is given (`oracle` is added on emulated
/// devices).
const DEFAULT_POLICIES: &[&str] = &[
    "classic",
    "interrupt",
    "hybrid",
    "fixed:5",
    "hybrid-3/4",
    "hybrid-min",
    "uring-hybrid",
    "adaptive",
];

#[derive(Parser)]
#[command(
    name = "hypoll",
    version,
    about = "Poll-mode storage I/O that decides, I/O by I/O, whether to spin, sleep or wait"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Compare poll policies side by side on one device and workload.
    Bench(Box<BenchArgs>),
    /// List every poll policy with a one-line description.
    Policies,
    /// List the emulated device profiles.
    Devices,
    /// Serve devices over NBD and vhost-user-blk until SIGINT, SIGTERM, SIGHUP or SIGQUIT (a
    /// graceful stop).
    Serve(Box<serve::ServeArgs>),
    /// Run the seeded fault simulation: several reactors, faults on, checked against a
    /// shadow model. Exit status 1 and the failing seed on the first failure.
    Sim(SimArgs),
}

#[derive(Parser)]
struct SimArgs {
    /// Run only this seed (replays a failure exactly).
    #[arg(long, conflicts_with_all = ["seeds", "first"])]
    seed: Option<u64>,
    /// How many seeds to run.
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 0)]
    first: u64,
    /// Reactors on the one emulated controller.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=16))]
    reactors: u16,
    /// I/Os each reactor submits per seed.
    #[arg(long, default_value_t = 300)]
    ios: usize,
    /// Multiplies every fault rate (media errors 2 %, lost 2 %, resets 0.3 % by default,
    /// before each seed's own factor of 0.5 to 4).
    #[arg(long, default_value_t = 1.0)]
    fault_scale: f64,
    /// Print one line per seed, and the reactors' recovery log lines.
    #[arg(long)]
    verbose: bool,
    /// Run on real reactor threads and the real clock (one reactor per allowed core, up to
    /// --reactors): the scheduler interleaves, so a seed does not replay exactly.
    #[arg(long)]
    threaded: bool,
    /// The poll policy the simulated reactors run; repeat for several (default: each
    /// built-in policy in turn; see `hypoll policies`). The threaded run draws its own.
    #[arg(long = "policy", value_name = "SPEC", value_parser = parse_policy)]
    policies: Vec<String>,
}

#[derive(Parser)]
struct BenchArgs {
    /// Device string: emu:<profile>[,key=value...], null, uring:/path[,direct=0|1]
    /// [,size=...][,iopoll=auto|on|off|hybrid][,taskrun=defer|signal][,wait=ring|epoll]
    /// [,sqpoll=off|on][,sqpoll_idle_ms=N][,sqpoll_cpu=N],
    /// vhost-user:/path.sock[,queues=N] (a vhost-user-blk back end, as a client; one queue
    /// per reactor), or nvme-tcp:HOST:PORT/SUBNQN[,ns=N][,digests=...] (a namespace of an
    /// NVMe/TCP target) (see `hypoll devices`).
    #[arg(long, default_value = "emu:optane", value_parser = parse_device)]
    device: DeviceConfig,
    /// Poll policy spec; repeat to compare several (default: every built-in policy, plus
    /// oracle on an emulated device). See `hypoll policies`.
    #[arg(long = "policy", value_name = "SPEC", value_parser = parse_policy)]
    policies: Vec<String>,
    /// randread, randwrite, read, write or randrw:<read %>.
    #[arg(long, default_value = "randread")]
    rw: Rw,
    /// How the workload is written: completion callbacks, or `async` tasks (one per I/O in
    /// flight, on each reactor's executor).
    #[arg(long, default_value = "callback")]
    api: Api,
    /// Block size of each I/O (4k, 128k, ...).
    #[arg(long, default_value = "4k", value_parser = parse_size_bytes)]
    bs: u64,
    /// I/Os in flight per reactor.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    qd: u16,
    /// Cores, one reactor each: 0, 0-1, 0,2 (default: the first core this process may use).
    #[arg(long, value_parser = parse_cores)]
    cores: Option<CoreList>,
    /// Measured seconds per policy and run.
    #[arg(long, default_value_t = 3.0, value_parser = parse_seconds)]
    runtime: f64,
    /// Seconds of warm-up before measuring (statistics windows fill, sleeps calibrate).
    #[arg(long, default_value_t = 0.5, value_parser = parse_seconds_or_zero)]
    ramp: f64,
    /// Span of the device the workload touches (e.g. 1G).
    #[arg(long, default_value = "1G", value_parser = parse_size_bytes)]
    size: u64,
    /// Runs per policy, in rounds (every policy once per round); the run with the median
    /// IOPS is reported.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=99))]
    repeat: u16,
    /// Run the two `--policy` specs together, taking turns every MS milliseconds (each
    /// keeps its own state and statistics across its turns), and compare them segment by
    /// segment as well as in total: an A/B comparison that a device drifting over seconds
    /// does not blur. Each policy gets about half of `--runtime` (and of `--ramp`); its CPU
    /// is the reactor threads' own (an io_uring thread's is not split).
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(alternate::SEGMENT_MS_MIN..=alternate::SEGMENT_MS_MAX))]
    alternate: Option<u64>,
    /// Write one JSON object per policy to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Draw mean latency against CPU, one point per policy, as SVG.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// After each run, write a pattern, read it back and count mismatches (must be 0). Not
    /// on `null`, which keeps nothing it is given.
    #[arg(long)]
    verify: bool,
}

/// The fewest segments `--alternate` takes: the first and last are cut short by the run's
/// start and end, and a comparison needs a whole segment of the first policy either side
/// of a whole one of the second, so four whole ones in a row.
const SEGMENTS_MIN: u64 = 6;

/// What `--alternate MS` needs: two policies to compare, neither `oracle` (the reactor tells
/// the emulated deadline only to a policy of that name), and a run of at least
/// [`SEGMENTS_MIN`] segments and at most [`alternate::SEGMENTS_MAX`].
fn check_alternate(ms: u64, policies: &[String], runtime_s: f64) -> Result<(), String> {
    if policies.len() != 2 {
        return Err(format!(
            "--alternate compares two policies: give exactly two --policy specs, not {}",
            policies.len()
        ));
    }
    if policies.iter().any(|p| p == "oracle") {
        return Err(
            "--alternate cannot run oracle: the reactor tells the emulated device's \
                    deadline only to a policy of that name"
                .to_string(),
        );
    }
    let segments = runtime_s * 1_000.0 / ms as f64;
    if segments < SEGMENTS_MIN as f64 {
        return Err(format!(
            "--runtime {runtime_s} holds {segments:.1} segments of --alternate {ms} ms: \
             a comparison needs at least {SEGMENTS_MIN} (use a longer --runtime or a shorter \
             segment)"
        ));
    }
    if segments > alternate::SEGMENTS_MAX as f64 {
        return Err(format!(
            "--runtime {runtime_s} holds {segments:.0} segments of --alternate {ms} ms, \
             more than the {} one run keeps: use a longer segment",
            alternate::SEGMENTS_MAX
        ));
    }
    Ok(())
}

fn parse_device(s: &str) -> Result<DeviceConfig, String> {
    s.parse().map_err(|e| format!("{e}"))
}

fn parse_policy(s: &str) -> Result<String, String> {
    hypoll_policy::build(s)
        .map(|p| p.name().to_string())
        .map_err(|e| format!("{e}"))
}

fn parse_cores(s: &str) -> Result<CoreList, String> {
    let cores = CoreList::parse(s).map_err(|e| e.to_string())?;
    let allowed = CoreList::allowed().map_err(|e| e.to_string())?;
    cores.check_within(&allowed).map_err(|e| e.to_string())?;
    Ok(cores)
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!(
            "{s:?}: expected seconds, more than 0 and at most 86400"
        )),
    }
}

fn parse_seconds_or_zero(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=3_600.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?}: expected seconds, from 0 to 3600")),
    }
}

/// A bad flag value found after parsing: reported like clap's, exit status 2.
fn usage_error(message: String) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Reactors log their recovery steps (timeouts, aborts, resets) as warnings, to stderr;
    // the fault simulation causes thousands on purpose, so it shows them only if --verbose.
    let level = match &cli.command {
        Cmd::Sim(args) if !args.verbose => tracing::level_filters::LevelFilter::OFF,
        Cmd::Serve(args) if args.verbose => tracing::level_filters::LevelFilter::INFO,
        _ => tracing::level_filters::LevelFilter::WARN,
    };
    match &cli.command {
        // The server's lines are its operators' log: one per event, as `hypoll serve: ...`.
        Cmd::Serve(_) => serve_log::init_log(level),
        _ => tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
            .init(),
    }
    match cli.command {
        Cmd::Bench(args) => bench_command(*args),
        Cmd::Serve(args) => serve::serve_command(*args),
        Cmd::Policies => {
            for info in hypoll_policy::list() {
                println!("{:<26} {}", info.syntax, info.description);
            }
            ExitCode::SUCCESS
        }
        Cmd::Sim(args) => sim_command(&args),
        Cmd::Devices => {
            println!(
                "{:<13} completes every command at once, moves no data",
                "null"
            );
            for (name, what) in profile_descriptions() {
                println!("emu:{name:<9} {what}");
            }
            println!(
                "{:<13} io_uring on a file or block device: keys direct=0|1 (O_DIRECT, default 1), \
                 size=, lba=512|4096, iopoll=auto|on|off|hybrid (auto: polled when the device \
                 has poll queues, else interrupts), taskrun=defer|signal (defer, the default: \
                 completions posted when the reactor next enters the kernel, Linux 6.1+), \
                 wait=ring|epoll, sqpoll=off|on (a kernel submission thread per ring), \
                 sqpoll_idle_ms=N (its idle time before it sleeps, default 1000), \
                 sqpoll_cpu=N (pin it), inline=auto|on|off (reads and writes made by the \
                 reactor itself; auto: on a file in memory whose file system refuses \
                 non-blocking reads, where io_uring would hand each to a worker thread), \
                 atime=coarse|kernel (reads through the page cache: the access time \
                 checked once a minute, the default, or on every read)",
                "uring:/path"
            );
            println!(
                "{:<13} a PCI NVMe controller bound to vfio-pci, driven from user space \
                 (vfio:0000:01:00.0; see docs/vfio.md)",
                "vfio:<addr>"
            );
            println!(
                "{:<13} a vhost-user-blk back end (hypoll serve --vhost-user-blk, \
                 qemu-storage-daemon, SPDK) as a client, through libblkio: keys queues=N (one \
                 per reactor, default 1), depth=D (default 256; see docs/devices.md)",
                "vhost-user:/path.sock"
            );
            ExitCode::SUCCESS
        }
    }
}

fn bench_command(args: BenchArgs) -> ExitCode {
    let emulated = matches!(args.device, DeviceConfig::Emu(_));
    let mut policies = args.policies.clone();
    if policies.is_empty() {
        policies = DEFAULT_POLICIES.iter().map(|p| p.to_string()).collect();
        if emulated {
            policies.push("oracle".to_string());
        }
    }
    if !emulated && policies.iter().any(|p| p == "oracle") {
        return usage_error(format!(
            "--policy oracle needs an emulated device (emu:<profile>), not {}",
            args.device
        ));
    }
    if let Some(ms) = args.alternate {
        if let Err(e) = check_alternate(ms, &args.policies, args.runtime) {
            return usage_error(e);
        }
    }
    // `null` discards what is written and reads zeroes: a verify pass there could only
    // report every block as a mismatch.
    if args.verify && matches!(args.device, DeviceConfig::Null(_)) {
        return usage_error(
            "--verify needs a device that keeps what is written; `null` discards writes \
             (use emu:..., uring:FILE or a real device)"
                .to_string(),
        );
    }
    // Open the device once up front: a missing file or an unusable device is reported
    // before any run starts, and the block size is the device's own.
    let (lba, device_described) = match args.device.open() {
        Ok(ctrl) => (u64::from(ctrl.namespace().lba_size_bytes), ctrl.describe()),
        Err(e) => {
            eprintln!("hypoll: opening {}: {e}", args.device);
            return ExitCode::FAILURE;
        }
    };
    if args.bs == 0 || !args.bs.is_multiple_of(lba) || args.bs > 2 << 20 {
        return usage_error(format!(
            "--bs {}: expected a multiple of the device's {lba}-byte block, at most 2M",
            args.bs
        ));
    }
    if args.size < args.bs {
        return usage_error(format!(
            "--size {} is smaller than --bs {}",
            args.size, args.bs
        ));
    }
    let cores = match args.cores.clone() {
        Some(c) => c,
        None => match CoreList::allowed() {
            Ok(all) => CoreList::new(all.as_slice()[..1].to_vec()),
            Err(e) => {
                eprintln!("hypoll: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let work = Workload {
        device: args.device.clone(),
        device_described,
        rw: args.rw,
        api: args.api,
        bs_bytes: args.bs,
        qd: usize::from(args.qd),
        cores,
        ramp: Duration::from_secs_f64(args.ramp),
        runtime: Duration::from_secs_f64(args.runtime),
        size_bytes: args.size,
        verify: args.verify,
        alternate: args.alternate.map(Duration::from_millis),
    };
    let repeat = usize::from(args.repeat);
    let runs_per_round = if work.alternate.is_some() {
        1
    } else {
        policies.len()
    };
    let progress = if std::io::stderr().is_terminal() {
        let bar = ProgressBar::new((runs_per_round * repeat) as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} runs  {elapsed} / ~{duration}  {msg}",
            )
            .expect("valid template"),
        );
        bar.enable_steady_tick(Duration::from_millis(200));
        bar
    } else {
        ProgressBar::hidden()
    };
    // Repeats go in rounds (every policy once, then again), not policy by policy: a slow
    // stretch of a shared machine then falls on every policy alike, not on whichever policy
    // happened to run during it.
    let mut runs: Vec<Vec<RunResult>> = policies
        .iter()
        .map(|_| Vec::with_capacity(repeat))
        .collect();
    let mut paired = Vec::new();
    let mut shown_run = 0;
    for run in 0..repeat {
        if let (Some(segment), [a, b]) = (work.alternate, &policies[..]) {
            progress.set_message(format!("{a} | {b} (run {}/{repeat})", run + 1));
            match bench_alternate::run_alternating(&work, &[a.clone(), b.clone()], segment) {
                Ok(alternated) => {
                    for (side, runs) in alternated.sides.into_iter().zip(&mut runs) {
                        runs.push(side);
                    }
                    paired.push(alternated.paired);
                }
                Err(e) => {
                    progress.abandon();
                    eprintln!("hypoll: {e}");
                    return ExitCode::FAILURE;
                }
            }
            progress.inc(1);
            continue;
        }
        for (policy, runs) in policies.iter().zip(&mut runs) {
            progress.set_message(format!("{policy} (run {}/{repeat})", run + 1));
            match bench::run_policy(&work, policy) {
                Ok(result) => runs.push(result),
                Err(e) => {
                    progress.abandon();
                    eprintln!("hypoll: {e}");
                    return ExitCode::FAILURE;
                }
            }
            progress.inc(1);
        }
    }
    let rows: Vec<RunResult> = if work.alternate.is_some() {
        // Both rows from one run, the run whose first policy had the median IOPS: each row
        // is a policy's turns in that run, and the two are compared in it.
        let mut order: Vec<usize> = (0..runs[0].len()).collect();
        order.sort_by(|&a, &b| runs[0][a].iops().total_cmp(&runs[0][b].iops()));
        let median = order[(order.len() - 1) / 2];
        shown_run = median;
        runs.into_iter()
            .map(|mut r| r.swap_remove(median))
            .collect()
    } else {
        runs.into_iter()
            .map(|mut runs| {
                runs.sort_by(|a, b| a.iops().total_cmp(&b.iops()));
                runs.swap_remove((runs.len() - 1) / 2)
            })
            .collect()
    };
    progress.finish_and_clear();
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = report::print_table(&mut stdout, &work, &rows)
        .and_then(|()| report::print_paired(&mut stdout, &work, &rows, &paired, shown_run))
    {
        eprintln!("hypoll: writing the table: {e}");
        return ExitCode::FAILURE;
    }
    if let Some(path) = &args.json {
        if let Err(e) = report::write_json(path, &work, &rows, repeat, &paired) {
            eprintln!("hypoll: {e}");
            return ExitCode::FAILURE;
        }
    }
    if let Some(path) = &args.plot {
        if let Err(e) = report::write_plot(path, &work, &rows) {
            eprintln!("hypoll: {e}");
            return ExitCode::FAILURE;
        }
    }
    let errors: u64 = rows.iter().map(|r| r.errors).sum();
    let mismatches: u64 = rows.iter().map(|r| r.mismatches).sum();
    if mismatches > 0 {
        eprintln!("hypoll: --verify found {mismatches} blocks that did not read back as written");
        return ExitCode::FAILURE;
    }
    if errors > 0 {
        eprintln!("hypoll: {errors} I/Os completed with an error status");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

fn sim_command(args: &SimArgs) -> ExitCode {
    let base = hypoll_reactor::sim::SimConfig::default();
    if !(0.0..=10.0).contains(&args.fault_scale) {
        return usage_error(format!(
            "--fault-scale {}: expected a factor from 0 to 10",
            args.fault_scale
        ));
    }
    let cfg = hypoll_reactor::sim::SimConfig {
        reactors: usize::from(args.reactors),
        ios_per_reactor: args.ios,
        err_pct: base.err_pct * args.fault_scale,
        lost_pct: base.lost_pct * args.fault_scale,
        reset_pct: base.reset_pct * args.fault_scale,
        ..base
    };
    let (first, count) = match args.seed {
        Some(seed) => (seed, 1),
        None => (args.first, args.seeds),
    };
    let policies = if args.threaded {
        vec![cfg.policy.clone()]
    } else if args.policies.is_empty() {
        hypoll_reactor::sim::policies()
    } else {
        args.policies.clone()
    };
    let mut ios = 0u64;
    let mut timeouts = 0u64;
    let mut abandoned = 0u64;
    let started = std::time::Instant::now();
    let runs = policies.iter().flat_map(|policy| {
        (first..first.saturating_add(count)).map(move |seed| (policy.clone(), seed))
    });
    for (policy, seed) in runs {
        let cfg = hypoll_reactor::sim::SimConfig {
            policy,
            ..cfg.clone()
        };
        let outcome = if args.threaded {
            hypoll_reactor::sim::run_threaded(seed, &cfg)
        } else {
            hypoll_reactor::sim::run(seed, &cfg)
        };
        match outcome {
            Ok(r) => {
                if args.verbose || args.seed.is_some() {
                    println!("{r:?}");
                }
                ios += r.ios;
                timeouts += r.io_timeouts;
                abandoned += r.abandoned;
            }
            Err(failure) => {
                eprintln!("hypoll: {failure}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!(
        "{count} seeds from {first} passed, each with {}: {ios} I/Os, {timeouts} timeouts, {abandoned} \
         abandoned, in {:.1} s",
        if args.threaded {
            "a policy it drew".to_owned()
        } else {
            policies.join(", ")
        },
        started.elapsed().as_secs_f64()
    );
    ExitCode::SUCCESS
}
