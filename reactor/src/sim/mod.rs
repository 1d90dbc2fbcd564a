//! A seeded, deterministic simulation of several reactors on one emulated controller with
//! faults on, checked against a shadow model (TigerBeetle-style).
//!
//! One run ([`run`]) builds N reactors on one thread, all on one [`EmuController`] and one
//! [`VirtualClock`], and steps them in an order drawn from the seed: submit a random read,
//! write, flush, write zeroes or deallocate on a random reactor, turn a random reactor's
//! loop, move virtual time forward. The controller injects media errors, lost commands
//! (some deaf to aborts) and controller resets; the reactors' timeouts abort, reset and, on
//! devices that cannot, abandon. Everything (workload, fault draws, interleaving, time)
//! follows from the seed, so a seed replays its run exactly. [`run_threaded`] runs the same
//! workload and checks on real reactor threads and the real clock (the scheduler then
//! picks the interleaving, so a seed does not replay exactly).
//!
//! What it checks:
//! - every accepted I/O's callback runs exactly once, within the bound its device's
//!   timeouts promise, and the reactors' counters agree;
//! - every read that succeeds returns, block by block, a value the shadow model allows;
//! - afterwards every block reads back as the model allows: the last acknowledged write,
//!   or a write whose outcome is unknown (failed, timed out, abandoned, or concurrent with
//!   the last acknowledged one).
//!
//! The shadow model. Time is a counter the simulation bumps before every submission and at
//! every callback. A write `w` has a window `[s_w, c_w]`: submitted at `s_w`, its callback at
//! `c_w` (for an abandoned write, open until its queue pair is deleted: the device may still
//! carry it out). A successful
//! write took effect on each of its blocks at one instant inside its window; a failed one at
//! most once (blocks independently: a device may tear a failed multi-block write). Write
//! zeroes and deallocate write the value "zeroes" (the emulator's deallocated blocks read
//! as zeroes). A read with window `[s_r, c_r]` may see, on a block, the value of any write
//! `w` to it (or the initial zeroes) unless `w` started after the read ended (`s_w > c_r`),
//! or some successful write `w'` certainly came between them: `s_w' > c_w` (after `w`) and
//! `c_w' < s_r` (before the read). That rule accepts every legal interleaving of
//! overlapping concurrent writes, so a failure is a real bug.

use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use hypoll_nvme::{
    Clock, Command, Completion, Controller, EmuConfig, EmuController, EmuQueuePair, IoBuf,
    NamespaceInfo, QueuePair, QueuePairError, RecoveryError, Status, SubmitError, VirtualClock,
};

use crate::io::{Device, DeviceId, DeviceOptions, IoDone, IoFailure, IoOp, IoRequest};
use crate::reactor::{mailbox, Reactor, ReactorTuning};
use crate::stats::Counters;

/// Block size of the simulated namespace.
const LBA_BYTES: usize = 512;
/// Blocks in one chunk of the emulator's memory store.
const CHUNK_BLOCKS: u64 = hypoll_nvme::emu::store::CHUNK_BYTES / LBA_BYTES as u64;
/// Largest I/O of the workload, in blocks.
const NLB_MAX: u32 = 8;
/// Most steps one run takes before it is declared hung.
const STEPS_MAX: u64 = 10_000_000;
/// How often (in steps) the run looks for an I/O that waited too long.
const HANG_CHECK_EVERY_STEPS: u64 = 1_024;
/// The threaded simulation's timeouts, in real time.
const THREADED_IO_TIMEOUT: Duration = Duration::from_millis(5);
const THREADED_STEP_TIMEOUT: Duration = Duration::from_millis(2);
/// Most I/Os the threaded simulation keeps in flight per reactor.
const THREADED_QD_MAX: usize = 8;
/// How long the threaded simulation waits for its workload before declaring it hung.
const THREADED_RUN_LIMIT: Duration = Duration::from_secs(60);
/// Attempts at reading a block back in the final check before giving up.
const FINAL_READ_ATTEMPTS: u32 = 1_000;

/// The shape of a run. The seed draws the rest: the device profile, namespace size, queue
/// depth, how far time moves per step, a factor on every fault rate (from 0.5 to 4), and
/// whether the device can abort and reset.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub reactors: usize,
    /// I/Os each reactor submits (attempts; a full queue retries later).
    pub ios_per_reactor: usize,
    /// Fault rates before the seed's factor.
    pub err_pct: f64,
    pub lost_pct: f64,
    pub stuck_pct: f64,
    pub reset_pct: f64,
    /// Per-device timeouts, in virtual time.
    pub io_timeout: Duration,
    pub abort_timeout: Duration,
    pub reset_timeout: Duration,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            reactors: 3,
            ios_per_reactor: 300,
            err_pct: 2.0,
            lost_pct: 2.0,
            stuck_pct: 30.0,
            reset_pct: 0.3,
            io_timeout: Duration::from_micros(300),
            abort_timeout: Duration::from_micros(100),
            reset_timeout: Duration::from_micros(100),
        }
    }
}

