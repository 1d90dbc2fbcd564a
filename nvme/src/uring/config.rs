//! What a `uring:` device string says: the path, the keys it accepts
//! (`direct`, `size`, `lba`, `iopoll`, `taskrun`, `wait`, `sqpoll`, `sqpoll_idle_ms`,
//! `sqpoll_cpu`, `inline`, `atime`), how each value is read, the rules between keys, and the
//! canonical text a configuration prints as.

use std::fmt;
use std::path::PathBuf;

use super::atime::AtimeMode;
use crate::config::{parse_size_bytes, size_text, ConfigError};

/// Keys `uring:` accepts.
pub const URING_KEYS: &[&str] = &[
    "direct",
    "size",
    "lba",
    "iopoll",
    "taskrun",
    "wait",
    "sqpoll",
    "sqpoll_idle_ms",
    "sqpoll_cpu",
    "inline",
    "atime",
];

/// Logical block size of a file namespace when `lba=` is not given: 4 KiB suits O_DIRECT
/// on every common file system and disk.
pub const URING_FILE_LBA_BYTES: u32 = 4096;

/// How long a ring's submission thread (`sqpoll=on`) keeps polling for new entries before it
/// sleeps, when `sqpoll_idle_ms` is not given: the kernel's own default, written out so that
/// the device string means the same on every kernel.
pub const SQPOLL_IDLE_MS_DEFAULT: u32 = 1000;

/// The longest `sqpoll_idle_ms` accepted: a thread that spins longer than this after the
/// last submission is a core given away, not an idle policy.
pub const SQPOLL_IDLE_MS_MAX: u32 = 60_000;

/// One past the highest CPU number `sqpoll_cpu` accepts (`CPU_SETSIZE`); whether the CPU is
/// online and allowed is the kernel's to say when the ring is created.
pub const SQPOLL_CPU_LIMIT: u32 = 1024;

/// Whether to find completions by polling the device (`IORING_SETUP_IOPOLL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IopollMode {
    /// Poll when the device supports it (probed when opened), otherwise interrupts.
    Auto,
    /// Always interrupts.
    Off,
    /// Poll, or fail to open.
    On,
    /// io_uring's hybrid polling (sleep, then poll), or fail to open.
    Hybrid,
}

impl IopollMode {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            IopollMode::Auto => "auto",
            IopollMode::Off => "off",
            IopollMode::On => "on",
            IopollMode::Hybrid => "hybrid",
        }
    }
}

/// Where the kernel finishes a completion in interrupt mode. A read's completion is posted
/// into the ring by task work that runs in the submitting thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskRun {
    /// `IORING_SETUP_DEFER_TASKRUN` (Linux 6.1+; the default where the kernel has it): the
    /// task work waits for the reactor's next `io_uring_enter`, which the queue pair makes
    /// as soon as the ring's `IORING_SQ_TASKRUN` flag shows some pending, and the ring's
    /// eventfd fires for it. A sleeping reactor is not woken by a completion, nor a spinning
    /// one interrupted by an inter-processor interrupt.
    Defer,
    /// The kernel's default: a completion signals the thread, which runs the task work at
    /// once, waking it from a sleep (which then resumes) or interrupting its spin.
    Signal,
}

/// Whether reads and writes are carried out by the reactor's own thread when submitted
/// (`pread`/`pwrite`, or `preadv2`/`pwritev2` for several buffers or FUA) rather than handed
/// to io_uring.
///
/// A buffered read of a file in memory (tmpfs) copies pages that are already there, which
/// takes about as long as handing it over. But io_uring tries a buffered read inline only on
/// a file system that takes non-blocking reads (`RWF_NOWAIT`); tmpfs refuses them on some
/// kernels, and io_uring then hands every read and write to a worker thread of its own,
/// which costs a thread wake-up and a second thread's CPU per I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InlineMode {
    /// Inline where both hold: the file lives in memory (tmpfs, ramfs) and its file system
    /// refuses a non-blocking read (probed when the device is opened), with `direct=0` and
    /// `sqpoll=off`.
    Auto,
    /// Always through io_uring.
    Off,
    /// Always inline (needs `direct=0`): a read of a page that is not in memory then stops
    /// the reactor until the disk answers.
    On,
}

impl InlineMode {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            InlineMode::Auto => "auto",
            InlineMode::Off => "off",
            InlineMode::On => "on",
        }
    }
}

