//! The workload: a random I/O, recorded in the model before it is submitted, and the
//! callback that records its outcome and checks what a read returned.

use std::rc::Rc;

use hypoll_nvme::{Clock, IoBuf, SubmitError};

use super::draw::Rng;
use super::model::{fill_block, OpRec, Shared, WriteRec};
use super::{CHUNK_BLOCKS, LBA_BYTES, NLB_MAX};
use crate::io::{DeviceId, IoDone, IoFailure, IoOp, IoRequest};
use crate::reactor::Reactor;

pub(super) enum SubmitOutcome {
    QueueFull,
    /// Every slot holds an abandoned command: this reactor can do no more I/O.
    Quarantined,
    Bug(String),
}

/// Runs after a simulated I/O's callback has recorded it (the threaded driver refills its
/// queue from here).
pub(super) type Then = Option<Rc<dyn Fn(&mut Reactor)>>;

/// Submits one random I/O on reactor `r` and records it in the model.
#[allow(clippy::too_many_arguments)]
pub(super) fn submit_random(
    r: &mut Reactor,
    reactor: usize,
    device: DeviceId,
    rng: &mut Rng,
    blocks: u64,
    model: &Shared,
    clock: &Clock,
    then: Then,
) -> Result<(), SubmitOutcome> {
    let op = match rng.below(100) {
        0..=34 => IoOp::Read,
        35..=79 => IoOp::Write,
        80..=84 => IoOp::Flush,
        85..=92 => IoOp::WriteZeroes,
        _ => IoOp::Deallocate,
    };
    let (slba, nlb) = if op == IoOp::Flush {
        (0, 0)
    } else {
        let nlb = 1 + rng.below(u64::from(NLB_MAX).min(blocks)) as u32;
        let last = blocks - u64::from(nlb);
        // On a namespace past one store chunk, a fifth of the I/Os sit on the chunk
        // boundary, where the store splits a transfer in two.
        let boundary = CHUNK_BLOCKS.saturating_sub(u64::from(NLB_MAX) - 1);
        let slba = if blocks > CHUNK_BLOCKS && rng.pct(20) {
            (boundary + rng.below(u64::from(NLB_MAX))).min(last)
        } else {
            rng.below(last + 1)
        };
        (slba, nlb)
    };
    let writes = matches!(op, IoOp::Write | IoOp::WriteZeroes | IoOp::Deallocate);
    // Record the I/O (and its writes) before submitting it: on another thread a read may
    // see its data before `submit` even returns. Undone below if it is refused.
    let (op_index, write_ids) = {
        let mut m = model.lock();
        let op_index = m.ops.len();
        let start = m.bump();
        let mut write_ids = Vec::new();
        if writes {
            let value = if op == IoOp::Write {
                op_index as u64 + 1
            } else {
                0
            };
            for lba in slba..slba + u64::from(nlb) {
                let id = m.writes.len();
                m.writes.push(WriteRec {
                    value,
                    start,
                    end: u64::MAX,
                    ok: false,
                });
                m.history[lba as usize].push(id);
                write_ids.push(id);
            }
        }
        m.ops.push(OpRec {
            op,
            reactor,
            slba,
            nlb,
            start,
            start_ns: clock.now_ns(),
            write_ids: write_ids.clone(),
            callbacks: 0,
            accepted: false,
        });
        (op_index, write_ids)
    };
    let buf = match op {
        IoOp::Read => Some(IoBuf::zeroed(nlb as usize * LBA_BYTES)),
        IoOp::Write => {
            let mut buf = IoBuf::zeroed(nlb as usize * LBA_BYTES);
            // Values are the op's index + 1: unique, never 0 (zeroes).
            for (i, block) in buf.chunks_mut(LBA_BYTES).enumerate() {
                fill_block(op_index as u64 + 1, slba + i as u64, block);
            }
            Some(buf)
        }
        _ => None,
    };
    let req = IoRequest::new(op, slba, nlb).with_user(op_index as u64);
    let cb_model = model.clone();
    let cb_clock = clock.clone();
    let submitted = r.submit(device, req, buf, move |r, _, done| {
        on_done(&cb_model, &cb_clock, done);
        if let Some(then) = then {
            then(r);
        }
    });
    let mut m = model.lock();
    match submitted {
        Ok(()) => {
            m.ops[op_index].accepted = true;
            Ok(())
        }
        Err(rejected) => {
            for (i, lba) in (slba..slba + u64::from(nlb)).enumerate() {
                if let Some(&id) = write_ids.get(i) {
                    m.history[lba as usize].retain(|&w| w != id);
                }
            }
            match rejected.reason {
                crate::RejectReason::Submit(SubmitError::QueueFull { .. }) => {
                    let data_op = matches!(op, IoOp::Read | IoOp::Write);
                    if rejected.buf.is_some() != data_op {
                        return Err(SubmitOutcome::Bug(
                            "a rejected read or write did not get its buffer back".into(),
                        ));
                    }
                    Err(SubmitOutcome::QueueFull)
                }
                crate::RejectReason::Quarantined { .. } => Err(SubmitOutcome::Quarantined),
                other => Err(SubmitOutcome::Bug(format!(
                    "reactor {reactor} rejected {op:?} {nlb} blocks at {slba}: {other}"
                ))),
            }
        }
    }
}

/// A callback: records the outcome in the model and checks what a read returned.
fn on_done(model: &Shared, clock: &Clock, done: IoDone) {
    let mut m = model.lock();
    let end = m.bump();
    let index = done.user as usize;
    let Some(op) = m.ops.get_mut(index).filter(|op| op.accepted) else {
        m.errors.push(format!(
            "a callback for I/O {index}, which was never accepted"
        ));
        return;
    };
    op.callbacks += 1;
    let op = op.clone();
    if op.callbacks > 1 {
        m.errors.push(format!(
            "I/O {index} ({:?} at {}) completed a second time: {:?}",
            op.op, op.slba, done.result
        ));
        return;
    }
    let latency_ns = clock.now_ns().saturating_sub(op.start_ns);
    m.latency_ns_max = m.latency_ns_max.max(latency_ns);
    let data_op = matches!(op.op, IoOp::Read | IoOp::Write);
    let buf_expected = data_op && done.result != Err(IoFailure::Abandoned);
    if done.buf.is_some() != buf_expected {
        m.errors.push(format!(
            "I/O {index} ({:?}, {:?}): buffer returned: {}, expected: {buf_expected}",
            op.op,
            done.result,
            done.buf.is_some()
        ));
    }
    if matches!(done.result, Err(IoFailure::Shutdown)) {
        m.errors.push(format!(
            "I/O {index} failed with Shutdown, yet nothing shut down"
        ));
    }
    // A write's window ends at its callback, unless it was abandoned: the device may carry
    // it out any time until its queue pair is deleted.
    let ok = done.result.is_ok();
    let write_end = if done.result == Err(IoFailure::Abandoned) {
        u64::MAX
    } else {
        end
    };
    for &id in &op.write_ids {
        m.writes[id].end = write_end;
        m.writes[id].ok = ok;
    }
    if op.op == IoOp::Read && ok {
        let buf = done.buf.expect("checked above");
        let what = format!("read {index} of {} blocks at {}", op.nlb, op.slba);
        m.check_read(op.slba, &buf, op.start, end, &what);
    }
}
