//! The log store as its clients see it: start it on a device, append records and read them
//! back by offset from any thread, shut it down and collect each shard's statistics.
//!
//! Two reactors, one per core, each own a shard: half of the device's blocks, a log that
//! only grows, and the records whose key is even (shard 0) or odd (shard 1). A client
//! reaches a shard through its reactor's handle, with a message that carries the request
//! and a channel for the answer; every request gets exactly one answer on that channel,
//! whether the record was written, read, refused for a limit, or failed on the device.
//! How a shard batches appends into 4 KiB blocks is in `log.rs`.

use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use hypoll_reactor::{
    CoreError, CoreList, Device, IoFailure, ReactorConfig, ReactorHandle, ReactorPanic, ReactorSet,
    RejectReason, SendError, StartError,
};

// The shard and the policy are the including crate's modules, beside this one: the
// callback store (`shard.rs` here) and the async one (`hypoll-async`'s
// `examples/logstore_async/shard.rs`) put theirs behind this same interface.
use crate::policy::spin_then_wait;
use crate::shard;
pub use crate::shard::ShardStats;
use crate::shard::{Shard, Waiter};

/// Shards, one reactor each.
pub const SHARDS: usize = 2;
/// The unit a commit writes: records are packed into blocks of this size, and a commit
/// writes every block its records touch, the partly filled last one included.
pub const LOG_BLOCK_BYTES: u64 = 4096;
/// Each record is stored behind a header: its length and a checksum, 4 bytes each.
pub const RECORD_HEADER_BYTES: usize = 8;
/// The longest record: with its header, one log block.
pub const RECORD_BYTES_MAX: usize = LOG_BLOCK_BYTES as usize - RECORD_HEADER_BYTES;
/// How long a client waits for room in a reactor's full mailbox before it is refused
/// (`SendError::Full`): a busy shard slows its clients down before it turns them away.
pub const SEND_WAIT: Duration = Duration::from_secs(1);

/// A shard's limits: what a client can make it hold at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreConfig {
    /// Depth of each reactor's queue pair on the device: one commit and the reads share it.
    pub queue_depth: usize,
    /// Appends a shard holds unacknowledged: those in the commit on the device and those
    /// waiting for the next one. One more is refused with [`StoreError::AppendsFull`].
    pub appends_max: usize,
    /// The same appends' bytes, headers included ([`StoreError::BytesFull`]). A commit
    /// writes at most this plus one block, so it bounds the shard's ring and every write.
    pub append_bytes_max: usize,
    /// Reads a shard has on the device or waiting for a queue slot
    /// ([`StoreError::ReadsFull`]).
    pub reads_max: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            queue_depth: 32,
            appends_max: 256,
            append_bytes_max: 64 << 10,
            reads_max: 64,
        }
    }
}

/// Where a record is: its shard, and the byte of that shard's log its header starts at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LogOffset {
    pub shard: usize,
    pub offset_bytes: u64,
}

/// An answer, with the tag its request was sent with.
#[derive(Debug)]
pub struct Reply {
    pub tag: u64,
    pub answer: Answer,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// The record is on the device (the commit that carried it completed), at this offset.
    Appended(Result<LogOffset, StoreError>),
    /// The record's bytes, as read from the device.
    Read(Result<Vec<u8>, StoreError>),
}

/// Why a request was not carried out. The `...Full` ones are back-pressure: retry once
/// some of your earlier requests have been answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("a record of {len_bytes} bytes is over the largest, {max_bytes}")]
    RecordTooLarge { len_bytes: usize, max_bytes: usize },
    #[error("{max} appends already wait for their commit on this shard")]
    AppendsFull { max: usize },
    #[error("{max_bytes} bytes of appends already wait for their commit on this shard")]
    BytesFull { max_bytes: usize },
    #[error("the shard's log is full ({capacity_bytes} bytes)")]
    LogFull { capacity_bytes: u64 },
    #[error("{max} reads are already under way on this shard")]
    ReadsFull { max: usize },
    #[error("no shard {shard}: the store has {shards}")]
    NoSuchShard { shard: usize, shards: usize },
    #[error("nothing durable at byte {offset_bytes}: the shard's log ends at {durable_bytes}")]
    NotDurable {
        offset_bytes: u64,
        durable_bytes: u64,
    },
    #[error("no record starts at byte {offset_bytes}: its header or checksum does not match")]
    NotARecord { offset_bytes: u64 },
    #[error("the device failed the I/O: {0}")]
    Io(IoFailure),
    #[error("the reactor refused the I/O: {0}")]
    Refused(RejectReason),
    #[error("the store shut down before carrying it out")]
    ShuttingDown,
}

