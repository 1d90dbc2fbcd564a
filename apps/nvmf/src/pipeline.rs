//! How an NVMe/TCP I/O command runs on a reactor: split into device-sized commands on the
//! reactor's queue pair for its namespace (waiting in the namespace's backlog while the
//! queue pair is full), a flush after the data when the host asked for FUA, and one answer
//! once every device command is back (`answer.rs`).
//!
//! Each device command carries its command's identity in its `user` word: the connection's
//! key, the command's key and the piece's index, so a completion finds its command without
//! an allocation or a lookup table.

use std::collections::VecDeque;
use std::ops::Range;

use hypoll_frontend::REQUESTS_INFLIGHT_MAX;
use hypoll_frontend::{BufCache, HasShard, Shard, CONNECTIONS_PER_REACTOR_MAX};
use hypoll_nvme::{IoBuf, Status, SubmitError};

use crate::answer::{answer, status_of};
use hypoll_reactor::{IoDone, IoOp, IoRequest, Reactor, RejectReason};

use crate::session::{BlockRange, IoCommand, IoOp as NvmeOp, WriteData};
use crate::shard::{Nvmf, ShardExport};

/// Bits of a command's `user` word that hold, from the top: the connection's key, the
/// command's key within the connection, and the piece's index within the command.
const CONN_BITS: u32 = 16;
const CMD_BITS: u32 = 16;
const PIECE_BITS: u32 = 32;

const _: () = assert!(CONN_BITS + CMD_BITS + PIECE_BITS == u64::BITS);
const _: () = assert!(CONNECTIONS_PER_REACTOR_MAX <= 1 << CONN_BITS);
const _: () = assert!(REQUESTS_INFLIGHT_MAX <= 1 << CMD_BITS);

/// What a command does, as the metrics name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Read,
    Write,
    Flush,
    WriteZeroes,
    Deallocate,
}

