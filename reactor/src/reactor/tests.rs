//! A reactor stepped by hand on a virtual clock, where its commands complete only when the
//! test says: what a refusal hands back, and what goes first when a reactor is dropped.

use std::sync::{mpsc, Arc, Mutex};

use hypoll_nvme::qpair::ZERO_NLB;
use hypoll_nvme::{
    Clock, Command, Completion, Controller, DeviceConfig, EmuController, EmuQueuePair, IoBuf,
    NamespaceInfo, QueuePair, QueuePairError, SubmitError, VirtualClock,
};

use super::{mailbox, Reactor, ReactorTuning};
use crate::io::{
    Device, DeviceId, DeviceOptions, IoDone, IoFailure, IoOp, IoRequest, RejectReason, Rejected,
};

/// An emulated controller on `clock`: its commands complete once the clock passes their
/// deadline, and only then.
pub(super) fn emu(spec: &str, clock: &VirtualClock) -> EmuController {
    let Ok(DeviceConfig::Emu(cfg)) = spec.parse::<DeviceConfig>() else {
        panic!("{spec} is an emulated device");
    };
    EmuController::with_clock(cfg, Clock::Virtual(clock.clone())).unwrap()
}

/// A reactor on `clock`, built by hand (no thread), under `policy`.
pub(super) fn reactor(clock: &VirtualClock, policy: &str) -> Reactor {
    let (handle, rx) = mailbox(0, 0, 16).unwrap();
    let policy = hypoll_policy::build(policy).unwrap();
    let mut r = Reactor::new(0, rx, Arc::new([handle]), policy, ReactorTuning::default()).unwrap();
    r.set_clock(Clock::Virtual(clock.clone()));
    r
}

/// What a test's callback reports when it runs: the tag it was made with, and its result.
type Answer = (&'static str, Result<(), IoFailure>);

/// A callback that answers through `tx`, as a server's callback answers its client.
fn answering(
    tx: &mpsc::Sender<Answer>,
    tag: &'static str,
) -> impl FnOnce(&mut Reactor, &mut (), IoDone) + 'static {
    let tx = tx.clone();
    move |_, _, done| tx.send((tag, done.result)).unwrap()
}

/// Checks a refusal: its reason, and what it hands back (the device and request as given,
/// the buffer if one was given); then answers it through its callback (`Rejected::fail`), as
/// a caller that does not retry does, and checks that the callback answered.
#[track_caller]
fn check_refused<F: FnOnce(&mut Reactor, &mut (), IoDone)>(
    r: &mut Reactor,
    rx: &mpsc::Receiver<Answer>,
    submitted: Result<(), Rejected<F>>,
    reason: RejectReason,
    (device, req, has_buf): (DeviceId, IoRequest, bool),
    tag: &'static str,
) {
    let Err(rejected) = submitted else {
        panic!("{tag} was accepted");
    };
    assert_eq!(rejected.reason, reason, "{tag}");
    assert_eq!((rejected.device, rejected.req), (device, req), "{tag}");
    assert_eq!(rejected.buf.is_some(), has_buf, "{tag}");
    rejected.fail(r, &mut ());
    assert_eq!(rx.try_recv(), Ok((tag, Err(IoFailure::Refused))));
}

/// Steps `r`, a millisecond of virtual time a turn, until `n` answers have come.
fn answers_until(
    r: &mut Reactor,
    clock: &VirtualClock,
    rx: &mpsc::Receiver<Answer>,
    answers: &mut Vec<Answer>,
    n: usize,
) {
    for _ in 0..1_000 {
        if answers.len() >= n {
            assert_eq!(answers.len(), n, "{answers:?}");
            return;
        }
        clock.advance_by(1_000_000);
        r.sim_turn(&mut ());
        answers.extend(rx.try_iter());
    }
    panic!("{n} answers expected, {} came: {answers:?}", answers.len());
}

