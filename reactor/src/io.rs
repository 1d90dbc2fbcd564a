//! The I/O API's types: requests, completions, rejections and attached devices.

use std::sync::Arc;
use std::time::Duration;

use hypoll_nvme::{
    ConfigError, Controller, DeviceConfig, IoBuf, MemoryRegion, QueuePairError, Status, SubmitError,
};
use hypoll_policy::{DeviceStats, StatsConfigError};

/// A device as reactors share it: its controller and its shared completion statistics (each
/// reactor records its own and publishes them here every window).
#[derive(Clone)]
pub struct Device {
    pub ctrl: Arc<dyn Controller>,
    pub stats: Arc<DeviceStats>,
}

impl Device {
    /// Wraps a controller, with statistics windows of the default 100 ms.
    pub fn new(ctrl: Arc<dyn Controller>) -> Device {
        Device {
            ctrl,
            stats: DeviceStats::new(),
        }
    }

    /// Opens a device from a spec string (`emu:optane`, `null`).
    pub fn open(spec: &str) -> Result<Device, DeviceError> {
        let parsed: DeviceConfig = spec.parse()?;
        let ctrl = parsed.open().map_err(|source| DeviceError::Open {
            spec: spec.to_string(),
            source,
        })?;
        Ok(Device::new(ctrl))
    }

    /// Uses statistics windows of `window_ms` instead of 100 ms.
    pub fn with_window_ms(mut self, window_ms: u64) -> Result<Device, StatsConfigError> {
        self.stats = DeviceStats::with_window_ms(window_ms)?;
        Ok(self)
    }
}

/// Why [`Device::open`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The device string does not parse: the parser's own error, as it is.
    #[error("device string: {0}")]
    Config(#[from] ConfigError),
    /// The device string parsed, but the device did not open (a missing file, a function
    /// not bound to vfio-pci...): the OS or backend error is the source.
    #[error("opening {spec}: {source}")]
    Open {
        spec: String,
        #[source]
        source: std::io::Error,
    },
}

/// Why [`Reactor::attach`](crate::Reactor::attach) refused a device. Nothing was attached.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttachError {
    /// The reactor already holds `max` ([`DEVICES_MAX`](crate::DEVICES_MAX)) devices.
    #[error("a reactor attaches at most {max} devices")]
    TooManyDevices { max: usize },
    /// [`DeviceOptions::io_timeout`] was `Some(0)`: use `None` for no timeout.
    #[error("io_timeout must be more than 0 (or None: never)")]
    ZeroIoTimeout,
    /// [`DeviceOptions::wait_queue`] is over `max` ([`WAIT_QUEUE_MAX`]).
    #[error("wait_queue {wait_queue} is over the limit of {max}")]
    WaitQueueTooLong { wait_queue: usize, max: usize },
    /// The controller could not create a queue pair (a depth out of range, no queues
    /// left, an OS error): its error is the source.
    #[error("{device}: {source}")]
    QueuePair {
        /// The device, as its controller describes itself.
        device: String,
        #[source]
        source: QueuePairError,
    },
    /// The queue pair's interrupt fd could not join the reactor's epoll set.
    #[error("watching the interrupt fd: {0}")]
    Interrupt(#[source] std::io::Error),
}

/// Default [`DeviceOptions::io_timeout`]: 30 s, as Linux's NVMe driver (`io_timeout`).
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Default [`DeviceOptions::abort_timeout`].
pub const DEFAULT_ABORT_TIMEOUT: Duration = Duration::from_secs(1);
/// Default [`DeviceOptions::reset_timeout`].
pub const DEFAULT_RESET_TIMEOUT: Duration = Duration::from_secs(1);
/// Most I/Os [`DeviceOptions::wait_queue`] lets wait for a slot, per device and reactor.
pub const WAIT_QUEUE_MAX: usize = 4096;