/// A parsed `uring:` device string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UringConfig {
    pub path: PathBuf,
    /// O_DIRECT (the default): bypass the page cache, so every read reaches the device.
    pub direct: bool,
    /// Expose only the first `size_bytes` of the file or device.
    pub size_bytes: Option<u64>,
    /// Logical block size; by default the block device's, or 4 KiB for a file.
    pub lba_bytes: Option<u32>,
    pub iopoll: IopollMode,
    /// Interrupt mode only: when completions are posted into the ring.
    pub taskrun: TaskRun,
    /// Interrupt mode only: a reactor whose only busy device is this one waits for its
    /// completions inside the ring (`wait=ring`, the default), or on the ring's eventfd in
    /// epoll (`wait=epoll`).
    pub ring_wait: bool,
    /// Open the file or block device without write access, so that nothing through this
    /// device can change it (a read-only export: [`DeviceConfig::read_only`]); writes,
    /// write zeroes and deallocations then fail. Not a key of the device string.
    ///
    /// [`DeviceConfig::read_only`]: crate::DeviceConfig::read_only
    pub read_only: bool,
    /// `sqpoll=on`: every ring of the device gets a kernel thread of its own that takes
    /// submissions from the ring (`IORING_SETUP_SQPOLL`), so a reactor hands entries over
    /// without `io_uring_enter` while that thread is awake.
    pub sqpoll: bool,
    /// `sqpoll_idle_ms`: how long the submission thread polls an empty ring before it sleeps
    /// (`sq_thread_idle`); [`SQPOLL_IDLE_MS_DEFAULT`] when not given. Needs `sqpoll=on`.
    pub sqpoll_idle_ms: Option<u32>,
    /// `sqpoll_cpu`: the CPU the submission thread is pinned to (`IORING_SETUP_SQ_AFF`);
    /// unpinned when not given. Needs `sqpoll=on`.
    pub sqpoll_cpu: Option<u32>,
    /// `inline`: reads and writes copied by the reactor itself (see [`InlineMode`]).
    pub inline: InlineMode,
    /// `atime`: whether each read through the page cache goes through the kernel's
    /// access-time check (see [`AtimeMode`]).
    pub atime: AtimeMode,
}

/// The submission thread's settings of a `sqpoll=on` device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SqPoll {
    pub idle_ms: u32,
    pub cpu: Option<u32>,
}

impl UringConfig {
    pub fn new(path: impl Into<PathBuf>) -> UringConfig {
        UringConfig {
            path: path.into(),
            direct: true,
            size_bytes: None,
            lba_bytes: None,
            iopoll: IopollMode::Auto,
            taskrun: TaskRun::Defer,
            ring_wait: true,
            read_only: false,
            sqpoll: false,
            sqpoll_idle_ms: None,
            sqpoll_cpu: None,
            inline: InlineMode::Auto,
            atime: AtimeMode::Coarse,
        }
    }

    /// The submission thread's settings, with `sqpoll=on`.
    pub fn sqpoll(&self) -> Option<SqPoll> {
        self.sqpoll.then(|| SqPoll {
            idle_ms: self.sqpoll_idle_ms.unwrap_or(SQPOLL_IDLE_MS_DEFAULT),
            cpu: self.sqpoll_cpu,
        })
    }

