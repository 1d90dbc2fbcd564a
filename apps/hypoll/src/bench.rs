//! `hypoll bench`: runs one workload per policy on a fresh reactor set and device, and
//! measures IOPS, CPU from the OS and latency, side by side. The workload is driven by
//! completion callbacks, or by tasks (`--api async`, in `bench_async`). The verify pass
//! after a run is in `bench_verify`, and two policies taking turns in `bench_alternate`.

use std::time::Duration;

use crossbeam_channel::Sender;
use hdrhistogram::Histogram;
use hypoll_async::Executor;
use hypoll_nvme::{DeviceConfig, IoBuf};
use hypoll_reactor::{
    CoreList, Device, DeviceId, IoDone, IoOp, IoRequest, PolicyFactory, Reactor, ReactorConfig,
    ReactorSet,
};

use crate::alternate::Tally;
use crate::bench_verify::Verify;

/// Histogram bounds: 1 ns to 60 s at 3 significant digits.
const LATENCY_NS_MAX: u64 = 60_000_000_000;
/// How long the bench waits for a reactor's report beyond the run's own length.
pub(crate) const REPORT_GRACE: Duration = Duration::from_secs(30);

/// The access pattern (named as fio names them, hence `RandRw`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)]
pub enum Rw {
    RandRead,
    RandWrite,
    Read,
    Write,
    /// Random, this percent reads.
    RandRw {
        read_pct: u8,
    },
}

impl std::str::FromStr for Rw {
    type Err = String;

    fn from_str(s: &str) -> Result<Rw, String> {
        Ok(match s {
            "randread" => Rw::RandRead,
            "randwrite" => Rw::RandWrite,
            "read" => Rw::Read,
            "write" => Rw::Write,
            _ => match s.strip_prefix("randrw:").map(str::parse::<u8>) {
                Some(Ok(read_pct)) if read_pct <= 100 => Rw::RandRw { read_pct },
                _ => {
                    return Err(format!(
                        "{s:?}: expected randread, randwrite, read, write or randrw:<read %> \
                         (0 to 100)"
                    ))
                }
            },
        })
    }
}

impl std::fmt::Display for Rw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rw::RandRead => write!(f, "randread"),
            Rw::RandWrite => write!(f, "randwrite"),
            Rw::Read => write!(f, "read"),
            Rw::Write => write!(f, "write"),
            Rw::RandRw { read_pct } => write!(f, "randrw:{read_pct}"),
        }
    }
}

/// How the workload is written: completion callbacks on the reactor, or `async` tasks
/// (`hypoll-async`), one per I/O in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Callback,
    Async,
}

impl std::str::FromStr for Api {
    type Err = String;

    fn from_str(s: &str) -> Result<Api, String> {
        match s {
            "callback" => Ok(Api::Callback),
            "async" => Ok(Api::Async),
            _ => Err(format!("{s:?}: expected callback or async")),
        }
    }
}

impl std::fmt::Display for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Api::Callback => "callback",
            Api::Async => "async",
        })
    }
}

/// Everything one run needs.
#[derive(Clone, Debug)]
pub struct Workload {
    pub device: DeviceConfig,
    /// What the opened device says of itself (for io_uring: how completions are found).
    pub device_described: String,
    pub rw: Rw,
    pub api: Api,
    pub bs_bytes: u64,
    pub qd: usize,
    pub cores: CoreList,
    pub ramp: Duration,
    pub runtime: Duration,
    pub size_bytes: u64,
    pub verify: bool,
    /// `--alternate`: two policies take turns in segments of this length.
    pub alternate: Option<Duration>,
}

