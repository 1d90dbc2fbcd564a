//! `hypoll bench --alternate MS`: two policies on one reactor, taking turns in segments of
//! MS milliseconds within one run, each keeping its own state across its turns.
//!
//! A device whose latency drifts over seconds (a virtio disk on a shared host) moves two
//! separate runs apart by more than the difference between two good policies. Taking turns
//! every few hundred milliseconds puts both under the same drift, and comparing each of the
//! second policy's segments with the mean of the first's on either side of it cancels
//! drift that is linear over three segments. What a policy does to the segment after its
//! own (a cold cache, a host that took the core back while it slept) falls on the other
//! policy: the comparison is fair only where that carry-over is small against the
//! difference sought.
//!
//! Time is cut at fixed multiples of the segment on the reactor's clock, so the policy
//! that decides for an I/O, and the side its latency is counted on, follow from the time
//! the I/O was submitted. Each policy keeps its own state across its turns, and is shown
//! statistics of its own turns only (the latencies of its I/Os, the overshoots of its
//! sleeps), not the reactor's, which mix the two. State a policy keeps by the wall clock
//! (a probe due every so many milliseconds) sees the other's turns as time passing: such a
//! policy behaves alike only where the segment is long against those periods.

use std::time::Duration;

use hypoll_policy::{
    Arrival, Decision, DeviceStats, IdleContext, Observation, PollContext, PollPolicy, Slept,
    StatsRecorder,
};
use hypoll_reactor::Counters;

use crate::bench::Totals;

/// The shortest segment `--alternate` takes: many times the reactor's timer resolution,
/// and thousands of I/Os on a microsecond-class device. (A policy that reads the published
/// statistics sees them refreshed once per statistics window, whatever the segment.)
pub const SEGMENT_MS_MIN: u64 = 10;
/// The longest segment `--alternate` takes.
pub const SEGMENT_MS_MAX: u64 = 60_000;
/// The most segments one run may keep (what `--runtime` over `--alternate` may be).
pub const SEGMENTS_MAX: u64 = 1 << 20;
/// Consecutive comparisons averaged into one batch for the standard error: neighbouring
/// comparisons share a segment, so they are not independent, while batches nearly are.
const BATCH: usize = 8;
/// Whole batches needed before a standard error is given: with fewer, the scatter of the
/// batch means says little about it.
const BATCHES_MIN: usize = 5;

/// The side (0 or 1) that owns time `at_ns`.
#[inline]
pub fn side_of(at_ns: u64, segment_ns: u64) -> usize {
    ((at_ns / segment_ns) % 2) as usize
}

/// Two policies as one: each call goes to the policy whose segment the I/O concerned was
/// submitted in (a completion, a decision for the oldest I/O), or whose segment it is now.
pub struct Alternating {
    name: String,
    sides: [Box<dyn PollPolicy>; 2],
    segment_ns: u64,
    /// The side that made the last decision: the one a sleep it asked for is reported to.
    last_side: usize,
    /// Each side's statistics, from its own completions and sleeps, in place of the
    /// reactor's (which also hold the other side's). They cover every device of the
    /// reactor together, and count failed I/Os too (a policy is not told the status).
    /// Built at the first call, on the reactor's clock.
    stats: Option<[StatsRecorder; 2]>,
}

impl Alternating {
    pub fn new(sides: [Box<dyn PollPolicy>; 2], segment: Duration) -> Alternating {
        let segment_ns = u64::try_from(segment.as_nanos()).unwrap_or(u64::MAX);
        assert!(segment_ns > 0, "a segment has a length");
        let name = format!("{}|{}", sides[0].name(), sides[1].name());
        Alternating {
            name,
            sides,
            segment_ns,
            last_side: 0,
            stats: None,
        }
    }
}

/// The sides' statistics, built at `now_ns` if they are not yet.
fn side_stats(stats: &mut Option<[StatsRecorder; 2]>, now_ns: u64) -> &mut [StatsRecorder; 2] {
    stats.get_or_insert_with(|| [(); 2].map(|()| DeviceStats::new().recorder(now_ns)))
}

impl PollPolicy for Alternating {
    fn name(&self) -> &str {
        &self.name
    }

    fn decide(&mut self, ctx: &PollContext<'_>) -> Decision {
        let side = side_of(ctx.oldest.submit_ns, self.segment_ns);
        self.last_side = side;
        let own = &mut side_stats(&mut self.stats, ctx.now_ns)[side];
        own.tick(ctx.now_ns);
        let ctx = PollContext {
            stats: own.snapshot(),
            overshoot: own.overshoot(),
            ..*ctx
        };
        self.sides[side].decide(&ctx)
    }

