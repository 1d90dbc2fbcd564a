//! One shard of the log: the state of one reactor, made by `init` on the reactor's thread
//! and handed as `&mut` to every message and completion there, and the exit hook that
//! turns it into the shard's statistics. What the state does: group commit in `commit.rs`,
//! reads in `read.rs`.
//!
//! The shard's log is a run of bytes on its half of the device: records packed one after
//! another, each behind a header (length, checksum), in 4 KiB log blocks, from byte 0. The
//! store keeps no index: a record is found by the offset its append was answered with.

// Paths spelled out: the test includes `store.rs` by path, and the tree must resolve the
// same from there as from `main.rs`.
#[path = "commit.rs"]
mod commit;
#[path = "read.rs"]
mod read;

use std::collections::VecDeque;
use std::sync::mpsc::Sender;

use hypoll_reactor::{
    Device, DeviceId, InitError, IoBuf, IoCallback, MemoryRegion, Reactor, Rejected,
};

use crate::store::{
    Answer, Reply, StoreConfig, StoreError, LOG_BLOCK_BYTES, RECORD_BYTES_MAX, RECORD_HEADER_BYTES,
};

pub use commit::append;
pub use read::read;

/// A read covers a record's header and its longest body from wherever it starts in a
/// device block: at most two log blocks, as a device block is at most one (`init` checks).
const READ_BUF_BYTES: usize = 2 * LOG_BLOCK_BYTES as usize;

/// A client waiting for an answer: its tag, and where to send the answer.
pub struct Waiter {
    tag: u64,
    reply: Sender<Reply>,
}

impl Waiter {
    pub fn new(tag: u64, reply: Sender<Reply>) -> Waiter {
        Waiter { tag, reply }
    }

    /// A client that stopped listening has nobody to tell: its answer is dropped.
    pub fn answer(self, answer: Answer) {
        let _ = self.reply.send(Reply {
            tag: self.tag,
            answer,
        });
    }
}

/// What a shard reports as its reactor exits.
#[derive(Clone, Debug, Default)]
pub struct ShardStats {
    pub shard: usize,
    pub core: usize,
    /// The reactor's poll policy, by name.
    pub policy: String,
    pub appends_acked: u64,
    /// Appends answered with an error after they were accepted (device or reactor).
    pub appends_failed: u64,
    /// Appends turned away at once: a limit, a record too long, a full log.
    pub appends_refused: u64,
    pub commits: u64,
    /// Most appends one commit carried.
    pub commit_appends_max: u64,
    /// Bytes the commits wrote, partial blocks written again included.
    pub commit_bytes: u64,
    /// Commits whose span wrapped around the ring: two segments.
    pub commits_wrapped: u64,
    /// Commits the queue pair was too full to take, submitted again after a completion.
    pub commits_requeued: u64,
    pub reads_ok: u64,
    /// Reads answered with an error after they were accepted: the device, the reactor, or
    /// no record at the offset.
    pub reads_failed: u64,
    /// Reads turned away at once: a limit, an offset not durable.
    pub reads_refused: u64,
    /// Reads the queue pair was too full to take, submitted again after a completion.
    pub reads_requeued: u64,
    /// Times the reactor blocked on the device's interrupt (the policy's second half).
    pub interrupt_waits: u64,
}

struct PendingAppend {
    record: Vec<u8>,
    waiter: Waiter,
}

struct StagedAppend {
    offset_bytes: u64,
    waiter: Waiter,
}

struct PendingRead {
    offset_bytes: u64,
    /// The end of the bytes the read fetches: a header claiming more is not a record.
    window_end_bytes: u64,
    waiter: Waiter,
}

/// One reactor's state.
pub struct Shard {
    cfg: StoreConfig,
    index: usize,
    dev: DeviceId,
    lba_bytes: u64,
    /// The shard's first device block.
    base_lba: u64,
    capacity_bytes: u64,
    /// Log byte `o` lives at ring byte `o % ring.len()` while it is not yet durable, and
    /// until the ring comes round to it again. Registered as `ring_region`; the state is
    /// dropped after the reactor, so the memory outlives the registration.
    ring: IoBuf,
    ring_region: MemoryRegion,
    /// Log bytes on the device, every append in them acknowledged.
    durable_bytes: u64,
    /// The end of the bytes in the ring: `staged` covers `durable_bytes..staged_end_bytes`.
    staged_end_bytes: u64,
    /// Appends in the ring, oldest first: the next commit's (or the one on the device).
    staged: Vec<StagedAppend>,
    committing: bool,
    /// Appends that arrived during a commit, oldest first, and their bytes with headers.
    pending: VecDeque<PendingAppend>,
    pending_bytes: u64,
    /// Reads under way, by the key their request carries in `user`; `free_keys` the rest.
    reads: Vec<Option<PendingRead>>,
    free_keys: Vec<usize>,
    /// Buffers for reads, one per key, back to the pool as each read completes.
    read_bufs: Vec<IoBuf>,
    /// Reads the queue pair was too full to take, oldest first, as refused.
    refused_reads: VecDeque<Rejected<IoCallback<Shard>>>,
    stats: ShardStats,
}