/// One policy's run, summed over its reactors.
#[derive(Clone, Debug)]
pub struct RunResult {
    pub policy: String,
    pub ios: u64,
    pub errors: u64,
    pub wall_ns: u64,
    /// CPU time of all reactor threads over the measured window, from the OS, and of
    /// io_uring's submission threads and workers where the device has them.
    pub cpu_ns: u64,
    pub cores: usize,
    pub latency: Histogram<u64>,
    pub sleeps: u64,
    pub interrupt_waits: u64,
    pub overshoot_ns: u64,
    /// Sum of the sleeps' requested lengths.
    pub slept_ns: u64,
    pub mismatches: u64,
}

impl RunResult {
    /// Adds `t`'s counts, CPU and latencies; not its wall time, which each caller combines
    /// as its runs were laid out.
    pub(crate) fn add_counts(&mut self, t: &Totals) {
        self.ios += t.ios;
        self.errors += t.errors;
        self.cpu_ns += t.cpu_ns;
        self.sleeps += t.sleeps;
        self.interrupt_waits += t.interrupt_waits;
        self.overshoot_ns += t.overshoot_ns;
        self.slept_ns += t.slept_ns;
        self.latency.add(&t.latency).expect("same bounds");
    }

    /// A run of `policy` on `cores` reactors with nothing counted yet.
    pub(crate) fn empty(policy: String, cores: usize) -> RunResult {
        RunResult {
            policy,
            ios: 0,
            errors: 0,
            wall_ns: 0,
            cpu_ns: 0,
            cores,
            latency: Histogram::new_with_bounds(1, LATENCY_NS_MAX, 3).expect("valid bounds"),
            sleeps: 0,
            interrupt_waits: 0,
            overshoot_ns: 0,
            slept_ns: 0,
            mismatches: 0,
        }
    }

    pub fn iops(&self) -> f64 {
        self.ios as f64 * 1e9 / self.wall_ns.max(1) as f64
    }

    /// CPU per core: reactor CPU time over wall time times cores.
    pub fn cpu_pct(&self) -> f64 {
        100.0 * self.cpu_ns as f64 / (self.wall_ns.max(1) as f64 * self.cores as f64)
    }

    pub fn iops_per_cpu_pct(&self) -> f64 {
        self.iops() / self.cpu_pct().max(1e-9)
    }

    pub fn mean_ns(&self) -> f64 {
        self.latency.mean()
    }

    pub fn quantile_ns(&self, q: f64) -> u64 {
        self.latency.value_at_quantile(q)
    }
}

/// Totals over a run: one reactor's, or under `--alternate` one side's of a reactor.
pub(crate) struct Totals {
    pub ios: u64,
    pub errors: u64,
    pub wall_ns: u64,
    pub cpu_ns: u64,
    pub latency: Histogram<u64>,
    pub sleeps: u64,
    pub interrupt_waits: u64,
    pub overshoot_ns: u64,
    pub slept_ns: u64,
}

impl Totals {
    pub(crate) fn new(latency_ns_max: u64) -> Totals {
        Totals {
            ios: 0,
            errors: 0,
            wall_ns: 0,
            cpu_ns: 0,
            latency: Histogram::new_with_bounds(1, latency_ns_max, 3).expect("valid bounds"),
            sleeps: 0,
            interrupt_waits: 0,
            overshoot_ns: 0,
            slept_ns: 0,
        }
    }
}

/// What one reactor measured.
struct ReactorReport {
    totals: Totals,
    alternation: Option<Tally>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Ramp,
    Measure,
    Drain,
}

/// Each reactor's state: the workload it runs, then the verify pass (`--verify`). The
/// completion callbacks are handed it, so they capture nothing and cost no allocation per
/// I/O. Under `--api async` it holds the reactor's executor.
#[derive(Default)]
pub(crate) struct Bench {
    pub(crate) job: Option<Job>,
    pub(crate) verify: Option<Verify>,
    pub(crate) executor: Option<Executor<Bench>>,
}

pub(crate) type BenchReactor = Reactor<Bench>;