/// What a passing run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimReport {
    pub seed: u64,
    /// What the seed drew: device string, queue depth, step, recovery support.
    pub shape: String,
    pub ios: u64,
    pub io_errors: u64,
    pub queue_full: u64,
    pub io_timeouts: u64,
    pub aborts: u64,
    pub resets: u64,
    pub abandoned: u64,
    pub late_completions: u64,
    pub controller_resets: u64,
    pub reads_checked: u64,
    /// Longest time an I/O waited for its callback (virtual ns).
    pub latency_ns_max: u64,
}

/// A failed run: the seed that replays it and what went wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimFailure {
    pub seed: u64,
    pub message: String,
}

impl fmt::Display for SimFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "simulation seed {} failed: {} (replay: hypoll sim --seed {})",
            self.seed, self.message, self.seed
        )
    }
}

impl std::error::Error for SimFailure {}

impl SimReport {
    fn add(&mut self, c: &Counters) {
        self.ios += c.ios;
        self.io_errors += c.io_errors;
        self.io_timeouts += c.io_timeouts;
        self.aborts += c.aborts;
        self.resets += c.resets;
        self.abandoned += c.abandoned_ios;
        self.late_completions += c.late_completions;
    }
}

/// SplitMix64: a small, well-mixed generator, so a seed means the same run on every
/// platform and version of any crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0; the bias of the modulo is irrelevant here).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pct(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

/// One write's effect as the model sees it (write zeroes and deallocate write value 0).
#[derive(Clone, Copy, Debug)]
struct WriteRec {
    value: u64,
    start: u64,
    /// `u64::MAX` while in flight, and forever for an abandoned write.
    end: u64,
    ok: bool,
}

/// An accepted I/O.
#[derive(Clone, Debug)]
struct OpRec {
    op: IoOp,
    reactor: usize,
    slba: u64,
    nlb: u32,
    start: u64,
    start_ns: u64,
    /// Indices into `Model::writes` for its blocks (write-like ops).
    write_ids: Vec<usize>,
    callbacks: u32,
    /// The reactor accepted it (recorded before submitting, so it can be refused).
    accepted: bool,
}

/// The model, shared by every reactor's callbacks.
type Shared = Arc<parking_lot::Mutex<Model>>;

#[derive(Default)]
struct Model {
    /// The event counter: bumped before each submission and at each callback.
    tick: u64,
    ops: Vec<OpRec>,
    writes: Vec<WriteRec>,
    /// Per block, the writes to it (indices into `writes`), in submission order.
    history: Vec<Vec<usize>>,
    errors: Vec<String>,
    reads_checked: u64,
    latency_ns_max: u64,
    latency_ns_bound: u64,
}

/// The bytes of value `value` on block `lba`: zeroes for value 0, else a header naming the
/// value and the block (a misdirected write shows) and a pattern derived from both.
fn fill_block(value: u64, lba: u64, block: &mut [u8]) {
    if value == 0 {
        block.fill(0);
        return;
    }
    block[..8].copy_from_slice(&value.to_le_bytes());
    block[8..16].copy_from_slice(&lba.to_le_bytes());
    let mut x = value.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ lba;
    for byte in &mut block[16..] {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *byte = x as u8;
    }
}

/// Names a block value for messages: zeroes, or the data of the write with that I/O number.
fn value_name(value: u64) -> String {
    if value == 0 {
        "zeroes".to_string()
    } else {
        format!("the data of I/O {}", value - 1)
    }
}

/// The value a block holds, or why it holds none.
fn decode_block(lba: u64, block: &[u8]) -> Result<u64, String> {
    if block.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    let value = u64::from_le_bytes(block[..8].try_into().expect("8 bytes"));
    let mut expected = [0u8; LBA_BYTES];
    fill_block(value, lba, &mut expected);
    if value == 0 || block != &expected[..] {
        let claimed = u64::from_le_bytes(block[8..16].try_into().expect("8 bytes"));
        return Err(format!(
            "block {lba} holds bytes no write produced (header: value {value}, block \
             {claimed})"
        ));
    }
    Ok(value)
}

impl Model {
    fn bump(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Whether block `lba` may hold `value` for a read with window `[start, end]`.
    fn allows(&self, lba: u64, value: u64, start: u64, end: u64) -> bool {
        let hist = &self.history[lba as usize];
        let initial = WriteRec {
            value: 0,
            start: 0,
            end: 0,
            ok: true,
        };
        let recs = std::iter::once(initial).chain(hist.iter().map(|&i| self.writes[i]));
        for w in recs {
            if w.value != value || w.start > end {
                continue;
            }
            let overwritten = hist
                .iter()
                .map(|&i| self.writes[i])
                .any(|later| later.ok && later.start > w.end && later.end < start);
            if !overwritten {
                return true;
            }
        }
        false
    }

    /// What the model allows on block `lba` now, for a failure message.
    fn allowed_now(&self, lba: u64, start: u64, end: u64) -> Vec<u64> {
        let mut values: Vec<u64> = std::iter::once(0)
            .chain(
                self.history[lba as usize]
                    .iter()
                    .map(|&i| self.writes[i].value),
            )
            .filter(|&v| self.allows(lba, v, start, end))
            .collect();
        values.sort_unstable();
        values.dedup();
        values
    }

    /// Checks a successful read's data against the model.
    fn check_read(&mut self, slba: u64, data: &[u8], start: u64, end: u64, what: &str) {
        for (i, block) in data.chunks(LBA_BYTES).enumerate() {
            let lba = slba + i as u64;
            match decode_block(lba, block) {
                Err(e) => self.errors.push(format!("{what}: {e}")),
                Ok(value) => {
                    if !self.allows(lba, value, start, end) {
                        let allowed: Vec<String> = self
                            .allowed_now(lba, start, end)
                            .into_iter()
                            .map(value_name)
                            .collect();
                        self.errors.push(format!(
                            "{what}: block {lba} holds {}, but the model allows only {} \
                             (read window {start}..={end})",
                            value_name(value),
                            allowed.join(", ")
                        ));
                    }
                }
            }
        }
        self.reads_checked += 1;
    }
}

/// An emulated controller whose queue pairs lack abort, or abort and reset: how a reactor
/// copes with devices that cannot do either (as `QueuePair`'s defaults say).
pub struct LimitedController {
    inner: EmuController,
    abort: bool,
    reset: bool,
}

impl LimitedController {
    pub fn new(inner: EmuController, abort: bool, reset: bool) -> LimitedController {
        LimitedController {
            inner,
            abort,
            reset,
        }
    }
}

impl Controller for LimitedController {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.inner.namespace()
    }

