//! The graceful stop of a service: stop accepting, let every connection finish the requests
//! it has in flight and send their replies (reading no new ones), close it, flush every
//! export, then stop the reactors, reporting what did not go cleanly.

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Instant;

use hypoll_reactor::{DeviceId, IoDone, ReactorSet};

use crate::protocol::{HasShard, Protocol};
use crate::service::Service;
use crate::{DRAIN_CHECK_PERIOD, DRAIN_TIMEOUT, FLUSH_TIMEOUT};

/// What a graceful stop did.
#[derive(Debug, Default)]
pub struct StopReport {
    /// Connections still open when the drain timed out (closed by the reactor shutdown).
    pub connections_left: usize,
    /// Exports whose final flush failed or timed out, with why.
    pub flush_failures: Vec<String>,
    /// I/Os the reactor shutdown had to fail (0 after a clean drain).
    pub failed_ios: u64,
    /// Reactors that panicked.
    pub panics: Vec<String>,
}

impl<P: Protocol, S: HasShard<P>> Service<P, S> {
    /// Stops gracefully: stops accepting, lets every connection finish the requests it has
    /// in flight and send their replies (reading no new ones), closes it, flushes every
    /// export, then stops the reactors.
    pub fn stop(mut self) -> StopReport {
        self.stop_inner()
    }

    pub(crate) fn stop_inner(&mut self) -> StopReport {
        let mut report = StopReport::default();
        let Some(set) = self.set.take() else {
            return report;
        };
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.listener.take() {
            let _ = t.join();
        }
        report.connections_left = self.drain(&set);
        self.flush_exports(&set, &mut report);
        self.endpoint = None;
        let shutdown = set.shutdown();
        report.failed_ios = shutdown.exits.iter().map(|e| e.failed_ios).sum();
        report.panics = shutdown.panics.iter().map(|p| p.to_string()).collect();
        assert!(self.set.is_none() && self.listener.is_none() && self.endpoint.is_none());
        report
    }

    /// Asks every reactor to stop reading requests and close connections as they finish;
    /// waits for them up to [`DRAIN_TIMEOUT`]. Returns the connections still open.
    fn drain(&self, set: &ReactorSet<S>) -> usize {
        for h in set.handles().iter() {
            let _ = h.send(|_, state: &mut S| state.shard().drain());
        }
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        while self.open.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            std::thread::sleep(DRAIN_CHECK_PERIOD);
        }
        self.open.load(Ordering::Acquire)
    }

    /// Flushes every export from the first reactor (a flush covers the whole device), and
    /// waits for the answers up to [`FLUSH_TIMEOUT`].
    fn flush_exports(&self, set: &ReactorSet<S>, report: &mut StopReport) {
        let (tx, rx) = mpsc::channel();
        for (i, name) in self.export_names.iter().enumerate() {
            let tx = tx.clone();
            let name = name.clone();
            let asked_for = name.clone();
            let sent = set.handles()[0].send(move |r, _| {
                let dev = DeviceId::from_index(i as u16);
                let name2 = name.clone();
                let tx2 = tx.clone();
                let submitted = r.flush(dev, move |_, _, done: IoDone| {
                    let _ = tx2.send(done.result.map_err(|e| format!("{name2}: flush: {e}")));
                });
                if let Err(e) = submitted {
                    let _ = tx.send(Err(format!("{name}: flush refused: {e}")));
                }
            });
            if let Err(e) = sent {
                report
                    .flush_failures
                    .push(format!("{asked_for}: could not ask for a flush: {e}"));
            }
        }
        drop(tx);
        let deadline = Instant::now() + FLUSH_TIMEOUT;
        let mut answered = report.flush_failures.len();
        while answered < self.export_names.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(Ok(())) => answered += 1,
                Ok(Err(e)) => {
                    report.flush_failures.push(e);
                    answered += 1;
                }
                Err(_) => {
                    report
                        .flush_failures
                        .push("the final flush did not finish in time".into());
                    break;
                }
            }
        }
    }
}