/// A reactor's workload.
pub(crate) struct Job {
    pub(crate) phase: Phase,
    rw: Rw,
    pub(crate) nlb: u32,
    span_ios: u64,
    base_ios: u64,
    next_seq: u64,
    rng: u64,
    ios: u64,
    errors: u64,
    latency: Histogram<u64>,
    start_ns: u64,
    cpu_start_ns: u64,
    sleeps_start: u64,
    waits_start: u64,
    overshoot_start: u64,
    slept_start: u64,
    wall_ns: u64,
    cpu_ns: u64,
    sleeps: u64,
    waits: u64,
    overshoot_ns: u64,
    slept_ns: u64,
    /// Under `--alternate`: the account per policy and per segment.
    alternation: Option<Tally>,
    report: Option<Sender<ReactorReport>>,
}

impl Job {
    /// xorshift64*: enough spread for block addresses, one multiply per I/O.
    fn next_random(&mut self) -> u64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Counts a completed I/O, seen at `now_ns`, while measuring: its latency if it
    /// succeeded.
    pub(crate) fn record(&mut self, ok: bool, latency_ns: u64, now_ns: u64) {
        if self.phase == Phase::Measure {
            self.ios += 1;
            if ok {
                self.latency.saturating_record(latency_ns.max(1));
            } else {
                self.errors += 1;
            }
            if let Some(tally) = &mut self.alternation {
                tally.record(now_ns.saturating_sub(latency_ns), ok, latency_ns);
            }
        }
    }

    /// The next I/O: its operation and first block.
    pub(crate) fn next_io(&mut self) -> (IoOp, u64) {
        let (random, read_pct) = match self.rw {
            Rw::RandRead => (true, 100),
            Rw::RandWrite => (true, 0),
            Rw::Read => (false, 100),
            Rw::Write => (false, 0),
            Rw::RandRw { read_pct } => (true, read_pct),
        };
        let index = if random {
            self.next_random() % self.span_ios
        } else {
            self.next_seq = (self.next_seq + 1) % self.span_ios;
            self.next_seq
        };
        let read = match read_pct {
            100 => true,
            0 => false,
            pct => self.next_random() % 100 < u64::from(pct),
        };
        let op = if read { IoOp::Read } else { IoOp::Write };
        (op, (self.base_ios + index) * u64::from(self.nlb))
    }
}

fn submit_next(r: &mut BenchReactor, s: &mut Bench, buf: IoBuf) {
    let job = s.job.as_mut().expect("a job runs on this reactor");
    let (op, slba) = job.next_io();
    let nlb = job.nlb;
    if let Err(rejected) = r.submit(
        DeviceId::FIRST,
        IoRequest::new(op, slba, nlb),
        Some(buf),
        on_done,
    ) {
        panic!("bench: a slot just freed refused an I/O: {rejected}");
    }
}

/// Completion callback: count, record, and keep the queue full until the run ends.
fn on_done(r: &mut BenchReactor, s: &mut Bench, done: IoDone) {
    let job = s.job.as_mut().expect("a job runs on this reactor");
    job.record(done.result.is_ok(), done.latency_ns, r.now_ns());
    let resubmit = job.phase != Phase::Drain;
    let buf = done.buf.expect("reads and writes return their buffer");
    if resubmit {
        submit_next(r, s, buf);
    } else if r.outstanding() == 0 {
        finish(s);
    }
}

/// CPU time of this reactor's thread alone, as `--alternate`'s cuts read it: without the
/// walk through /proc that the io_uring threads take.
fn thread_cpu_ns(r: &BenchReactor) -> u64 {
    r.handles()[r.index()].cpu_ns().unwrap_or(0)
}

/// CPU time of this reactor's thread. Reactor 0 also carries the process's io_uring
/// threads: submission threads (`uring:...,sqpoll=on`) and the workers that make what a
/// ring cannot make in the reactor's thread (buffered reads that miss the page cache, every
/// read of a file system that refuses non-blocking ones). They run no reactor code, but
/// they are what the rings cost, and leaving them out would make that work look free.
fn reactor_cpu_ns(r: &BenchReactor) -> u64 {
    let own_ns = r.handles()[r.index()].cpu_ns().unwrap_or(0);
    if r.index() == 0 {
        own_ns + hypoll_nvme::io_uring_threads_cpu_ns()
    } else {
        own_ns
    }
}