    fn create_queue_pair(&self, depth: usize) -> Result<Box<dyn QueuePair>, QueuePairError> {
        Ok(Box::new(LimitedQp {
            inner: self.inner.queue_pair(depth)?,
            abort: self.abort,
            reset: self.reset,
        }))
    }
}

struct LimitedQp {
    inner: EmuQueuePair,
    abort: bool,
    reset: bool,
}

impl QueuePair for LimitedQp {
    unsafe fn submit(&mut self, cmd: &Command<'_>, tag: u64) -> Result<(), SubmitError> {
        // SAFETY: forwarded unchanged: our caller keeps the submit contract for us.
        unsafe { self.inner.submit(cmd, tag) }
    }

    fn process_completions(&mut self, max: usize, out: &mut dyn FnMut(Completion)) -> usize {
        self.inner.process_completions(max, out)
    }

    fn interrupt_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.inner.interrupt_fd()
    }

    fn arm_interrupt(&mut self) {
        self.inner.arm_interrupt()
    }

    fn disarm_interrupt(&mut self) {
        self.inner.disarm_interrupt()
    }

    fn outstanding(&self) -> usize {
        self.inner.outstanding()
    }

    fn depth(&self) -> usize {
        self.inner.depth()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.inner.namespace()
    }

    fn abort(&mut self, tag: u64) -> Result<(), RecoveryError> {
        if self.abort {
            QueuePair::abort(&mut self.inner, tag)
        } else {
            Err(RecoveryError::Unsupported)
        }
    }

    fn reset(&mut self) -> Result<(), RecoveryError> {
        if self.reset {
            QueuePair::reset(&mut self.inner)
        } else {
            Err(RecoveryError::Unsupported)
        }
    }
}

/// Draws how a device answers recovery: (can abort, can reset, in words).
fn recovery_mode(rng: &mut Rng) -> (bool, bool, &'static str) {
    match rng.below(10) {
        0..=4 => (true, true, "abort+reset"),
        5..=6 => (false, true, "reset only"),
        7 => (true, false, "abort only"),
        _ => (false, false, "neither"),
    }
}

/// The controller as a device that can abort and reset as asked.
fn device_for(ctrl: &EmuController, abort: bool, reset: bool) -> Device {
    if abort && reset {
        Device::new(Arc::new(ctrl.clone()))
    } else {
        Device::new(Arc::new(LimitedController::new(ctrl.clone(), abort, reset)))
    }
}

