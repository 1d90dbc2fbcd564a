//! A command's answer, once every device command of it is back: the session is told, and
//! what it says is queued for the socket. A read's C2HData header goes inline in the reply
//! and the device's own buffers behind it, so the data is never copied on the server.

use hypoll_frontend::{Conn, Shard, HEAD_INLINE_BYTES_MAX};
use hypoll_nvme::{IoBuf, Status};
use hypoll_reactor::IoFailure;

use crate::pipeline::{Kind, Pending};
use crate::session::CompleteError;
use crate::shard::Nvmf;

/// The NVMe status a failed device command is answered with: the device's own where it
/// gave one.
pub(crate) fn status_of(failure: &IoFailure) -> Status {
    match failure {
        IoFailure::Device(s) => *s,
        IoFailure::Shutdown => Status::ABORTED_SQ_DELETION,
        _ => Status::INTERNAL_ERROR,
    }
}

/// Tells the session a command is done and queues what it says: a read's C2HData around
/// the device's buffers, a response capsule, and any R2Ts the freed room lets it send.
pub(crate) fn answer(shard: &mut Shard<Nvmf>, key: usize, p: Pending) {
    let nvmf = &mut shard.proto;
    let conn = &mut shard.conns[key];
    let session = &mut conn.proto.session;
    let (head, tail) = (&mut nvmf.head, &mut nvmf.tail);
    head.clear();
    tail.clear();
    let mut data = Vec::new();
    let result = if p.kind == Kind::Read && p.status.is_success() {
        data = p
            .read_bufs
            .into_iter()
            .map(|b| b.expect("every piece of a successful read is back"))
            .collect();
        match &data[..] {
            [one] => session.complete_read_framed(p.cid, &[&one[..]], head, tail),
            many => {
                let pieces: Vec<&[u8]> = many.iter().map(|b| &b[..]).collect();
                session.complete_read_framed(p.cid, &pieces, head, tail)
            }
        }
    } else {
        p.read_bufs
            .into_iter()
            .flatten()
            .for_each(|b| shard.bufs.give(b));
        session.complete(p.cid, p.status, head)
    };
    match result {
        Ok(()) if !conn.gone => {
            push(conn, head, data);
            push(conn, tail, Vec::new());
        }
        Ok(()) | Err(CompleteError::Closed) => data.into_iter().for_each(|b| shard.bufs.give(b)),
        Err(e) => {
            // The pipeline answers each command once, as the session handed it out.
            debug_assert!(false, "the session refused a completion: {e}");
            data.into_iter().for_each(|b| shard.bufs.give(b));
        }
    }
}

/// Queues `head` (and a read's `data` behind it): inline when it is short, as its own
/// message otherwise (a header padded to the host's alignment, R2Ts after a response).
fn push(conn: &mut Conn<Nvmf>, head: &[u8], data: Vec<IoBuf>) {
    if head.is_empty() && data.is_empty() {
        return;
    }
    if head.len() <= HEAD_INLINE_BYTES_MAX {
        conn.push_reply(head, data);
    } else {
        conn.push_bytes(head.to_vec());
        if !data.is_empty() {
            conn.push_reply(&[], data);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_status_is_passed_on_and_other_failures_are_internal_errors() {
        let s = Status::LBA_OUT_OF_RANGE;
        assert_eq!(status_of(&IoFailure::Device(s)), s);
        assert_eq!(status_of(&IoFailure::Shutdown), Status::ABORTED_SQ_DELETION);
        for other in [
            IoFailure::TimedOut,
            IoFailure::Abandoned,
            IoFailure::Refused,
        ] {
            assert_eq!(status_of(&other), Status::INTERNAL_ERROR, "{other}");
        }
    }
}
