//! Group commit. An append is copied into the shard's ring, registered with the device
//! once (the only copy of its bytes), and a commit writes every log block from the last
//! durable byte to the end of the newest record straight out of the ring with one
//! vectored write: two segments where the span wraps around the ring's end. The partly
//! filled last block is written again by the next commit, from the same place, with the
//! records that joined it: nothing is moved or copied to build a write.
//!
//! One commit at a time. Appends that arrive while it is on the device wait in `pending`
//! (their bytes still in the client's `Vec`) and go into the ring together as soon as it
//! completes: the device may read any byte of the span in flight, the last block's free
//! tail included. Each append is answered only when the commit carrying it completes.
//!
//! A log that recovers after a crash would not write acknowledged bytes again in place (a
//! torn write of the last block could lose them) but alternate that block between two
//! places; this one keeps no index and does not recover, so it rewrites in place.

use hypoll_reactor::{IoDone, IoOp, IoRequest, Reactor, RegionSlice};

use super::{resume, PendingAppend, Shard, StagedAppend, Waiter};
use crate::store::{
    Answer, LogOffset, StoreError, LOG_BLOCK_BYTES, RECORD_BYTES_MAX, RECORD_HEADER_BYTES,
};

/// A client's append: refused at once past a limit, otherwise answered when its commit
/// completes.
pub fn append(r: &mut Reactor<Shard>, s: &mut Shard, record: Vec<u8>, waiter: Waiter) {
    debug_assert!(s.holds());
    let need_bytes = (RECORD_HEADER_BYTES + record.len()) as u64;
    let unacked_bytes = s.staged_end_bytes - s.durable_bytes + s.pending_bytes;
    let refusal = if record.len() > RECORD_BYTES_MAX {
        Some(StoreError::RecordTooLarge {
            len_bytes: record.len(),
            max_bytes: RECORD_BYTES_MAX,
        })
    } else if s.staged.len() + s.pending.len() >= s.cfg.appends_max {
        Some(StoreError::AppendsFull {
            max: s.cfg.appends_max,
        })
    } else if unacked_bytes + need_bytes > s.cfg.append_bytes_max as u64 {
        Some(StoreError::BytesFull {
            max_bytes: s.cfg.append_bytes_max,
        })
    } else if s.staged_end_bytes + s.pending_bytes + need_bytes > s.capacity_bytes {
        Some(StoreError::LogFull {
            capacity_bytes: s.capacity_bytes,
        })
    } else {
        None
    };
    if let Some(error) = refusal {
        s.stats.appends_refused += 1;
        return waiter.answer(Answer::Appended(Err(error)));
    }
    s.pending_bytes += need_bytes;
    s.pending.push_back(PendingAppend { record, waiter });
    try_commit(r, s);
    debug_assert!(s.holds());
}

/// Starts the next commit unless one is on the device: stages what is pending into the
/// ring, then writes the span. A full queue pair leaves the staged appends for the next
/// completion to retry (`resume`); any other refusal answers them.
pub(super) fn try_commit(r: &mut Reactor<Shard>, s: &mut Shard) {
    while !s.committing {
        while let Some(append) = s.pending.pop_front() {
            stage(s, append);
        }
        s.pending_bytes = 0;
        if s.staged.is_empty() {
            return;
        }
        let first_bytes = s.durable_bytes / LOG_BLOCK_BYTES * LOG_BLOCK_BYTES;
        let end_bytes = s.staged_end_bytes.next_multiple_of(LOG_BLOCK_BYTES);
        let ring_bytes = s.ring.len();
        let at = (first_bytes % ring_bytes as u64) as usize;
        let len = (end_bytes - first_bytes) as usize;
        let head = len.min(ring_bytes - at);
        let head_segment = RegionSlice::new(s.ring_region, at, head).expect("inside the ring");
        let (segments, count) = match RegionSlice::new(s.ring_region, 0, len - head) {
            Some(tail_segment) => ([head_segment, tail_segment], 2),
            None => ([head_segment; 2], 1),
        };
        let segments = &segments[..count];
        // FUA: "acknowledged after the write" must mean on the media, not in a cache.
        let req = IoRequest::new(
            IoOp::Write,
            s.base_lba + first_bytes / s.lba_bytes,
            ((end_bytes - first_bytes) / s.lba_bytes) as u32,
        )
        .with_fua(true);
        match r.submit_vectored(s.dev, req, segments, after_commit) {
            Ok(()) => {
                s.committing = true;
                s.stats.commits += 1;
                s.stats.commit_bytes += len as u64;
                s.stats.commits_wrapped += u64::from(count > 1);
                s.stats.commit_appends_max = s.stats.commit_appends_max.max(s.staged.len() as u64);
            }
            Err(refused) if refused.reason.is_queue_full() => {
                // Something is on the device, so a completion is coming to call `resume`.
                s.stats.commits_requeued += 1;
                return;
            }
            Err(refused) => fail_staged(s, StoreError::Refused(refused.reason)),
        }
    }
}

