//! How a storage server embeds hypoll: start reactors on chosen cores with state of their
//! own, open a device, attach it on every reactor, submit I/O from a reactor and handle its
//! refusals, read statistics, shut down and collect what each reactor made of its state.
//!
//! `cargo run --release -p hypoll-reactor --example embed -- [cores] [device] [policy]`
//! e.g. `... --example embed -- 0-1 emu:optane hybrid`

use std::collections::VecDeque;
use std::time::Duration;

// hypoll-reactor is the only dependency an embedder needs: it re-exports `IoBuf` and the
// rest of what embedding takes from the crates below it.
use hypoll_reactor::{
    CoreList, Device, DeviceId, IoBuf, IoCallback, IoDone, IoOp, IoRequest, Reactor, ReactorConfig,
    ReactorSet, Rejected,
};

/// Queue depth of each reactor's queue pair on the device.
const QUEUE_DEPTH: usize = 32;
/// Write-then-verify chains each reactor keeps going at once: more than its queue pair
/// holds, as a server's clients can be, so some submissions are refused (back-pressure).
const CHAINS: usize = 48;
/// Bytes per I/O of this example.
const IO_BYTES: u64 = 4096;

/// Each reactor's state: a tiny "server" that writes blocks, reads them back and checks
/// them, over and over, for one second, in `CHAINS` chains at once. `init` makes one per
/// reactor; every callback on that reactor gets `&mut` to it, so nothing here is shared,
/// locked or reference-counted.
struct Verifier {
    blocks_per_io: u64,
    next_lba: u64,
    tally: Tally,
    /// Chains still running.
    chains: usize,
    until_ns: u64,
    /// I/Os the queue pair was too full to take, oldest first, each with everything its
    /// refusal handed back (buffer, callback): submitted again as completions free slots.
    /// At most `CHAINS`: a chain has one I/O at a time.
    refused: VecDeque<Rejected<IoCallback<Verifier>>>,
}

/// What a reactor reports as it exits: its exit hook makes it of the state.
#[derive(Debug, Default)]
struct Tally {
    verified: u64,
    mismatches: u64,
    /// I/Os that failed, or whose refusal waiting would not cure: each ended its chain.
    failed: u64,
    /// Submissions refused because the queue pair was full, and submitted again later.
    retried: u64,
}

fn block_for(lba: u64) -> IoBuf {
    let mut buf = IoBuf::zeroed(IO_BYTES as usize);
    for (i, byte) in buf.iter_mut().enumerate() {
        *byte = (lba as usize + i) as u8;
    }
    buf
}

/// One chain's step: writes a block; its completion reads it back and checks it. The
/// callbacks are plain functions (they capture nothing, so no allocation per I/O): the
/// block they are about travels in `IoRequest::user`, the rest is in the state.
fn write_then_verify(r: &mut Reactor<Verifier>, v: &mut Verifier) {
    if r.now_ns() >= v.until_ns {
        return end_chain(r, v);
    }
    v.next_lba = (v.next_lba + v.blocks_per_io) % (1 << 20);
    let (lba, nlb) = (v.next_lba, v.blocks_per_io as u32);
    let write = IoRequest::new(IoOp::Write, lba, nlb).with_user(lba);
    let submitted = r.submit(DeviceId::FIRST, write, Some(block_for(lba)), after_write);
    on_refusal(r, v, submitted.map_err(Rejected::boxed));
}

fn after_write(r: &mut Reactor<Verifier>, v: &mut Verifier, done: IoDone) {
    // A completion freed a slot: first the I/Os refused for want of one.
    retry_refused(r, v);
    if done.result.is_err() {
        v.tally.failed += 1;
        return end_chain(r, v);
    }
    // Reuse the write's buffer for the read: no allocation on the way back.
    let buf = done.buf.expect("the buffer comes back");
    let read = IoRequest::new(IoOp::Read, done.user, v.blocks_per_io as u32).with_user(done.user);
    let submitted = r.submit(DeviceId::FIRST, read, Some(buf), after_read);
    on_refusal(r, v, submitted.map_err(Rejected::boxed));
}

fn after_read(r: &mut Reactor<Verifier>, v: &mut Verifier, done: IoDone) {
    retry_refused(r, v);
    if done.result.is_err() {
        v.tally.failed += 1;
        return end_chain(r, v);
    }
    let ok = done.buf.as_deref() == Some(&block_for(done.user)[..]);
    v.tally.verified += 1;
    v.tally.mismatches += u64::from(!ok);
    write_then_verify(r, v);
}

