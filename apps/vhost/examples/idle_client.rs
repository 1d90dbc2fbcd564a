//! A vhost-user-blk front end that attaches and then does nothing, to measure what an idle
//! guest costs a back end (`scripts/vhost-compare`): libblkio's driver connects with
//! QUEUES virtqueues, reads one block on each (so every ring has started and served a
//! request), prints `attached`, stays connected and idle for SECONDS, prints `leaving`
//! and exits.
//!
//!   cargo run --release -p hypoll-vhost --example idle_client -- SOCKET QUEUES SECONDS

use std::io::Write;
use std::mem::MaybeUninit;
use std::process::ExitCode;
use std::time::Duration;

use blkio::{Blkio, Completion, ReqFlags};

/// Most queues asked for (the back ends here offer one per reactor).
const QUEUES_MAX: i32 = 64;
/// Longest idle spell asked for.
const SECONDS_MAX: u64 = 3600;

fn run(socket: &str, queues: i32, seconds: u64) -> Result<(), String> {
    let mut b = Blkio::new("virtio-blk-vhost-user").map_err(|e| e.to_string())?;
    b.set_str("path", socket).map_err(|e| e.to_string())?;
    b.connect()
        .map_err(|e| format!("connecting to {socket}: {e}"))?;
    b.set_i32("num-queues", queues).map_err(|e| e.to_string())?;
    let mut started = b.start().map_err(|e| e.to_string())?;
    let region = b.alloc_mem_region(4096).map_err(|e| e.to_string())?;
    b.map_mem_region(&region).map_err(|e| e.to_string())?;
    for (i, q) in started.queues.iter_mut().enumerate() {
        q.read(0, region.addr as *mut u8, 4096, 0, ReqFlags::empty());
        let mut done = [const { MaybeUninit::<Completion>::uninit() }; 1];
        let mut timeout = Duration::from_secs(10);
        let n = q
            .do_io(&mut done, 1, Some(&mut timeout), None)
            .map_err(|e| format!("queue {i}: {e}"))?;
        if n != 1 {
            return Err(format!("queue {i}: no completion in 10 s"));
        }
        // SAFETY: `do_io` filled one completion.
        let ret = unsafe { done[0].assume_init_read() }.ret;
        if ret != 0 {
            return Err(format!("queue {i}: the read failed ({ret})"));
        }
    }
    println!("attached");
    let _ = std::io::stdout().flush();
    std::thread::sleep(Duration::from_secs(seconds));
    println!("leaving");
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = match args.as_slice() {
        [socket, queues, seconds] => queues
            .parse::<i32>()
            .ok()
            .filter(|q| (1..=QUEUES_MAX).contains(q))
            .zip(seconds.parse::<u64>().ok().filter(|s| *s <= SECONDS_MAX))
            .map(|(q, s)| (socket.clone(), q, s)),
        _ => None,
    };
    let Some((socket, queues, seconds)) = parsed else {
        eprintln!("usage: idle_client SOCKET QUEUES(1-{QUEUES_MAX}) SECONDS(0-{SECONDS_MAX})");
        return ExitCode::from(2);
    };
    match run(&socket, queues, seconds) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idle_client: {e}");
            ExitCode::FAILURE
        }
    }
}
