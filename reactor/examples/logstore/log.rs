//! One shard's log, whichever way its I/O is driven (callbacks in `shard.rs` here, tasks in
//! `hypoll-async`'s `examples/logstore_async/shard.rs`): where it lives on the device, the
//! ring its appends are staged in, its limits, and its record format. Nothing here submits
//! an I/O; a shard asks for the request and hands back the result.
//!
//! The log is a run of bytes on the shard's part of the device: records packed one after
//! another, each behind a header (length, checksum), in 4 KiB log blocks from byte 0. The
//! store keeps no index: a record is found by the offset its append was answered with.
//!
//! Group commit. An append is copied into the ring, registered with the device once (the
//! only copy of its bytes), and a commit writes every log block from the last durable byte
//! to the end of the newest record straight out of it, with one vectored write: two
//! segments where the span wraps the ring's end. The partly filled last block is written
//! again by the next commit, from the same place, with the records that joined it. One
//! commit at a time: appends that arrive while it is on the device stay pending (their
//! bytes in the client's `Vec`), since the device may read any byte of the span in flight.
//!
//! A log that recovers after a crash would not write acknowledged bytes again in place (a
//! torn write of the last block could lose them) but alternate that block between two
//! places; this one keeps no index and does not recover, so it rewrites in place.

use std::collections::VecDeque;
use std::sync::mpsc::Sender;

use hypoll_reactor::{
    Device, DeviceId, InitError, IoBuf, IoOp, IoRequest, MemoryRegion, Reactor, RegionSlice,
};

use crate::store::{
    Answer, LogOffset, Reply, StoreConfig, StoreError, LOG_BLOCK_BYTES, RECORD_BYTES_MAX,
    RECORD_HEADER_BYTES,
};

/// A read covers a record's header and its longest body from wherever it starts in a
/// device block: at most two log blocks, as a device block is at most one (`open` checks).
pub const READ_BUF_BYTES: usize = 2 * LOG_BLOCK_BYTES as usize;

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
    /// Commits that found the queue pair full and waited for a slot.
    pub commits_requeued: u64,
    pub reads_ok: u64,
    /// Reads answered with an error after they were accepted: the device, the reactor, or
    /// no record at the offset.
    pub reads_failed: u64,
    /// Reads turned away at once: a limit, an offset not durable.
    pub reads_refused: u64,
    /// Reads that found the queue pair full and waited for a slot.
    pub reads_requeued: u64,
    /// Times the reactor blocked on the device's interrupt (the policy's second half).
    pub interrupt_waits: u64,
}

/// The write that commits what is staged: one or two segments of the ring.
pub struct Commit {
    pub dev: DeviceId,
    pub req: IoRequest,
    segments: [RegionSlice; 2],
    count: usize,
}

impl Commit {
    pub fn segments(&self) -> &[RegionSlice] {
        &self.segments[..self.count]
    }
}

/// A read the log let through: its request, and the end of the bytes it fetches (a header
/// claiming more is not a record).
#[derive(Clone, Copy)]
pub struct ReadPlan {
    pub dev: DeviceId,
    pub req: IoRequest,
    pub offset_bytes: u64,
    end_bytes: u64,
}

/// One shard's log.
pub struct Log {
    pub cfg: StoreConfig,
    pub dev: DeviceId,
    index: usize,
    lba_bytes: u64,
    /// The shard's first device block.
    base_lba: u64,
    capacity_bytes: u64,
    /// Log byte `o` lives at ring byte `o % ring.len()` while it is not yet durable, and
    /// until the ring comes round to it again. Registered as `ring_region`; the shard is
    /// dropped after the reactor, so the memory outlives the registration.
    ring: IoBuf,
    ring_region: MemoryRegion,
    /// Log bytes on the device, every append in them acknowledged.
    durable_bytes: u64,
    /// The end of the bytes in the ring: `staged` covers `durable_bytes..staged_end_bytes`.
    staged_end_bytes: u64,
    /// Appends in the ring, oldest first, by offset: the commit's (on the device or next).
    staged: Vec<(u64, Waiter)>,
    /// Appends not in the ring yet, oldest first, and their bytes with headers.
    pending: VecDeque<(Vec<u8>, Waiter)>,
    pending_bytes: u64,
    /// The commit of what is staged is on the device.
    committing: bool,
    pub stats: ShardStats,
}