    /// The rules between keys, checked once every key is set: the submission thread's
    /// settings mean nothing without the thread, so they are refused rather than ignored.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.inline == InlineMode::On && self.direct {
            return Err(ConfigError::BadValue {
                key: "inline".to_string(),
                value: "on".to_string(),
                expected: "direct=0 with it (with O_DIRECT every read waits for the disk, \
                           which inline would make the reactor wait for too)"
                    .to_string(),
            });
        }
        if self.sqpoll {
            return Ok(());
        }
        let given = [
            ("sqpoll_idle_ms", self.sqpoll_idle_ms),
            ("sqpoll_cpu", self.sqpoll_cpu),
        ];
        match given.into_iter().find(|(_, v)| v.is_some()) {
            Some((key, Some(value))) => Err(ConfigError::BadValue {
                key: key.to_string(),
                value: value.to_string(),
                expected: "sqpoll=on with it (it sets io_uring's submission thread, which \
                           only sqpoll=on starts)"
                    .to_string(),
            }),
            _ => Ok(()),
        }
    }

    /// Sets one `key=value` of the device string.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let bad = |expected: &str| ConfigError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            expected: expected.to_string(),
        };
        match key {
            "direct" => {
                self.direct = match value {
                    "1" | "true" | "on" => true,
                    "0" | "false" | "off" => false,
                    _ => return Err(bad("0 or 1")),
                }
            }
            "size" => {
                self.size_bytes = Some(
                    parse_size_bytes(value)
                        .ok()
                        .filter(|v| *v > 0)
                        .ok_or_else(|| bad("a size such as 512M, 8G, 1T"))?,
                )
            }
            "lba" => {
                self.lba_bytes = Some(match value {
                    "512" => 512,
                    "4096" | "4k" | "4K" => 4096,
                    _ => return Err(bad("512 or 4096")),
                })
            }
            "iopoll" => {
                self.iopoll = match value {
                    "auto" => IopollMode::Auto,
                    "off" | "0" => IopollMode::Off,
                    "on" | "1" => IopollMode::On,
                    "hybrid" => IopollMode::Hybrid,
                    _ => return Err(bad("auto, on, off or hybrid")),
                }
            }
            "taskrun" => {
                self.taskrun = match value {
                    "defer" => TaskRun::Defer,
                    "signal" => TaskRun::Signal,
                    _ => return Err(bad("defer or signal")),
                }
            }
            "wait" => {
                self.ring_wait = match value {
                    "ring" => true,
                    "epoll" => false,
                    _ => return Err(bad("ring or epoll")),
                }
            }
            "sqpoll" => {
                self.sqpoll = match value {
                    "on" | "1" => true,
                    "off" | "0" => false,
                    _ => return Err(bad("on or off")),
                }
            }
            "sqpoll_idle_ms" => {
                self.sqpoll_idle_ms = Some(
                    value
                        .parse::<u32>()
                        .ok()
                        .filter(|ms| (1..=SQPOLL_IDLE_MS_MAX).contains(ms))
                        .ok_or_else(|| {
                            bad(&format!("milliseconds from 1 to {SQPOLL_IDLE_MS_MAX}"))
                        })?,
                )
            }
            "sqpoll_cpu" => {
                self.sqpoll_cpu = Some(
                    value
                        .parse::<u32>()
                        .ok()
                        .filter(|cpu| *cpu < SQPOLL_CPU_LIMIT)
                        .ok_or_else(|| bad(&format!("a CPU number below {SQPOLL_CPU_LIMIT}")))?,
                )
            }
            "inline" => {
                self.inline = match value {
                    "auto" => InlineMode::Auto,
                    "on" | "1" => InlineMode::On,
                    "off" | "0" => InlineMode::Off,
                    _ => return Err(bad("auto, on or off")),
                }
            }
            "atime" => {
                self.atime = match value {
                    "coarse" => AtimeMode::Coarse,
                    "kernel" => AtimeMode::Kernel,
                    _ => return Err(bad("coarse or kernel")),
                }
            }
            _ => {
                return Err(ConfigError::UnknownKey {
                    device: "uring".into(),
                    key: key.into(),
                    accepted: URING_KEYS.join(", "),
                })
            }
        }
        Ok(())
    }
}

/// The canonical device string: `uring:/path` and every key that differs from its default.
impl fmt::Display for UringConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "uring:{}", self.path.display())?;
        if !self.direct {
            write!(f, ",direct=0")?;
        }
        if let Some(size_bytes) = self.size_bytes {
            write!(f, ",size={}", size_text(size_bytes))?;
        }
        if let Some(lba_bytes) = self.lba_bytes {
            write!(f, ",lba={lba_bytes}")?;
        }
        if self.iopoll != IopollMode::Auto {
            write!(f, ",iopoll={}", self.iopoll.as_str())?;
        }
        if self.taskrun == TaskRun::Signal {
            write!(f, ",taskrun=signal")?;
        }
        if !self.ring_wait {
            write!(f, ",wait=epoll")?;
        }
        if self.sqpoll {
            write!(f, ",sqpoll=on")?;
        }
        if let Some(ms) = self.sqpoll_idle_ms {
            write!(f, ",sqpoll_idle_ms={ms}")?;
        }
        if let Some(cpu) = self.sqpoll_cpu {
            write!(f, ",sqpoll_cpu={cpu}")?;
        }
        if self.inline != InlineMode::Auto {
            write!(f, ",inline={}", self.inline.as_str())?;
        }
        if self.atime != AtimeMode::Coarse {
            write!(f, ",atime={}", self.atime.as_str())?;
        }
        Ok(())
    }
}