/// Runs one seeded simulation. `Ok` with what it did, or the first thing it found wrong.
pub fn run(seed: u64, cfg: &SimConfig) -> Result<SimReport, SimFailure> {
    let mut rng = Rng(seed);
    // The seed draws the device (nand's 400 us tail outlives the 300 us timeout: pending
    // commands get aborted too), the namespace size (so how often I/Os overlap), the depth,
    // the step, the fault rates and how the device answers recovery.
    let profile = ["dram", "optane", "nand"][rng.below(3) as usize];
    // 4096 blocks span two of the memory store's 1 MiB chunks (see `submit_random`).
    let blocks = [32u64, 64, 128, 256, 4096][rng.below(5) as usize];
    let depth = [1usize, 2, 8, 16, 32][rng.below(5) as usize];
    let wait_queue = [0usize, 4, 32][rng.below(3) as usize];
    let step_ns_max = [1_000u64, 4_000, 16_000][rng.below(3) as usize];
    let factor = [0.5, 1.0, 2.0, 4.0][rng.below(4) as usize];
    let (abort, reset, recovery) = recovery_mode(&mut rng);
    // Half the runs attach a second queue pair on the same controller to every reactor,
    // with its own recovery support: per-device timeouts and recovery side by side.
    let second = rng.pct(50).then(|| recovery_mode(&mut rng));
    let spec = format!(
        "emu:{profile},size={},seed={},err_pct={},lost_pct={},stuck_pct={},reset_pct={},\
         queues={}",
        blocks * LBA_BYTES as u64,
        rng.next(),
        cfg.err_pct * factor,
        cfg.lost_pct * factor,
        cfg.stuck_pct,
        cfg.reset_pct * factor,
        2 * cfg.reactors + 1
    );
    let second_text = second.map_or(String::new(), |(_, _, r)| format!(" second={r}"));
    let shape = format!(
        "{spec} depth={depth} wait_queue={wait_queue} step<={step_ns_max}ns \
         recovery={recovery}{second_text} reactors={}",
        cfg.reactors
    );
    let fail = |message: String| SimFailure {
        seed,
        message: format!("{message} [{shape}]"),
    };
    let emu_cfg: EmuConfig = match spec.parse::<hypoll_nvme::DeviceConfig>() {
        Ok(hypoll_nvme::DeviceConfig::Emu(c)) => c,
        other => return Err(fail(format!("bad device string {spec}: {other:?}"))),
    };
    let vclock = VirtualClock::new(1_000_000_000);
    let ctrl = EmuController::with_clock(emu_cfg, Clock::Virtual(vclock.clone()))
        .map_err(|e| fail(format!("{spec}: {e}")))?;
    let mut devices = vec![device_for(&ctrl, abort, reset)];
    if let Some((abort, reset, _)) = second {
        devices.push(device_for(&ctrl, abort, reset));
    }
    let options = DeviceOptions::new(depth)
        .with_io_timeout(Some(cfg.io_timeout))
        .with_abort_timeout(cfg.abort_timeout)
        .with_reset_timeout(cfg.reset_timeout)
        .with_wait_queue(wait_queue);
    let ns = |d: Duration| d.as_nanos() as u64;

    let clock = Clock::Virtual(vclock.clone());
    let model: Shared = Arc::new(parking_lot::Mutex::new(Model {
        history: vec![Vec::new(); blocks as usize],
        // Timeouts, plus the turns it takes to notice each step: a reactor is turned about
        // once every `reactors` steps; allow 64 of those per step.
        latency_ns_bound: ns(cfg.io_timeout)
            + ns(cfg.abort_timeout)
            + ns(cfg.reset_timeout)
            + 3 * 64 * cfg.reactors as u64 * step_ns_max,
        ..Model::default()
    }));

    // The reactors: built by hand (not on threads), on the virtual clock.
    let mut reactors = Vec::with_capacity(cfg.reactors);
    let mut receivers = Vec::new();
    let mut handles = Vec::new();
    for i in 0..cfg.reactors {
        let (handle, rx) = mailbox(i, i, 16).map_err(|e| fail(format!("mailbox: {e}")))?;
        handles.push(handle);
        receivers.push(rx);
    }
    let handles: Arc<[_]> = handles.into();
    for (i, rx) in receivers.into_iter().enumerate() {
        let policy = hypoll_policy::build("classic").map_err(|e| fail(e.to_string()))?;
        let mut r = Reactor::new(i, rx, handles.clone(), policy, ReactorTuning::default())
            .map_err(|e| fail(format!("reactor: {e}")))?;
        r.set_clock(Clock::Virtual(vclock.clone()));
        for device in &devices {
            r.attach_with(device, options).map_err(fail)?;
        }
        reactors.push(r);
    }

    let mut left: Vec<usize> = vec![cfg.ios_per_reactor; cfg.reactors];
    let mut queue_full = 0u64;
    let mut steps = 0u64;
    loop {
        steps += 1;
        if steps > STEPS_MAX {
            let outstanding: Vec<usize> = reactors.iter().map(|r| r.outstanding()).collect();
            return Err(fail(format!(
                "hung: {STEPS_MAX} steps and I/O still outstanding per reactor: \
                 {outstanding:?}"
            )));
        }
        if steps.is_multiple_of(HANG_CHECK_EVERY_STEPS) {
            let m = model.lock();
            let now_ns = vclock.now_ns();
            let stuck = m.ops.iter().enumerate().find(|(_, op)| {
                op.accepted && op.callbacks == 0 && now_ns - op.start_ns > 2 * m.latency_ns_bound
            });
            if let Some((n, op)) = stuck {
                return Err(fail(format!(
                    "hung: I/O {n} ({:?} of {} blocks at {} on reactor {}) has waited {} ns \
                     for its callback; the timeouts promise at most {} ns",
                    op.op,
                    op.nlb,
                    op.slba,
                    op.reactor,
                    now_ns - op.start_ns,
                    m.latency_ns_bound
                )));
            }
        }
        let all_issued = left.iter().all(|&n| n == 0);
        if all_issued && reactors.iter().all(|r| r.outstanding() == 0) {
            break;
        }
        let i = rng.below(cfg.reactors as u64) as usize;
        if left[i] > 0 && rng.pct(45) {
            let device = DeviceId::from_index(rng.below(devices.len() as u64) as u16);
            let r = &mut reactors[i];
            match submit_random(r, i, device, &mut rng, blocks, &model, &clock, None) {
                Ok(()) => left[i] -= 1,
                Err(SubmitOutcome::QueueFull) => {
                    queue_full += 1;
                    // Every slot quarantined (a device that cannot reset lost them all):
                    // this reactor cannot do more I/O; stop asking.
                    if reactors[i].outstanding() == 0 {
                        left[i] -= 1;
                    }
                }
                Err(SubmitOutcome::Quarantined) => {
                    queue_full += 1;
                    left[i] -= 1;
                }
                Err(SubmitOutcome::Bug(message)) => return Err(fail(message)),
            }
        } else {
            reactors[i].sim_turn();
        }
        vclock.advance_by(rng.below(step_ns_max + 1));
        if let Some(e) = model.lock().errors.first() {
            return Err(fail(e.clone()));
        }
    }

    // Accounting: every accepted I/O ran its callback exactly once, and the reactors
    // counted as many completions.
    let mut report = SimReport {
        seed,
        shape: shape.clone(),
        queue_full,
        controller_resets: ctrl.resets(),
        ..SimReport::default()
    };
    for r in &reactors {
        report.add(r.counters());
    }
    check_accounting(&model, report.ios).map_err(fail)?;
    {
        let m = model.lock();
        report.reads_checked = m.reads_checked;
        report.latency_ns_max = m.latency_ns_max;
        if m.latency_ns_max > m.latency_ns_bound {
            return Err(fail(format!(
                "an I/O waited {} ns for its callback; the timeouts promise at most {} ns",
                m.latency_ns_max, m.latency_ns_bound
            )));
        }
    }

    // Deleting the queue pairs ends the windows of abandoned writes: nothing changes the
    // blocks after this but the final reads.
    drop(reactors);
    final_check(&ctrl, &clock, blocks, &model).map_err(fail)?;
    Ok(report)
}