/// How a reactor attaches a device: the queue depth, and how long an I/O may take before
/// the reactor recovers it (see docs/reactor.md, "Timeouts").
///
/// An I/O outstanding for `io_timeout` is aborted ([`hypoll_nvme::QueuePair::abort`]); if
/// its completion has not arrived `abort_timeout` later (or the device cannot abort), the
/// queue pair is reset ([`hypoll_nvme::QueuePair::reset`]), which completes every command
/// on it; whatever has still not completed `reset_timeout` after that (or if the device
/// cannot reset) is failed locally with [`IoFailure::Abandoned`]. So every I/O's callback
/// runs within `io_timeout + abort_timeout + reset_timeout` (plus one loop turn).
///
/// A full queue pair refuses a submission at once, handing everything back ([`Rejected`]),
/// unless [`DeviceOptions::wait_queue`] lets it wait; that default is deliberate (see the
/// field, and docs/reactor.md, "Refusals and back-pressure").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceOptions {
    /// Queue depth of the reactor's queue pair on the device.
    pub depth: usize,
    /// `None`: never time out (only for devices that cannot lose a command).
    pub io_timeout: Option<Duration>,
    pub abort_timeout: Duration,
    pub reset_timeout: Duration,
    /// How many I/Os may wait, in order, for a slot when the queue pair is full, instead of
    /// being refused with `QueueFull`. Their timeout runs from the moment they were
    /// accepted; at most [`WAIT_QUEUE_MAX`].
    ///
    /// The default is 0, refuse at once, on purpose: a refusal hands back everything
    /// ([`Rejected`]: request, buffer, callback), so a caller loses nothing by it and is the
    /// one that knows whether to retry after completions, hold a client back or answer it;
    /// a wait queue only moves the limit (depth + `wait_queue`) and turns overload into
    /// latency, then timeouts. Set it for first come, first served waiting in the reactor.
    pub wait_queue: usize,
}

impl DeviceOptions {
    /// `depth`, with the default timeouts.
    pub fn new(depth: usize) -> DeviceOptions {
        DeviceOptions {
            depth,
            io_timeout: Some(DEFAULT_IO_TIMEOUT),
            abort_timeout: DEFAULT_ABORT_TIMEOUT,
            reset_timeout: DEFAULT_RESET_TIMEOUT,
            wait_queue: 0,
        }
    }

    pub fn with_wait_queue(mut self, wait_queue: usize) -> DeviceOptions {
        self.wait_queue = wait_queue;
        self
    }

    pub fn with_io_timeout(mut self, io_timeout: Option<Duration>) -> DeviceOptions {
        self.io_timeout = io_timeout;
        self
    }

    pub fn with_abort_timeout(mut self, abort_timeout: Duration) -> DeviceOptions {
        self.abort_timeout = abort_timeout;
        self
    }

    pub fn with_reset_timeout(mut self, reset_timeout: Duration) -> DeviceOptions {
        self.reset_timeout = reset_timeout;
        self
    }
}

/// A device attached to one reactor: its position in the order of `Reactor::attach` calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceId(pub(crate) u16);

impl DeviceId {
    /// The first device a reactor attached.
    pub const FIRST: DeviceId = DeviceId(0);

    /// The device attached `index`-th (from 0).
    pub fn from_index(index: u16) -> DeviceId {
        DeviceId(index)
    }

    pub fn index(self) -> u16 {
        self.0
    }
}

/// What an I/O does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoOp {
    Read,
    Write,
    Flush,
    WriteZeroes,
    Deallocate,
}

/// One I/O as an application asks for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoRequest {
    pub op: IoOp,
    pub slba: u64,
    /// Blocks, counted from 1.
    pub nlb: u32,
    /// Force Unit Access, for writes.
    pub fua: bool,
    /// For Write Zeroes: the device may deallocate the blocks (see
    /// `hypoll_nvme::Command::with_deallocate`); without it they stay allocated.
    pub deallocate: bool,
    /// Handed back in [`IoDone::user`]: state for the callback without an allocation.
    pub user: u64,
}

impl IoRequest {
    pub fn new(op: IoOp, slba: u64, nlb: u32) -> IoRequest {
        IoRequest {
            op,
            slba,
            nlb,
            fua: false,
            deallocate: false,
            user: 0,
        }
    }

