//! How a storage server embeds hypoll: start reactors on chosen cores, open a device, attach
//! it on every reactor, submit I/O from a reactor and handle its refusals, read statistics,
//! shut down.
//!
//! `cargo run --release -p hypoll-reactor --example embed -- [cores] [device] [policy]`
//! e.g. `... --example embed -- 0-1 emu:optane hybrid`

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Duration;

// hypoll-reactor is the only dependency an embedder needs: it re-exports `IoBuf` and the
// rest of what embedding takes from the crates below it.
use hypoll_reactor::{
    CoreList, Device, DeviceId, IoBuf, IoDone, IoFailure, Reactor, ReactorConfig, ReactorSet,
    Rejected,
};

/// Queue depth of each reactor's queue pair on the device.
const QUEUE_DEPTH: usize = 32;
/// Write-then-verify chains each reactor keeps going at once: more than its queue pair
/// holds, as a server's clients can be, so some submissions are refused (back-pressure).
const CHAINS: usize = 48;

/// Per-reactor application state: a tiny "server" that writes blocks, reads them back and
/// checks them, over and over, for one second, in `CHAINS` chains at once.
struct Verifier {
    blocks_per_io: u64,
    next_lba: u64,
    verified: u64,
    mismatches: u64,
    /// I/Os that failed, or whose refusal waiting would not cure: each ended its chain.
    failed: u64,
    /// Submissions refused because the queue pair was full, and submitted again later.
    retried: u64,
    /// Chains still running.
    chains: usize,
    until_ns: u64,
    /// I/Os the queue pair was too full to take, oldest first, each with everything its
    /// refusal handed back (buffer, callback): submitted again as completions free slots.
    /// At most `CHAINS`: a chain has one I/O at a time.
    refused: VecDeque<Rejected>,
}

/// Bytes per I/O of this example.
const IO_BYTES: u64 = 4096;

fn block_for(lba: u64) -> IoBuf {
    let mut buf = IoBuf::zeroed(IO_BYTES as usize);
    for (i, byte) in buf.iter_mut().enumerate() {
        *byte = (lba as usize + i) as u8;
    }
    buf
}

/// One chain's step: writes a block, and on its completion reads it back and checks it.
fn write_then_verify(r: &mut Reactor, state: Rc<RefCell<Verifier>>) {
    let (lba, nlb) = {
        let mut s = state.borrow_mut();
        if r.now_ns() >= s.until_ns {
            drop(s);
            return end_chain(r, &state);
        }
        s.next_lba = (s.next_lba + s.blocks_per_io) % (1 << 20);
        (s.next_lba, s.blocks_per_io as u32)
    };
    let chain = state.clone();
    let after_write = move |r: &mut Reactor, done: IoDone| {
        // A completion freed a slot: first the I/Os refused for want of one.
        retry_refused(r, &chain);
        if done.result.is_err() {
            chain.borrow_mut().failed += 1;
            return end_chain(r, &chain);
        }
        let verify = chain.clone();
        let after_read = move |r: &mut Reactor, done: IoDone| {
            retry_refused(r, &verify);
            {
                let mut s = verify.borrow_mut();
                if done.result.is_ok() {
                    let ok = done.buf.as_deref() == Some(&block_for(lba)[..]);
                    s.verified += 1;
                    s.mismatches += u64::from(!ok);
                } else {
                    s.failed += 1;
                    drop(s);
                    return end_chain(r, &verify);
                }
            }
            write_then_verify(r, verify);
        };
        // Reuse the write's buffer for the read: no allocation on the way back.
        let buf = done.buf.expect("the buffer comes back");
        let submitted = r.read(DeviceId::FIRST, lba, nlb, buf, after_read);
        on_refusal(r, &chain, submitted.map_err(Rejected::boxed));
    };
    let submitted = r.write(DeviceId::FIRST, lba, block_for(lba), after_write);
    on_refusal(r, &state, submitted.map_err(Rejected::boxed));
}

