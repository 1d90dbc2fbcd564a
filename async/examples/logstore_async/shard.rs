//! One shard of the log, as tasks: a commit task that writes whatever appends arrived
//! while the last commit was on the device (group commit), and a task per read. Client
//! messages run on the reactor, check the shard's limits and hand the work to a task.
//!
//! The log is the callback version's: records packed one after another, each behind a
//! header (length, checksum), in 4 KiB log blocks from byte 0, no index. Appends are
//! copied into a ring registered with the device, and a commit writes every log block
//! from the last durable byte to the end of the newest record straight out of it, with
//! FUA, in one vectored write (two segments where the span wraps the ring's end). A full
//! queue pair needs no code here: an I/O future waits for room.

use std::collections::VecDeque;
use std::sync::mpsc::Sender;

use hypoll_async::{Executor, HasExecutor, IoError, Local};
use hypoll_reactor::{
    Device, DeviceId, InitError, IoBuf, IoOp, IoRequest, MemoryRegion, Reactor, RegionSlice,
};

use crate::store::{
    Answer, LogOffset, Reply, StoreConfig, StoreError, LOG_BLOCK_BYTES, RECORD_BYTES_MAX,
    RECORD_HEADER_BYTES,
};

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

/// What a shard reports as its reactor exits (the callback version's fields; "requeued"
/// counts I/Os that found the queue pair full and waited for room).
#[derive(Clone, Debug, Default)]
pub struct ShardStats {
    pub shard: usize,
    pub core: usize,
    pub policy: String,
    pub appends_acked: u64,
    pub appends_failed: u64,
    pub appends_refused: u64,
    pub commits: u64,
    pub commit_appends_max: u64,
    pub commit_bytes: u64,
    pub commits_wrapped: u64,
    pub commits_requeued: u64,
    pub reads_ok: u64,
    pub reads_failed: u64,
    pub reads_refused: u64,
    pub reads_requeued: u64,
    pub interrupt_waits: u64,
}

/// One reactor's state.
pub struct Shard {
    executor: Executor<Shard>,
    cfg: StoreConfig,
    index: usize,
    dev: DeviceId,
    lba_bytes: u64,
    base_lba: u64,
    capacity_bytes: u64,
    /// Log byte `o` lives at ring byte `o % ring.len()` until the ring comes round to it
    /// again; registered as `ring_region` (the state outlives the reactor's queue pairs).
    ring: IoBuf,
    ring_region: MemoryRegion,
    /// Log bytes on the device, every append in them acknowledged.
    durable_bytes: u64,
    /// The end of the bytes in the ring: `staged` holds their appends, by offset.
    staged_end_bytes: u64,
    staged: Vec<(u64, Waiter)>,
    /// Appends waiting for the next commit, with their bytes (headers included).
    pending: VecDeque<(Vec<u8>, Waiter)>,
    pending_bytes: u64,
    /// A commit task is running: it takes what is pending before it ends.
    committing: bool,
    reads_out: usize,
    read_bufs: Vec<IoBuf>,
    stats: ShardStats,
}

impl HasExecutor for Shard {
    fn executor(&self) -> &Executor<Shard> {
        &self.executor
    }
}