/// Attaches the device on this reactor and builds its shard: every buffer and queue it
/// will use, sized by `cfg`, so that serving allocates nothing but answers.
pub fn init(r: &mut Reactor<Shard>, device: &Device, cfg: StoreConfig) -> Result<Shard, InitError> {
    if cfg.queue_depth == 0 || cfg.appends_max == 0 || cfg.reads_max == 0 {
        return Err("queue_depth, appends_max and reads_max must be at least 1".into());
    }
    if cfg.append_bytes_max < RECORD_HEADER_BYTES + RECORD_BYTES_MAX {
        return Err(format!(
            "append_bytes_max must hold a longest record, {LOG_BLOCK_BYTES} bytes"
        )
        .into());
    }
    let dev = r.attach(device, cfg.queue_depth)?;
    let ns = r
        .namespace(dev)
        .ok_or("the device just attached has no namespace")?;
    let lba_bytes = u64::from(ns.lba_size_bytes);
    if !LOG_BLOCK_BYTES.is_multiple_of(lba_bytes) {
        return Err(
            format!("device blocks of {lba_bytes} bytes do not divide {LOG_BLOCK_BYTES}").into(),
        );
    }
    // The longest commit: every byte a client may have waiting, and the partial blocks at
    // both ends. The ring holds exactly that, so a commit's span never meets itself.
    let ring_bytes =
        (cfg.append_bytes_max as u64).next_multiple_of(LOG_BLOCK_BYTES) + LOG_BLOCK_BYTES;
    if ring_bytes > u64::from(ns.transfer_bytes_max) {
        return Err(format!(
            "a commit may write {ring_bytes} bytes, over the device's largest transfer, {}",
            ns.transfer_bytes_max
        )
        .into());
    }
    let shards = r.handles().len() as u64;
    let shard_lbas =
        ns.capacity_lbas / shards / (LOG_BLOCK_BYTES / lba_bytes) * (LOG_BLOCK_BYTES / lba_bytes);
    if shard_lbas == 0 {
        return Err("the device is too small for a log block per shard".into());
    }
    let mut ring = IoBuf::zeroed(ring_bytes as usize);
    // SAFETY: `ring` is owned by the shard returned below, which the reactor drops only
    // after itself, so the memory stays valid while registered. Only commits use it: the
    // shard writes into it only while no commit is on the device (`try_commit`).
    let ring_region = unsafe { r.register_memory(dev, ring.as_mut_ptr(), ring.len()) }?;
    let index = r.index();
    Ok(Shard {
        cfg,
        index,
        dev,
        lba_bytes,
        base_lba: index as u64 * shard_lbas,
        capacity_bytes: shard_lbas * lba_bytes,
        ring,
        ring_region,
        durable_bytes: 0,
        staged_end_bytes: 0,
        staged: Vec::with_capacity(cfg.appends_max),
        committing: false,
        pending: VecDeque::with_capacity(cfg.appends_max),
        pending_bytes: 0,
        reads: (0..cfg.reads_max).map(|_| None).collect(),
        free_keys: (0..cfg.reads_max).rev().collect(),
        read_bufs: (0..cfg.reads_max)
            .map(|_| IoBuf::zeroed(READ_BUF_BYTES))
            .collect(),
        refused_reads: VecDeque::with_capacity(cfg.reads_max),
        stats: ShardStats {
            shard: index,
            core: r.core(),
            policy: r.policy_name().to_string(),
            ..ShardStats::default()
        },
    })
}

impl Shard {
    /// The shard's invariants, for `debug_assert!` where its state changes hands.
    fn holds(&self) -> bool {
        let ring_bytes = self.ring.len() as u64;
        let span_bytes = self.staged_end_bytes.next_multiple_of(LOG_BLOCK_BYTES)
            - self.durable_bytes / LOG_BLOCK_BYTES * LOG_BLOCK_BYTES;
        let unacked_bytes = self.staged_end_bytes - self.durable_bytes + self.pending_bytes;
        let reads_out = self.reads.iter().filter(|r| r.is_some()).count();
        self.durable_bytes <= self.staged_end_bytes
            && self.staged_end_bytes + self.pending_bytes <= self.capacity_bytes
            && span_bytes <= ring_bytes
            && self.staged.is_empty() == (self.staged_end_bytes == self.durable_bytes)
            && (!self.committing || !self.staged.is_empty())
            && self.staged.len() + self.pending.len() <= self.cfg.appends_max
            && unacked_bytes <= self.cfg.append_bytes_max as u64
            && reads_out + self.free_keys.len() == self.cfg.reads_max
            && self.refused_reads.len() <= reads_out
    }
}

/// A completion freed a queue slot: first to the commit waiting for one (its appends'
/// clients wait on it), then to the reads refused for want of one.
fn resume(r: &mut Reactor<Shard>, s: &mut Shard) {
    commit::try_commit(r, s);
    read::retry_refused(r, s);
}

/// The exit hook: the reactor has drained its I/O, and each completion answered what it
/// carried; whatever is left never reached the device, and is answered so.
pub fn exit(r: &mut Reactor<Shard>, mut s: Shard) -> ShardStats {
    debug_assert!(s.holds());
    let appends = s.staged.drain(..).map(|a| a.waiter);
    for waiter in appends.chain(s.pending.drain(..).map(|a| a.waiter)) {
        s.stats.appends_failed += 1;
        waiter.answer(Answer::Appended(Err(StoreError::ShuttingDown)));
    }
    for read in s.reads.iter_mut().filter_map(Option::take) {
        s.stats.reads_failed += 1;
        read.waiter
            .answer(Answer::Read(Err(StoreError::ShuttingDown)));
    }
    s.stats.interrupt_waits = r.counters().interrupt_waits;
    s.stats
}