    pub fn with_user(mut self, user: u64) -> IoRequest {
        self.user = user;
        self
    }

    pub fn with_fua(mut self, fua: bool) -> IoRequest {
        self.fua = fua;
        self
    }

    pub fn with_deallocate(mut self, deallocate: bool) -> IoRequest {
        self.deallocate = deallocate;
        self
    }
}

impl IoRequest {
    /// The request for `len_bytes` at byte `offset_bytes` of a device whose blocks are
    /// `lba_bytes` long ([`Reactor::lba_bytes`](crate::Reactor::lba_bytes)): for front ends
    /// whose clients count in bytes (NBD) or 512-byte sectors (virtio-blk). Refuses an
    /// offset or a length that is not whole blocks, and a length over what one command
    /// encodes, rather than rounding either.
    pub fn from_bytes(
        op: IoOp,
        offset_bytes: u64,
        len_bytes: u64,
        lba_bytes: u32,
    ) -> Result<IoRequest, AddressError> {
        let lba = u64::from(lba_bytes);
        if lba == 0 || !offset_bytes.is_multiple_of(lba) || !len_bytes.is_multiple_of(lba) {
            return Err(AddressError::NotWholeBlocks {
                offset_bytes,
                len_bytes,
                lba_bytes,
            });
        }
        let nlb = u32::try_from(len_bytes / lba).map_err(|_| AddressError::TooLong {
            len_bytes,
            lba_bytes,
        })?;
        Ok(IoRequest::new(op, offset_bytes / lba, nlb))
    }
}

/// A byte range of a region registered with a device
/// ([`Reactor::register_memory`](crate::Reactor::register_memory)): one segment of a
/// vectored I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionSlice {
    region: MemoryRegion,
    offset_bytes: usize,
    len_bytes: usize,
}

impl RegionSlice {
    /// `len_bytes` at `offset_bytes` into `region`; `None` if the range leaves the region or
    /// is empty.
    pub fn new(region: MemoryRegion, offset_bytes: usize, len_bytes: usize) -> Option<Self> {
        let end = offset_bytes.checked_add(len_bytes)?;
        (len_bytes > 0 && end <= region.len_bytes()).then_some(RegionSlice {
            region,
            offset_bytes,
            len_bytes,
        })
    }

    pub fn region(&self) -> MemoryRegion {
        self.region
    }

    pub fn offset_bytes(&self) -> usize {
        self.offset_bytes
    }

    pub fn len(&self) -> usize {
        self.len_bytes
    }

    /// Never: an empty range is not a slice (see [`RegionSlice::new`]).
    pub fn is_empty(&self) -> bool {
        self.len_bytes == 0
    }

    /// The first byte, inside the region by construction.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.region.ptr().wrapping_add(self.offset_bytes)
    }
}

/// Why registering or unregistering memory with an attached device failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegionUseError {
    #[error("no such device on this reactor")]
    UnknownDevice,
    #[error(transparent)]
    Register(#[from] hypoll_nvme::RegisterError),
    #[error(transparent)]
    Unregister(#[from] hypoll_nvme::UnregisterError),
}

/// Why [`IoRequest::from_bytes`] refused a byte range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddressError {
    #[error(
        "{len_bytes} bytes at byte {offset_bytes} is not whole blocks of {lba_bytes} bytes \
         (the device's block size)"
    )]
    NotWholeBlocks {
        offset_bytes: u64,
        len_bytes: u64,
        lba_bytes: u32,
    },
    #[error("{len_bytes} bytes is more blocks of {lba_bytes} bytes than one command counts")]
    TooLong { len_bytes: u64, lba_bytes: u32 },
}

