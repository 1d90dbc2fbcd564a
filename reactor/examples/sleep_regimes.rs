//! How a sleep's wake-up overshoot and CPU cost depend on how often the thread sleeps: the
//! measurement behind `adaptive`'s probe warm-up (docs/policies.md, "Probe").
//!
//! `cargo run --release -p hypoll-reactor --example sleep_regimes -- [sleep_us] [period_us]
//! [sleeps]` (defaults 7, 16 and 3000)
//!
//! A loop stands in for a reactor at queue depth 1 on a `period_us` device: each iteration
//! lasts `period_us`, spun, except that every `k`-th one first sleeps `sleep_us` (the
//! reactor's own sleep, timer slack 1 ns) and spins the rest. For each spacing `k` in 1, 2,
//! 4, 8 and 16 it prints the overshoot's quantiles (wake-up past the deadline), the median
//! CPU a sleep costs (the thread's CPU clock around it, which includes one clock read, whose
//! own cost it prints first), and the thread's CPU share over the whole loop. Both the
//! overshoot and the cost differ from machine to machine, and with how often the thread
//! sleeps; docs/results.md and the campaigns under docs/lab/ have figures, with the machines
//! they came from.

use hypoll_nvme::sys::monotonic_ns;
use hypoll_reactor::{set_timer_slack_ns, sleep_until_ns, ThreadCpuClock};

/// The spacings measured: a sleep every this many iterations.
const SPACINGS: [u64; 5] = [1, 2, 4, 8, 16];
/// Reads of the thread's CPU clock timed to price one.
const CLOCK_READS: u64 = 100_000;

fn arg(index: usize, default: u64) -> u64 {
    match std::env::args().nth(index) {
        None => default,
        Some(text) => text.parse().unwrap_or_else(|_| {
            eprintln!("sleep_regimes: argument {index} must be a whole number, got {text:?}");
            std::process::exit(2)
        }),
    }
}

fn spin_until_ns(deadline_ns: u64) {
    while monotonic_ns() < deadline_ns {
        std::hint::spin_loop();
    }
}

/// The `q` quantile (0..=1) of sorted samples, in microseconds.
fn quantile_us(sorted: &[u64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q) as usize] as f64 / 1e3
}

fn main() {
    let sleep_ns = arg(1, 7) * 1_000;
    let period_ns = arg(2, 16) * 1_000;
    let sleeps = arg(3, 3_000).max(1) as usize;
    if let Err(e) = set_timer_slack_ns(1) {
        eprintln!(
            "sleep_regimes: cannot set the timer slack to 1 ns ({e}): figures use the default"
        );
    }
    let clock = ThreadCpuClock::current().expect("the thread's CPU clock");
    let cpu_ns = || clock.cpu_ns().expect("a running thread's CPU time");
    // What one read of the CPU clock costs: a sampled sleep's measured CPU includes one.
    let reads_start_ns = monotonic_ns();
    for _ in 0..CLOCK_READS {
        std::hint::black_box(cpu_ns());
    }
    let read_ns = (monotonic_ns() - reads_start_ns) / CLOCK_READS;
    println!(
        "sleep {} us in a {} us loop, {sleeps} sleeps per spacing; a CPU clock read takes \
         {read_ns} ns",
        sleep_ns / 1_000,
        period_ns / 1_000
    );
    for every in SPACINGS {
        let mut overshoots_ns = Vec::with_capacity(sleeps);
        let mut sleep_cpus_ns = Vec::with_capacity(sleeps);
        let (wall_start_ns, cpu_start_ns) = (monotonic_ns(), cpu_ns());
        let mut iteration = 0u64;
        while overshoots_ns.len() < sleeps {
            let start_ns = monotonic_ns();
            if iteration.is_multiple_of(every) {
                let cpu_before_ns = cpu_ns();
                sleep_until_ns(start_ns + sleep_ns);
                let woke_ns = monotonic_ns();
                sleep_cpus_ns.push(cpu_ns().saturating_sub(cpu_before_ns));
                overshoots_ns.push(woke_ns.saturating_sub(start_ns + sleep_ns));
            }
            spin_until_ns(start_ns + period_ns);
            iteration += 1;
        }
        let cpu_pct = 100.0 * (cpu_ns() - cpu_start_ns) as f64
            / (monotonic_ns() - wall_start_ns).max(1) as f64;
        overshoots_ns.sort_unstable();
        sleep_cpus_ns.sort_unstable();
        println!(
            "a sleep every {every:2}: overshoot p10 {:5.1} p50 {:5.1} p90 {:5.1} p99 {:6.1} us \
             | CPU per sleep p50 {:5.1} us | thread CPU {cpu_pct:5.1} %",
            quantile_us(&overshoots_ns, 0.1),
            quantile_us(&overshoots_ns, 0.5),
            quantile_us(&overshoots_ns, 0.9),
            quantile_us(&overshoots_ns, 0.99),
            quantile_us(&sleep_cpus_ns, 0.5),
        );
    }
}