/// Attaches the device and builds the shard, with every buffer it will use (sized by
/// `cfg`).
pub fn init(r: &mut Reactor<Shard>, device: &Device, cfg: StoreConfig) -> Result<Shard, InitError> {
    if cfg.queue_depth == 0 || cfg.appends_max == 0 || cfg.reads_max == 0 {
        return Err("queue_depth, appends_max and reads_max must be at least 1".into());
    }
    if cfg.append_bytes_max < RECORD_HEADER_BYTES + RECORD_BYTES_MAX {
        return Err("append_bytes_max must hold a longest record, 4096 bytes".into());
    }
    let dev = r.attach(device, cfg.queue_depth)?;
    let ns = r.namespace(dev).ok_or("the device has no namespace")?;
    let lba_bytes = u64::from(ns.lba_size_bytes);
    if !LOG_BLOCK_BYTES.is_multiple_of(lba_bytes) {
        return Err(format!("device blocks of {lba_bytes} bytes do not divide 4096").into());
    }
    // The longest commit: every byte a client may have waiting, and the partial blocks at
    // both ends. The ring holds exactly that, so a commit's span never meets itself.
    let ring_bytes =
        (cfg.append_bytes_max as u64).next_multiple_of(LOG_BLOCK_BYTES) + LOG_BLOCK_BYTES;
    if ring_bytes > u64::from(ns.transfer_bytes_max) {
        return Err(format!("a commit may write {ring_bytes} bytes, over a transfer").into());
    }
    let block_lbas = LOG_BLOCK_BYTES / lba_bytes;
    let shard_lbas = ns.capacity_lbas / r.handles().len() as u64 / block_lbas * block_lbas;
    if shard_lbas == 0 {
        return Err("the device is too small for a log block per shard".into());
    }
    let mut ring = IoBuf::zeroed(ring_bytes as usize);
    // SAFETY: the shard owns `ring` and is dropped after the reactor's queue pairs; only
    // the commit task writes into it, and only while no commit is on the device.
    let ring_region = unsafe { r.register_memory(dev, ring.as_mut_ptr(), ring.len()) }?;
    let index = r.index();
    Ok(Shard {
        executor: Executor::install(r)?,
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
        pending: VecDeque::with_capacity(cfg.appends_max),
        pending_bytes: 0,
        committing: false,
        reads_out: 0,
        read_bufs: (0..cfg.reads_max)
            .map(|_| IoBuf::zeroed(READ_BUF_BYTES))
            .collect(),
        stats: ShardStats {
            shard: index,
            core: r.core(),
            policy: r.policy_name().to_string(),
            ..ShardStats::default()
        },
    })
}

/// A client's append: refused at once past a limit, otherwise answered once the commit
/// carrying it completes (a commit task starts if none is running).
pub fn append(_r: &mut Reactor<Shard>, s: &mut Shard, record: Vec<u8>, waiter: Waiter) {
    let need_bytes = (RECORD_HEADER_BYTES + record.len()) as u64;
    let unacked_bytes = s.staged_end_bytes - s.durable_bytes + s.pending_bytes;
    let refusal = if record.len() > RECORD_BYTES_MAX {
        let (len_bytes, max_bytes) = (record.len(), RECORD_BYTES_MAX);
        StoreError::RecordTooLarge {
            len_bytes,
            max_bytes,
        }
    } else if s.staged.len() + s.pending.len() >= s.cfg.appends_max {
        StoreError::AppendsFull {
            max: s.cfg.appends_max,
        }
    } else if unacked_bytes + need_bytes > s.cfg.append_bytes_max as u64 {
        StoreError::BytesFull {
            max_bytes: s.cfg.append_bytes_max,
        }
    } else if s.staged_end_bytes + s.pending_bytes + need_bytes > s.capacity_bytes {
        StoreError::LogFull {
            capacity_bytes: s.capacity_bytes,
        }
    } else {
        s.pending_bytes += need_bytes;
        s.pending.push_back((record, waiter));
        if !std::mem::replace(&mut s.committing, true) {
            let commits = commit_task(s.executor.local());
            drop(
                s.executor
                    .spawn_local(commits)
                    .expect("room for one commit task"),
            );
        }
        return;
    };
    s.stats.appends_refused += 1;
    waiter.answer(Answer::Appended(Err(refusal)));
}

/// Commits, one at a time, until no append is pending: each stages every pending append
/// into the ring, writes the span, and answers them.
async fn commit_task(io: Local<Shard>) {
    while let Some((dev, req, segments, count)) = io.with(stage_pending) {
        let written = io.submit_vectored(dev, req, &segments[..count]).await;
        io.with(|_, s| {
            let offsets = s.staged.drain(..);
            if let Err(error) = written {
                // Their offsets go back: the next records take them.
                s.stats.appends_failed += offsets.len() as u64;
                for (_, waiter) in offsets {
                    waiter.answer(Answer::Appended(Err(store_error(error))));
                }
                s.staged_end_bytes = s.durable_bytes;
                return;
            }
            s.durable_bytes = s.staged_end_bytes;
            s.stats.appends_acked += offsets.len() as u64;
            for (offset_bytes, waiter) in offsets {
                let shard = s.index;
                waiter.answer(Answer::Appended(Ok(LogOffset {
                    shard,
                    offset_bytes,
                })));
            }
        });
    }
}

