//! What io_uring's own threads cost. Two kinds run beside the reactors, as threads of the
//! process (since Linux 5.12; listed under `/proc/self/task`): a ring's submission thread
//! (`sqpoll=on`, named `iou-sqp-<pid>`), and the workers (`iou-wrk-<pid>`) that make what
//! io_uring cannot make in the submitting thread without blocking: a buffered read that
//! misses the page cache, every buffered read and write on a file system that refuses
//! non-blocking ones, `fsync`, `fallocate`. Their CPU time counts in the process's, but in
//! no reactor thread's: a benchmark that charges CPU per reactor thread adds it from here.
//!
//! Workers come and go (one left idle for a few seconds exits), and an exited thread's time
//! leaves `/proc/self/task` with it, so a sum over the threads present could shrink over a
//! window. The total is kept by thread instead: each look adds what every thread ran since
//! the last look saw it (all of it, for a thread not seen before), so it never decreases.
//! What a thread ran between the last look and its exit is lost.

use std::fs;
use std::sync::{Mutex, PoisonError};

/// The prefixes of io_uring's thread names (`comm`): submission threads and workers.
const IO_URING_THREAD_PREFIXES: [&str; 2] = ["iou-sqp-", "iou-wrk-"];

/// Most threads of the process looked at, so that a process with a runaway thread count
/// costs a bounded walk.
const THREADS_MAX: usize = 4096;

/// What the last look saw, and the total so far.
#[derive(Debug, Default)]
pub(super) struct Seen {
    /// (thread id, CPU time in ns), sorted by thread id.
    threads: Vec<(u32, u64)>,
    total_ns: u64,
}

static SEEN: Mutex<Seen> = Mutex::new(Seen {
    threads: Vec::new(),
    total_ns: 0,
});

impl Seen {
    /// Adds what the threads in `now` (thread id, CPU time in ns) ran since the last look
    /// and keeps them for the next; the total so far.
    pub(super) fn look(&mut self, mut now: Vec<(u32, u64)>) -> u64 {
        now.sort_unstable_by_key(|&(tid, _)| tid);
        let added: u64 = now
            .iter()
            .map(|&(tid, ns)| {
                match self.threads.binary_search_by_key(&tid, |&(t, _)| t) {
                    // A thread id used again by a newer thread shows less time: none added.
                    Ok(i) => ns.saturating_sub(self.threads[i].1),
                    Err(_) => ns,
                }
            })
            .sum();
        self.total_ns += added;
        self.threads = now;
        self.total_ns
    }
}

/// CPU time (user and system, in ns) that this process's io_uring submission threads and
/// workers have run, as far as this process has looked (see the module documentation): a
/// count that never decreases, of which a caller takes the difference over a window. 0
/// where `/proc` cannot say.
pub fn io_uring_threads_cpu_ns() -> u64 {
    let mut seen = SEEN.lock().unwrap_or_else(PoisonError::into_inner);
    match io_uring_threads(&seen.threads) {
        Some(now) => seen.look(now),
        // Nothing could be listed: the last look stands.
        None => seen.total_ns,
    }
}

/// This process's io_uring threads and their CPU time so far, from each one's `schedstat`;
/// `None` if `/proc/self/task` cannot be listed. A thread that the last look saw (`last`)
/// and whose files cannot be read now keeps its last time, so that the next look does not
/// count its whole life again.
fn io_uring_threads(last: &[(u32, u64)]) -> Option<Vec<(u32, u64)>> {
    let tasks = fs::read_dir("/proc/self/task").ok()?;
    let threads = tasks
        .flatten()
        .take(THREADS_MAX)
        .filter_map(|task| {
            let tid = task.file_name().to_str()?.parse::<u32>().ok()?;
            let known = last
                .binary_search_by_key(&tid, |&(t, _)| t)
                .ok()
                .map(|i| last[i]);
            let Ok(comm) = fs::read_to_string(task.path().join("comm")) else {
                return known;
            };
            if !IO_URING_THREAD_PREFIXES
                .iter()
                .any(|prefix| comm.starts_with(prefix))
            {
                return None;
            }
            // The first field of schedstat is the time spent on a CPU, in ns.
            let ns = fs::read_to_string(task.path().join("schedstat"))
                .ok()
                .and_then(|stat| stat.split_whitespace().next()?.parse::<u64>().ok());
            match ns {
                Some(ns) => Some((tid, ns)),
                None => known,
            }
        })
        .collect();
    Some(threads)
}