enum SubmitOutcome {
    QueueFull,
    /// Every slot holds an abandoned command: this reactor can do no more I/O.
    Quarantined,
    Bug(String),
}

/// Runs after a simulated I/O's callback has recorded it (the threaded driver refills its
/// queue from here).
type Then = Option<Rc<dyn Fn(&mut Reactor)>>;

/// Submits one random I/O on reactor `r` and records it in the model.
#[allow(clippy::too_many_arguments)]
fn submit_random(
    r: &mut Reactor,
    reactor: usize,
    device: DeviceId,
    rng: &mut Rng,
    blocks: u64,
    model: &Shared,
    clock: &Clock,
    then: Then,
) -> Result<(), SubmitOutcome> {
    let op = match rng.below(100) {
        0..=34 => IoOp::Read,
        35..=79 => IoOp::Write,
        80..=84 => IoOp::Flush,
        85..=92 => IoOp::WriteZeroes,
        _ => IoOp::Deallocate,
    };
    let (slba, nlb) = if op == IoOp::Flush {
        (0, 0)
    } else {
        let nlb = 1 + rng.below(u64::from(NLB_MAX).min(blocks)) as u32;
        let last = blocks - u64::from(nlb);
        // On a namespace past one store chunk, a fifth of the I/Os sit on the chunk
        // boundary, where the store splits a transfer in two.
        let boundary = CHUNK_BLOCKS.saturating_sub(u64::from(NLB_MAX) - 1);
        let slba = if blocks > CHUNK_BLOCKS && rng.pct(20) {
            (boundary + rng.below(u64::from(NLB_MAX))).min(last)
        } else {
            rng.below(last + 1)
        };
        (slba, nlb)
    };
    let writes = matches!(op, IoOp::Write | IoOp::WriteZeroes | IoOp::Deallocate);
    // Record the I/O (and its writes) before submitting it: on another thread a read may
    // see its data before `submit` even returns. Undone below if it is refused.
    let (op_index, write_ids) = {
        let mut m = model.lock();
        let op_index = m.ops.len();
        let start = m.bump();
        let mut write_ids = Vec::new();
        if writes {
            let value = if op == IoOp::Write {
                op_index as u64 + 1
            } else {
                0
            };
            for lba in slba..slba + u64::from(nlb) {
                let id = m.writes.len();
                m.writes.push(WriteRec {
                    value,
                    start,
                    end: u64::MAX,
                    ok: false,
                });
                m.history[lba as usize].push(id);
                write_ids.push(id);
            }
        }
        m.ops.push(OpRec {
            op,
            reactor,
            slba,
            nlb,
            start,
            start_ns: clock.now_ns(),
            write_ids: write_ids.clone(),
            callbacks: 0,
            accepted: false,
        });
        (op_index, write_ids)
    };
    let buf = match op {
        IoOp::Read => Some(IoBuf::zeroed(nlb as usize * LBA_BYTES)),
        IoOp::Write => {
            let mut buf = IoBuf::zeroed(nlb as usize * LBA_BYTES);
            // Values are the op's index + 1: unique, never 0 (zeroes).
            for (i, block) in buf.chunks_mut(LBA_BYTES).enumerate() {
                fill_block(op_index as u64 + 1, slba + i as u64, block);
            }
            Some(buf)
        }
        _ => None,
    };
    let req = IoRequest::new(op, slba, nlb).with_user(op_index as u64);
    let cb_model = model.clone();
    let cb_clock = clock.clone();
    let submitted = r.submit(device, req, buf, move |r, done| {
        on_done(&cb_model, &cb_clock, done);
        if let Some(then) = then {
            then(r);
        }
    });
    let mut m = model.lock();
    match submitted {
        Ok(()) => {
            m.ops[op_index].accepted = true;
            Ok(())
        }
        Err(rejected) => {
            for (i, lba) in (slba..slba + u64::from(nlb)).enumerate() {
                if let Some(&id) = write_ids.get(i) {
                    m.history[lba as usize].retain(|&w| w != id);
                }
            }
            match rejected.reason {
                crate::RejectReason::Submit(SubmitError::QueueFull { .. }) => {
                    let data_op = matches!(op, IoOp::Read | IoOp::Write);
                    if rejected.buf.is_some() != data_op {
                        return Err(SubmitOutcome::Bug(
                            "a rejected read or write did not get its buffer back".into(),
                        ));
                    }
                    Err(SubmitOutcome::QueueFull)
                }
                crate::RejectReason::Quarantined { .. } => Err(SubmitOutcome::Quarantined),
                other => Err(SubmitOutcome::Bug(format!(
                    "reactor {reactor} rejected {op:?} {nlb} blocks at {slba}: {other}"
                ))),
            }
        }
    }
}