impl StoreError {
    /// Back-pressure: a limit of the shard, which frees up as it answers earlier requests.
    pub fn is_back_pressure(&self) -> bool {
        matches!(
            self,
            StoreError::AppendsFull { .. }
                | StoreError::BytesFull { .. }
                | StoreError::ReadsFull { .. }
        )
    }
}

/// Why [`LogStore::start`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreStartError {
    #[error(
        "a log store runs {SHARDS} reactors on cores of their own; this process may use {allowed}"
    )]
    TooFewCores { allowed: usize },
    #[error(transparent)]
    Cores(#[from] CoreError),
    #[error(transparent)]
    Start(#[from] StartError),
}

/// A running log store.
pub struct LogStore {
    set: ReactorSet<Shard, ShardStats>,
}

impl LogStore {
    /// Starts one reactor per shard, on the first [`SHARDS`] cores this process may use,
    /// each with its own queue pair on `device` and the spin-then-wait policy. An empty
    /// log: the store keeps no index, so what an earlier run wrote is not found again.
    pub fn start(device: Device, cfg: StoreConfig) -> Result<LogStore, StoreStartError> {
        let allowed = CoreList::allowed()?;
        if allowed.len() < SHARDS {
            return Err(StoreStartError::TooFewCores {
                allowed: allowed.len(),
            });
        }
        let cores = CoreList::new(allowed.as_slice()[..SHARDS].to_vec());
        let reactors = ReactorConfig {
            cores: Some(cores),
            custom_policy: Some(spin_then_wait()),
            ..ReactorConfig::default()
        };
        let init = move |r: &mut _| shard::init(r, &device, cfg);
        let set = ReactorSet::start_with_exit(reactors, init, shard::exit)?;
        Ok(LogStore { set })
    }

    /// A handle for clients, on any thread.
    pub fn client(&self) -> LogClient {
        LogClient {
            handles: self.set.handles().clone(),
        }
    }

    /// Stops the reactors once their I/O has drained (anything not carried out by then is
    /// answered [`StoreError::ShuttingDown`]) and returns each shard's statistics, shard 0
    /// first; or the first reactor that panicked.
    pub fn shutdown(self) -> Result<Vec<ShardStats>, ReactorPanic> {
        let report = self.set.shutdown();
        if let Some(panic) = report.panics.into_iter().next() {
            return Err(panic);
        }
        let mut stats: Vec<ShardStats> = report.exits.into_iter().map(|e| e.output).collect();
        stats.sort_by_key(|s| s.shard);
        Ok(stats)
    }
}

/// How clients reach the shards. Cheap to clone; every method returns at once (or after
/// up to [`SEND_WAIT`] when a shard's mailbox is full), and the answer arrives on `reply`.
/// `Err` means the request never reached its shard and no answer will come.
#[derive(Clone)]
pub struct LogClient {
    handles: Arc<[ReactorHandle<Shard>]>,
}

impl LogClient {
    /// Appends `record` (at most [`RECORD_BYTES_MAX`] bytes) to the shard of `key`. The
    /// answer, [`Answer::Appended`], comes once the record is on the device.
    pub fn append(
        &self,
        key: u64,
        record: Vec<u8>,
        tag: u64,
        reply: &Sender<Reply>,
    ) -> Result<(), SendError> {
        let shard = (key % self.handles.len() as u64) as usize;
        let waiter = Waiter::new(tag, reply.clone());
        self.handles[shard].send_timeout(move |r, s| shard::append(r, s, record, waiter), SEND_WAIT)
    }

    /// Reads the record at `at`, as an append answered it. The answer is [`Answer::Read`].
    pub fn read(&self, at: LogOffset, tag: u64, reply: &Sender<Reply>) -> Result<(), SendError> {
        let waiter = Waiter::new(tag, reply.clone());
        let Some(handle) = self.handles.get(at.shard) else {
            waiter.answer(Answer::Read(Err(StoreError::NoSuchShard {
                shard: at.shard,
                shards: self.handles.len(),
            })));
            return Ok(());
        };
        handle.send_timeout(
            move |r, s| shard::read(r, s, at.offset_bytes, waiter),
            SEND_WAIT,
        )
    }
}
