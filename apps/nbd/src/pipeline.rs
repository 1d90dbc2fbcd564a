//! How an NBD request runs: split into device-sized commands on the reactor's queue pair for
//! its export (waiting in the export's backlog while the queue pair is full), a flush after
//! the data when the client asked for FUA, and one reply once every command is back.
//!
//! Each device command carries its request's identity in its `user` word: the connection's
//! key, the request's key and the piece's index, so a completion finds its request without
//! an allocation or a lookup table.

use std::collections::VecDeque;

use hypoll_frontend::{HasShard, Shard, CONNECTIONS_PER_REACTOR_MAX, REQUESTS_INFLIGHT_MAX};
use hypoll_nvme::{IoBuf, Status, SubmitError};
use hypoll_reactor::{IoDone, IoFailure, IoOp, IoRequest, Reactor, RejectReason};

use crate::proto::{self, simple_reply};
use crate::session::{Op, Request};
use crate::shard::Nbd;

/// Bits of a command's `user` word that hold, from the top: the connection's key, the
/// request's key within the connection, and the piece's index within the request.
const CONN_BITS: u32 = 16;
const REQUEST_BITS: u32 = 16;
const PIECE_BITS: u32 = 32;

const _: () = assert!(CONN_BITS + REQUEST_BITS + PIECE_BITS == u64::BITS);
// A shard holds at most CONNECTIONS_PER_REACTOR_MAX connections, keyed from 0.
const _: () = assert!(CONNECTIONS_PER_REACTOR_MAX <= 1 << CONN_BITS);
// A connection holds at most REQUESTS_INFLIGHT_MAX requests, keyed from 0.
const _: () = assert!(REQUESTS_INFLIGHT_MAX <= 1 << REQUEST_BITS);
// A request's length is a u32 and each piece at least a byte, so its pieces fit.
const _: () = assert!(u32::BITS <= PIECE_BITS);
const _: () = assert!(proto::REPLY_HEADER_BYTES <= hypoll_frontend::HEAD_INLINE_BYTES_MAX);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Data,
    /// A flush after the data: the request had FUA, or is a flush.
    Flush,
}

/// A request in flight.
pub(crate) struct Pending {
    op: Op,
    cookie: u64,
    export: usize,
    offset: u64,
    length: u32,
    fua: bool,
    /// Write Zeroes may leave a hole (the client did not send `NO_HOLE`).
    may_deallocate: bool,
    stage: Stage,
    /// Bytes of the data stage submitted so far.
    submitted: u64,
    flush_submitted: bool,
    /// Device commands in flight.
    pieces_out: u32,
    /// The NBD error of the reply (0: success).
    error: u32,
    /// A write's payload, one buffer per piece, taken as pieces are submitted.
    write_bufs: VecDeque<IoBuf>,
    /// A read's data, one buffer per piece, filled as pieces complete.
    read_bufs: Vec<Option<IoBuf>>,
    start_ns: u64,
}

impl Pending {
    /// Bytes of data the request holds while in flight: its write payload or its read's
    /// length, counted against its connection's bound.
    fn held_bytes(&self) -> usize {
        match self.op {
            Op::Read | Op::Write => self.length as usize,
            _ => 0,
        }
    }
}

/// Packs a piece's identity into `IoRequest::user`: connection, request, piece index.
fn pack(conn: usize, req: usize, piece: u32) -> u64 {
    debug_assert!(conn < 1 << CONN_BITS && req < 1 << REQUEST_BITS);
    ((conn as u64) << (REQUEST_BITS + PIECE_BITS)) | ((req as u64) << PIECE_BITS) | u64::from(piece)
}

fn unpack(user: u64) -> (usize, usize, u32) {
    (
        (user >> (REQUEST_BITS + PIECE_BITS)) as usize,
        ((user >> PIECE_BITS) & ((1 << REQUEST_BITS) - 1)) as usize,
        user as u32,
    )
}

/// The NBD error a failed device command is answered with: `ENOSPC` when the device is out
/// of space (the protocol asks for it on a write that fails so), `EIO` otherwise.
fn nbd_error_of(failure: &IoFailure) -> u32 {
    match failure {
        IoFailure::Device(Status::CAPACITY_EXCEEDED) => proto::ENOSPC,
        _ => proto::EIO,
    }
}