/// A refusal hands back everything the submission was given, the callback included (it has
/// not run). A full queue pair is back-pressure: the I/O waits in `refused` until a
/// completion frees a slot. Any other reason will not pass by waiting: the I/O's own
/// callback answers now, with a failure, so whoever waits on it hears back (here its chain;
/// in a server, a client's reply channel captured in the callback).
fn on_refusal(r: &mut Reactor, state: &Rc<RefCell<Verifier>>, submitted: Result<(), Rejected>) {
    let Err(rejected) = submitted else {
        return;
    };
    if rejected.reason.is_queue_full() {
        let mut s = state.borrow_mut();
        s.retried += 1;
        s.refused.push_back(rejected);
        return;
    }
    eprintln!("core {}: I/O refused: {}", r.core(), rejected.reason);
    let done = IoDone {
        device: rejected.device,
        result: Err(IoFailure::Refused),
        buf: rejected.buf,
        user: rejected.req.user,
        latency_ns: 0,
    };
    (rejected.callback)(r, done);
}

/// Submits refused I/Os again, oldest first, while the queue pair has room. Every refused
/// I/O found the queue pair full, so a completion is always to come and call this.
fn retry_refused(r: &mut Reactor, state: &Rc<RefCell<Verifier>>) {
    while r.has_room(DeviceId::FIRST) {
        let Some(rejected) = state.borrow_mut().refused.pop_front() else {
            return;
        };
        let submitted = r.resubmit(rejected);
        on_refusal(r, state, submitted);
    }
}

/// A chain stops (its time is up, or its I/O failed); the last one reports.
fn end_chain(r: &mut Reactor, state: &Rc<RefCell<Verifier>>) {
    let mut s = state.borrow_mut();
    s.chains -= 1;
    if s.chains == 0 {
        println!(
            "reactor on core {}: verified {} blocks, {} mismatches, {} failed, {} retried \
             after a full queue",
            r.core(),
            s.verified,
            s.mismatches,
            s.failed,
            s.retried
        );
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let cores = args.next().map(|c| CoreList::parse(&c)).transpose()?;
    let device_spec = args.next().unwrap_or_else(|| "emu:optane".to_string());
    let policy = args.next().unwrap_or_else(|| "hybrid".to_string());

    // 1. Open the device once; every reactor gets its own queue pair on it.
    let device = Device::open(&device_spec)?;

    // 2. Start reactors; `init` runs on each reactor thread before its loop.
    let cfg = ReactorConfig {
        cores,
        policy,
        ..ReactorConfig::default()
    };
    let set = ReactorSet::start(cfg, move |reactor| {
        reactor.attach(&device, QUEUE_DEPTH)?;
        Ok(())
    })?;

    // 3. Work reaches a reactor as a closure; from there, I/O callbacks drive it.
    for handle in set.handles().iter() {
        handle.send(|r| {
            let lba_bytes = r
                .namespace(DeviceId::FIRST)
                .expect("attached")
                .lba_size_bytes;
            let state = Rc::new(RefCell::new(Verifier {
                blocks_per_io: IO_BYTES / u64::from(lba_bytes),
                next_lba: r.index() as u64 * (1 << 16),
                verified: 0,
                mismatches: 0,
                failed: 0,
                retried: 0,
                chains: CHAINS,
                until_ns: r.now_ns() + 1_000_000_000,
                refused: VecDeque::with_capacity(CHAINS),
            }));
            for _ in 0..CHAINS {
                write_then_verify(r, state.clone());
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

    // 5. Shut down: outstanding I/O drains (or fails with a clear status), threads join.
    let report = set.shutdown();
    for panic in &report.panics {
        eprintln!("{panic}");
    }
    if report.panics.is_empty() {
        Ok(())
    } else {
        Err("a reactor panicked".into())
    }
}