impl Log {
    /// Attaches `device` on this reactor with a queue pair of `cfg.queue_depth`, and makes
    /// the shard's log on its part of it (one of as many as the reactor set has reactors).
    pub fn open<S>(
        r: &mut Reactor<S>,
        device: &Device,
        cfg: StoreConfig,
    ) -> Result<Log, InitError> {
        if cfg.queue_depth == 0 || cfg.appends_max == 0 || cfg.reads_max == 0 {
            return Err("queue_depth, appends_max and reads_max must be at least 1".into());
        }
        if cfg.append_bytes_max < RECORD_HEADER_BYTES + RECORD_BYTES_MAX {
            let message =
                format!("append_bytes_max must hold a longest record, {LOG_BLOCK_BYTES} bytes");
            return Err(message.into());
        }
        let dev = r.attach(device, cfg.queue_depth)?;
        let ns = r
            .namespace(dev)
            .ok_or("the device just attached has no namespace")?;
        let lba_bytes = u64::from(ns.lba_size_bytes);
        if !LOG_BLOCK_BYTES.is_multiple_of(lba_bytes) {
            let message =
                format!("device blocks of {lba_bytes} bytes do not divide {LOG_BLOCK_BYTES}");
            return Err(message.into());
        }
        // The longest commit: every byte a client may have waiting, and the partial blocks
        // at both ends. The ring holds exactly that, so a commit's span never meets itself.
        let ring_bytes =
            (cfg.append_bytes_max as u64).next_multiple_of(LOG_BLOCK_BYTES) + LOG_BLOCK_BYTES;
        if ring_bytes > u64::from(ns.transfer_bytes_max) {
            let max = ns.transfer_bytes_max;
            let message = format!(
                "a commit may write {ring_bytes} bytes, over the device's largest transfer, {max}"
            );
            return Err(message.into());
        }
        let block_lbas = LOG_BLOCK_BYTES / lba_bytes;
        let shard_lbas = ns.capacity_lbas / r.handles().len() as u64 / block_lbas * block_lbas;
        if shard_lbas == 0 {
            return Err("the device is too small for a log block per shard".into());
        }
        let mut ring = IoBuf::zeroed(ring_bytes as usize);
        // SAFETY: `ring` is owned by the log, which its shard drops only after the reactor,
        // so the memory stays valid while registered. Only commits use it, and the log
        // writes into it only while no commit is on the device (`stage`).
        let ring_region = unsafe { r.register_memory(dev, ring.as_mut_ptr(), ring.len()) }?;
        let index = r.index();
        Ok(Log {
            cfg,
            dev,
            index,
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
            stats: ShardStats {
                shard: index,
                core: r.core(),
                policy: r.policy_name().to_string(),
                ..ShardStats::default()
            },
        })
    }

    /// The log's invariants, for `debug_assert!` where its state changes hands.
    pub fn holds(&self) -> bool {
        let span_bytes = self.staged_end_bytes.next_multiple_of(LOG_BLOCK_BYTES)
            - self.durable_bytes / LOG_BLOCK_BYTES * LOG_BLOCK_BYTES;
        let unacked_bytes = self.staged_end_bytes - self.durable_bytes + self.pending_bytes;
        self.durable_bytes <= self.staged_end_bytes
            && self.staged_end_bytes + self.pending_bytes <= self.capacity_bytes
            && span_bytes <= self.ring.len() as u64
            && self.staged.is_empty() == (self.staged_end_bytes == self.durable_bytes)
            && (!self.committing || !self.staged.is_empty())
            && self.staged.len() + self.pending.len() <= self.cfg.appends_max
            && unacked_bytes <= self.cfg.append_bytes_max as u64
    }

