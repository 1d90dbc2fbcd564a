//! The threaded runner: the same workload and checks on real reactor threads and the real
//! clock. The scheduler picks the interleaving, so a seed does not replay exactly.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use hypoll_nvme::{Clock, EmuConfig, EmuController};

use super::check::{check_accounting, final_check};
use super::config::{SimConfig, SimFailure, SimReport};
use super::draw::{recovery_mode, Rng};
use super::limited::device_for;
use super::model::{Model, Shared};
use super::workload::{submit_random, SubmitOutcome};
use super::LBA_BYTES;
use crate::io::{DeviceId, DeviceOptions};
use crate::reactor::Reactor;

/// The threaded simulation's timeouts, in real time.
const THREADED_IO_TIMEOUT: Duration = Duration::from_millis(5);
const THREADED_STEP_TIMEOUT: Duration = Duration::from_millis(2);
/// Most I/Os the threaded simulation keeps in flight per reactor.
const THREADED_QD_MAX: usize = 8;
/// How long the threaded simulation waits for its workload before declaring it hung.
const THREADED_RUN_LIMIT: Duration = Duration::from_secs(60);

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
            policy: policy.to_owned(),
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
        policy: policy.to_owned(),
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
    let set = crate::ReactorSet::start(config, move |r| {
        r.attach_with(&device, options)?;
        Ok(())
    })
    .map_err(|e| fail(format!("starting reactors: {e}")))?;
    let (done_tx, done_rx) = crossbeam_channel::bounded(cores.len());
    for (i, h) in set.handles().iter().enumerate() {
        let model = model.clone();
        let done = done_tx.clone();
        let rng = Rng(rng.next());
        let (left, qd) = (cfg.ios_per_reactor, depth.min(THREADED_QD_MAX));
        h.send(move |r, _| {
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
        policy: policy.to_owned(),
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