fn begin_measure(r: &mut BenchReactor, s: &mut Bench) {
    let (now, cpu, c) = (r.now_ns(), reactor_cpu_ns(r), *r.counters());
    {
        let job = s.job.as_mut().expect("job");
        job.phase = Phase::Measure;
        job.start_ns = now;
        job.cpu_start_ns = cpu;
        job.sleeps_start = c.sleeps;
        job.waits_start = c.interrupt_waits;
        job.overshoot_start = c.overshoot_ns;
        job.slept_start = c.slept_ns;
        if let Some(tally) = &mut job.alternation {
            let end_ns = tally.open(now, thread_cpu_ns(r), c);
            r.after(Duration::from_nanos(end_ns - now), segment_cut);
        }
    }
}

/// Under `--alternate`: ends one segment and begins the next, until the run ends. The
/// segments count the reactor thread's CPU only (not an io_uring thread's).
fn segment_cut(r: &mut BenchReactor, s: &mut Bench) {
    let (now, cpu, c) = (r.now_ns(), thread_cpu_ns(r), *r.counters());
    let Some(job) = s.job.as_mut().filter(|j| j.phase == Phase::Measure) else {
        return;
    };
    if let Some(tally) = &mut job.alternation {
        let end_ns = tally.cut(now, cpu, c);
        r.after(
            Duration::from_nanos(end_ns.saturating_sub(now)),
            segment_cut,
        );
    }
}

fn end_measure(r: &mut BenchReactor, s: &mut Bench) {
    let (now, cpu, c) = (r.now_ns(), reactor_cpu_ns(r), *r.counters());
    {
        let job = s.job.as_mut().expect("job");
        job.phase = Phase::Drain;
        job.wall_ns = now - job.start_ns;
        job.cpu_ns = cpu.saturating_sub(job.cpu_start_ns);
        job.sleeps = c.sleeps - job.sleeps_start;
        job.waits = c.interrupt_waits - job.waits_start;
        job.overshoot_ns = c.overshoot_ns - job.overshoot_start;
        job.slept_ns = c.slept_ns - job.slept_start;
        if let Some(tally) = &mut job.alternation {
            tally.close(now, thread_cpu_ns(r), c);
        }
    }
    if r.outstanding() == 0 {
        finish(s);
    }
}

/// Sends this reactor's report, once.
pub(crate) fn finish(s: &mut Bench) {
    if let Some(mut job) = s.job.take() {
        if let Some(tx) = job.report.take() {
            let _ = tx.send(ReactorReport {
                totals: Totals {
                    ios: job.ios,
                    errors: job.errors,
                    wall_ns: job.wall_ns,
                    cpu_ns: job.cpu_ns,
                    latency: job.latency,
                    sleeps: job.sleeps,
                    interrupt_waits: job.waits,
                    overshoot_ns: job.overshoot_ns,
                    slept_ns: job.slept_ns,
                },
                alternation: job.alternation,
            });
        }
    }
}

/// Runs `work` under `policy` on a fresh device and reactor set.
pub fn run_policy(work: &Workload, policy: &str) -> Result<RunResult, String> {
    run(work, policy, None).map(|(total, _)| total)
}

