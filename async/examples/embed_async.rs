//! `reactor/examples/embed.rs` in async form: reactors with state of their own, a device
//! attached on each, chains that write a block, read it back and check it, for one second,
//! more chains than the queue pair holds (so some wait for room), statistics, shutdown.
//!
//! `cargo run --release -p hypoll-async --example embed_async -- [cores] [device] [policy]`
//! e.g. `... --example embed_async -- 0-1 emu:optane hybrid`

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use hypoll_async::{Executor, HasExecutor, Local, SpawnExt};
use hypoll_reactor::{CoreList, Device, DeviceId, IoBuf, ReactorConfig, ReactorSet};

/// Queue depth of each reactor's queue pair on the device.
const QUEUE_DEPTH: usize = 32;
/// Chains each reactor runs at once: more than its queue pair holds, so some wait for room.
const CHAINS: u64 = 48;
/// Bytes per I/O of this example.
const IO_BYTES: u64 = 4096;

/// Each reactor's state: its executor (the executor is found through it).
struct App {
    executor: Executor<App>,
}

impl HasExecutor for App {
    fn executor(&self) -> &Executor<App> {
        &self.executor
    }
}

/// What one reactor's chains did.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    verified: u64,
    mismatches: u64,
    failed: u64,
}

fn block_for(lba: u64) -> IoBuf {
    let bytes: Vec<u8> = (0..IO_BYTES).map(|i| (lba + i) as u8).collect();
    IoBuf::from_slice(&bytes)
}

/// One chain: write a block, read it back into the same buffer, check it; until time is up
/// or an I/O fails. A full queue pair is not an error here: the I/O waits for room.
async fn chain(io: Local<App>, first_lba: u64, until: std::time::Instant, tally: Rc<Cell<Tally>>) {
    let nlb = (IO_BYTES / u64::from(io.with(|r, _| r.lba_bytes(DeviceId::FIRST).unwrap()))) as u32;
    let mut lba = first_lba;
    while std::time::Instant::now() < until {
        let checked = async {
            let buf = io.write(DeviceId::FIRST, lba, nlb, block_for(lba)).await?;
            io.read(DeviceId::FIRST, lba, nlb, buf).await
        };
        let outcome = checked.await;
        // The tally is read and written with no await between: other chains run only at
        // an await.
        let mut t = tally.get();
        match outcome {
            Ok(back) => {
                t.verified += 1;
                t.mismatches += u64::from(back[..] != block_for(lba)[..]);
            }
            Err(e) => {
                eprintln!("chain at block {lba}: {e}");
                t.failed += 1;
                tally.set(t);
                return;
            }
        }
        tally.set(t);
        lba = (lba + CHAINS * u64::from(nlb)) % (1 << 20);
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let cores = args.next().map(|c| CoreList::parse(&c)).transpose()?;
    let device_spec = args.next().unwrap_or_else(|| "emu:optane".to_string());
    let policy = args.next().unwrap_or_else(|| "hybrid".to_string());

    // 1. Open the device once; every reactor gets its own queue pair on it, and an executor.
    let device = Device::open(&device_spec)?;
    let cfg = ReactorConfig {
        cores,
        policy,
        ..ReactorConfig::default()
    };
    let set = ReactorSet::start(cfg, move |reactor| {
        reactor.attach(&device, QUEUE_DEPTH)?;
        Ok(App {
            executor: Executor::install(reactor)?,
        })
    })?;

    // 2. A task per reactor, sent from this thread, runs the reactor's chains as tasks of
    //    its own and sums what they did.
    let mut runs = Vec::new();
    for (index, handle) in set.handles().iter().enumerate() {
        runs.push(handle.spawn(move |io| async move {
            let until = std::time::Instant::now() + Duration::from_secs(1);
            let tally = Rc::new(Cell::new(Tally::default()));
            let mut chains = Vec::new();
            for c in 0..CHAINS {
                let first_lba = ((index as u64) << 16) | (c * (IO_BYTES / 512));
                let task = chain(io.clone(), first_lba, until, tally.clone());
                chains.push(io.spawn_local(task).expect("room for the chains"));
            }
            for done in chains {
                done.await.expect("a chain does not panic");
            }
            tally.get()
        })?);
    }

    // 3. Statistics are readable from any thread while the reactors run.
    std::thread::sleep(Duration::from_millis(900));
    for handle in set.handles().iter() {
        let s = handle.stats();
        println!(
            "core {}: {:.0} IOPS, busy {:.1} %, CPU {:.1} %, {} sleeps, {} interrupt waits, \
             {} parks",
            s.core,
            s.iops(),
            s.busy_pct(),
            s.cpu_pct(),
            s.counters.sleeps,
            s.counters.interrupt_waits,
            s.counters.parks,
        );
    }

    // 4. Each reactor's result, waited for from this thread; then shut down.
    for (handle, run) in set.handles().iter().zip(runs) {
        let t = run.wait()?;
        println!(
            "reactor on core {}: verified {} blocks, {} mismatches, {} failed",
            handle.core(),
            t.verified,
            t.mismatches,
            t.failed
        );
    }
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