/// Why an I/O failed after it was accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IoFailure {
    #[error("device returned {0}")]
    Device(Status),
    /// The reactor shut down before the device completed it; the queue pair was deleted.
    #[error("not completed before the reactor shut down")]
    Shutdown,
    /// The device did not complete it within the I/O timeout; the reactor aborted it (or
    /// reset the queue pair) and the device confirmed it is done with it. A write may or
    /// may not have reached the media. The buffer comes back.
    #[error("timed out: the device did not complete it in time and it was aborted")]
    TimedOut,
    /// Timed out, and the device could neither abort it nor reset its queue pair in time:
    /// the reactor gave up on it. The device may still carry it out until the queue pair is
    /// deleted (at shutdown), so the buffer is kept in quarantine until then (or until a
    /// late completion arrives) and `IoDone::buf` is `None`.
    #[error("timed out, and the device could not abort it or reset: abandoned")]
    Abandoned,
    /// It waited for a slot (see [`DeviceOptions::wait_queue`]) and the queue pair then
    /// refused it (for example because it was disabled); a warning in the log says why.
    /// An application that answers a refused submission through the callback its
    /// [`Rejected`] handed back may pass it too. (No payload: `IoDone` stays small, and it
    /// is copied for every I/O.)
    #[error("the queue pair refused it after it waited for a slot (see the log)")]
    Refused,
}

/// A completed I/O, handed to its callback.
#[derive(Debug)]
pub struct IoDone {
    pub device: DeviceId,
    pub result: Result<(), IoFailure>,
    /// The buffer given at submission, back to its owner (`None` for an I/O without one,
    /// and for [`IoFailure::Abandoned`]: the device may still use it).
    pub buf: Option<IoBuf>,
    pub user: u64,
    /// Completion seen by the reactor minus acceptance (`Reactor::submit`), time waiting
    /// for a queue slot included.
    pub latency_ns: u64,
}

/// Why an I/O was not accepted, with everything the caller gave `Reactor::submit` (or
/// `read`, `write`, ...) handed back: the device, the request, the buffer and the callback
/// itself, which never ran and never will unless the caller runs it. So a refused I/O can
/// be retried as it is (`r.submit(rejected.device, rejected.req, rejected.buf,
/// rejected.callback)`), queued until completions free a slot, or answered: whatever the
/// callback captured (a reply channel, a client's state) is still there.
///
/// `F` is the callback's own type, so neither a refusal nor a retry allocates.
#[non_exhaustive]
pub struct Rejected<F = IoCallback> {
    pub reason: RejectReason,
    pub device: DeviceId,
    /// The request as submitted. (A refused vectored I/O comes back with no buffer: submit
    /// it again with [`Reactor::submit_vectored`](crate::Reactor::submit_vectored) and its
    /// segments, not with `resubmit`.)
    pub req: IoRequest,
    pub buf: Option<IoBuf>,
    pub callback: F,
}

impl<F> Rejected<F> {
    /// The callback, boxed: to keep refusals of different callbacks in one queue.
    pub fn boxed<S>(self) -> Rejected<IoCallback<S>>
    where
        F: FnOnce(&mut crate::Reactor<S>, &mut S, IoDone) + 'static,
    {
        Rejected {
            reason: self.reason,
            device: self.device,
            req: self.req,
            buf: self.buf,
            callback: Box::new(self.callback),
        }
    }
}

impl<F> Rejected<F> {
    /// Answers the refused I/O through its own callback, as failed with
    /// [`IoFailure::Refused`] and its buffer handed back: for a caller that does not retry,
    /// so that whoever waits on the callback (a client's reply, a chain of I/Os) hears back.
    pub fn fail<S>(self, reactor: &mut crate::Reactor<S>, state: &mut S)
    where
        F: FnOnce(&mut crate::Reactor<S>, &mut S, IoDone),
    {
        let done = IoDone {
            device: self.device,
            result: Err(IoFailure::Refused),
            buf: self.buf,
            user: self.req.user,
            latency_ns: 0,
        };
        (self.callback)(reactor, state, done);
    }
}