/// Copies one append into the ring at the end of what is staged, behind its header.
fn stage(s: &mut Shard, append: PendingAppend) {
    let offset_bytes = s.staged_end_bytes;
    let len = append.record.len();
    let mut header = [0u8; RECORD_HEADER_BYTES];
    header[..4].copy_from_slice(&(len as u32).to_le_bytes());
    header[4..].copy_from_slice(&checksum(offset_bytes, &append.record).to_le_bytes());
    ring_put(s, offset_bytes, &header);
    ring_put(s, offset_bytes + RECORD_HEADER_BYTES as u64, &append.record);
    s.staged_end_bytes += (RECORD_HEADER_BYTES + len) as u64;
    s.staged.push(StagedAppend {
        offset_bytes,
        waiter: append.waiter,
    });
}

/// Writes `bytes` at log byte `at_bytes` into the ring, wrapping at its end. Only while
/// no commit is on the device: the device may be reading any byte of the ring's span.
fn ring_put(s: &mut Shard, at_bytes: u64, bytes: &[u8]) {
    debug_assert!(!s.committing);
    let ring_bytes = s.ring.len();
    // A log block entered for the first time is zeroed first: what the ring's last lap
    // left there would otherwise reach the device in the free tail of the last block.
    let end_bytes = at_bytes + bytes.len() as u64;
    let mut block = at_bytes.next_multiple_of(LOG_BLOCK_BYTES);
    while block < end_bytes {
        let at = (block % ring_bytes as u64) as usize;
        s.ring[at..at + LOG_BLOCK_BYTES as usize].fill(0);
        block += LOG_BLOCK_BYTES;
    }
    let at = (at_bytes % ring_bytes as u64) as usize;
    let head = bytes.len().min(ring_bytes - at);
    s.ring[at..at + head].copy_from_slice(&bytes[..head]);
    s.ring[..bytes.len() - head].copy_from_slice(&bytes[head..]);
}

/// Answers every staged append with `error`, and gives their offsets back: the next
/// records take them, and the next commit writes their blocks again.
fn fail_staged(s: &mut Shard, error: StoreError) {
    s.stats.appends_failed += s.staged.len() as u64;
    for staged in s.staged.drain(..) {
        staged.waiter.answer(Answer::Appended(Err(error)));
    }
    s.staged_end_bytes = s.durable_bytes;
}

/// A commit's completion: its appends are durable (or failed), and the next group goes.
fn after_commit(r: &mut Reactor<Shard>, s: &mut Shard, done: IoDone) {
    debug_assert!(s.committing && s.holds());
    s.committing = false;
    match done.result {
        Ok(()) => {
            s.durable_bytes = s.staged_end_bytes;
            s.stats.appends_acked += s.staged.len() as u64;
            for staged in s.staged.drain(..) {
                let at = LogOffset {
                    shard: s.index,
                    offset_bytes: staged.offset_bytes,
                };
                staged.waiter.answer(Answer::Appended(Ok(at)));
            }
        }
        Err(failure) => fail_staged(s, StoreError::Io(failure)),
    }
    resume(r, s);
    debug_assert!(s.holds());
}

/// FNV-1a over a record's offset and bytes: a header read from the wrong place, or a
/// stale or torn block, does not match.
pub(super) fn checksum(offset_bytes: u64, body: &[u8]) -> u32 {
    offset_bytes
        .to_le_bytes()
        .iter()
        .chain(body)
        .fold(0x811c_9dc5, |hash, &byte| {
            (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
        })
}
