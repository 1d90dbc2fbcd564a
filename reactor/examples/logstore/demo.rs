//! The log store's demonstration client, shared by the callback store's `main.rs` and
//! the async store's (`hypoll-async`'s `examples/logstore_async/main.rs`): it appends
//! `records` records of 1 to 4088 bytes, keeping up to `WINDOW` requests out at once and
//! sending again those refused for back-pressure, reads every one back and compares it,
//! then prints what each shard did.

use std::collections::VecDeque;
use std::error::Error;
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use crate::store::{Answer, LogOffset, LogStore, Reply, StoreConfig, RECORD_BYTES_MAX};
use hypoll_reactor::{Device, SendError};

/// Requests this client keeps out at once, over both shards: more than the shards hold
/// (`StoreConfig::appends_max`, `reads_max`), so some are refused and sent again.
const WINDOW: u64 = 256;
/// How long the client waits for any answer before it calls the store stuck.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// Record `seq`: its length and bytes follow from its number, so a read can be checked
/// without keeping what was written.
fn record(seq: u64) -> Vec<u8> {
    let len = 1 + (seq.wrapping_mul(2_654_435_761) % RECORD_BYTES_MAX as u64) as usize;
    (0..len)
        .map(|i| (seq as usize * 7 + i * 13) as u8)
        .collect()
}

/// Sends requests `0..count` through `send`, at most `WINDOW` unanswered, and hands each
/// answer to `take`, which says whether it must be sent again (back-pressure).
fn run(
    count: u64,
    rx: &Receiver<Reply>,
    mut send: impl FnMut(u64) -> Result<(), SendError>,
    mut take: impl FnMut(Reply) -> Result<bool, Box<dyn Error>>,
) -> Result<u64, Box<dyn Error>> {
    let (mut next, mut done, mut out, mut resent) = (0, 0, 0, 0);
    let mut again = VecDeque::new();
    while done < count {
        while out < WINDOW && (next < count || !again.is_empty()) {
            let seq = again.pop_front().unwrap_or_else(|| {
                next += 1;
                next - 1
            });
            send(seq)?;
            out += 1;
        }
        let reply = rx.recv_timeout(ANSWER_WAIT)?;
        out -= 1;
        let tag = reply.tag;
        if take(reply)? {
            again.push_back(tag);
            resent += 1;
        } else {
            done += 1;
        }
    }
    Ok(resent)
}

/// Runs the demonstration: `[device] [records]` from the command line.
pub fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let spec = args.next().unwrap_or_else(|| "emu:nand".to_string());
    let count: u64 = args
        .next()
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(20_000);

    let store = LogStore::start(Device::open(&spec)?, StoreConfig::default())?;
    let client = store.client();
    let (tx, rx) = mpsc::channel();

    let mut offsets: Vec<Option<LogOffset>> = vec![None; count as usize];
    let t0 = Instant::now();
    let resent = run(
        count,
        &rx,
        |seq| client.append(seq, record(seq), seq, &tx),
        |reply| match reply.answer {
            Answer::Appended(Ok(at)) => {
                offsets[reply.tag as usize] = Some(at);
                Ok(false)
            }
            Answer::Appended(Err(e)) if e.is_back_pressure() => Ok(true),
            other => Err(format!("append {}: {other:?}", reply.tag).into()),
        },
    )?;
    let append_s = t0.elapsed().as_secs_f64();
    println!("{count} appends in {append_s:.3} s ({resent} sent again after back-pressure)");

    let t0 = Instant::now();
    let resent = run(
        count,
        &rx,
        |seq| client.read(offsets[seq as usize].expect("appended"), seq, &tx),
        |reply| match reply.answer {
            Answer::Read(Ok(bytes)) if bytes == record(reply.tag) => Ok(false),
            Answer::Read(Err(e)) if e.is_back_pressure() => Ok(true),
            other => Err(format!("read of record {}: {other:?}", reply.tag).into()),
        },
    )?;
    let read_s = t0.elapsed().as_secs_f64();
    println!("{count} records read back and checked in {read_s:.3} s ({resent} sent again)");

    for s in store.shutdown()? {
        println!(
            "shard {} on core {} ({}): {} appends in {} commits (up to {} each, {} wrapped the \
             ring, {} waited for a queue slot), {} KiB written; {} reads ({} waited for a \
             slot); {} refused, {} failed; {} interrupt waits",
            s.shard,
            s.core,
            s.policy,
            s.appends_acked,
            s.commits,
            s.commit_appends_max,
            s.commits_wrapped,
            s.commits_requeued,
            s.commit_bytes >> 10,
            s.reads_ok,
            s.reads_requeued,
            s.appends_refused + s.reads_refused,
            s.appends_failed + s.reads_failed,
            s.interrupt_waits,
        );
    }
    Ok(())
}