/// Starts a valid request of connection `key`, whose payload is still at the front of the
/// connection's input: splits it into device commands and submits what fits.
pub(crate) fn start<S: HasShard<Nbd>>(
    shard: &mut Shard<Nbd>,
    r: &mut Reactor<S>,
    key: usize,
    export: usize,
    req: Request,
) {
    let ex = &shard.proto.exports[export];
    let conn = &mut shard.conns[key];
    let mut write_bufs = VecDeque::new();
    if req.op == Op::Write {
        let payload = &conn.input()[req.payload.start..req.payload.end];
        for chunk in payload.chunks(ex.rw_piece_bytes as usize) {
            // From the pinned pool: a uring device then skips per-I/O page pinning.
            let mut buf = shard.bufs.take(chunk.len());
            buf.copy_from_slice(chunk);
            write_bufs.push_back(buf);
        }
    }
    let read_pieces = if req.op == Op::Read {
        (req.length as usize).div_ceil(ex.rw_piece_bytes as usize)
    } else {
        0
    };
    let pending = Pending {
        op: req.op,
        cookie: req.cookie,
        export,
        offset: req.offset,
        length: req.length,
        fua: req.fua,
        may_deallocate: !req.no_hole,
        stage: if req.op == Op::Flush {
            Stage::Flush
        } else {
            Stage::Data
        },
        submitted: 0,
        flush_submitted: false,
        pieces_out: 0,
        error: 0,
        write_bufs,
        read_bufs: (0..read_pieces).map(|_| None).collect(),
        start_ns: r.now_ns(),
    };
    conn.hold(pending.held_bytes());
    let rk = conn.proto.inflight.insert(pending);
    assert!(
        rk < REQUESTS_INFLIGHT_MAX,
        "a connection past its request bound"
    );
    if shard.proto.exports[export].backlog.is_empty() && pump(shard, r, key, rk) {
        maybe_finish(shard, r, key, rk);
    } else {
        shard.proto.exports[export].backlog.push_back((key, rk));
    }
}

/// Submits the request's next device commands until all are submitted (true) or the
/// queue pair is full (false).
fn pump<S: HasShard<Nbd>>(
    shard: &mut Shard<Nbd>,
    r: &mut Reactor<S>,
    ck: usize,
    rk: usize,
) -> bool {
    let p = &mut shard.conns[ck].proto.inflight[rk];
    let ex = &shard.proto.exports[p.export];
    let lba = u64::from(ex.lba_bytes);
    assert!(p.submitted <= u64::from(p.length));
    loop {
        let data_left = u64::from(p.length) - p.submitted;
        let more = match p.stage {
            Stage::Data => data_left > 0,
            Stage::Flush => !p.flush_submitted,
        };
        if more && !r.has_room(ex.dev) {
            // Full: retried from the backlog, without building a buffer to be refused.
            return false;
        }
        let (req, buf, piece_bytes) = match p.stage {
            Stage::Data if data_left > 0 => {
                let at = p.offset + p.submitted;
                let piece = (p.submitted / u64::from(ex.rw_piece_bytes)) as u32;
                match p.op {
                    Op::Read | Op::Write => {
                        let n = data_left.min(u64::from(ex.rw_piece_bytes));
                        let (op, buf) = if p.op == Op::Read {
                            let mut buf = shard.bufs.take(n as usize);
                            if !ex.reads_fill {
                                buf.fill(0);
                            }
                            (IoOp::Read, buf)
                        } else {
                            let buf = p.write_bufs.pop_front().expect("one buffer a piece");
                            (IoOp::Write, buf)
                        };
                        let req = IoRequest::new(op, at / lba, (n / lba) as u32)
                            .with_user(pack(ck, rk, piece));
                        (req, Some(buf), n)
                    }
                    Op::Trim | Op::WriteZeroes => {
                        let n = data_left.min(u64::from(ex.zero_piece_blocks) * lba);
                        let op = if p.op == Op::Trim {
                            IoOp::Deallocate
                        } else {
                            IoOp::WriteZeroes
                        };
                        let req = IoRequest::new(op, at / lba, (n / lba) as u32)
                            .with_deallocate(p.may_deallocate)
                            .with_user(pack(ck, rk, 0));
                        (req, None, n)
                    }
                    Op::Flush => unreachable!("a flush has no data stage"),
                }
            }
            Stage::Flush if !p.flush_submitted => {
                let req = IoRequest::new(IoOp::Flush, 0, 0).with_user(pack(ck, rk, 0));
                (req, None, 0)
            }
            _ => return true,
        };
        match r.submit(ex.dev, req, buf, piece_done::<S>) {
            Ok(()) => {
                p.pieces_out += 1;
                if p.stage == Stage::Flush {
                    p.flush_submitted = true;
                } else {
                    p.submitted += piece_bytes;
                }
                assert!(p.submitted <= u64::from(p.length));
            }
            Err(rejected) => {
                if let RejectReason::Submit(SubmitError::QueueFull { .. }) = rejected.reason {
                    if let (Op::Write, Some(buf)) = (p.op, rejected.buf) {
                        p.write_bufs.push_front(buf);
                    }
                    return false;
                }
                // Anything else will not get better: fail the rest of the request.
                if p.error == 0 {
                    p.error = match rejected.reason {
                        RejectReason::ShuttingDown => proto::ESHUTDOWN,
                        _ => proto::EIO,
                    };
                }
                p.submitted = u64::from(p.length);
                p.flush_submitted = true;
                p.write_bufs.clear();
                return true;
            }
        }
    }
}