    fn on_completion(&mut self, seen: &Observation) {
        let side = side_of(seen.submit_ns, self.segment_ns);
        let seen_ns = seen.submit_ns + seen.latency_ns;
        let own = &mut side_stats(&mut self.stats, seen_ns)[side];
        if let Some(bucket) = seen.bucket {
            own.record(bucket, seen.latency_ns);
        }
        own.tick(seen_ns);
        self.sides[side].on_completion(seen);
    }

    fn on_sleep(&mut self, slept: &Slept, cpu_ns: Option<u64>) {
        if let Some(stats) = &mut self.stats {
            stats[self.last_side].record_sleep(slept.requested_ns, slept.actual_ns);
        }
        self.sides[self.last_side].on_sleep(slept, cpu_ns);
    }

    fn on_arrivals(&mut self, arrival: &Arrival) {
        self.sides[side_of(arrival.now_ns, self.segment_ns)].on_arrivals(arrival);
    }

    fn decide_idle(&mut self, ctx: &IdleContext) -> Duration {
        self.sides[side_of(ctx.now_ns, self.segment_ns)].decide_idle(ctx)
    }
}

/// One segment as one reactor measured it; `index` is its start over the segment length,
/// so segments of several reactors with the same index cover the same time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Segment {
    pub index: u64,
    pub ios: u64,
    pub latency_sum_ns: u64,
    pub wall_ns: u64,
    pub cpu_ns: u64,
}

impl Segment {
    pub fn side(&self) -> usize {
        (self.index % 2) as usize
    }

    fn mean_ns(&self) -> f64 {
        self.latency_sum_ns as f64 / self.ios as f64
    }

    fn cpu_pct(&self) -> f64 {
        100.0 * self.cpu_ns as f64 / self.wall_ns as f64
    }
}

/// Where the open segment started.
#[derive(Clone, Copy)]
struct Mark {
    at_ns: u64,
    cpu_ns: u64,
    counters: Counters,
}

/// A reactor's account of an alternating run: per side, and per segment.
pub struct Tally {
    segment_ns: u64,
    pub sides: [Totals; 2],
    /// Closed segments, oldest first: at most the count the run was built for (the
    /// capacity reserved by [`Tally::new`]; later ones are not kept).
    pub segments: Vec<Segment>,
    open: Segment,
    mark: Option<Mark>,
}

impl Tally {
    /// A tally for a run of `runtime`, with room for every segment it holds.
    pub fn new(segment: Duration, runtime: Duration, latency_ns_max: u64) -> Tally {
        let segment_ns = u64::try_from(segment.as_nanos()).unwrap_or(u64::MAX);
        assert!(segment_ns > 0, "a segment has a length");
        let room = runtime.as_nanos() / u128::from(segment_ns) + 2;
        Tally {
            segment_ns,
            sides: [Totals::new(latency_ns_max), Totals::new(latency_ns_max)],
            segments: Vec::with_capacity(usize::try_from(room).unwrap_or(usize::MAX)),
            open: Segment::default(),
            mark: None,
        }
    }

    /// Opens the segment that holds `at_ns`; returns when it ends.
    pub fn open(&mut self, at_ns: u64, cpu_ns: u64, counters: Counters) -> u64 {
        self.open_index(at_ns / self.segment_ns, at_ns, cpu_ns, counters)
    }

    fn open_index(&mut self, index: u64, at_ns: u64, cpu_ns: u64, counters: Counters) -> u64 {
        self.open = Segment {
            index,
            ..Segment::default()
        };
        self.mark = Some(Mark {
            at_ns,
            cpu_ns,
            counters,
        });
        (index + 1) * self.segment_ns
    }

    /// Closes the open segment at `at_ns`: its time, CPU and counters go to its side. A
    /// close that comes late (a reactor kept from running past the segment's end) charges
    /// the time until it to the closing side: there is no reading of the CPU in between.
    pub fn close(&mut self, at_ns: u64, cpu_ns: u64, counters: Counters) {
        let Some(mark) = self.mark.take() else {
            return;
        };
        let mut seg = self.open;
        seg.wall_ns = at_ns.saturating_sub(mark.at_ns);
        seg.cpu_ns = cpu_ns.saturating_sub(mark.cpu_ns);
        let side = &mut self.sides[seg.side()];
        side.wall_ns += seg.wall_ns;
        side.cpu_ns += seg.cpu_ns;
        side.sleeps += counters.sleeps - mark.counters.sleeps;
        side.interrupt_waits += counters.interrupt_waits - mark.counters.interrupt_waits;
        side.overshoot_ns += counters.overshoot_ns - mark.counters.overshoot_ns;
        side.slept_ns += counters.slept_ns - mark.counters.slept_ns;
        if self.segments.len() < self.segments.capacity() {
            self.segments.push(seg);
        }
    }

