//! `hypoll bench --verify`: after a run, each reactor writes a pattern over (part of) its
//! slice of the device and reads it back, counting the blocks that do not match.

use crossbeam_channel::Sender;
use hypoll_nvme::IoBuf;
use hypoll_reactor::{DeviceId, IoDone, IoOp, IoRequest, ReactorSet};

use crate::bench::{Bench, BenchReactor, Workload, REPORT_GRACE};

/// Blocks each reactor writes and reads back under `--verify` (at most), in I/Os.
const VERIFY_IOS_MAX: u64 = 4096;

/// The pattern block `slba` holds under `--verify`: its address, repeated.
fn pattern(slba: u64, len: usize) -> IoBuf {
    let mut buf = IoBuf::zeroed(len);
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let word = (slba.wrapping_mul(0x1_0000_0001) ^ i as u64).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
    buf
}

/// Each reactor writes a pattern over (part of) its slice, then reads it back and compares.
/// Returns the blocks that did not match (or failed).
pub(crate) fn verify(
    set: &ReactorSet<Bench>,
    work: &Workload,
    nlb: u32,
    per_reactor_ios: u64,
) -> Result<u64, String> {
    let count = per_reactor_ios.min(VERIFY_IOS_MAX);
    let (tx, rx) = crossbeam_channel::unbounded::<u64>();
    for h in set.handles().iter() {
        let tx = tx.clone();
        let base = h.index() as u64 * per_reactor_ios;
        let verify = Verify {
            base,
            count,
            nlb,
            bs: work.bs_bytes as usize,
            qd: work.qd as u64,
            tx,
            next: 0,
            done: 0,
            reading: false,
            mismatches: 0,
            ended: false,
        };
        h.send(move |r, s| {
            s.verify = Some(verify);
            verify_phase(r, s);
        })
        .map_err(|e| format!("starting verify: {e}"))?;
    }
    drop(tx);
    let mut mismatches = 0;
    for _ in 0..set.handles().len() {
        mismatches += rx
            .recv_timeout(REPORT_GRACE)
            .map_err(|_| "verify did not finish".to_string())?;
    }
    Ok(mismatches)
}

/// One reactor's verify pass: where (`count` I/Os of `nlb` blocks from I/O `base`), how
/// deep, and how far it got.
pub(crate) struct Verify {
    base: u64,
    count: u64,
    nlb: u32,
    bs: usize,
    qd: u64,
    tx: Sender<u64>,
    next: u64,
    done: u64,
    reading: bool,
    mismatches: u64,
    /// An I/O was refused (the reactor is stopping): the pass has reported and ended.
    ended: bool,
}

/// Starts a phase (writing the pattern, then reading it back) at the pass's depth.
fn verify_phase(r: &mut BenchReactor, s: &mut Bench) {
    let v = s.verify.as_ref().expect("a verify pass runs");
    for _ in 0..v.qd.min(v.count) {
        verify_issue(r, s);
    }
}

fn verify_issue(r: &mut BenchReactor, s: &mut Bench) {
    let v = s.verify.as_mut().expect("a verify pass runs");
    if v.next == v.count {
        return;
    }
    v.next += 1;
    let slba = (v.base + v.next - 1) * u64::from(v.nlb);
    let (op, buf) = if v.reading {
        (IoOp::Read, IoBuf::pinned(v.bs))
    } else {
        (IoOp::Write, pattern(slba, v.bs))
    };
    let req = IoRequest::new(op, slba, v.nlb).with_user(slba);
    if let Err(rejected) = r.submit(DeviceId::FIRST, req, Some(buf), verify_done) {
        // Verify stays within the queue depth, so only a stopping reactor refuses: every
        // block not yet checked counts as failed, and the pass reports once.
        let v = s.verify.as_mut().expect("a verify pass runs");
        if !v.ended {
            v.ended = true;
            let unchecked = v.count - v.done + if v.reading { 0 } else { v.count };
            eprintln!("hypoll: verify stopped: {rejected}");
            let _ = v.tx.send(v.mismatches + unchecked);
        }
    }
}

fn verify_done(r: &mut BenchReactor, s: &mut Bench, done: IoDone) {
    let v = s.verify.as_mut().expect("a verify pass runs");
    if v.ended {
        return;
    }
    let slba = done.user;
    let ok = done.result.is_ok()
        && (!v.reading || done.buf.as_deref() == Some(&pattern(slba, v.bs)[..]));
    v.mismatches += u64::from(!ok);
    v.done += 1;
    if v.done < v.count {
        verify_issue(r, s);
    } else if v.reading {
        let _ = v.tx.send(v.mismatches);
    } else {
        v.reading = true;
        v.next = 0;
        v.done = 0;
        verify_phase(r, s);
    }
}