/// Submits the requests waiting for room at export `export`'s queue pair, in order, until
/// it is full again. Returns the requests fully submitted.
pub(crate) fn retry_backlog<S: HasShard<Nbd>>(
    shard: &mut Shard<Nbd>,
    r: &mut Reactor<S>,
    export: usize,
) -> usize {
    let mut work = 0;
    while let Some(&(ck, rk)) = shard.proto.exports[export].backlog.front() {
        if !pump(shard, r, ck, rk) {
            break;
        }
        shard.proto.exports[export].backlog.pop_front();
        work += 1;
        maybe_finish(shard, r, ck, rk);
    }
    work
}

/// Runs on the reactor when a device command of a request completes.
fn piece_done<S: HasShard<Nbd>>(r: &mut Reactor<S>, state: &mut S, done: IoDone) {
    let (conn, req, piece) = unpack(done.user);
    on_piece_done(state.shard(), r, conn, req, piece, done);
}

fn on_piece_done<S: HasShard<Nbd>>(
    shard: &mut Shard<Nbd>,
    r: &mut Reactor<S>,
    ck: usize,
    rk: usize,
    piece: u32,
    done: IoDone,
) {
    let Some(p) = shard
        .conns
        .get_mut(ck)
        .and_then(|c| c.proto.inflight.get_mut(rk))
    else {
        // Cannot happen: a connection and its requests stay until every piece is back.
        tracing::error!("completion for a request that is gone ({ck}/{rk})");
        return;
    };
    debug_assert!(p.pieces_out > 0, "a completion for a piece never submitted");
    p.pieces_out -= 1;
    match done.result {
        Ok(()) => {
            if p.op == Op::Read && p.stage == Stage::Data {
                p.read_bufs[piece as usize] = done.buf;
            } else if let Some(buf) = done.buf {
                // A written piece's payload: its buffer serves the next request.
                shard.bufs.give(buf);
            }
        }
        Err(e) => {
            if p.error == 0 {
                let error = nbd_error_of(&e);
                p.error = error;
                let name = if error == proto::ENOSPC {
                    "ENOSPC"
                } else {
                    "EIO"
                };
                let peer = shard.conns[ck].peer.clone();
                shard.log(&peer, &format!("device error, replying {name}: {e}"));
            }
        }
    }
    maybe_finish(shard, r, ck, rk);
}

/// Once every command of a request is back: a flush for FUA, or the reply.
fn maybe_finish<S: HasShard<Nbd>>(
    shard: &mut Shard<Nbd>,
    r: &mut Reactor<S>,
    ck: usize,
    rk: usize,
) {
    loop {
        let p = &mut shard.conns[ck].proto.inflight[rk];
        let all_submitted = match p.stage {
            Stage::Data => p.submitted == u64::from(p.length),
            Stage::Flush => p.flush_submitted,
        };
        if !all_submitted || p.pieces_out > 0 {
            return;
        }
        if p.stage == Stage::Data && p.fua && p.error == 0 {
            p.stage = Stage::Flush;
            let export = p.export;
            if !shard.proto.exports[export].backlog.is_empty() || !pump(shard, r, ck, rk) {
                shard.proto.exports[export].backlog.push_back((ck, rk));
                return;
            }
            continue;
        }
        break;
    }
    let conn = &mut shard.conns[ck];
    let p = conn.proto.inflight.remove(rk);
    assert_eq!(p.pieces_out, 0);
    conn.release(p.held_bytes());
    let m = &shard.proto.exports[p.export].io[p.op as usize];
    m.requests.inc();
    if p.error == 0 {
        m.bytes.inc_by(u64::from(p.length));
    } else {
        m.errors.inc();
    }
    m.latency
        .observe(r.now_ns().saturating_sub(p.start_ns) as f64 / 1e9);
    if !conn.gone {
        let data = if p.op == Op::Read && p.error == 0 {
            p.read_bufs
                .into_iter()
                .map(|b| b.expect("every piece of a successful read is back"))
                .collect()
        } else {
            Vec::new()
        };
        conn.push_reply(&simple_reply(p.cookie, p.error), data);
    }
    shard.mark_dirty(ck);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_out_of_space_is_answered_enospc_and_other_failures_eio() {
        let enospc = IoFailure::Device(Status::CAPACITY_EXCEEDED);
        assert_eq!(nbd_error_of(&enospc), proto::ENOSPC);
        for other in [
            IoFailure::Device(Status::WRITE_FAULT),
            IoFailure::Device(Status::UNRECOVERED_READ_ERROR),
            IoFailure::TimedOut,
            IoFailure::Shutdown,
        ] {
            assert_eq!(nbd_error_of(&other), proto::EIO, "{other}");
        }
    }

    #[test]
    fn a_piece_identity_survives_the_user_word() {
        for (c, r, p) in [(0, 0, 0), (65535, 65535, u32::MAX), (7, 300, 8191)] {
            assert_eq!(unpack(pack(c, r, p)), (c, r, p));
        }
    }
}