/// A callback: records the outcome in the model and checks what a read returned.
fn on_done(model: &Shared, clock: &Clock, done: IoDone) {
    let mut m = model.lock();
    let end = m.bump();
    let index = done.user as usize;
    let Some(op) = m.ops.get_mut(index).filter(|op| op.accepted) else {
        m.errors.push(format!(
            "a callback for I/O {index}, which was never accepted"
        ));
        return;
    };
    op.callbacks += 1;
    let op = op.clone();
    if op.callbacks > 1 {
        m.errors.push(format!(
            "I/O {index} ({:?} at {}) completed a second time: {:?}",
            op.op, op.slba, done.result
        ));
        return;
    }
    let latency_ns = clock.now_ns().saturating_sub(op.start_ns);
    m.latency_ns_max = m.latency_ns_max.max(latency_ns);
    let data_op = matches!(op.op, IoOp::Read | IoOp::Write);
    let buf_expected = data_op && done.result != Err(IoFailure::Abandoned);
    if done.buf.is_some() != buf_expected {
        m.errors.push(format!(
            "I/O {index} ({:?}, {:?}): buffer returned: {}, expected: {buf_expected}",
            op.op,
            done.result,
            done.buf.is_some()
        ));
    }
    if matches!(done.result, Err(IoFailure::Shutdown)) {
        m.errors.push(format!(
            "I/O {index} failed with Shutdown, yet nothing shut down"
        ));
    }
    // A write's window ends at its callback, unless it was abandoned: the device may carry
    // it out any time until its queue pair is deleted.
    let ok = done.result.is_ok();
    let write_end = if done.result == Err(IoFailure::Abandoned) {
        u64::MAX
    } else {
        end
    };
    for &id in &op.write_ids {
        m.writes[id].end = write_end;
        m.writes[id].ok = ok;
    }
    if op.op == IoOp::Read && ok {
        let buf = done.buf.expect("checked above");
        let what = format!("read {index} of {} blocks at {}", op.nlb, op.slba);
        m.check_read(op.slba, &buf, op.start, end, &what);
    }
}

/// Checks that every accepted I/O ran its callback exactly once, and that the reactors
/// counted as many completions (`counted`).
fn check_accounting(model: &Shared, counted: u64) -> Result<(), String> {
    let m = model.lock();
    let mut accepted = 0u64;
    for (n, op) in m.ops.iter().enumerate() {
        let expected = u32::from(op.accepted);
        accepted += u64::from(op.accepted);
        if op.callbacks != expected {
            return Err(format!(
                "I/O {n} ({:?} of {} blocks at {} on reactor {}, accepted: {}) ran its \
                 callback {} times",
                op.op, op.nlb, op.slba, op.reactor, op.accepted, op.callbacks
            ));
        }
    }
    if counted != accepted {
        return Err(format!(
            "the reactors counted {counted} completions for {accepted} accepted I/Os"
        ));
    }
    Ok(())
}

/// Reads every block back through a fresh queue pair (faults still on: errors and lost
/// commands are retried, lost ones after a reset) and checks it against the model.
fn final_check(
    ctrl: &EmuController,
    clock: &Clock,
    blocks: u64,
    model: &Shared,
) -> Result<(), String> {
    let mut qp = ctrl
        .queue_pair(1)
        .map_err(|e| format!("final check: {e}"))?;
    // Waits until the emulated command's deadline (virtual or real time).
    let wait_until = |deadline_ns: u64| match clock {
        Clock::Virtual(v) => v.advance_to(deadline_ns),
        Clock::Monotonic => {
            let now_ns = hypoll_nvme::monotonic_ns();
            std::thread::sleep(Duration::from_nanos(deadline_ns.saturating_sub(now_ns)));
        }
    };
    for lba in 0..blocks {
        let mut attempts = 0;
        let data = loop {
            attempts += 1;
            if attempts > FINAL_READ_ATTEMPTS {
                return Err(format!(
                    "final check: block {lba} did not read back in {FINAL_READ_ATTEMPTS} tries"
                ));
            }
            let mut buf = IoBuf::zeroed(LBA_BYTES);
            // SAFETY: `buf` is neither touched nor dropped until this command's completion
            // is reaped below: a lost command is completed by the reset before we leave.
            let submitted = unsafe { qp.submit(&Command::read(lba, 1, &mut buf), 0) };
            if submitted.is_err() {
                continue;
            }
            let mut status = None;
            while status.is_none() {
                qp.process_completions(1, &mut |c| status = Some(c.status));
                if status.is_some() {
                    break;
                }
                match qp.oracle_next_deadline_ns() {
                    Some(deadline_ns) => wait_until(deadline_ns),
                    // Lost: a reset completes it.
                    None => {
                        qp.reset();
                    }
                }
            }
            match status {
                Some(Status::SUCCESS) => break buf,
                _ => continue,
            }
        };
        let mut m = model.lock();
        let tick = m.bump();
        m.check_read(lba, &data, tick, tick, "final read-back");
        if let Some(e) = m.errors.first() {
            return Err(e.clone());
        }
    }
    Ok(())
}

