//! One shard of the store, driven by completion callbacks: the state of one reactor, made
//! by `init` on the reactor's thread and handed as `&mut` to every message and completion
//! there, and the exit hook that turns it into the shard's statistics. The log itself
//! (its place on the device, the ring, the limits, the record format) is `log.rs`; what is
//! here is getting its I/O done: one commit at a time, reads by key, and the I/Os a full
//! queue pair refused, tried again when a completion frees a slot.

// Paths spelled out: the tests include this file by path, and the tree must resolve the
// same from there as from `main.rs`.
#[path = "log.rs"]
mod log;

use std::collections::VecDeque;

use hypoll_reactor::{Device, InitError, IoBuf, IoCallback, IoDone, Reactor, Rejected};

use crate::store::{Answer, StoreConfig, StoreError};
use log::{Log, ReadPlan, READ_BUF_BYTES};
pub use log::{ShardStats, Waiter};

struct PendingRead {
    plan: ReadPlan,
    waiter: Waiter,
}

/// One reactor's state.
pub struct Shard {
    log: Log,
    /// Reads under way, by the key their request carries in `user`; `free_keys` the rest.
    reads: Vec<Option<PendingRead>>,
    free_keys: Vec<usize>,
    /// Buffers for reads, one per key, back to the pool as each read completes.
    read_bufs: Vec<IoBuf>,
    /// Reads the queue pair was too full to take, oldest first, as refused.
    refused_reads: VecDeque<Rejected<IoCallback<Shard>>>,
}

/// Attaches the device on this reactor and builds its shard: every buffer and queue it
/// will use, sized by `cfg`, so that serving allocates nothing but answers.
pub fn init(r: &mut Reactor<Shard>, device: &Device, cfg: StoreConfig) -> Result<Shard, InitError> {
    Ok(Shard {
        log: Log::open(r, device, cfg)?,
        reads: (0..cfg.reads_max).map(|_| None).collect(),
        free_keys: (0..cfg.reads_max).rev().collect(),
        read_bufs: (0..cfg.reads_max)
            .map(|_| IoBuf::zeroed(READ_BUF_BYTES))
            .collect(),
        refused_reads: VecDeque::with_capacity(cfg.reads_max),
    })
}

impl Shard {
    /// The shard's invariants, for `debug_assert!` where its state changes hands.
    fn holds(&self) -> bool {
        let reads_out = self.reads.iter().filter(|r| r.is_some()).count();
        self.log.holds()
            && reads_out + self.free_keys.len() == self.log.cfg.reads_max
            && self.refused_reads.len() <= reads_out
    }
}

/// A client's append: refused at once past a limit, otherwise answered when its commit
/// completes.
pub fn append(r: &mut Reactor<Shard>, s: &mut Shard, record: Vec<u8>, waiter: Waiter) {
    debug_assert!(s.holds());
    if s.log.append(record, waiter) {
        try_commit(r, s);
    }
    debug_assert!(s.holds());
}

/// Starts the next commit unless one is on the device. A full queue pair leaves the
/// staged appends for the next completion to retry (`resume`); any other refusal answers
/// them.
fn try_commit(r: &mut Reactor<Shard>, s: &mut Shard) {
    if s.log.committing() {
        return;
    }
    let Some(commit) = s.log.stage() else {
        return;
    };
    match r.submit_vectored(commit.dev, commit.req, commit.segments(), after_commit) {
        Ok(()) => s.log.submitted(&commit),
        // Something is on the device, so a completion is coming to call `resume`.
        Err(refused) if refused.reason.is_queue_full() => s.log.stats.commits_requeued += 1,
        Err(refused) => s.log.committed(Err(StoreError::Refused(refused.reason))),
    }
}

/// A commit's completion: its appends are durable (or failed), and the next group goes.
fn after_commit(r: &mut Reactor<Shard>, s: &mut Shard, done: IoDone) {
    s.log.committed(done.result.map_err(StoreError::Io));
    resume(r, s);
    debug_assert!(s.holds());
}

