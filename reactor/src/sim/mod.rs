//! A seeded, deterministic simulation of several reactors on one emulated controller with
//! faults on, checked against a shadow model (TigerBeetle-style).
//!
//! One run ([`run`]) builds N reactors on one thread, all on one
//! [`EmuController`](hypoll_nvme::EmuController) and one
//! [`VirtualClock`](hypoll_nvme::VirtualClock), and steps them in an order drawn from the
//! seed: submit a random read, write, flush, write zeroes or deallocate on a random reactor,
//! turn a random reactor's loop, move virtual time forward. The controller injects media errors, lost commands
//! (some deaf to aborts) and controller resets; the reactors' timeouts abort, reset and, on
//! devices that cannot, abandon. Everything (workload, fault draws, interleaving, time)
//! follows from the seed, so a seed replays its run exactly. [`run_threaded`] runs the same
//! workload and checks on real reactor threads and the real clock (the scheduler then
//! picks the interleaving, so a seed does not replay exactly).
//!
//! What it checks:
//! - every accepted I/O's callback runs exactly once, within the bound its device's
//!   timeouts promise, and the reactors' counters agree;
//! - every read that succeeds returns, block by block, a value the shadow model allows;
//! - afterwards every block reads back as the model allows: the last acknowledged write,
//!   or a write whose outcome is unknown (failed, timed out, abandoned, or concurrent with
//!   the last acknowledged one).
//!
//! The shadow model. Time is a counter the simulation bumps before every submission and at
//! every callback. A write `w` has a window `[s_w, c_w]`: submitted at `s_w`, its callback at
//! `c_w` (for an abandoned write, open until its queue pair is deleted: the device may still
//! carry it out). A successful write took effect on each of its blocks at one instant inside
//! its window; a failed one at most once (blocks independently: a device may tear a failed
//! multi-block write). Write zeroes and deallocate write the value "zeroes" (the emulator's
//! deallocated blocks read as zeroes). A read with window `[s_r, c_r]` may see, on a block, the value of any write
//! `w` to it (or the initial zeroes) unless `w` started after the read ended (`s_w > c_r`),
//! or some successful write `w'` certainly came between them: `s_w' > c_w` (after `w`) and
//! `c_w' < s_r` (before the read). That rule accepts every legal interleaving of
//! overlapping concurrent writes, so a failure is a real bug.
//!
//! The files: `config` (what a run takes and reports), `draw` (the seed's generator and
//! draws), `limited` (devices that cannot abort or reset), `model` (the shadow model of the
//! blocks), `workload` (random I/O and its callbacks), `mail` (messages and timers, and
//! their checks), `check` (the checks after a run),
//! `waiter` (the virtual waiter: sleeps, interrupt waits and parks in virtual time, with
//! the machine's costs drawn per seed), `deterministic` ([`run`]) and `threaded`
//! ([`run_threaded`]). Apart from the simulation, `stepped` ([`SimReactor`]) drives one
//! reactor in virtual time, for tests of how a reactor waits that would otherwise measure
//! the real clock and CPU.
//!
//! The deterministic run takes the reactors through their idle path too: each runs
//! [`SimConfig::policy`], and its waits put it to sleep in virtual time (see `waiter`).
//! It also checks that the reactors' counters of sleeps, interrupt waits and parks agree
//! with what their waiters carried out, that no timed sleep outlasts the long-sleep bound,
//! and it hashes the run's events ([`SimReport::trace_hash`]): a seed and policy replay.
//! And it sends the reactors messages through their handles, in bursts, many while they
//! are parked or asleep, some of which arm and cancel timers: each runs exactly once, and a
//! waiting reactor wakes for each within a bound (`mail` states it).

mod check;
mod config;
mod deterministic;
mod draw;
mod limited;
mod mail;
mod model;
mod stepped;
mod threaded;
pub(crate) mod waiter;
mod workload;

#[cfg(test)]
mod tests;

pub use config::{SimConfig, SimFailure, SimReport};
pub use deterministic::run;
pub use limited::LimitedController;
pub use mail::MailSeen;
pub use stepped::SimReactor;
pub use threaded::run_threaded;
pub use waiter::{VirtualWaiter, WaitCosts, WaitsSeen};

/// Block size of the simulated namespace.
const LBA_BYTES: usize = 512;
/// Blocks in one chunk of the emulator's memory store.
const CHUNK_BLOCKS: u64 = hypoll_nvme::emu::store::CHUNK_BYTES / LBA_BYTES as u64;
/// Largest I/O of the workload, in blocks.
const NLB_MAX: u32 = 8;

/// Every built-in policy, as a spec the simulation runs (a policy that takes a value gets
/// one: `fixed:5`).
pub fn policies() -> Vec<String> {
    hypoll_policy::list()
        .iter()
        .map(|info| {
            if hypoll_policy::build(info.name).is_ok() {
                info.name.to_owned()
            } else {
                format!("{}:5", info.name)
            }
        })
        .collect()
}

/// Runs the seeds `first..first + count` one after another ([`run`]); stops at the first
/// that fails.
pub fn run_seeds(first: u64, count: u64, cfg: &SimConfig) -> Result<Vec<SimReport>, SimFailure> {
    (first..first.saturating_add(count))
        .map(|seed| run(seed, cfg))
        .collect()
}