#[test]
fn every_refusal_hands_back_the_request_the_buffer_and_a_callback_that_still_answers() {
    let clock = VirtualClock::new(1_000_000_000);
    let mut r = reactor(&clock, "classic");
    let device = Device::new(Arc::new(emu("emu:optane,size=1M", &clock)));
    // Device `now` refuses at once when full; `waits` lets 2 I/Os wait for its one slot.
    let now = r.attach_with(&device, DeviceOptions::new(2)).unwrap();
    let waits = r
        .attach_with(&device, DeviceOptions::new(1).with_wait_queue(2))
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let read = |slba| IoRequest::new(IoOp::Read, slba, 8).with_user(slba);
    let buf = || Some(IoBuf::zeroed(4096));
    let flush = IoRequest::new(IoOp::Flush, 0, 0);

    let no_buf = r.submit(now, read(0), None, answering(&tx, "no buffer"));
    let given = (now, read(0), false);
    check_refused(
        &mut r,
        &rx,
        no_buf,
        RejectReason::Buffer,
        given,
        "no buffer",
    );
    let unknown = DeviceId::from_index(9);
    let nowhere = r.submit(unknown, flush, None, answering(&tx, "unknown"));
    let given = (unknown, flush, false);
    check_refused(
        &mut r,
        &rx,
        nowhere,
        RejectReason::UnknownDevice,
        given,
        "unknown",
    );
    // Commands that cannot be built.
    let empty = IoRequest::new(IoOp::Read, 0, 0);
    let unbuildable = r.submit(now, empty, buf(), answering(&tx, "nlb 0"));
    let invalid = RejectReason::Submit(SubmitError::InvalidField(ZERO_NLB));
    check_refused(
        &mut r,
        &rx,
        unbuildable,
        invalid,
        (now, empty, true),
        "nlb 0",
    );
    let big = IoRequest::new(IoOp::Read, 0, 16);
    let too_small = r.submit(now, big, buf(), answering(&tx, "small buffer"));
    let small = RejectReason::Submit(SubmitError::BufferTooSmall {
        need_bytes: 8192,
        have_bytes: 4096,
    });
    check_refused(
        &mut r,
        &rx,
        too_small,
        small,
        (now, big, true),
        "small buffer",
    );

    // A full queue pair without a wait queue refuses at once.
    r.submit(now, read(8), buf(), answering(&tx, "first"))
        .unwrap();
    r.submit(now, read(16), buf(), answering(&tx, "second"))
        .unwrap();
    let full = RejectReason::Submit(SubmitError::QueueFull { depth: 2 });
    let refused = r.submit(now, read(24), buf(), answering(&tx, "full"));
    check_refused(&mut r, &rx, refused, full, (now, read(24), true), "full");

    // With a wait queue: one on the queue pair, then waiting; a command that cannot be
    // built is refused even with room to wait; past the wait queue, full.
    r.submit(waits, read(0), buf(), answering(&tx, "on the qp"))
        .unwrap();
    r.submit(waits, read(8), buf(), answering(&tx, "waits"))
        .unwrap();
    let behind = r.submit(waits, empty, buf(), answering(&tx, "nlb 0 behind"));
    let given = (waits, empty, true);
    check_refused(&mut r, &rx, behind, invalid, given, "nlb 0 behind");
    r.submit(waits, read(16), buf(), answering(&tx, "waits too"))
        .unwrap();
    let past = r.submit(waits, read(24), buf(), answering(&tx, "past"));
    let full_1 = RejectReason::Submit(SubmitError::QueueFull { depth: 1 });
    check_refused(&mut r, &rx, past, full_1, (waits, read(24), true), "past");
    assert_eq!(r.outstanding(), 5);

    // A stopping reactor refuses too.
    r.stopping = true;
    let stopping = r.submit(now, flush, None, answering(&tx, "stopping"));
    let given = (now, flush, false);
    check_refused(
        &mut r,
        &rx,
        stopping,
        RejectReason::ShuttingDown,
        given,
        "stopping",
    );
    r.stopping = false;
    assert!(rx.try_recv().is_err(), "no accepted I/O answered yet");

    // Submitted again as handed back, a refused I/O runs its own callback on completion:
    // typed (no box), and boxed, from a queue of refusals.
    let retry = r
        .submit(now, read(24), buf(), answering(&tx, "retried"))
        .unwrap_err();
    let queued: Rejected = r
        .submit(now, read(32), buf(), answering(&tx, "queued"))
        .unwrap_err()
        .boxed();
    let mut answers = Vec::new();
    answers_until(&mut r, &clock, &rx, &mut answers, 5);
    r.submit(retry.device, retry.req, retry.buf, retry.callback)
        .unwrap();
    r.resubmit(queued).unwrap();
    answers_until(&mut r, &clock, &rx, &mut answers, 7);
    answers.sort_by_key(|&(tag, _)| tag);
    let ok = |tag| (tag, Ok(()));
    assert_eq!(
        answers,
        [
            ok("first"),
            ok("on the qp"),
            ok("queued"),
            ok("retried"),
            ok("second"),
            ok("waits"),
            ok("waits too"),
        ]
    );
    assert_eq!(r.outstanding(), 0);
}

/// Who was dropped, in order.
type DropLog = Arc<Mutex<Vec<&'static str>>>;