/// Stages the pending appends into the ring and returns the commit's write: every log
/// block from the last durable byte to the end of the newest record, in one or two
/// segments of the ring. `None`, and the commit task ends, when nothing is pending.
fn stage_pending(
    r: &mut Reactor<Shard>,
    s: &mut Shard,
) -> Option<(DeviceId, IoRequest, [RegionSlice; 2], usize)> {
    if s.pending.is_empty() {
        s.committing = false;
        return None;
    }
    while let Some((record, waiter)) = s.pending.pop_front() {
        let offset_bytes = s.staged_end_bytes;
        let mut header = [0u8; RECORD_HEADER_BYTES];
        header[..4].copy_from_slice(&(record.len() as u32).to_le_bytes());
        header[4..].copy_from_slice(&checksum(offset_bytes, &record).to_le_bytes());
        ring_put(s, offset_bytes, &header);
        ring_put(s, offset_bytes + RECORD_HEADER_BYTES as u64, &record);
        s.staged_end_bytes += (RECORD_HEADER_BYTES + record.len()) as u64;
        s.staged.push((offset_bytes, waiter));
    }
    s.pending_bytes = 0;
    let first_bytes = s.durable_bytes / LOG_BLOCK_BYTES * LOG_BLOCK_BYTES;
    let len = s.staged_end_bytes.next_multiple_of(LOG_BLOCK_BYTES) - first_bytes;
    let at = (first_bytes % s.ring.len() as u64) as usize;
    let head = (len as usize).min(s.ring.len() - at);
    let head_segment = RegionSlice::new(s.ring_region, at, head).expect("in the ring");
    let (segments, count) = match RegionSlice::new(s.ring_region, 0, len as usize - head) {
        Some(tail_segment) => ([head_segment, tail_segment], 2),
        None => ([head_segment; 2], 1),
    };
    s.stats.commits += 1;
    s.stats.commit_bytes += len;
    s.stats.commits_wrapped += u64::from(count > 1);
    s.stats.commit_appends_max = s.stats.commit_appends_max.max(s.staged.len() as u64);
    s.stats.commits_requeued += u64::from(!r.has_room(s.dev));
    // FUA: "acknowledged after the write" must mean on the media, not in a cache.
    let slba = s.base_lba + first_bytes / s.lba_bytes;
    let req = IoRequest::new(IoOp::Write, slba, (len / s.lba_bytes) as u32).with_fua(true);
    Some((s.dev, req, segments, count))
}

/// Writes `bytes` at log byte `at_bytes` into the ring, wrapping at its end; a log block
/// entered for the first time is zeroed first, so the ring's last lap does not reach the
/// device in the free tail of the last block.
fn ring_put(s: &mut Shard, at_bytes: u64, bytes: &[u8]) {
    let ring_bytes = s.ring.len();
    let mut block = at_bytes.next_multiple_of(LOG_BLOCK_BYTES);
    while block < at_bytes + bytes.len() as u64 {
        let at = (block % ring_bytes as u64) as usize;
        s.ring[at..at + LOG_BLOCK_BYTES as usize].fill(0);
        block += LOG_BLOCK_BYTES;
    }
    let at = (at_bytes % ring_bytes as u64) as usize;
    let head = bytes.len().min(ring_bytes - at);
    s.ring[at..at + head].copy_from_slice(&bytes[..head]);
    s.ring[..bytes.len() - head].copy_from_slice(&bytes[head..]);
}

/// A client's read of the record at `offset_bytes`: refused at once past a limit or the
/// durable end, otherwise a task that reads the longest record that could start there.
pub fn read(_r: &mut Reactor<Shard>, s: &mut Shard, offset_bytes: u64, waiter: Waiter) {
    let durable_bytes = s.durable_bytes;
    let refusal = if offset_bytes.saturating_add(RECORD_HEADER_BYTES as u64) > durable_bytes {
        StoreError::NotDurable {
            offset_bytes,
            durable_bytes,
        }
    } else if s.reads_out == s.cfg.reads_max {
        StoreError::ReadsFull {
            max: s.cfg.reads_max,
        }
    } else {
        s.reads_out += 1;
        let task = read_task(s.executor.local(), offset_bytes, ReadClient(Some(waiter)));
        drop(
            s.executor
                .spawn_local(task)
                .expect("reads_max bounds the tasks"),
        );
        return;
    };
    s.stats.reads_refused += 1;
    waiter.answer(Answer::Read(Err(refusal)));
}

/// A read's client: answered `ShuttingDown` if the read's task is dropped unfinished
/// (the reactor stopped first).
struct ReadClient(Option<Waiter>);