    /// A client's append: answered at once with the limit it would pass, or pending until
    /// a commit carries it. Returns whether it is pending.
    pub fn append(&mut self, record: Vec<u8>, waiter: Waiter) -> bool {
        let need_bytes = (RECORD_HEADER_BYTES + record.len()) as u64;
        let unacked_bytes = self.staged_end_bytes - self.durable_bytes + self.pending_bytes;
        let cfg = self.cfg;
        let refusal = if record.len() > RECORD_BYTES_MAX {
            let (len_bytes, max_bytes) = (record.len(), RECORD_BYTES_MAX);
            StoreError::RecordTooLarge {
                len_bytes,
                max_bytes,
            }
        } else if self.staged.len() + self.pending.len() >= cfg.appends_max {
            StoreError::AppendsFull {
                max: cfg.appends_max,
            }
        } else if unacked_bytes + need_bytes > cfg.append_bytes_max as u64 {
            StoreError::BytesFull {
                max_bytes: cfg.append_bytes_max,
            }
        } else if self.staged_end_bytes + self.pending_bytes + need_bytes > self.capacity_bytes {
            StoreError::LogFull {
                capacity_bytes: self.capacity_bytes,
            }
        } else {
            self.pending_bytes += need_bytes;
            self.pending.push_back((record, waiter));
            return true;
        };
        self.stats.appends_refused += 1;
        waiter.answer(Answer::Appended(Err(refusal)));
        false
    }

    /// Stages every pending append into the ring and returns the write that commits all
    /// that is staged; `None` when nothing is. Only while no commit is on the device: the
    /// device may be reading any byte of the ring's span.
    pub fn stage(&mut self) -> Option<Commit> {
        debug_assert!(!self.committing);
        while let Some((record, waiter)) = self.pending.pop_front() {
            let offset_bytes = self.staged_end_bytes;
            let mut header = [0u8; RECORD_HEADER_BYTES];
            header[..4].copy_from_slice(&(record.len() as u32).to_le_bytes());
            header[4..].copy_from_slice(&checksum(offset_bytes, &record).to_le_bytes());
            self.ring_put(offset_bytes, &header);
            self.ring_put(offset_bytes + RECORD_HEADER_BYTES as u64, &record);
            self.staged_end_bytes += (RECORD_HEADER_BYTES + record.len()) as u64;
            self.staged.push((offset_bytes, waiter));
        }
        self.pending_bytes = 0;
        if self.staged.is_empty() {
            return None;
        }
        let first_bytes = self.durable_bytes / LOG_BLOCK_BYTES * LOG_BLOCK_BYTES;
        let len = (self.staged_end_bytes.next_multiple_of(LOG_BLOCK_BYTES) - first_bytes) as usize;
        let at = (first_bytes % self.ring.len() as u64) as usize;
        let head = len.min(self.ring.len() - at);
        let head_segment = RegionSlice::new(self.ring_region, at, head).expect("inside the ring");
        let (segments, count) = match RegionSlice::new(self.ring_region, 0, len - head) {
            Some(tail_segment) => ([head_segment, tail_segment], 2),
            None => ([head_segment; 2], 1),
        };
        let slba = self.base_lba + first_bytes / self.lba_bytes;
        let nlb = (len as u64 / self.lba_bytes) as u32;
        // FUA: "acknowledged after the write" must mean on the media, not in a cache.
        let req = IoRequest::new(IoOp::Write, slba, nlb).with_fua(true);
        Some(Commit {
            dev: self.dev,
            req,
            segments,
            count,
        })
    }

    /// Writes `bytes` at log byte `at_bytes` into the ring, wrapping at its end.
    fn ring_put(&mut self, at_bytes: u64, bytes: &[u8]) {
        let ring_bytes = self.ring.len();
        // A log block entered for the first time is zeroed first: what the ring's last lap
        // left there would otherwise reach the device in the free tail of the last block.
        let mut block = at_bytes.next_multiple_of(LOG_BLOCK_BYTES);
        while block < at_bytes + bytes.len() as u64 {
            let at = (block % ring_bytes as u64) as usize;
            self.ring[at..at + LOG_BLOCK_BYTES as usize].fill(0);
            block += LOG_BLOCK_BYTES;
        }
        let at = (at_bytes % ring_bytes as u64) as usize;
        let head = bytes.len().min(ring_bytes - at);
        self.ring[at..at + head].copy_from_slice(&bytes[..head]);
        self.ring[..bytes.len() - head].copy_from_slice(&bytes[head..]);
    }

    /// Whether a commit is on the device.
    pub fn committing(&self) -> bool {
        self.committing
    }

