//! The graceful stop's wait for the guests: before the reactors stop, every ring stops
//! taking the guest's requests, answers those it took into the used ring (signalling the
//! guest), and ends; the stop waits for that up to a bound, then the reactors stop (and
//! what is still in flight then completes or fails as a reactor's shutdown says).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use hypoll_frontend::DRAIN_CHECK_PERIOD;
use hypoll_reactor::ReactorHandle;

use crate::shard::VhostState;

/// How long [`drain`] waits for rings by default: the same bound as the other front ends'
/// drain.
pub const VHOST_DRAIN_TIMEOUT: Duration = hypoll_frontend::DRAIN_TIMEOUT;

/// Drains the vhost-user back end on the reactors of `handles`: asks each reactor to serve
/// no new front end and to stop every ring (`VhostShard::drain`), then waits up to
/// `timeout` for every ring to have answered what it took and ended. Returns the rings
/// still running then (0 after a clean drain).
pub fn drain<S: VhostState>(handles: &[ReactorHandle<S>], timeout: Duration) -> usize {
    let deadline = Instant::now() + timeout;
    // Each reactor says when it has taken the drain: a ring a control connection started
    // before that is in its owner's mailbox ahead of the counts asked for below.
    let (tx, rx) = mpsc::channel();
    let mut asked = 0;
    for h in handles {
        let tx = tx.clone();
        let sent = h.send(move |_, s: &mut S| {
            s.vhost().drain();
            let _ = tx.send(());
        });
        asked += usize::from(sent.is_ok());
    }
    drop(tx);
    for _ in 0..asked {
        if rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .is_err()
        {
            break;
        }
    }
    loop {
        let left = rings_running(handles, deadline);
        if left == 0 {
            return 0;
        }
        if Instant::now() >= deadline {
            tracing::warn!(
                rings = left,
                "vhost-user rings still had guests' requests in flight when the drain \
                 timed out"
            );
            return left;
        }
        std::thread::sleep(DRAIN_CHECK_PERIOD);
    }
}

/// The rings running on all reactors of `handles`; a reactor that does not answer by
/// `deadline` (or at once, past it) counts as one.
fn rings_running<S: VhostState>(handles: &[ReactorHandle<S>], deadline: Instant) -> usize {
    let (tx, rx) = mpsc::channel();
    let mut asked = 0;
    for h in handles {
        let tx = tx.clone();
        if h.send(move |_, s: &mut S| {
            let _ = tx.send(s.vhost().rings());
        })
        .is_ok()
        {
            asked += 1;
        }
    }
    drop(tx);
    let mut running = 0;
    for _ in 0..asked {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .max(DRAIN_CHECK_PERIOD);
        running += rx.recv_timeout(wait).unwrap_or(1);
    }
    running
}
