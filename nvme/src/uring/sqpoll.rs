//! What the submission threads of `sqpoll=on` rings cost. Each such ring has a kernel thread
//! that polls it for entries; since Linux 5.12 it is a thread of the process that made the
//! ring (named `iou-sqp-<pid>`, listed under `/proc/self/task`), so its CPU time counts in
//! the process's, but not in any reactor thread's. A benchmark that charges CPU per
//! reactor thread adds it from here.

use std::fs;

/// The prefix of a submission thread's name (`comm`).
const SQPOLL_THREAD_PREFIX: &str = "iou-sqp-";

/// Most threads of the process looked at, so that a process with a runaway thread count
/// costs a bounded walk.
const THREADS_MAX: usize = 4096;

/// CPU time (user and system, in ns) that this process's io_uring submission threads have
/// run so far, from each thread's `schedstat`. Threads that have exited are no longer
/// counted, so a caller takes the difference over a window in which its rings stay open.
/// 0 where `/proc` cannot say (no such thread, no `/proc`).
pub fn sqpoll_threads_cpu_ns() -> u64 {
    let Ok(tasks) = fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .take(THREADS_MAX)
        .filter(|task| {
            fs::read_to_string(task.path().join("comm"))
                .is_ok_and(|comm| comm.starts_with(SQPOLL_THREAD_PREFIX))
        })
        .filter_map(|task| {
            // The first field of schedstat is the time spent on a CPU, in ns.
            let stat = fs::read_to_string(task.path().join("schedstat")).ok()?;
            stat.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum()
}
