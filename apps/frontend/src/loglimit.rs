//! A bound on how fast one source may log: a client that reconnects in a loop, or floods a
//! full server, must not turn the log into its amplifier (one line per attempt can be
//! hundreds of thousands a second, and a full disk or a slow terminal then stalls the
//! server itself).

use std::cell::Cell;
use std::time::Instant;

/// Lines one source may log per window; the rest are counted, and the count is told with
/// the first line logged in a later window.
pub const LOG_LINES_PER_WINDOW_MAX: u32 = 20;
/// The window over which [`LOG_LINES_PER_WINDOW_MAX`] counts, in ms.
pub const LOG_WINDOW_MS: u64 = 1_000;

/// One source's log budget. Interior mutability: logging happens from `&self` methods.
#[derive(Debug)]
pub struct LogLimit {
    window_start: Cell<Option<Instant>>,
    logged: Cell<u32>,
    suppressed: Cell<u64>,
}

impl Default for LogLimit {
    fn default() -> Self {
        LogLimit {
            window_start: Cell::new(None),
            logged: Cell::new(0),
            suppressed: Cell::new(0),
        }
    }
}

impl LogLimit {
    /// Whether a line may be logged at `now`: `Some(n)` with the lines suppressed since the
    /// last one logged (to tell in it), `None` to drop it (it is counted).
    pub fn admit(&self, now: Instant) -> Option<u64> {
        let window_over = self.window_start.get().is_none_or(|start| {
            now.saturating_duration_since(start).as_millis() >= u128::from(LOG_WINDOW_MS)
        });
        if window_over {
            self.window_start.set(Some(now));
            self.logged.set(0);
        }
        if self.logged.get() >= LOG_LINES_PER_WINDOW_MAX {
            self.suppressed.set(self.suppressed.get() + 1);
            return None;
        }
        self.logged.set(self.logged.get() + 1);
        debug_assert!(self.logged.get() <= LOG_LINES_PER_WINDOW_MAX);
        Some(self.suppressed.replace(0))
    }
}

/// What a line logged after `suppressed` dropped ones adds to say so.
pub fn suppressed_note(suppressed: u64) -> String {
    if suppressed == 0 {
        String::new()
    } else {
        format!(" ({suppressed} similar lines were not logged: at most {LOG_LINES_PER_WINDOW_MAX} a second)")
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_flood_logs_the_bound_per_window_and_then_says_how_many_it_dropped() {
        let limit = LogLimit::default();
        let t0 = Instant::now();
        let admitted = (0..10_000)
            .filter(|i| limit.admit(t0 + Duration::from_micros(*i)).is_some())
            .count();
        assert_eq!(admitted, LOG_LINES_PER_WINDOW_MAX as usize);
        let next = t0 + Duration::from_millis(LOG_WINDOW_MS);
        let dropped = 10_000 - u64::from(LOG_LINES_PER_WINDOW_MAX);
        assert_eq!(
            limit.admit(next),
            Some(dropped),
            "the next window tells the count"
        );
        assert_eq!(limit.admit(next), Some(0), "once");
        assert!(suppressed_note(dropped).contains(&format!("{dropped} similar lines")));
        assert_eq!(suppressed_note(0), "");
    }
}
