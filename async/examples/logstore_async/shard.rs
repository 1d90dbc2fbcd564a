//! One shard of the store, as tasks: a commit task that runs while appends are pending,
//! writing whatever arrived while the last commit was on the device (group commit), and a
//! task per read. Client messages run on the reactor, check the shard's limits and hand
//! the work to a task. The log itself (its place on the device, the ring, the limits, the
//! record format) is the callback version's `log.rs`. A full queue pair needs no code
//! here: an I/O future waits for room.

#[path = "../../../reactor/examples/logstore/log.rs"]
mod log;

use hypoll_async::{Executor, HasExecutor, IoError, IoOutput, Local};
use hypoll_reactor::{Device, InitError, IoBuf, Reactor};
use scopeguard::{guard, ScopeGuard};

use crate::store::{Answer, StoreConfig, StoreError};
use log::{Commit, Log, ReadPlan, READ_BUF_BYTES};
pub use log::{ShardStats, Waiter};

/// One reactor's state.
pub struct Shard {
    executor: Executor<Shard>,
    log: Log,
    /// Buffers for reads: one per read the shard takes at once, back as each read ends.
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
        read_bufs: read_bufs.collect(),
    })
}

/// A client's append: refused at once past a limit, otherwise answered once the commit
/// carrying it completes. With no commit on the device, it starts the commit task.
pub fn append(r: &mut Reactor<Shard>, s: &mut Shard, record: Vec<u8>, waiter: Waiter) {
    debug_assert!(s.log.holds());
    if s.log.append(record, waiter) && !s.log.committing() {
        let task = commit_task(s.executor.local(), stage(r, s));
        let _detached = s.executor.spawn_local(task).expect("one commit task");
    }
}

/// Commits, one at a time, until no append is pending.
async fn commit_task(io: Local<Shard>, mut next: Option<Commit>) {
    while let Some(commit) = next {
        let segments = commit.segments();
        let written = io.submit_vectored(commit.dev, commit.req, segments).await;
        next = io.with(|r, s| {
            s.log.committed(written.map_err(store_error));
            stage(r, s)
        });
    }
}

/// The next commit's write, counted as on the device (its task submits it next); `None`
/// if no append waits.
fn stage(r: &Reactor<Shard>, s: &mut Shard) -> Option<Commit> {
    let commit = s.log.stage()?;
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
        Ok(plan) => match s.read_bufs.pop() {
            None => StoreError::ReadsFull { max },
            Some(buf) => {
                let task = read_task(s.executor.local(), plan, buf, waiter);
                let _detached = s.executor.spawn_local(task).expect("reads_max bounds them");
                return;
            }
        },
    };
    s.log.stats.reads_refused += 1;
    waiter.answer(Answer::Read(Err(refusal)));
}

/// Reads a record from the device (not the ring) and answers with it.
async fn read_task(io: Local<Shard>, plan: ReadPlan, buf: IoBuf, waiter: Waiter) {
    // If the stopping reactor drops the task unfinished, its client is answered so.
    let shut_down = Answer::Read(Err(StoreError::ShuttingDown));
    let waiter = guard(waiter, |waiter| waiter.answer(shut_down));
    io.with(|r, s| s.log.stats.reads_requeued += u64::from(!r.has_room(plan.dev)));
    let (result, buf) = io.submit(plan.dev, plan.req, Some(buf)).await.into_parts();
    io.with(|_, s| {
        let result = result.map_err(store_error);
        let answer = s.log.read_ended(&plan, result, buf.as_deref());
        ScopeGuard::into_inner(waiter).answer(answer);
        // An abandoned read keeps its buffer (the device may still write into it).
        let buf = buf.unwrap_or_else(|| IoBuf::zeroed(READ_BUF_BYTES));
        s.read_bufs.push(buf);
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
    // A read under way holds a buffer.
    s.log.stats.reads_failed += (s.log.cfg.reads_max - s.read_bufs.len()) as u64;
    s.log.stats.interrupt_waits = r.counters().interrupt_waits;
    std::mem::take(&mut s.log.stats)
}
