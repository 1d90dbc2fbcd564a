//! `ReactorSet`: starts one pinned reactor thread per core, and stops them.

use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::cores::{CoreError, CoreList};
use crate::reactor::{build_policy, mailbox, ExitReport, Reactor, ReactorHandle, ReactorTuning};
use hypoll_policy::{PolicySpecError, PollPolicy};

/// Default mailbox size of each reactor.
pub const MAILBOX_CAPACITY: usize = 1024;
/// Timer slack reactor threads run with: a short sleep must end when it asked to, not as
/// late as the default slack lets the kernel fire it.
pub const REACTOR_TIMER_SLACK_NS: u64 = 1;

/// How to start a set of reactors.
#[derive(Clone, Debug)]
pub struct ReactorConfig {
    /// Cores to run on, one reactor each; `None`: every core the process may use.
    pub cores: Option<CoreList>,
    /// Poll policy spec for every reactor (`classic`, `hybrid`, `hybrid-min:adjust=2000`).
    pub policy: String,
    /// A policy of the application's own, built once per reactor; `policy` is then unused.
    pub custom_policy: Option<PolicyFactory>,
    pub mailbox_capacity: usize,
    pub tuning: ReactorTuning,
}

/// Builds a reactor's own [`PollPolicy`] on the reactor's thread, given the reactor's index:
/// how an application plugs in a policy that is not among the built-in ones.
#[derive(Clone)]
pub struct PolicyFactory(pub Arc<dyn Fn(usize) -> Box<dyn PollPolicy> + Send + Sync>);

impl PolicyFactory {
    pub fn new(build: impl Fn(usize) -> Box<dyn PollPolicy> + Send + Sync + 'static) -> Self {
        PolicyFactory(Arc::new(build))
    }
}

impl std::fmt::Debug for PolicyFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PolicyFactory(..)")
    }
}

impl Default for ReactorConfig {
    fn default() -> Self {
        ReactorConfig {
            cores: None,
            policy: "classic".to_string(),
            custom_policy: None,
            mailbox_capacity: MAILBOX_CAPACITY,
            tuning: ReactorTuning::default(),
        }
    }
}

/// What a reactor's `init` (see [`ReactorSet::start`]) fails with: any error, boxed.
///
/// A box, not a type parameter: an init attaches devices ([`AttachError`](crate::AttachError)),
/// adds pollers (`io::Error`) and builds the application's own state (its own errors), and
/// `?` turns each of them into this with its source chain intact. [`StartError`] then stays
/// one plain type, carried from the reactor's thread to `start`'s caller
/// ([`ReactorStartError::Init`]), rather than a `StartError<E>` that every function that
/// starts reactors would have to name. A `String` or `&str` converts too (`Err("no
/// disk".into())`).
pub type InitError = Box<dyn std::error::Error + Send + Sync>;