/// A client's read of the record at `offset_bytes`: refused at once past the durable end
/// or a limit, otherwise answered when its read from the device completes.
pub fn read(r: &mut Reactor<Shard>, s: &mut Shard, offset_bytes: u64, waiter: Waiter) {
    debug_assert!(s.holds());
    let plan = match s.log.read(offset_bytes) {
        Ok(plan) => plan,
        Err(error) => {
            s.log.stats.reads_refused += 1;
            return waiter.answer(Answer::Read(Err(error)));
        }
    };
    let Some(key) = s.free_keys.pop() else {
        s.log.stats.reads_refused += 1;
        let max = s.log.cfg.reads_max;
        return waiter.answer(Answer::Read(Err(StoreError::ReadsFull { max })));
    };
    // An abandoned read keeps its buffer (the device may still write into it): replace it.
    let buf = s.read_bufs.pop();
    let buf = buf.unwrap_or_else(|| IoBuf::zeroed(READ_BUF_BYTES));
    s.reads[key] = Some(PendingRead { plan, waiter });
    // The block holding the durable end may be on its way to the device again with new
    // records behind the old ones: a read racing that write sees the old bytes either way.
    let req = plan.req.with_user(key as u64);
    let submitted = r.submit(plan.dev, req, Some(buf), after_read);
    on_read_refused(s, submitted.map_err(Rejected::boxed));
    debug_assert!(s.holds());
}

/// A refused read waits for a slot if the queue pair was full, or is answered now.
fn on_read_refused(s: &mut Shard, submitted: Result<(), Rejected<IoCallback<Shard>>>) {
    let Err(refused) = submitted else {
        return;
    };
    if refused.reason.is_queue_full() {
        s.log.stats.reads_requeued += 1;
        return s.refused_reads.push_back(refused);
    }
    let key = refused.req.user as usize;
    let read = s.reads[key]
        .take()
        .expect("a read holds its key until answered");
    s.free_keys.push(key);
    s.read_bufs.extend(refused.buf);
    s.log.stats.reads_failed += 1;
    let error = StoreError::Refused(refused.reason);
    read.waiter.answer(Answer::Read(Err(error)));
}

fn after_read(r: &mut Reactor<Shard>, s: &mut Shard, done: IoDone) {
    let key = done.user as usize;
    let read = s.reads[key]
        .take()
        .expect("a read holds its key until answered");
    s.free_keys.push(key);
    let result = done.result.map_err(StoreError::Io);
    read.waiter
        .answer(s.log.read_ended(&read.plan, result, done.buf.as_deref()));
    s.read_bufs.extend(done.buf);
    resume(r, s);
    debug_assert!(s.holds());
}

/// A completion freed a queue slot: first to the commit waiting for one (its appends'
/// clients wait on it), then to the reads refused for want of one, oldest first.
fn resume(r: &mut Reactor<Shard>, s: &mut Shard) {
    try_commit(r, s);
    while r.has_room(s.log.dev) {
        let Some(refused) = s.refused_reads.pop_front() else {
            return;
        };
        match r.resubmit(refused) {
            Ok(()) => {}
            // Not expected after `has_room`; either way the next completion comes back.
            Err(again) if again.reason.is_queue_full() => {
                s.refused_reads.push_front(again);
                return;
            }
            Err(again) => on_read_refused(s, Err(again)),
        }
    }
}

/// The exit hook: the reactor has drained its I/O, and each completion answered what it
/// carried; whatever is left never reached the device, and is answered so.
pub fn exit(r: &mut Reactor<Shard>, mut s: Shard) -> ShardStats {
    debug_assert!(s.holds());
    s.log.close();
    for read in s.reads.iter_mut().filter_map(Option::take) {
        s.log.stats.reads_failed += 1;
        read.waiter
            .answer(Answer::Read(Err(StoreError::ShuttingDown)));
    }
    s.log.stats.interrupt_waits = r.counters().interrupt_waits;
    std::mem::take(&mut s.log.stats)
}