impl Kind {
    pub(crate) const ALL: [Kind; 5] = [
        Kind::Read,
        Kind::Write,
        Kind::Flush,
        Kind::WriteZeroes,
        Kind::Deallocate,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Read => "read",
            Kind::Write => "write",
            Kind::Flush => "flush",
            Kind::WriteZeroes => "write_zeroes",
            Kind::Deallocate => "deallocate",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Write data still arriving by H2CData: nothing submitted yet.
    Receiving,
    Data,
    /// A flush after the data: the command had FUA, or is a flush.
    Flush,
}

/// The blocks a command's data stage covers: one run (read, write, write zeroes), or
/// Dataset Management's ranges.
enum Ranges {
    One(BlockRange),
    Many(Vec<BlockRange>),
}

impl Ranges {
    fn get(&self, i: usize) -> Option<BlockRange> {
        match self {
            Ranges::One(r) => (i == 0).then_some(*r),
            Ranges::Many(v) => v.get(i).copied(),
        }
    }
}

/// A command in flight.
pub(crate) struct Pending {
    pub(crate) cid: u16,
    pub(crate) kind: Kind,
    export: usize,
    ranges: Ranges,
    fua: bool,
    /// Write Zeroes may deallocate (the host set DEAC).
    deallocate: bool,
    stage: Stage,
    /// The range being submitted, and its blocks submitted so far.
    range_at: usize,
    range_blocks_done: u32,
    /// Device commands of the data stage submitted so far (a read's piece index).
    pieces_submitted: u32,
    flush_submitted: bool,
    /// Device commands in flight.
    pieces_out: u32,
    /// The first failure (SUCCESS while there is none).
    pub(crate) status: Status,
    /// A write's data, one buffer per piece, taken as pieces are submitted.
    write_bufs: VecDeque<IoBuf>,
    /// A read's data, one buffer per piece, filled as pieces complete.
    pub(crate) read_bufs: Vec<Option<IoBuf>>,
    /// Bytes counted against the connection's bound while the command is at the device.
    held: usize,
    start_ns: u64,
}

/// Packs a piece's identity into `IoRequest::user`: connection, command, piece index.
fn pack(conn: usize, cmd: usize, piece: u32) -> u64 {
    debug_assert!(conn < 1 << CONN_BITS && cmd < 1 << CMD_BITS);
    ((conn as u64) << (CMD_BITS + PIECE_BITS)) | ((cmd as u64) << PIECE_BITS) | u64::from(piece)
}

fn unpack(user: u64) -> (usize, usize, u32) {
    (
        (user >> (CMD_BITS + PIECE_BITS)) as usize,
        ((user >> PIECE_BITS) & ((1 << CMD_BITS) - 1)) as usize,
        user as u32,
    )
}

/// Starts a valid I/O command of connection `key`. An in-capsule write's data is still at
/// `input_at..` of the connection's input (`data` is relative to that); a solicited
/// write waits for its data ([`receive`]).
pub(crate) fn start<S: HasShard<Nvmf>>(
    shard: &mut Shard<Nvmf>,
    r: &mut Reactor<S>,
    key: usize,
    cmd: IoCommand,
) {
    let export = cmd.nsid as usize - 1;
    let ex = &shard.proto.exports[export];
    let piece_bytes = ex.rw_piece_bytes as usize;
    let lba = ex.lba_bytes as usize;
    let in_capsule = match &cmd.op {
        NvmeOp::Write {
            data: WriteData::InCapsule(range),
            ..
        } => Some(Some(range.clone())),
        NvmeOp::Write {
            data: WriteData::Solicited,
            ..
        } => Some(None),
        _ => None,
    };
    let (kind, ranges, fua, deallocate) = match cmd.op {
        NvmeOp::Read { slba, blocks, .. } => (
            Kind::Read,
            Ranges::One(BlockRange { slba, blocks }),
            false,
            false,
        ),
        NvmeOp::Write {
            slba, blocks, fua, ..
        } => (
            Kind::Write,
            Ranges::One(BlockRange { slba, blocks }),
            fua,
            false,
        ),
        NvmeOp::Flush => (
            Kind::Flush,
            Ranges::One(BlockRange { slba: 0, blocks: 0 }),
            false,
            false,
        ),
        NvmeOp::WriteZeroes {
            slba,
            blocks,
            deallocate,
            fua,
        } => (
            Kind::WriteZeroes,
            Ranges::One(BlockRange { slba, blocks }),
            fua,
            deallocate,
        ),
        NvmeOp::Deallocate { ranges } => (Kind::Deallocate, Ranges::Many(ranges), false, false),
    };
    let conn = &mut shard.conns[key];
    let bytes = match &ranges {
        Ranges::One(r) if matches!(kind, Kind::Read | Kind::Write) => r.blocks as usize * lba,
        _ => 0,
    };
    let mut write_bufs = VecDeque::new();
    let mut stage = if kind == Kind::Flush {
        Stage::Flush
    } else {
        Stage::Data
    };
    match in_capsule {
        Some(Some(range)) => {
            let payload = &conn.input()[range];
            debug_assert_eq!(payload.len(), bytes);
            for chunk in payload.chunks(piece_bytes) {
                // From the pinned pool: a uring device then skips per-I/O page pinning.
                let mut buf = shard.bufs.take(chunk.len());
                buf.copy_from_slice(chunk);
                write_bufs.push_back(buf);
            }
        }
        Some(None) => stage = Stage::Receiving,
        None => {}
    }
    let read_pieces = if kind == Kind::Read {
        bytes.div_ceil(piece_bytes)
    } else {
        0
    };
    // A solicited write's buffers are counted once its data is in: until then the session
    // bounds them (its R2T limit), and counting them would let writes that wait for their
    // data stop the connection from reading it.
    let held = if stage == Stage::Receiving { 0 } else { bytes };
    let pending = Pending {
        cid: cmd.cid,
        kind,
        export,
        ranges,
        fua,
        deallocate,
        stage,
        range_at: 0,
        range_blocks_done: 0,
        pieces_submitted: 0,
        flush_submitted: false,
        pieces_out: 0,
        status: Status::SUCCESS,
        write_bufs,
        read_bufs: (0..read_pieces).map(|_| None).collect(),
        held,
        start_ns: r.now_ns(),
    };
    conn.hold(held);
    let ck = conn.proto.inflight.insert(pending);
    assert!(
        ck < REQUESTS_INFLIGHT_MAX,
        "a connection past its command bound"
    );
    if stage == Stage::Receiving {
        let prev = conn.proto.by_cid.insert(cmd.cid, ck);
        debug_assert!(prev.is_none(), "the session refuses a cid in use");
        return;
    }
    submit_or_wait(shard, r, key, ck);
}

/// Submits command `ck` now if nothing waits before it, else queues it behind them.
fn submit_or_wait<S: HasShard<Nvmf>>(
    shard: &mut Shard<Nvmf>,
    r: &mut Reactor<S>,
    key: usize,
    ck: usize,
) {
    let export = shard.conns[key].proto.inflight[ck].export;
    if shard.proto.exports[export].backlog.is_empty() && pump(shard, r, key, ck) {
        maybe_finish(shard, r, key, ck);
    } else {
        shard.proto.exports[export].backlog.push_back((key, ck));
    }
}

/// Solicited write data for command `cid`: `data` lands at byte `offset` of the command's
/// data (`data` is a range of the connection's input); after the `last` piece the write is
/// submitted. Data for a command the connection
/// does not hold (the session checked it) is ignored.
pub(crate) fn receive<S: HasShard<Nvmf>>(
    shard: &mut Shard<Nvmf>,
    r: &mut Reactor<S>,
    key: usize,
    cid: u16,
    offset: u32,
    data: Range<usize>,
    last: bool,
) {
    let conn = &mut shard.conns[key];
    let (input, state) = conn.input_and_state();
    let Some(&ck) = state.by_cid.get(&cid) else {
        debug_assert!(false, "write data for a command not waiting for it");
        return;
    };
    let p = &mut state.inflight[ck];
    debug_assert_eq!(p.stage, Stage::Receiving);
    let ex = &shard.proto.exports[p.export];
    let piece_bytes = ex.rw_piece_bytes as usize;
    if p.write_bufs.is_empty() {
        // Taken at the first data, not at the command: the session sends the R2T that
        // lets data come only within its bound of solicited bytes.
        let Some(BlockRange { blocks, .. }) = p.ranges.get(0) else {
            unreachable!("a write has its blocks")
        };
        let mut left = blocks as usize * ex.lba_bytes as usize;
        while left > 0 {
            let n = left.min(piece_bytes);
            p.write_bufs.push_back(shard.bufs.take(n));
            left -= n;
        }
    }
    let mut at = offset as usize;
    let mut rest = &input[data];
    while !rest.is_empty() {
        let (piece, within) = (at / piece_bytes, at % piece_bytes);
        let buf = &mut p.write_bufs[piece];
        let n = rest.len().min(buf.len() - within);
        buf[within..within + n].copy_from_slice(&rest[..n]);
        rest = &rest[n..];
        at += n;
    }
    if !last {
        return;
    }
    p.stage = Stage::Data;
    p.held = p.write_bufs.iter().map(|b| b.len()).sum();
    let held = p.held;
    conn.proto.by_cid.remove(&cid);
    conn.hold(held);
    submit_or_wait(shard, r, key, ck);
}

/// A solicited write whose data failed its digest: the session answered it; its buffers
/// go back.
pub(crate) fn abort(shard: &mut Shard<Nvmf>, key: usize, cid: u16) {
    let conn = &mut shard.conns[key];
    let Some(ck) = conn.proto.by_cid.remove(&cid) else {
        return;
    };
    let p = conn.proto.inflight.remove(ck);
    debug_assert_eq!((p.stage, p.held, p.pieces_out), (Stage::Receiving, 0, 0));
    p.write_bufs.into_iter().for_each(|b| shard.bufs.give(b));
}

/// The next device command of the data stage: its request (user word unset), buffer and
/// blocks; `None` once the stage is all submitted.
fn next_piece(
    p: &mut Pending,
    ex: &ShardExport,
    bufs: &mut BufCache,
) -> Option<(IoRequest, Option<IoBuf>)> {
    let range = p.ranges.get(p.range_at)?;
    let left = range.blocks - p.range_blocks_done;
    let slba = range.slba + u64::from(p.range_blocks_done);
    let (req, buf, blocks) = match p.kind {
        Kind::Read | Kind::Write => {
            let blocks = left.min(ex.rw_piece_bytes / ex.lba_bytes);
            let bytes = blocks as usize * ex.lba_bytes as usize;
            let (op, buf) = if p.kind == Kind::Read {
                let mut buf = bufs.take(bytes);
                if !ex.reads_fill {
                    buf.fill(0);
                }
                (IoOp::Read, buf)
            } else {
                let buf = p.write_bufs.pop_front().expect("one buffer a piece");
                debug_assert_eq!(buf.len(), bytes);
                (IoOp::Write, buf)
            };
            (IoRequest::new(op, slba, blocks), Some(buf), blocks)
        }
        Kind::WriteZeroes | Kind::Deallocate => {
            let blocks = left.min(ex.zero_piece_blocks);
            let op = if p.kind == Kind::Deallocate {
                IoOp::Deallocate
            } else {
                IoOp::WriteZeroes
            };
            let req = IoRequest::new(op, slba, blocks).with_deallocate(p.deallocate);
            (req, None, blocks)
        }
        Kind::Flush => return None,
    };
    Some((req, buf)).inspect(|_| {
        p.range_blocks_done += blocks;
        if p.range_blocks_done == range.blocks {
            p.range_at += 1;
            p.range_blocks_done = 0;
        }
    })
}

/// Whether every device command of the current stage is submitted.
fn stage_submitted(p: &Pending) -> bool {
    match p.stage {
        Stage::Receiving => false,
        Stage::Data => p.ranges.get(p.range_at).is_none(),
        Stage::Flush => p.flush_submitted,
    }
}

/// Submits the command's next device commands until all are submitted (true) or the queue
/// pair is full (false).
fn pump<S: HasShard<Nvmf>>(
    shard: &mut Shard<Nvmf>,
    r: &mut Reactor<S>,
    key: usize,
    ck: usize,
) -> bool {
    loop {
        let p = &mut shard.conns[key].proto.inflight[ck];
        if stage_submitted(p) {
            return true;
        }
        let dev = shard.proto.exports[p.export].dev;
        if !r.has_room(dev) {
            // Full: retried from the backlog, without building a buffer to be refused.
            return false;
        }
        // The piece's position, to undo it if the queue pair refuses it.
        let (range_at, range_blocks_done) = (p.range_at, p.range_blocks_done);
        let (req, buf, piece) = if p.stage == Stage::Flush {
            (IoRequest::new(IoOp::Flush, 0, 0), None, 0)
        } else {
            let ex = &shard.proto.exports[p.export];
            let (req, buf) = next_piece(p, ex, &mut shard.bufs).expect("pieces left");
            (req, buf, p.pieces_submitted)
        };
        let req = req.with_user(pack(key, ck, piece));
        let result = r.submit(dev, req, buf, piece_done::<S>);
        let p = &mut shard.conns[key].proto.inflight[ck];
        match result {
            Ok(()) => {
                p.pieces_out += 1;
                if p.stage == Stage::Flush {
                    p.flush_submitted = true;
                } else {
                    p.pieces_submitted += 1;
                }
            }
            Err(rejected) => {
                if let RejectReason::Submit(SubmitError::QueueFull { .. }) = rejected.reason {
                    p.range_at = range_at;
                    p.range_blocks_done = range_blocks_done;
                    match (p.kind, rejected.buf) {
                        (Kind::Write, Some(buf)) => p.write_bufs.push_front(buf),
                        (_, Some(buf)) => shard.bufs.give(buf),
                        _ => {}
                    }
                    return false;
                }
                // Anything else will not get better: fail the rest of the command.
                if p.status.is_success() {
                    p.status = match rejected.reason {
                        RejectReason::ShuttingDown => Status::ABORTED_SQ_DELETION,
                        _ => Status::INTERNAL_ERROR,
                    };
                }
                p.range_at = usize::MAX;
                p.flush_submitted = true;
                p.write_bufs.drain(..).for_each(|b| shard.bufs.give(b));
                if let Some(buf) = rejected.buf {
                    shard.bufs.give(buf);
                }
                return true;
            }
        }
    }
}

/// Submits the commands waiting for room at namespace `export`'s queue pair, in order,
/// until it is full again. Returns the commands fully submitted.
pub(crate) fn retry_backlog<S: HasShard<Nvmf>>(
    shard: &mut Shard<Nvmf>,
    r: &mut Reactor<S>,
    export: usize,
) -> usize {
    let mut work = 0;
    while let Some(&(key, ck)) = shard.proto.exports[export].backlog.front() {
        if !pump(shard, r, key, ck) {
            break;
        }
        shard.proto.exports[export].backlog.pop_front();
        work += 1;
        maybe_finish(shard, r, key, ck);
    }
    work
}

/// Runs on the reactor when a device command completes.
fn piece_done<S: HasShard<Nvmf>>(r: &mut Reactor<S>, state: &mut S, done: IoDone) {
    let shard = state.shard();
    let (key, ck, piece) = unpack(done.user);
    let Some(p) = shard
        .conns
        .get_mut(key)
        .and_then(|c| c.proto.inflight.get_mut(ck))
    else {
        // Cannot happen: a connection and its commands stay until every piece is back.
        tracing::error!("completion for a command that is gone ({key}/{ck})");
        return;
    };
    debug_assert!(p.pieces_out > 0, "a completion for a piece never submitted");
    p.pieces_out -= 1;
    match done.result {
        Ok(()) => {
            if p.kind == Kind::Read && p.stage == Stage::Data {
                p.read_bufs[piece as usize] = done.buf;
            } else if let Some(buf) = done.buf {
                // A written piece's data: its buffer serves the next command.
                shard.bufs.give(buf);
            }
        }
        Err(e) => {
            if let Some(buf) = done.buf {
                shard.bufs.give(buf);
            }
            if p.status.is_success() {
                p.status = status_of(&e);
                let peer = shard.conns[key].peer.clone();
                shard.log(
                    &peer,
                    &format!("device error, answered with its status: {e}"),
                );
            }
        }
    }
    maybe_finish(shard, r, key, ck);
}

/// Once every device command of a command is back: a flush for FUA, or the answer.
fn maybe_finish<S: HasShard<Nvmf>>(
    shard: &mut Shard<Nvmf>,
    r: &mut Reactor<S>,
    key: usize,
    ck: usize,
) {
    loop {
        let p = &mut shard.conns[key].proto.inflight[ck];
        if !stage_submitted(p) || p.pieces_out > 0 {
            return;
        }
        if p.stage == Stage::Data && p.fua && p.status.is_success() {
            p.stage = Stage::Flush;
            let export = p.export;
            if !shard.proto.exports[export].backlog.is_empty() || !pump(shard, r, key, ck) {
                shard.proto.exports[export].backlog.push_back((key, ck));
                return;
            }
            continue;
        }
        break;
    }
    let conn = &mut shard.conns[key];
    let p = conn.proto.inflight.remove(ck);
    debug_assert_eq!(p.pieces_out, 0);
    conn.release(p.held);
    let m = &shard.proto.exports[p.export].io[p.kind as usize];
    m.requests.inc();
    if p.status.is_success() {
        m.bytes.inc_by(p.held as u64);
    } else {
        m.errors.inc();
    }
    m.latency
        .observe(r.now_ns().saturating_sub(p.start_ns) as f64 / 1e9);
    answer(shard, key, p);
    shard.mark_dirty(key);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_identity_survives_the_user_word() {
        for (c, k, p) in [(0, 0, 0), (65535, 65535, u32::MAX), (7, 300, 8191)] {
            assert_eq!(unpack(pack(c, k, p)), (c, k, p));
        }
    }
}