/// Why [`ReactorSet::start`] failed. Reactors already started were stopped again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    #[error(transparent)]
    Cores(#[from] CoreError),
    #[error("no cores to run on")]
    NoCores,
    /// [`ReactorConfig::policy`] names no policy: the registry's error, as it is.
    #[error("policy: {0}")]
    Policy(#[from] PolicySpecError),
    #[error("mailbox capacity must be at least 1")]
    Mailbox,
    /// One reactor did not start: its core (`usize::MAX` if its thread vanished without
    /// saying which), and what failed.
    #[error("reactor on core {core}: {source}")]
    Reactor {
        core: usize,
        #[source]
        source: ReactorStartError,
    },
}

/// What failed as one reactor started ([`StartError::Reactor`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReactorStartError {
    #[error("creating its mailbox: {0}")]
    Mailbox(#[source] io::Error),
    #[error("spawning its thread: {0}")]
    Spawn(#[source] io::Error),
    /// The OS refused to pin the thread to its core.
    #[error("pinning to its core failed")]
    Pin,
    #[error("setting timer slack: {0}")]
    TimerSlack(#[source] io::Error),
    #[error("reading its CPU clock: {0}")]
    CpuClock(#[source] io::Error),
    #[error("policy: {0}")]
    Policy(#[source] PolicySpecError),
    #[error("creating its epoll and timer: {0}")]
    Setup(#[source] io::Error),
    /// The application's `init` returned this error (its source chain kept).
    #[error("{0}")]
    Init(#[source] InitError),
    /// `init` panicked; the panic's message.
    #[error("panicked while starting: {message}")]
    Panicked { message: String },
    /// The thread ended while starting, with no error or panic to report.
    #[error("the reactor thread exited while starting")]
    Exited,
}

/// A reactor that panicked: its core and the panic message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reactor on core {core} panicked: {message}")]
pub struct ReactorPanic {
    pub core: usize,
    pub message: String,
}

/// What `shutdown` found.
#[derive(Debug)]
pub struct ShutdownReport<X = ()> {
    /// One per reactor that exited normally, with what its exit hook returned.
    pub exits: Vec<ExitReport<X>>,
    /// One per reactor that panicked.
    pub panics: Vec<ReactorPanic>,
}

// Not derived: a derived `Default` would ask `X: Default`.
impl<X> Default for ShutdownReport<X> {
    fn default() -> Self {
        ShutdownReport {
            exits: Vec::new(),
            panics: Vec::new(),
        }
    }
}

/// Running reactors, one per core, each with its state `S`; each hands back an `X` as it
/// exits.
pub struct ReactorSet<S = (), X = ()> {
    handles: Arc<[ReactorHandle<S>]>,
    /// `None` from a thread whose reactor never started.
    threads: Vec<(usize, JoinHandle<Option<ExitReport<X>>>)>,
}

/// A reactor and its state, as its thread holds them: the reactor is dropped first, so its
/// queue pairs are gone before any buffer the state owns (a panic unwinding the thread
/// drops fields in this order).
struct Running<S> {
    reactor: Reactor<S>,
    state: S,
}

impl<S: 'static> ReactorSet<S> {
    /// Starts one reactor per core of `cfg.cores` (checked against the allowed set), each
    /// pinned, named `hypoll-r<core>`, with 1 ns timer slack, and runs `init` on each before
    /// its loop starts (attach devices, add pollers and timers there): what it returns is
    /// the reactor's state, which every message, timer, poller and I/O callback on that
    /// reactor is handed as `&mut S`. Returns once every reactor is running, or the first
    /// error (having stopped the others). An error `init` returns comes back as
    /// [`StartError::Reactor`] with [`ReactorStartError::Init`].
    ///
    /// The state is made on the reactor's thread and never leaves it, so it need not be
    /// `Send`: `Rc`, `RefCell` and buffers the reactor's devices point into are all fine.
    pub fn start(
        cfg: ReactorConfig,
        init: impl Fn(&mut Reactor<S>) -> Result<S, InitError> + Send + Sync + 'static,
    ) -> Result<ReactorSet<S>, StartError> {
        ReactorSet::start_with_exit(cfg, init, |_, _| ())
    }
}

impl<S: 'static, X: Send + 'static> ReactorSet<S, X> {
    /// [`ReactorSet::start`], with an exit hook: as each reactor stops, once its I/O has
    /// drained (or failed) and its queue pairs are deleted, `exit` takes its state and
    /// returns what [`ReactorSet::shutdown`] collects for that reactor
    /// ([`ExitReport::output`]): a summary, a flushed index, the state itself if it is
    /// `Send`. A reactor that panicked has no output; its state is dropped on its thread.
    pub fn start_with_exit(
        cfg: ReactorConfig,
        init: impl Fn(&mut Reactor<S>) -> Result<S, InitError> + Send + Sync + 'static,
        exit: impl Fn(&mut Reactor<S>, S) -> X + Send + Sync + 'static,
    ) -> Result<ReactorSet<S, X>, StartError> {
        let allowed = CoreList::allowed()?;
        let cores = match cfg.cores {
            Some(cores) => {
                cores.check_within(&allowed)?;
                cores
            }
            None => allowed,
        };
        if cores.is_empty() {
            return Err(StartError::NoCores);
        }
        if cfg.mailbox_capacity == 0 {
            return Err(StartError::Mailbox);
        }
        if cfg.custom_policy.is_none() {
            hypoll_policy::build(&cfg.policy)?;
        }

        let mut handles = Vec::new();
        let mut receivers = Vec::new();
        for (index, &core) in cores.as_slice().iter().enumerate() {
            let (handle, rx) =
                mailbox(index, core, cfg.mailbox_capacity).map_err(|e| StartError::Reactor {
                    core,
                    source: ReactorStartError::Mailbox(e),
                })?;
            handles.push(handle);
            receivers.push(rx);
        }
        let handles: Arc<[ReactorHandle<S>]> = handles.into();
        let init = Arc::new(init);
        let exit = Arc::new(exit);
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(cores.len());
        let mut set = ReactorSet {
            handles: handles.clone(),
            threads: Vec::new(),
        };
        for (index, rx) in receivers.into_iter().enumerate() {
            let core = handles[index].core();
            let handles = handles.clone();
            let init = init.clone();
            let exit = exit.clone();
            let ready = ready_tx.clone();
            let policy_spec = cfg.policy.clone();
            let custom_policy = cfg.custom_policy.clone();
            let tuning = cfg.tuning.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("hypoll-r{core}"))
                .spawn(move || {
                    // Freezes the thread's CPU time as it exits, panic or not.
                    let _freeze = FreezeCpuOnExit(handles[index].clone());
                    let started = (|| -> Result<Running<S>, ReactorStartError> {
                        if !core_affinity::set_for_current(core_affinity::CoreId { id: core }) {
                            return Err(ReactorStartError::Pin);
                        }
                        crate::sys::set_timer_slack_ns(REACTOR_TIMER_SLACK_NS)
                            .map_err(ReactorStartError::TimerSlack)?;
                        let cpu = crate::sys::ThreadCpuClock::current()
                            .map_err(ReactorStartError::CpuClock)?;
                        handles[index].stats_cell().set_cpu_clock(cpu);
                        let policy = build_policy(&policy_spec, custom_policy.as_ref(), index)?;
                        let mut reactor = Reactor::new(index, rx, handles.clone(), policy, tuning)
                            .map_err(ReactorStartError::Setup)?;
                        // A panicking init is reported like a failing one, so `start` never
                        // waits on a thread that died.
                        let init = std::panic::AssertUnwindSafe(|| init(&mut reactor));
                        let state = std::panic::catch_unwind(init)
                            .map_err(|p| ReactorStartError::Panicked {
                                message: panic_message(p.as_ref()),
                            })?
                            .map_err(ReactorStartError::Init)?;
                        Ok(Running { reactor, state })
                    })();
                    match started {
                        Ok(mut running) => {
                            let _ = ready.send(Ok(core));
                            // Drop our sender: `start` must see the channel close if every
                            // other reactor is gone.
                            drop(ready);
                            let report = running.reactor.run(&mut running.state);
                            let output = exit(&mut running.reactor, running.state);
                            Some(report.with_output(output))
                        }
                        Err(source) => {
                            let _ = ready.send(Err((core, source)));
                            None
                        }
                    }
                });
            match spawned {
                Ok(thread) => set.threads.push((core, thread)),
                Err(e) => {
                    let _ = set.shutdown();
                    return Err(StartError::Reactor {
                        core,
                        source: ReactorStartError::Spawn(e),
                    });
                }
            }
        }
        drop(ready_tx);
        for _ in 0..set.threads.len() {
            let outcome = ready_rx.recv();
            let failure = match outcome {
                Ok(Ok(_)) => continue,
                Ok(Err((core, source))) => StartError::Reactor { core, source },
                // A thread panicked during init: its sender is gone.
                Err(_) => {
                    let report = set.shutdown();
                    let panic = report.panics.into_iter().next();
                    return Err(match panic {
                        Some(p) => StartError::Reactor {
                            core: p.core,
                            source: ReactorStartError::Panicked { message: p.message },
                        },
                        None => StartError::Reactor {
                            core: usize::MAX,
                            source: ReactorStartError::Exited,
                        },
                    });
                }
            };
            let _ = set.shutdown();
            return Err(failure);
        }
        Ok(set)
    }
}

impl<S, X> ReactorSet<S, X> {
    /// Handles to every reactor, in core order.
    pub fn handles(&self) -> &Arc<[ReactorHandle<S>]> {
        &self.handles
    }

    /// Reactors whose thread has ended (they panicked, or were stopped).
    pub fn finished(&self) -> Vec<usize> {
        self.threads
            .iter()
            .filter(|(_, t)| t.is_finished())
            .map(|(core, _)| *core)
            .collect()
    }

    /// Stops every reactor and joins its thread: each runs what is queued, lets its
    /// outstanding I/O complete (up to its shutdown timeout) and fails the rest with a
    /// clear status. Panics are reported, never a hang.
    pub fn shutdown(mut self) -> ShutdownReport<X> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> ShutdownReport<X> {
        for handle in self.handles.iter() {
            handle.stop();
        }
        let mut report = ShutdownReport::default();
        for (core, thread) in self.threads.drain(..) {
            match thread.join() {
                Ok(Some(exit)) => report.exits.push(exit),
                Ok(None) => {}
                Err(payload) => report.panics.push(ReactorPanic {
                    core,
                    message: panic_message(payload.as_ref()),
                }),
            }
        }
        report
    }
}

impl<S, X> Drop for ReactorSet<S, X> {
    /// Dropping a set stops and joins its reactors, so no thread outlives it.
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}

/// Freezes a reactor's CPU time when its thread exits: a thread's CPU clock id can be reused
/// by a later thread.
struct FreezeCpuOnExit<S>(ReactorHandle<S>);

impl<S> Drop for FreezeCpuOnExit<S> {
    fn drop(&mut self) {
        self.0.stats_cell().freeze_cpu();
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}