/// What the threaded simulation drives on each reactor: keeps `qd` I/Os in flight until
/// it has submitted its share.
struct Driver {
    reactor: usize,
    rng: Rng,
    left: usize,
    in_flight: usize,
    qd: usize,
    blocks: u64,
    model: Shared,
    clock: Clock,
    queue_full: u64,
    done: Option<crossbeam_channel::Sender<u64>>,
}

/// Tops the reactor's queue up; reports once its share is submitted and completed.
fn pump(r: &mut Reactor, driver: &Rc<RefCell<Driver>>) {
    loop {
        let mut d = driver.borrow_mut();
        if d.left == 0 {
            if d.in_flight == 0 {
                if let Some(done) = d.done.take() {
                    let _ = done.send(d.queue_full);
                }
            }
            return;
        }
        if d.in_flight >= d.qd {
            return;
        }
        let then: Rc<dyn Fn(&mut Reactor)> = {
            let driver = driver.clone();
            Rc::new(move |r: &mut Reactor| {
                driver.borrow_mut().in_flight -= 1;
                pump(r, &driver);
            })
        };
        let Driver {
            reactor,
            rng,
            blocks,
            model,
            clock,
            ..
        } = &mut *d;
        let first = DeviceId::FIRST;
        match submit_random(r, *reactor, first, rng, *blocks, model, clock, Some(then)) {
            Ok(()) => {
                d.left -= 1;
                d.in_flight += 1;
            }
            Err(SubmitOutcome::QueueFull) => {
                d.queue_full += 1;
                if d.in_flight == 0 {
                    // Every slot quarantined: nothing will free one. Give up on this I/O.
                    d.left -= 1;
                    continue;
                }
                // A completion of ours frees a slot and calls back here.
                return;
            }
            Err(SubmitOutcome::Quarantined) => {
                d.queue_full += 1;
                d.left -= 1;
            }
            Err(SubmitOutcome::Bug(message)) => {
                d.model.lock().errors.push(message);
                d.left = 0;
            }
        }
    }
}