/// A refusal's callback need not be `Debug`: it is shown as its type's name.
impl<F> std::fmt::Debug for Rejected<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rejected")
            .field("reason", &self.reason)
            .field("device", &self.device)
            .field("req", &self.req)
            .field("buf", &self.buf.as_ref().map(|b| b.len()))
            .field("callback", &std::any::type_name::<F>())
            .finish()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RejectReason {
    /// The queue pair refused it: full (back-pressure: retry after completions), or a
    /// command that cannot be built.
    #[error("{0}")]
    Submit(#[from] SubmitError),
    #[error("no such device on this reactor")]
    UnknownDevice,
    #[error("a read or write needs a buffer; other operations take none")]
    Buffer,
    #[error("the reactor is shutting down")]
    ShuttingDown,
    /// A vectored I/O with no segments, or more than a command carries.
    #[error("{count} segments: a vectored I/O takes 1 to {max}")]
    Segments { count: usize, max: usize },
    /// A vectored I/O's segment (by its position) is in a region not registered with
    /// this device on this reactor (or since unregistered).
    #[error("segment {segment} is not in a region registered with this device")]
    Unregistered { segment: usize },
    /// Every slot of the queue pair holds an abandoned command (see
    /// [`IoFailure::Abandoned`]): the device stopped completing commands and could not be
    /// reset. Retrying helps only once it completes them (or after a restart).
    #[error(
        "all {abandoned} queue slots hold abandoned commands: the device is not completing \
         commands; retry after it recovers"
    )]
    Quarantined { abandoned: usize },
}

impl RejectReason {
    /// Back-pressure: the queue pair (and its wait queue, if any) is full, and a retry after
    /// completions have freed a slot may succeed. Every other reason stays until something
    /// else changes (the request, the device, the reactor).
    pub fn is_queue_full(&self) -> bool {
        matches!(self, RejectReason::Submit(SubmitError::QueueFull { .. }))
    }
}

impl<F> std::fmt::Display for Rejected<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.reason.fmt(f)
    }
}

impl<F> std::error::Error for Rejected<F> {}

/// The callback an I/O runs on completion, on its reactor, given the reactor and its state
/// `S`. A closure that captures nothing (or a plain `fn`) costs no allocation; one that
/// captures state costs one small allocation per I/O: keep what the callback needs in the
/// reactor's state, and carry a number to find it by in [`IoRequest::user`].
pub type IoCallback<S = ()> = Box<dyn FnOnce(&mut crate::Reactor<S>, &mut S, IoDone)>;

#[cfg(test)]
mod tests {
    use super::*;

    /// Refusals are read in logs: one sentence each, with no run of spaces left by a line
    /// continuation in the source.
    #[test]
    fn refusal_messages_read_as_one_sentence() {
        let reasons = [
            RejectReason::UnknownDevice,
            RejectReason::Buffer,
            RejectReason::ShuttingDown,
            RejectReason::Quarantined { abandoned: 3 },
        ];
        for reason in reasons {
            let text = reason.to_string();
            assert!(!text.contains("  "), "{text:?}");
            assert!(!text.is_empty() && !text.ends_with(' '), "{text:?}");
        }
        assert!(RejectReason::Quarantined { abandoned: 3 }
            .to_string()
            .contains("all 3 queue slots"));
    }

    /// Bytes become blocks only when they are whole blocks; anything else is refused with
    /// the figures, never rounded.
    #[test]
    fn byte_ranges_become_blocks_only_when_whole() {
        let req = IoRequest::from_bytes(IoOp::Write, 8192, 4096, 512).unwrap();
        assert_eq!((req.op, req.slba, req.nlb), (IoOp::Write, 16, 8));
        let err = IoRequest::from_bytes(IoOp::Read, 4096, 1000, 512).unwrap_err();
        assert!(matches!(err, AddressError::NotWholeBlocks { .. }), "{err}");
        assert!(err.to_string().contains("1000 bytes at byte 4096"), "{err}");
        let err = IoRequest::from_bytes(IoOp::Read, 100, 4096, 4096).unwrap_err();
        assert!(matches!(err, AddressError::NotWholeBlocks { .. }));
        assert!(IoRequest::from_bytes(IoOp::Read, 0, 4096, 0).is_err());
        let err = IoRequest::from_bytes(IoOp::Read, 0, 512 << 32, 512).unwrap_err();
        assert!(matches!(err, AddressError::TooLong { .. }));
    }
}
