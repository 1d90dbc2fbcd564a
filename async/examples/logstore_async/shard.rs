//! One shard of the store, as tasks: a commit task that runs while appends are pending,
//! writing whatever arrived while the last commit was on the device (group commit), and a
//! task per read. Client messages run on the reactor, check the shard's limits and hand
//! the work to a task. The log itself (its place on the device, the ring, the limits, the
//! record format) is the callback version's `log.rs`. A full queue pair needs no code
//! here: an I/O future waits for room.

#[path = "../../../reactor/examples/logstore/log.rs"]
mod log;

use hypoll_async::{Executor, HasExecutor, IoError, Local};
use hypoll_reactor::{Device, InitError, IoBuf, Reactor};

use crate::store::{Answer, StoreConfig, StoreError};
use log::{Commit, Log, ReadPlan, READ_BUF_BYTES};
pub use log::{ShardStats, Waiter};

/// One reactor's state.
pub struct Shard {
    executor: Executor<Shard>,
    log: Log,
    /// A commit task runs: it takes what is pending before it ends.
    commit_task: bool,
    reads_out: usize,
    read_bufs: Vec<IoBuf>,
}

impl HasExecutor for Shard {
    fn executor(&self) -> &Executor<Shard> {
        &self.executor
    }
}

/// Attaches the device and builds the shard, with every buffer it will use.
pub fn init(r: &mut Reactor<Shard>, device: &Device, cfg: StoreConfig) -> Result<Shard, InitError> {
    let read_bufs = (0..cfg.reads_max).map(|_| IoBuf::zeroed(READ_BUF_BYTES));
    Ok(Shard {
        log: Log::open(r, device, cfg)?,
        executor: Executor::install(r)?,
        commit_task: false,
        reads_out: 0,
        read_bufs: read_bufs.collect(),
    })
}

/// A client's append: refused at once past a limit, otherwise answered once the commit
/// carrying it completes.
pub fn append(_r: &mut Reactor<Shard>, s: &mut Shard, record: Vec<u8>, waiter: Waiter) {
    // A commit on the device is a commit task's.
    debug_assert!(s.log.holds() && (s.commit_task || !s.log.committing()));
    if s.log.append(record, waiter) && !std::mem::replace(&mut s.commit_task, true) {
        let task = s.executor.spawn_local(commit_task(s.executor.local()));
        let _detached = task.expect("room for one commit task");
    }
}

/// Commits, one at a time, until no append is pending.
async fn commit_task(io: Local<Shard>) {
    while let Some(commit) = io.with(stage) {
        let segments = commit.segments();
        let written = io.submit_vectored(commit.dev, commit.req, segments).await;
        io.with(|_, s| s.log.committed(written.map_err(store_error)));
    }
}

/// The next commit's write, counted; `None`, and the commit task ends, if nothing waits.
fn stage(r: &mut Reactor<Shard>, s: &mut Shard) -> Option<Commit> {
    let Some(commit) = s.log.stage() else {
        s.commit_task = false;
        return None;
    };
    s.log.stats.commits_requeued += u64::from(!r.has_room(commit.dev));
    s.log.submitted(&commit);
    Some(commit)
}

/// A client's read of the record at `offset_bytes`: refused at once past the durable end
/// or a limit, otherwise a task that reads it.
pub fn read(_r: &mut Reactor<Shard>, s: &mut Shard, offset_bytes: u64, waiter: Waiter) {
    let max = s.log.cfg.reads_max;
    let refusal = match s.log.read(offset_bytes) {
        Err(error) => error,
        Ok(_) if s.reads_out == max => StoreError::ReadsFull { max },
        Ok(plan) => {
            s.reads_out += 1;
            let task = read_task(s.executor.local(), plan, ReadClient(Some(waiter)));
            let _detached = s.executor.spawn_local(task).expect("reads_max bounds them");
            return;
        }
    };
    s.log.stats.reads_refused += 1;
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

/// Reads a record from the device (not the ring) and answers with it.
async fn read_task(io: Local<Shard>, plan: ReadPlan, mut client: ReadClient) {
    let buf = io.with(|r, s| {
        s.log.stats.reads_requeued += u64::from(!r.has_room(plan.dev));
        // An abandoned read keeps its buffer (the device may still write into it).
        let buf = s.read_bufs.pop();
        buf.unwrap_or_else(|| IoBuf::zeroed(READ_BUF_BYTES))
    });
    let (result, buf) = match io.submit(plan.dev, plan.req, Some(buf)).await {
        Ok(buf) => (Ok(()), buf),
        Err(e) => {
            let (error, buf) = e.into_parts();
            (Err(store_error(error)), buf)
        }
    };
    io.with(|_, s| {
        s.reads_out -= 1;
        let answer = s.log.read_ended(&plan, result, buf.as_deref());
        s.read_bufs.extend(buf);
        client.0.take().expect("answered once").answer(answer);
    });
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
    s.log.close();
    s.log.stats.reads_failed += s.reads_out as u64;
    s.log.stats.interrupt_waits = r.counters().interrupt_waits;
    std::mem::take(&mut s.log.stats)
}