    /// Closes the open segment at `at_ns` and opens the next: the one after it, or the
    /// one that holds `at_ns` if the cut came a whole segment late. Returns when it ends.
    pub fn cut(&mut self, at_ns: u64, cpu_ns: u64, counters: Counters) -> u64 {
        let next = (self.open.index + 1).max(at_ns / self.segment_ns);
        self.close(at_ns, cpu_ns, counters);
        self.open_index(next, at_ns, cpu_ns, counters)
    }

    /// A completed I/O submitted at `submit_ns`, counted on its side, and in its segment
    /// if that is the open one or the one just closed (an I/O in flight across a cut).
    pub fn record(&mut self, submit_ns: u64, ok: bool, latency_ns: u64) {
        let index = submit_ns / self.segment_ns;
        let side = &mut self.sides[(index % 2) as usize];
        side.ios += 1;
        if !ok {
            side.errors += 1;
            return;
        }
        side.latency.saturating_record(latency_ns.max(1));
        let seg = if self.mark.is_some() && self.open.index == index {
            Some(&mut self.open)
        } else {
            self.segments.last_mut().filter(|s| s.index == index)
        };
        if let Some(seg) = seg {
            seg.ios += 1;
            seg.latency_sum_ns += latency_ns;
        }
    }
}

/// Segments of several reactors summed by index, in order of index.
pub fn merge(all: impl IntoIterator<Item = Segment>) -> Vec<Segment> {
    let mut merged: std::collections::BTreeMap<u64, Segment> = Default::default();
    for seg in all {
        let m = merged.entry(seg.index).or_insert(Segment {
            index: seg.index,
            ..Segment::default()
        });
        m.ios += seg.ios;
        m.latency_sum_ns += seg.latency_sum_ns;
        m.wall_ns += seg.wall_ns;
        m.cpu_ns += seg.cpu_ns;
    }
    merged.into_values().collect()
}

/// Side 1 against side 0, from each side-1 segment against the mean of the side-0 segments
/// either side of it (on logarithms for latency, in CPU points for CPU).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Paired {
    /// Comparisons made: side-1 segments with a whole side-0 segment either side.
    pub comparisons: usize,
    /// Side 1's mean latency over side 0's: the geometric mean of the comparisons.
    pub latency_ratio: f64,
    /// Standard error of the latency ratio's logarithm (about its relative error), from
    /// batches of consecutive comparisons; `None` with fewer than [`BATCHES_MIN`] batches.
    pub latency_log_se: Option<f64>,
    /// Side 1's CPU less side 0's, in points of a core per reactor.
    pub cpu_points: f64,
    /// Standard error of `cpu_points`, as for the latency.
    pub cpu_points_se: Option<f64>,
}

/// Compares the sides over merged segments ([`merge`]) of `reactors` reactors. A segment
/// shorter than half the segment length (the run's first and last) or without a completed
/// I/O takes no part. `None` if no comparison can be made.
pub fn paired(segments: &[Segment], segment_ns: u64, reactors: usize) -> Option<Paired> {
    let whole = |s: &Segment| s.ios > 0 && s.wall_ns >= segment_ns / 2 * reactors as u64;
    let mut lat = Vec::new();
    let mut cpu = Vec::new();
    for w in segments.windows(3) {
        let [before, mid, after] = [&w[0], &w[1], &w[2]];
        let consecutive = before.index + 1 == mid.index && mid.index + 1 == after.index;
        if mid.side() != 1 || !consecutive || ![before, mid, after].into_iter().all(whole) {
            continue;
        }
        lat.push(mid.mean_ns().ln() - (before.mean_ns().ln() + after.mean_ns().ln()) / 2.0);
        cpu.push(mid.cpu_pct() - (before.cpu_pct() + after.cpu_pct()) / 2.0);
    }
    if lat.is_empty() {
        return None;
    }
    let (lat_mean, latency_log_se) = mean_and_batch_se(&lat);
    let (cpu_points, cpu_points_se) = mean_and_batch_se(&cpu);
    Some(Paired {
        comparisons: lat.len(),
        latency_ratio: lat_mean.exp(),
        latency_log_se,
        cpu_points,
        cpu_points_se,
    })
}

/// The mean, and its standard error from the means of whole batches of [`BATCH`] (none
/// with fewer than [`BATCHES_MIN`] batches).
fn mean_and_batch_se(values: &[f64]) -> (f64, Option<f64>) {
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let batches: Vec<f64> = values
        .chunks_exact(BATCH)
        .map(|b| b.iter().sum::<f64>() / BATCH as f64)
        .collect();
    if batches.len() < BATCHES_MIN {
        return (mean, None);
    }
    let n = batches.len() as f64;
    let bmean = batches.iter().sum::<f64>() / n;
    let var = batches.iter().map(|b| (b - bmean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, Some((var / n).sqrt()))
}

#[cfg(test)]
mod tests;
