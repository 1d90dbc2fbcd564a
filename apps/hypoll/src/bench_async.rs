//! `hypoll bench --api async`: the bench's workload driven by tasks of `hypoll-async`, one
//! per I/O in flight, each submitting, awaiting and recording in a loop, so that callbacks
//! and `async` are measured on the same device, policy and workload.
//!
//! A task measures its I/O's latency as the callback path does: from the reactor's
//! timestamp when it submits to the reactor's timestamp of the batch that completed it
//! (the task runs in that batch's turn).

use hypoll_async::{Executor, HasExecutor, Local};
use hypoll_nvme::IoBuf;
use hypoll_reactor::{DeviceId, IoRequest};

use crate::bench::{finish, Bench, BenchReactor, Phase};

impl HasExecutor for Bench {
    fn executor(&self) -> &Executor<Bench> {
        self.executor
            .as_ref()
            .expect("--api async installs an executor on every reactor")
    }
}

/// Spawns one task that keeps one I/O in flight with `buf` until the run drains.
pub(crate) fn spawn_worker(_r: &mut BenchReactor, s: &mut Bench, buf: IoBuf) {
    let io = s.executor().local();
    // Detached: the last task out reports for the reactor.
    let spawned = io.spawn_local(worker(io.clone(), buf));
    drop(spawned.expect("the bench spawns one task per I/O in flight, within the limit"));
}

async fn worker(io: Local<Bench>, mut buf: IoBuf) {
    loop {
        let next = io.with(|r, s| {
            let job = s.job.as_mut()?;
            if job.phase == Phase::Drain {
                return None;
            }
            let (op, slba) = job.next_io();
            Some((IoRequest::new(op, slba, job.nlb), r.now_ns()))
        });
        let Some((req, submitted_ns)) = next else {
            break;
        };
        let (ok, back) = match io.submit(DeviceId::FIRST, req, Some(buf)).await {
            Ok(back) => (true, back),
            Err(e) => (false, e.into_buf()),
        };
        io.with(|r, s| {
            if let Some(job) = s.job.as_mut() {
                let now_ns = r.now_ns();
                job.record(ok, now_ns.saturating_sub(submitted_ns), now_ns);
            }
        });
        // An abandoned I/O's buffer stays with the reactor (the device may still use it):
        // this task's share of the queue depth ends with it.
        let Some(back) = back else {
            break;
        };
        buf = back;
    }
    // The last task out, with nothing left in flight, reports.
    io.with(|r, s| {
        if r.outstanding() == 0 {
            finish(s);
        }
    });
}