impl Drop for ReadClient {
    fn drop(&mut self) {
        if let Some(waiter) = self.0.take() {
            waiter.answer(Answer::Read(Err(StoreError::ShuttingDown)));
        }
    }
}

/// Reads the longest record that could start at `offset_bytes`, but nothing past the
/// durable end, from the device (not the ring), and answers with the record that its
/// header and checksum find there.
async fn read_task(io: Local<Shard>, offset_bytes: u64, mut client: ReadClient) {
    let (dev, req, end_bytes, buf) = io.with(|r, s| {
        let longest_bytes = (RECORD_HEADER_BYTES + RECORD_BYTES_MAX) as u64;
        let end_bytes = (offset_bytes + longest_bytes).min(s.durable_bytes);
        let first_lba = offset_bytes / s.lba_bytes;
        let nlb = (end_bytes.div_ceil(s.lba_bytes) - first_lba) as u32;
        s.stats.reads_requeued += u64::from(!r.has_room(s.dev));
        // An abandoned read keeps its buffer (the device may still write into it).
        let buf = s.read_bufs.pop();
        let buf = buf.unwrap_or_else(|| IoBuf::zeroed(READ_BUF_BYTES));
        let req = IoRequest::new(IoOp::Read, s.base_lba + first_lba, nlb);
        (s.dev, req, end_bytes, buf)
    });
    let done = io.submit(dev, req, Some(buf)).await;
    io.with(|_, s| {
        s.reads_out -= 1;
        let (result, buf) = match done {
            Ok(buf) => {
                let buf = buf.expect("a read hands its buffer back");
                let at = (offset_bytes % s.lba_bytes) as usize;
                (decode(offset_bytes, end_bytes, &buf[at..]), Some(buf))
            }
            Err(e) => {
                let (error, buf) = e.into_parts();
                (Err(store_error(error)), buf)
            }
        };
        s.read_bufs.extend(buf);
        match result {
            Ok(_) => s.stats.reads_ok += 1,
            Err(_) => s.stats.reads_failed += 1,
        }
        let waiter = client.0.take().expect("answered once");
        waiter.answer(Answer::Read(result));
    });
}

/// The record at log byte `offset_bytes`, from `bytes` read from there up to log byte
/// `end_bytes`, if its header and checksum say so.
fn decode(offset_bytes: u64, end_bytes: u64, bytes: &[u8]) -> Result<Vec<u8>, StoreError> {
    let len = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")) as usize;
    let sum = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
    let record_end_bytes = offset_bytes + (RECORD_HEADER_BYTES + len) as u64;
    match bytes.get(RECORD_HEADER_BYTES..RECORD_HEADER_BYTES + len) {
        Some(body) if record_end_bytes <= end_bytes && checksum(offset_bytes, body) == sum => {
            Ok(body.to_vec())
        }
        _ => Err(StoreError::NotARecord { offset_bytes }),
    }
}

/// FNV-1a over a record's offset and bytes: a header read from the wrong place, or a
/// stale or torn block, does not match.
fn checksum(offset_bytes: u64, body: &[u8]) -> u32 {
    let bytes = offset_bytes.to_le_bytes();
    bytes.iter().chain(body).fold(0x811c_9dc5, |hash, &byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
    })
}

fn store_error(error: IoError) -> StoreError {
    match error {
        IoError::Failed(failure) => StoreError::Io(failure),
        IoError::Refused(reason) => StoreError::Refused(reason),
        _ => StoreError::ShuttingDown,
    }
}

/// The exit hook: the reactor drained its I/O, and the tasks answered what completed.
/// Appends that never reached the device are answered here; reads still waiting for room
/// are answered by their tasks' drop, with the executor, as the state goes.
pub fn exit(r: &mut Reactor<Shard>, mut s: Shard) -> ShardStats {
    let appends = s.staged.drain(..).map(|(_, waiter)| waiter);
    for waiter in appends.chain(s.pending.drain(..).map(|(_, waiter)| waiter)) {
        s.stats.appends_failed += 1;
        waiter.answer(Answer::Appended(Err(StoreError::ShuttingDown)));
    }
    s.stats.reads_failed += s.reads_out as u64;
    s.stats.interrupt_waits = r.counters().interrupt_waits;
    std::mem::take(&mut s.stats)
}