/// Runs `work` under `policy` (the policy's spec, or a label when `custom` builds it) on
/// a fresh device and reactor set; with the reactors' alternation tallies under
/// `--alternate`.
pub(crate) fn run(
    work: &Workload,
    policy: &str,
    custom: Option<PolicyFactory>,
) -> Result<(RunResult, Vec<Tally>), String> {
    let ctrl = work
        .device
        .open()
        .map_err(|e| format!("opening {}: {e}", work.device))?;
    let ns = ctrl.namespace();
    let device = Device::new(ctrl);
    let (qd, api) = (work.qd, work.api);
    let cfg = ReactorConfig {
        cores: Some(work.cores.clone()),
        policy: policy.to_string(),
        custom_policy: custom,
        ..ReactorConfig::default()
    };
    let set = ReactorSet::start(cfg, move |r| {
        r.attach(&device, qd)?;
        let executor = match api {
            Api::Callback => None,
            Api::Async => Some(Executor::install(r)?),
        };
        Ok(Bench {
            executor,
            ..Bench::default()
        })
    })
    .map_err(|e| format!("starting reactors for {policy}: {e}"))?;
    let lba = u64::from(ns.lba_size_bytes);
    let nlb = (work.bs_bytes / lba) as u32;
    let reactors = set.handles().len() as u64;
    let span_ios = (work.size_bytes.min(ns.capacity_bytes()) / work.bs_bytes).max(1);
    // Each reactor works in its own slice of the span, so sequential streams do not overlap.
    let per_reactor_ios = (span_ios / reactors).max(1);
    let (tx, rx) = crossbeam_channel::unbounded();
    for h in set.handles().iter() {
        let tx = tx.clone();
        let (rw, ramp, runtime, bs) = (work.rw, work.ramp, work.runtime, work.bs_bytes);
        let alternation = work
            .alternate
            .map(|segment| Tally::new(segment, runtime, LATENCY_NS_MAX));
        let index = h.index() as u64;
        h.send(move |r, s| {
            {
                s.job = Some(Job {
                    phase: Phase::Ramp,
                    rw,
                    nlb,
                    span_ios: per_reactor_ios,
                    base_ios: index * per_reactor_ios,
                    next_seq: 0,
                    rng: 0x9e37_79b9_7f4a_7c15 ^ (index + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9),
                    ios: 0,
                    errors: 0,
                    latency: Histogram::new_with_bounds(1, LATENCY_NS_MAX, 3)
                        .expect("valid histogram bounds"),
                    start_ns: 0,
                    cpu_start_ns: 0,
                    sleeps_start: 0,
                    waits_start: 0,
                    overshoot_start: 0,
                    slept_start: 0,
                    wall_ns: 0,
                    cpu_ns: 0,
                    sleeps: 0,
                    waits: 0,
                    overshoot_ns: 0,
                    slept_ns: 0,
                    alternation,
                    report: Some(tx),
                });
            }
            r.after(ramp, begin_measure);
            r.after(ramp + runtime, end_measure);
            for _ in 0..qd {
                let mut buf = IoBuf::pinned(bs as usize);
                buf.fill(0x5a);
                match api {
                    Api::Callback => submit_next(r, s, buf),
                    Api::Async => crate::bench_async::spawn_worker(r, s, buf),
                }
            }
        })
        .map_err(|e| format!("starting the workload: {e}"))?;
    }
    drop(tx);
    let mut total = RunResult::empty(policy.to_string(), reactors as usize);
    let wait = work.ramp + work.runtime + REPORT_GRACE;
    let mut tallies = Vec::new();
    for _ in 0..reactors {
        let rep = rx
            .recv_timeout(wait)
            .map_err(|_| format!("{policy}: a reactor did not report within {wait:?}"))?;
        // The reactors ran side by side: the run lasted as long as the longest.
        total.add_counts(&rep.totals);
        total.wall_ns = total.wall_ns.max(rep.totals.wall_ns);
        tallies.extend(rep.alternation);
    }
    if work.verify {
        total.mismatches = crate::bench_verify::verify(&set, work, nlb, per_reactor_ios)?;
    }
    let report = set.shutdown();
    if let Some(p) = report.panics.first() {
        return Err(format!("{policy}: {p}"));
    }
    Ok((total, tallies))
}