/// Runs one seed on real reactor threads (one per core this process may use, up to
/// `cfg.reactors`), on the real clock, with a policy drawn from the seed. The interleaving
/// is the scheduler's, so a seed does not replay exactly; the checks are the same (less
/// the timing bound: a shared machine may deschedule a reactor for any time).
pub fn run_threaded(seed: u64, cfg: &SimConfig) -> Result<SimReport, SimFailure> {
    let mut rng = Rng(seed ^ 0x7468_7265_6164);
    let profile = ["dram", "optane"][rng.below(2) as usize];
    let blocks = [32u64, 128][rng.below(2) as usize];
    let depth = [2usize, 8, 32][rng.below(3) as usize];
    let wait_queue = [0usize, 16][rng.below(2) as usize];
    let policy = ["classic", "hybrid", "interrupt", "adaptive"][rng.below(4) as usize];
    let (abort, reset, recovery) = recovery_mode(&mut rng);
    let cores = crate::sys::allowed_cores()
        .map_err(|e| SimFailure {
            seed,
            message: format!("allowed cores: {e}"),
        })?
        .into_iter()
        .take(cfg.reactors.max(1))
        .collect::<Vec<_>>();
    let spec = format!(
        "emu:{profile},size={},seed={},err_pct={},lost_pct={},stuck_pct={},reset_pct={},\
         queues={}",
        blocks * LBA_BYTES as u64,
        rng.next(),
        cfg.err_pct,
        cfg.lost_pct,
        cfg.stuck_pct,
        cfg.reset_pct,
        cores.len() + 1
    );
    let shape = format!(
        "threaded {spec} depth={depth} wait_queue={wait_queue} policy={policy} \
         recovery={recovery} reactors={}",
        cores.len()
    );
    let fail = |message: String| SimFailure {
        seed,
        message: format!("{message} [{shape}]"),
    };
    let emu_cfg: EmuConfig = match spec.parse::<hypoll_nvme::DeviceConfig>() {
        Ok(hypoll_nvme::DeviceConfig::Emu(c)) => c,
        other => return Err(fail(format!("bad device string {spec}: {other:?}"))),
    };
    let ctrl = EmuController::new(emu_cfg).map_err(|e| fail(format!("{spec}: {e}")))?;
    let device = device_for(&ctrl, abort, reset);
    // Real time on a shared machine: timeouts long enough that most I/O beats them,
    // short enough that lost commands are recovered quickly.
    let options = DeviceOptions::new(depth)
        .with_io_timeout(Some(THREADED_IO_TIMEOUT))
        .with_abort_timeout(THREADED_STEP_TIMEOUT)
        .with_reset_timeout(THREADED_STEP_TIMEOUT)
        .with_wait_queue(wait_queue);
    let model: Shared = Arc::new(parking_lot::Mutex::new(Model {
        history: vec![Vec::new(); blocks as usize],
        latency_ns_bound: u64::MAX,
        ..Model::default()
    }));
    let config = crate::ReactorConfig {
        cores: Some(crate::CoreList::new(cores.clone())),
        policy: policy.to_string(),
        ..crate::ReactorConfig::default()
    };
    let set = crate::ReactorSet::start(config, move |r| r.attach_with(&device, options).map(drop))
        .map_err(|e| fail(format!("starting reactors: {e}")))?;
    let (done_tx, done_rx) = crossbeam_channel::bounded(cores.len());
    for (i, h) in set.handles().iter().enumerate() {
        let model = model.clone();
        let done = done_tx.clone();
        let rng = Rng(rng.next());
        let (left, qd) = (cfg.ios_per_reactor, depth.min(THREADED_QD_MAX));
        h.send(move |r| {
            let driver = Rc::new(RefCell::new(Driver {
                reactor: i,
                rng,
                left,
                in_flight: 0,
                qd,
                blocks,
                model,
                clock: Clock::Monotonic,
                queue_full: 0,
                done: Some(done),
            }));
            pump(r, &driver);
        })
        .map_err(|e| fail(format!("starting the workload: {e}")))?;
    }
    let mut queue_full = 0;
    for _ in 0..cores.len() {
        match done_rx.recv_timeout(THREADED_RUN_LIMIT) {
            Ok(n) => queue_full += n,
            Err(_) => {
                let outstanding: Vec<u64> = set
                    .handles()
                    .iter()
                    .map(|h| h.stats().outstanding)
                    .collect();
                return Err(fail(format!(
                    "hung: the workload did not finish in {THREADED_RUN_LIMIT:?}; outstanding \
                     per reactor: {outstanding:?}"
                )));
            }
        }
    }
    let report = set.shutdown();
    if let Some(p) = report.panics.first() {
        return Err(fail(p.to_string()));
    }
    let mut sim_report = SimReport {
        seed,
        shape: shape.clone(),
        queue_full,
        controller_resets: ctrl.resets(),
        ..SimReport::default()
    };
    for exit in &report.exits {
        if exit.failed_ios > 0 {
            return Err(fail(format!(
                "{} I/Os were still outstanding at shutdown",
                exit.failed_ios
            )));
        }
        let c = exit.stats.counters;
        sim_report.add(&c);
    }
    if let Some(e) = model.lock().errors.first() {
        return Err(fail(e.clone()));
    }
    check_accounting(&model, sim_report.ios).map_err(fail)?;
    final_check(&ctrl, &Clock::Monotonic, blocks, &model).map_err(fail)?;
    let m = model.lock();
    sim_report.reads_checked = m.reads_checked;
    sim_report.latency_ns_max = m.latency_ns_max;
    Ok(sim_report)
}

pub fn run_seeds(first: u64, count: u64, cfg: &SimConfig) -> Result<Vec<SimReport>, SimFailure> {
    (first..first.saturating_add(count))
        .map(|seed| run(seed, cfg))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_decode_to_the_value_written_and_catch_misdirection() {
        let mut block = [0u8; LBA_BYTES];
        assert_eq!(decode_block(5, &block), Ok(0));
        fill_block(42, 5, &mut block);
        assert_eq!(decode_block(5, &block), Ok(42));
        assert!(decode_block(6, &block).is_err(), "written for block 5");
        block[300] ^= 1;
        assert!(decode_block(5, &block).is_err(), "one flipped bit");
    }

    #[test]
    fn the_model_allows_overlapping_writes_either_way_and_nothing_older() {
        let mut m = Model {
            history: vec![Vec::new(); 1],
            ..Model::default()
        };
        let write = |m: &mut Model, value, start, end, ok| {
            m.writes.push(WriteRec {
                value,
                start,
                end,
                ok,
            });
            let id = m.writes.len() - 1;
            m.history[0].push(id);
        };
        // Write 1 done at 2; writes 2 and 3 overlap (3..6, 4..5); write 4 failed (7..8).
        write(&mut m, 1, 1, 2, true);
        write(&mut m, 2, 3, 6, true);
        write(&mut m, 3, 4, 5, true);
        write(&mut m, 4, 7, 8, false);
        // A read after everything: 2 or 3 (either order), or 4 (failed: maybe); not 1 or 0.
        let after = |m: &Model, v| m.allows(0, v, 9, 9);
        assert!(after(&m, 2) && after(&m, 3) && after(&m, 4));
        assert!(!after(&m, 1) && !after(&m, 0));
        // A read concurrent with writes 2 and 3 may also see 1, but not the initial zeroes.
        assert!(m.allows(0, 1, 3, 4) && m.allows(0, 2, 3, 4));
        assert!(!m.allows(0, 0, 3, 4));
        // Nor a value written after the read ended.
        assert!(!m.allows(0, 4, 3, 4));
    }
}