/// A refusal hands back everything the submission was given, the callback included (it has
/// not run). A full queue pair is back-pressure: the I/O waits in `refused` until a
/// completion frees a slot. Any other reason will not pass by waiting: the I/O's own
/// callback answers now, with a failure, so whoever waits on it hears back (here its chain;
/// in a server, a client's reply channel captured in the callback).
fn on_refusal(
    r: &mut Reactor<Verifier>,
    v: &mut Verifier,
    submitted: Result<(), Rejected<IoCallback<Verifier>>>,
) {
    let Err(rejected) = submitted else {
        return;
    };
    if rejected.reason.is_queue_full() {
        v.tally.retried += 1;
        v.refused.push_back(rejected);
        return;
    }
    eprintln!("core {}: I/O refused: {}", r.core(), rejected.reason);
    rejected.fail(r, v);
}

/// Submits refused I/Os again, oldest first, while the queue pair has room. Every refused
/// I/O found the queue pair full, so a completion is always to come and call this.
fn retry_refused(r: &mut Reactor<Verifier>, v: &mut Verifier) {
    while r.has_room(DeviceId::FIRST) {
        let Some(rejected) = v.refused.pop_front() else {
            return;
        };
        let submitted = r.resubmit(rejected);
        on_refusal(r, v, submitted);
    }
}

/// A chain stops (its time is up, or its I/O failed).
fn end_chain(_r: &mut Reactor<Verifier>, v: &mut Verifier) {
    v.chains -= 1;
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let cores = args.next().map(|c| CoreList::parse(&c)).transpose()?;
    let device_spec = args.next().unwrap_or_else(|| "emu:optane".to_string());
    let policy = args.next().unwrap_or_else(|| "hybrid".to_string());

    // 1. Open the device once; every reactor gets its own queue pair on it.
    let device = Device::open(&device_spec)?;

    // 2. Start reactors; `init` runs on each reactor thread before its loop and returns
    //    that reactor's state. The exit hook turns the state into what `shutdown` reports.
    let cfg = ReactorConfig {
        cores,
        policy,
        ..ReactorConfig::default()
    };
    let init = move |reactor: &mut Reactor<Verifier>| {
        let device_id = reactor.attach(&device, QUEUE_DEPTH)?;
        let lba_bytes = reactor.lba_bytes(device_id).expect("just attached");
        Ok(Verifier {
            blocks_per_io: IO_BYTES / u64::from(lba_bytes),
            next_lba: reactor.index() as u64 * (1 << 16),
            tally: Tally::default(),
            chains: 0,
            until_ns: 0,
            refused: VecDeque::with_capacity(CHAINS),
        })
    };
    let exit = |_: &mut Reactor<Verifier>, v: Verifier| v.tally;
    let set = ReactorSet::start_with_exit(cfg, init, exit)?;

    // 3. Work reaches a reactor as a closure, given the reactor and its state; from there,
    //    I/O callbacks drive it.
    for handle in set.handles().iter() {
        handle.send(|r, v| {
            v.chains = CHAINS;
            v.until_ns = r.now_ns() + 1_000_000_000;
            for _ in 0..CHAINS {
                write_then_verify(r, v);
            }
        })?;
    }

    // 4. Statistics are readable from any thread while the reactors run.
    std::thread::sleep(Duration::from_millis(1_200));
    for handle in set.handles().iter() {
        let s = handle.stats();
        println!(
            "core {}: {:.0} IOPS, busy {:.1} %, CPU {:.1} %, {} sleeps (mean overshoot {} ns), \
             {} interrupt waits, {} parks",
            s.core,
            s.iops(),
            s.busy_pct(),
            s.cpu_pct(),
            s.counters.sleeps,
            s.overshoot_mean_ns().unwrap_or(0),
            s.counters.interrupt_waits,
            s.counters.parks,
        );
    }

    // 5. Shut down: outstanding I/O drains (or fails with a clear status), each exit hook
    //    runs, threads join.
    let report = set.shutdown();
    for exit in &report.exits {
        let t = &exit.output;
        println!(
            "reactor on core {}: verified {} blocks, {} mismatches, {} failed, {} retried \
             after a full queue",
            exit.core, t.verified, t.mismatches, t.failed, t.retried
        );
    }
    for panic in &report.panics {
        eprintln!("{panic}");
    }
    if report.panics.is_empty() {
        Ok(())
    } else {
        Err("a reactor panicked".into())
    }
}