/// Logs its name when dropped.
struct Logged(DropLog, &'static str);

impl Drop for Logged {
    fn drop(&mut self) {
        self.0.lock().unwrap().push(self.1);
    }
}

/// An emulated controller whose queue pairs log when they are dropped.
struct LoggingController {
    inner: EmuController,
    log: DropLog,
}

impl Controller for LoggingController {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.inner.namespace()
    }

    fn create_queue_pair(&self, depth: usize) -> Result<Box<dyn QueuePair>, QueuePairError> {
        Ok(Box::new(LoggingQp {
            inner: self.inner.queue_pair(depth)?,
            _dropped: Logged(self.log.clone(), "queue pair"),
        }))
    }
}

struct LoggingQp {
    inner: EmuQueuePair,
    _dropped: Logged,
}

impl QueuePair for LoggingQp {
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

    fn outstanding(&self) -> usize {
        self.inner.outstanding()
    }

    fn depth(&self) -> usize {
        self.inner.depth()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.inner.namespace()
    }
}

#[test]
fn a_reactor_dropped_with_io_in_flight_drops_its_queue_pairs_before_the_buffers() {
    let clock = VirtualClock::new(1_000_000_000);
    let log = DropLog::default();
    let ctrl = LoggingController {
        inner: emu("emu:nand,size=1M", &clock),
        log: log.clone(),
    };
    let device = Device::new(Arc::new(ctrl));
    let mut r = reactor(&clock, "classic");
    let dev = r.attach(&device, 4).unwrap();
    // An I/O in flight: its slot holds its buffer and its callback, which holds a `Logged`:
    // they go together.
    let in_flight = Logged(log.clone(), "slot");
    r.read(dev, 0, 8, IoBuf::zeroed(4096), move |_, _, _| {
        drop(in_flight)
    })
    .unwrap();
    assert_eq!(r.outstanding(), 1);
    // Dropped without a shutdown, as a panic unwinding its thread drops it.
    drop(r);
    assert_eq!(*log.lock().unwrap(), ["queue pair", "slot"]);
}

#[test]
fn the_oracle_policy_alone_is_told_the_emulated_deadline_and_sleeps_by_it() {
    let clock = VirtualClock::new(1_000_000_000);
    let emulated = Device::new(Arc::new(emu("emu:nand,size=1M", &clock)));
    // A queue pair that is not the emulator's (it wraps one): no deadline to tell.
    let wrapped = Device::new(Arc::new(LoggingController {
        inner: emu("emu:nand,size=1M", &clock),
        log: DropLog::default(),
    }));
    for (policy, device, sleeps) in [
        ("oracle", &emulated, 1),
        ("classic", &emulated, 0),
        ("oracle", &wrapped, 0),
    ] {
        let mut r = reactor(&clock, policy);
        let dev = r.attach(device, 4).unwrap();
        r.read(dev, 0, 8, IoBuf::zeroed(4096), |_, _, _| {})
            .unwrap();
        assert_eq!(
            r.sim_turn(&mut ()),
            0,
            "nothing completes before the clock moves"
        );
        // The oracle sleeps until the deadline it is told (a NAND read's, far enough ahead
        // to be worth a sleep); without one it spins, as classic does.
        r.when_idle();
        assert_eq!(
            r.counters.sleeps,
            sleeps,
            "{policy} on {}",
            device.ctrl.describe()
        );
    }
}

/// Each callback of a batch of completions learns how many of the batch come after it
/// (an executor polls a task woken alone at once, and leaves a batch's tasks for one run
/// after it); outside a batch, none.
#[test]
fn a_callback_learns_how_many_completions_of_its_batch_follow() {
    let clock = VirtualClock::new(1_000_000_000);
    let mut r = reactor(&clock, "classic");
    let device = Device::new(Arc::new(emu("emu:nand,size=1M", &clock)));
    let dev = r.attach(&device, 4).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    for slba in [0, 8, 16] {
        let seen = seen.clone();
        let callback = move |r: &mut Reactor, _: &mut (), _| {
            seen.lock().unwrap().push(r.completions_left());
        };
        r.read(dev, slba, 8, IoBuf::zeroed(4096), callback).unwrap();
    }
    assert_eq!(r.completions_left(), 0, "outside a batch");
    // Every read's deadline passes, and one turn reaps the three in one batch.
    clock.advance_by(1_000_000_000);
    r.sim_turn(&mut ());
    assert_eq!(*seen.lock().unwrap(), [2, 1, 0]);
    assert_eq!(r.completions_left(), 0);
}
