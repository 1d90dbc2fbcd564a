//! The seeded fault simulation (see `hypoll_reactor::sim`): a fixed budget of seeds with
//! faults on, plus every seed that once found a bug. `hypoll sim --seeds N` runs more.

use hypoll_reactor::sim::{run, run_threaded, SimConfig};

/// Seeds the suite runs every time (debug build, 2 cores: well under a minute).
const SEED_BUDGET: u64 = 40;

#[test]
fn every_io_is_accounted_for_and_every_block_reads_back_as_the_model_allows() {
    let cfg = SimConfig::default();
    let mut totals = (0u64, 0u64, 0u64, 0u64, 0u64);
    for seed in 0..SEED_BUDGET {
        let report = run(seed, &cfg).unwrap_or_else(|failure| panic!("{failure}"));
        totals.0 += report.ios;
        totals.1 += report.io_timeouts;
        totals.2 += report.resets;
        totals.3 += report.abandoned;
        totals.4 += report.controller_resets;
    }
    eprintln!("ios, timeouts, resets, abandoned, controller resets: {totals:?}");
}

/// Seeds of the threaded variant the suite runs every time.
const THREADED_SEED_BUDGET: u64 = 8;

/// The same workload and checks on real reactor threads and the real clock, under each
/// wait policy: what the hand-stepped run cannot show (cross-thread controller resets,
/// parking with lost commands outstanding).
#[test]
fn threaded_reactors_keep_every_io_and_every_block_too() {
    let cfg = SimConfig {
        ios_per_reactor: 200,
        ..SimConfig::default()
    };
    for seed in 0..THREADED_SEED_BUDGET {
        let report = run_threaded(seed, &cfg).unwrap_or_else(|failure| panic!("{failure}"));
        assert!(report.ios > 0, "{report:?}");
    }
}
