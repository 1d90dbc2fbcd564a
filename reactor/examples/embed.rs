//! How a storage server embeds hypoll: start reactors on chosen cores, open a device, attach
//! it on every reactor, submit I/O from a reactor, read statistics, shut down.
//!
//! `cargo run --release -p hypoll-reactor --example embed -- [cores] [device] [policy]`
//! e.g. `... --example embed -- 0-1 emu:optane hybrid`

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

// hypoll-reactor is the only dependency an embedder needs: it re-exports `IoBuf` and the
// rest of what embedding takes from the crates below it.
use hypoll_reactor::{
    CoreList, Device, DeviceId, IoBuf, IoDone, Reactor, ReactorConfig, ReactorSet,
};

/// Per-reactor application state: a tiny "server" that writes a block, reads it back and
/// checks it, over and over, for one second.
struct Verifier {
    blocks_per_io: u64,
    next_lba: u64,
    verified: u64,
    mismatches: u64,
    until_ns: u64,
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

/// Writes one block, and on its completion reads it back.
fn write_then_verify(r: &mut Reactor, state: Rc<RefCell<Verifier>>) {
    let lba = {
        let mut s = state.borrow_mut();
        if r.now_ns() >= s.until_ns {
            println!(
                "reactor on core {}: verified {} blocks, {} mismatches",
                r.core(),
                s.verified,
                s.mismatches
            );
            return;
        }
        s.next_lba = (s.next_lba + s.blocks_per_io) % (1 << 20);
        s.next_lba
    };
    let nlb = state.borrow().blocks_per_io as u32;
    let after_write = move |r: &mut Reactor, done: IoDone| {
        done.result.expect("write failed");
        let after_read = move |r: &mut Reactor, done: IoDone| {
            done.result.expect("read failed");
            {
                let mut s = state.borrow_mut();
                let ok = done.buf.as_deref() == Some(&block_for(lba)[..]);
                s.verified += 1;
                s.mismatches += u64::from(!ok);
            }
            write_then_verify(r, state);
        };
        // Reuse the write's buffer for the read: no allocation on the way back.
        let buf = done.buf.expect("the buffer comes back");
        if let Err(rejected) = r.read(DeviceId::FIRST, lba, nlb, buf, after_read) {
            eprintln!("read refused: {rejected}");
        }
    };
    if let Err(rejected) = r.write(DeviceId::FIRST, lba, block_for(lba), after_write) {
        eprintln!("write refused: {rejected}");
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
        reactor.attach(&device, 32)?;
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
                until_ns: r.now_ns() + 1_000_000_000,
            }));
            write_then_verify(r, state);
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
