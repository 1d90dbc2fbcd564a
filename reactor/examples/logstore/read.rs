//! Reads by offset. A read goes to the device, not the ring, so a record read back is one
//! that was written; it fetches the longest record that could start at its offset (never
//! past the durable end) into a buffer from the shard's pool, and the record's header and
//! checksum say whether one does start there.

use hypoll_reactor::{IoBuf, IoCallback, IoDone, IoOp, IoRequest, Reactor, Rejected};

use super::commit::checksum;
use super::{resume, PendingRead, Shard, Waiter, READ_BUF_BYTES};
use crate::store::{Answer, StoreError, RECORD_BYTES_MAX, RECORD_HEADER_BYTES};

/// A client's read of the record at `offset_bytes`: from the device, covering the
/// longest record that could start there, but nothing past the durable end.
pub fn read(r: &mut Reactor<Shard>, s: &mut Shard, offset_bytes: u64, waiter: Waiter) {
    debug_assert!(s.holds());
    if offset_bytes.saturating_add(RECORD_HEADER_BYTES as u64) > s.durable_bytes {
        s.stats.reads_refused += 1;
        let error = StoreError::NotDurable {
            offset_bytes,
            durable_bytes: s.durable_bytes,
        };
        return waiter.answer(Answer::Read(Err(error)));
    }
    let Some(key) = s.free_keys.pop() else {
        s.stats.reads_refused += 1;
        let error = StoreError::ReadsFull {
            max: s.cfg.reads_max,
        };
        return waiter.answer(Answer::Read(Err(error)));
    };
    // An abandoned read keeps its buffer (the device may still write into it): replace it.
    let buf = s
        .read_bufs
        .pop()
        .unwrap_or_else(|| IoBuf::zeroed(READ_BUF_BYTES));
    let window_end_bytes =
        (offset_bytes + (RECORD_HEADER_BYTES + RECORD_BYTES_MAX) as u64).min(s.durable_bytes);
    let first_lba = offset_bytes / s.lba_bytes;
    let nlb = (window_end_bytes.div_ceil(s.lba_bytes) - first_lba) as u32;
    let req = IoRequest::new(IoOp::Read, s.base_lba + first_lba, nlb).with_user(key as u64);
    s.reads[key] = Some(PendingRead {
        offset_bytes,
        window_end_bytes,
        waiter,
    });
    // The block holding the durable end may be on its way to the device again with new
    // records behind the old ones: a read racing that write sees the old bytes either way.
    let submitted = r.submit(s.dev, req, Some(buf), after_read);
    on_read_refused(s, submitted.map_err(Rejected::boxed));
    debug_assert!(s.holds());
}

/// A refused read waits for a slot if the queue pair was full, or is answered now.
fn on_read_refused(s: &mut Shard, submitted: Result<(), Rejected<IoCallback<Shard>>>) {
    let Err(refused) = submitted else {
        return;
    };
    if refused.reason.is_queue_full() {
        s.stats.reads_requeued += 1;
        return s.refused_reads.push_back(refused);
    }
    let key = refused.req.user as usize;
    let read = s.reads[key]
        .take()
        .expect("a read holds its key until answered");
    s.free_keys.push(key);
    s.read_bufs.extend(refused.buf);
    s.stats.reads_failed += 1;
    let error = StoreError::Refused(refused.reason);
    read.waiter.answer(Answer::Read(Err(error)));
}

fn after_read(r: &mut Reactor<Shard>, s: &mut Shard, done: IoDone) {
    let key = done.user as usize;
    let read = s.reads[key]
        .take()
        .expect("a read holds its key until answered");
    s.free_keys.push(key);
    let result = match (done.result, &done.buf) {
        (Ok(()), Some(buf)) => decode(s.lba_bytes, &read, buf),
        (Err(failure), _) => Err(StoreError::Io(failure)),
        (Ok(()), None) => unreachable!("a read that succeeded hands its buffer back"),
    };
    s.read_bufs.extend(done.buf);
    if result.is_ok() {
        s.stats.reads_ok += 1;
    } else {
        s.stats.reads_failed += 1;
    }
    read.waiter.answer(Answer::Read(result));
    resume(r, s);
    debug_assert!(s.holds());
}

/// The record at the start of a read's window, if its header and checksum say so.
fn decode(lba_bytes: u64, read: &PendingRead, buf: &[u8]) -> Result<Vec<u8>, StoreError> {
    let not_a_record = StoreError::NotARecord {
        offset_bytes: read.offset_bytes,
    };
    let at = (read.offset_bytes % lba_bytes) as usize;
    let header = &buf[at..at + RECORD_HEADER_BYTES];
    let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
    let sum = u32::from_le_bytes(header[4..].try_into().expect("4 bytes"));
    let end_bytes = read.offset_bytes + (RECORD_HEADER_BYTES + len) as u64;
    if len > RECORD_BYTES_MAX || end_bytes > read.window_end_bytes {
        return Err(not_a_record);
    }
    let body = &buf[at + RECORD_HEADER_BYTES..at + RECORD_HEADER_BYTES + len];
    if checksum(read.offset_bytes, body) != sum {
        return Err(not_a_record);
    }
    Ok(body.to_vec())
}

/// Submits refused reads again, oldest first, while the queue pair has room.
pub(super) fn retry_refused(r: &mut Reactor<Shard>, s: &mut Shard) {
    while r.has_room(s.dev) {
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