    /// `commit`, the last `stage` made, is on the device now.
    pub fn submitted(&mut self, commit: &Commit) {
        self.committing = true;
        self.stats.commits += 1;
        self.stats.commit_bytes += u64::from(commit.req.nlb) * self.lba_bytes;
        self.stats.commits_wrapped += u64::from(commit.count > 1);
        let appends = self.staged.len() as u64;
        self.stats.commit_appends_max = self.stats.commit_appends_max.max(appends);
    }

    /// The commit of what is staged ended: every staged append is durable and answered
    /// with its offset, or answered with `error` and its offset given back (the next
    /// records take it, and the next commit writes its blocks again).
    pub fn committed(&mut self, result: Result<(), StoreError>) {
        self.committing = false;
        let staged = self.staged.drain(..);
        match result {
            Ok(()) => {
                self.durable_bytes = self.staged_end_bytes;
                self.stats.appends_acked += staged.len() as u64;
                for (offset_bytes, waiter) in staged {
                    let shard = self.index;
                    waiter.answer(Answer::Appended(Ok(LogOffset {
                        shard,
                        offset_bytes,
                    })));
                }
            }
            Err(error) => {
                self.stats.appends_failed += staged.len() as u64;
                for (_, waiter) in staged {
                    waiter.answer(Answer::Appended(Err(error)));
                }
                self.staged_end_bytes = self.durable_bytes;
            }
        }
    }

    /// A read of the record at `offset_bytes`: from the device, covering the longest
    /// record that could start there but nothing past the durable end; or why not.
    pub fn read(&self, offset_bytes: u64) -> Result<ReadPlan, StoreError> {
        let durable_bytes = self.durable_bytes;
        if offset_bytes.saturating_add(RECORD_HEADER_BYTES as u64) > durable_bytes {
            return Err(StoreError::NotDurable {
                offset_bytes,
                durable_bytes,
            });
        }
        let longest_bytes = (RECORD_HEADER_BYTES + RECORD_BYTES_MAX) as u64;
        let end_bytes = (offset_bytes + longest_bytes).min(durable_bytes);
        let first_lba = offset_bytes / self.lba_bytes;
        let nlb = (end_bytes.div_ceil(self.lba_bytes) - first_lba) as u32;
        let req = IoRequest::new(IoOp::Read, self.base_lba + first_lba, nlb);
        Ok(ReadPlan {
            dev: self.dev,
            req,
            offset_bytes,
            end_bytes,
        })
    }

    /// A read ended with `result` and, if it succeeded, the bytes it read: the client's
    /// answer, the record they hold or why not, counted.
    pub fn read_ended(
        &mut self,
        read: &ReadPlan,
        result: Result<(), StoreError>,
        bytes: Option<&[u8]>,
    ) -> Answer {
        let bytes = || bytes.expect("a read that succeeded hands its buffer back");
        let record = result.and_then(|()| self.decode(read, bytes()));
        match record {
            Ok(_) => self.stats.reads_ok += 1,
            Err(_) => self.stats.reads_failed += 1,
        }
        Answer::Read(record)
    }

    /// The record a read found at the start of its window, if its header and checksum
    /// say so.
    fn decode(&self, read: &ReadPlan, buf: &[u8]) -> Result<Vec<u8>, StoreError> {
        let offset_bytes = read.offset_bytes;
        let bytes = &buf[(offset_bytes % self.lba_bytes) as usize..];
        let len = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")) as usize;
        let sum = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
        let end_bytes = offset_bytes + (RECORD_HEADER_BYTES + len) as u64;
        match bytes.get(RECORD_HEADER_BYTES..RECORD_HEADER_BYTES + len) {
            Some(body) if end_bytes <= read.end_bytes && checksum(offset_bytes, body) == sum => {
                Ok(body.to_vec())
            }
            _ => Err(StoreError::NotARecord { offset_bytes }),
        }
    }

    /// The reactor stopped: appends that never reached the device are answered so.
    pub fn close(&mut self) {
        let appends = self.staged.drain(..).map(|(_, waiter)| waiter);
        for waiter in appends.chain(self.pending.drain(..).map(|(_, waiter)| waiter)) {
            self.stats.appends_failed += 1;
            waiter.answer(Answer::Appended(Err(StoreError::ShuttingDown)));
        }
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
