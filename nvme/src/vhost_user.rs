//! `vhost-user:PATH`: a client of any vhost-user-blk back end (hypoll's own, SPDK's,
//! qemu-storage-daemon), built on libblkio's `virtio-blk-vhost-user` driver (the `blkio`
//! crate), so `hypoll bench` can measure such a back end under every policy.
//!
//! One vhost-user connection per device, opened with `queues` virtqueues; each reactor's
//! queue pair takes one of them. vhost-user needs every buffer to lie in memory the back
//! end has mapped, which an `IoBuf` from the heap does not: each queue pair maps a bounce
//! area of one slot per command and copies write data in and read data out. That copy is
//! the client's cost; the back end's (what a comparison of back ends measures) is not
//! touched by it.

use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, RawFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use blkio::{Blkio, Blkioq, Completion as BlkioCompletion, MemoryRegion as BlkioRegion, ReqFlags};

use crate::command::Command;
use crate::config::ConfigError;
use crate::qpair::{Completion, Controller, QueuePair, QueuePairError, SubmitError};
use crate::spec::{NamespaceInfo, Opcode, Status};

/// Largest transfer of one command: each queue pair maps this much per slot.
pub const SLOT_BYTES_MAX: u32 = 128 << 10;
/// Most virtqueues one device asks for.
pub const QUEUES_MAX: usize = 64;
/// Virtqueue size asked for, unless `depth=` says otherwise: the deepest queue pair.
pub const DEPTH_DEFAULT: usize = 256;

/// `vhost-user:PATH[,queues=N][,depth=D]`.
#[derive(Debug, Clone, PartialEq)]
pub struct VhostUserConfig {
    pub path: PathBuf,
    /// Virtqueues, one per reactor that attaches the device.
    pub queues: usize,
    /// Each virtqueue's size: the deepest queue pair.
    pub depth: usize,
}

impl VhostUserConfig {
    pub fn new(path: &str) -> VhostUserConfig {
        VhostUserConfig {
            path: PathBuf::from(path),
            queues: 1,
            depth: DEPTH_DEFAULT,
        }
    }

    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let bad = |expected: &str| ConfigError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            expected: expected.to_string(),
        };
        let number = |max: usize| {
            value
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=max).contains(n))
        };
        match key {
            "queues" => {
                self.queues = number(QUEUES_MAX).ok_or_else(|| bad("1 to 64 queues"))?;
            }
            "depth" => {
                self.depth = number(1024)
                    .filter(|n| n.is_power_of_two())
                    .ok_or_else(|| bad("a power of two from 1 to 1024"))?;
            }
            _ => {
                return Err(ConfigError::UnknownKey {
                    device: "vhost-user".into(),
                    key: key.into(),
                    accepted: "queues, depth".into(),
                })
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for VhostUserConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "vhost-user:{}", self.path.display())?;
        if self.queues != 1 {
            write!(f, ",queues={}", self.queues)?;
        }
        if self.depth != DEPTH_DEFAULT {
            write!(f, ",depth={}", self.depth)?;
        }
        Ok(())
    }
}

fn os(e: blkio::Error) -> std::io::Error {
    std::io::Error::other(format!("libblkio: {}", e.message()))
}

/// The connection and the virtqueues not yet taken by a queue pair.
struct Shared {
    blkio: Blkio,
    queues: Vec<Option<Blkioq>>,
}

/// A vhost-user-blk back end, connected.
pub struct VhostUserController {
    cfg: VhostUserConfig,
    ns: NamespaceInfo,
    discard: bool,
    write_zeroes: bool,
    shared: Arc<Mutex<Shared>>,
}

impl VhostUserController {
    /// Connects to the back end at `cfg.path` and starts its queues.
    pub fn open(cfg: &VhostUserConfig) -> std::io::Result<VhostUserController> {
        let path = cfg.path.to_str().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "a path that is not UTF-8")
        })?;
        let mut blkio = Blkio::new("virtio-blk-vhost-user").map_err(os)?;
        blkio.set_str("path", path).map_err(os)?;
        blkio.connect().map_err(os)?;
        blkio.set_i32("num-queues", cfg.queues as i32).map_err(os)?;
        blkio.set_i32("queue-size", cfg.depth as i32).map_err(os)?;
        let started = blkio.start().map_err(os)?;
        let lba = u32::try_from(blkio.get_i32("request-alignment").map_err(os)?).unwrap_or(512);
        let capacity = blkio.get_u64("capacity").map_err(os)?;
        let transfer = u32::try_from(blkio.get_i32("max-transfer").map_err(os)?)
            .ok()
            .filter(|&t| t > 0)
            .unwrap_or(SLOT_BYTES_MAX)
            .min(SLOT_BYTES_MAX);
        let discard = blkio.get_u64("max-discard-len").map_err(os)? > 0;
        let write_zeroes = blkio.get_u64("max-write-zeroes-len").map_err(os)? > 0;
        Ok(VhostUserController {
            cfg: cfg.clone(),
            ns: NamespaceInfo {
                nsid: 1,
                lba_size_bytes: lba,
                capacity_lbas: capacity / u64::from(lba),
                transfer_bytes_max: transfer,
            },
            discard,
            write_zeroes,
            shared: Arc::new(Mutex::new(Shared {
                blkio,
                queues: started.queues.into_iter().map(Some).collect(),
            })),
        })
    }
}

impl Controller for VhostUserController {
    fn describe(&self) -> String {
        self.cfg.to_string()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.ns
    }

    fn supports(&self, opcode: Opcode) -> bool {
        match opcode {
            Opcode::DatasetManagement => self.discard,
            Opcode::WriteZeroes => self.write_zeroes,
            _ => true,
        }
    }

    fn create_queue_pair(&self, depth: usize) -> Result<Box<dyn QueuePair>, QueuePairError> {
        if depth == 0 || depth > self.cfg.depth {
            return Err(QueuePairError::BadDepth {
                depth,
                max: self.cfg.depth,
            });
        }
        let mut shared = self.shared.lock().expect("never poisoned");
        let max = shared.queues.len();
        let queue = shared
            .queues
            .iter_mut()
            .find_map(Option::take)
            .ok_or(QueuePairError::NoQueuesLeft { max })?;
        let slot_bytes = self.ns.transfer_bytes_max as usize;
        let region = shared
            .blkio
            .alloc_mem_region(depth * slot_bytes)
            .map_err(os)?;
        if let Err(e) = shared.blkio.map_mem_region(&region) {
            shared.blkio.free_mem_region(&region);
            return Err(os(e).into());
        }
        if let Some(fd) = queue.get_completion_fd() {
            set_nonblocking(fd)?;
        }
        let segment_bytes = shared
            .blkio
            .get_i32("max-segment-len")
            .ok()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n > 0)
            .unwrap_or(slot_bytes);
        Ok(Box::new(VhostUserQueuePair {
            ns: self.ns,
            queue: Some(queue),
            shared: self.shared.clone(),
            region,
            slot_bytes,
            segment_bytes,
            slots: (0..depth)
                .map(|_| Slot {
                    tag: 0,
                    read_into: Vec::with_capacity(crate::SEGMENTS_MAX),
                    read_bytes: 0,
                    iov: Vec::with_capacity(slot_bytes.div_ceil(segment_bytes)),
                })
                .collect(),
            free: (0..depth).rev().collect(),
            reaped: (0..depth).map(|_| MaybeUninit::uninit()).collect(),
            early: Vec::with_capacity(depth),
        }))
    }
}

/// One command in flight: its tag, and where a read's data goes once it is in.
struct Slot {
    tag: u64,
    /// Where a read's data goes: (address, bytes) pieces in order.
    read_into: Vec<(*mut u8, usize)>,
    read_bytes: usize,
    /// The bounce slot as the back end's segments (at most its `size_max` each), kept until
    /// the request completes.
    iov: Vec<libc::iovec>,
}

/// One reactor's virtqueue.
pub struct VhostUserQueuePair {
    ns: NamespaceInfo,
    /// Dropped before the region it uses (see `Drop`).
    queue: Option<Blkioq>,
    shared: Arc<Mutex<Shared>>,
    region: BlkioRegion,
    slot_bytes: usize,
    /// The back end's largest segment (`size_max`): a transfer goes as segments of it.
    segment_bytes: usize,
    slots: Vec<Slot>,
    free: Vec<usize>,
    reaped: Vec<MaybeUninit<BlkioCompletion>>,
    /// Completions reaped outside `process_completions`, handed out by the next one.
    early: Vec<(usize, i32)>,
}

impl Drop for VhostUserQueuePair {
    fn drop(&mut self) {
        // The queue goes first: dropping it removes it from the driver, which then touches
        // no slot of the region.
        self.queue = None;
        let mut shared = self.shared.lock().expect("never poisoned");
        shared.blkio.unmap_mem_region(&self.region);
        shared.blkio.free_mem_region(&self.region);
    }
}

impl VhostUserQueuePair {
    fn queue(&mut self) -> &mut Blkioq {
        self.queue.as_mut().expect("present until dropped")
    }

    fn bounce(&self, slot: usize) -> *mut u8 {
        (self.region.addr + slot * self.slot_bytes) as *mut u8
    }

    /// Lays slot `slot`'s first `bytes` out as segments; returns (iovecs, count).
    fn segments(&mut self, slot: usize, bytes: usize) -> (*const libc::iovec, u32) {
        let base = self.bounce(slot) as usize;
        let seg = self.segment_bytes;
        let iov = &mut self.slots[slot].iov;
        iov.clear();
        iov.extend((0..bytes).step_by(seg).map(|at| libc::iovec {
            iov_base: (base + at) as *mut libc::c_void,
            iov_len: seg.min(bytes - at),
        }));
        (iov.as_ptr(), iov.len() as u32)
    }

    /// Hands what the back end has finished to libblkio's queue and takes what it has
    /// finished into `early`, without waiting.
    fn kick_and_reap(&mut self) {
        let mut reaped = std::mem::take(&mut self.reaped);
        let mut zero = Duration::ZERO;
        let n = self
            .queue()
            .do_io(&mut reaped, 0, Some(&mut zero), None)
            .unwrap_or(0);
        for c in &reaped[..n] {
            // SAFETY: `do_io` filled the first `n`.
            let c = unsafe { c.assume_init_read() };
            self.early.push((c.user_data, c.ret));
        }
        self.reaped = reaped;
    }
}

impl QueuePair for VhostUserQueuePair {
    unsafe fn submit(&mut self, cmd: &Command<'_>, tag: u64) -> Result<(), SubmitError> {
        cmd.check(self.ns.lba_size_bytes)?;
        let Some(slot) = self.free.pop() else {
            return Err(SubmitError::QueueFull {
                depth: self.slots.len(),
            });
        };
        let lba = u64::from(self.ns.lba_size_bytes);
        let start = cmd.slba() * lba;
        let bytes = u64::from(cmd.nlb()) * lba;
        let bounce = self.bounce(slot);
        let mut pieces = std::mem::take(&mut self.slots[slot].read_into);
        pieces.clear();
        match cmd.segments() {
            Some(segs) => pieces.extend(segs.iter().map(|s| (s.ptr(), s.len_bytes()))),
            None => pieces.push((cmd.buf_ptr(), cmd.buf_len_bytes())),
        }
        self.slots[slot].tag = tag;
        let fua = if cmd.fua() {
            ReqFlags::FUA
        } else {
            ReqFlags::empty()
        };
        match cmd.opcode() {
            Opcode::Read | Opcode::Write if bytes as usize > self.slot_bytes => {
                self.early.push((slot, -libc::EINVAL));
            }
            Opcode::Read => {
                self.slots[slot].read_bytes = bytes as usize;
                let (iov, n) = self.segments(slot, bytes as usize);
                self.queue().readv(start, iov, n, slot, ReqFlags::empty());
            }
            Opcode::Write => {
                let mut at = 0usize;
                for &(ptr, len) in &pieces {
                    let take = len.min(bytes as usize - at);
                    // SAFETY: the caller keeps the command's memory valid and unwritten
                    // by others until it completes (`submit`'s contract); the slot's
                    // bounce area is this queue pair's own, `slot_bytes` long.
                    unsafe { std::ptr::copy_nonoverlapping(ptr, bounce.add(at), take) };
                    at += take;
                }
                pieces.clear();
                let (iov, n) = self.segments(slot, bytes as usize);
                self.queue().writev(start, iov, n, slot, fua);
            }
            Opcode::Flush => self.queue().flush(slot, ReqFlags::empty()),
            Opcode::WriteZeroes => {
                let flags = if cmd.may_deallocate() {
                    ReqFlags::empty()
                } else {
                    ReqFlags::NO_UNMAP
                };
                self.queue().write_zeroes(start, bytes, slot, flags);
            }
            Opcode::DatasetManagement => {
                self.queue().discard(start, bytes, slot, ReqFlags::empty())
            }
        }
        if cmd.opcode() != Opcode::Read {
            pieces.clear();
        }
        self.slots[slot].read_into = pieces;
        // libblkio queues a request until `do_io`: hand it over now.
        self.kick_and_reap();
        Ok(())
    }

    fn process_completions(&mut self, max: usize, out: &mut dyn FnMut(Completion)) -> usize {
        if self.early.is_empty() {
            self.kick_and_reap();
        }
        let n = self.early.len().min(max);
        for i in 0..n {
            let (slot, ret) = self.early[i];
            let status = match ret {
                0 => Status::SUCCESS,
                r if r == -libc::EINVAL => Status::INVALID_FIELD,
                _ => Status::DATA_TRANSFER_ERROR,
            };
            if ret == 0 && !self.slots[slot].read_into.is_empty() {
                let mut at = 0usize;
                let bounce = self.bounce(slot);
                let total = self.slots[slot].read_bytes;
                for &(ptr, len) in &self.slots[slot].read_into {
                    let take = len.min(total - at);
                    // SAFETY: the read's buffer stays valid and the device's alone until
                    // this completion (`submit`'s contract); the bounce slot holds the data.
                    unsafe { std::ptr::copy_nonoverlapping(bounce.add(at), ptr, take) };
                    at += take;
                }
            }
            self.free.push(slot);
            out(Completion {
                tag: self.slots[slot].tag,
                status,
            });
        }
        self.early.drain(..n);
        n
    }

    fn interrupt_fd(&self) -> Option<BorrowedFd<'_>> {
        let fd: RawFd = self.queue.as_ref()?.get_completion_fd()?;
        // SAFETY: the fd belongs to the libblkio queue, which lives as long as `self`
        // (the borrow's lifetime).
        Some(unsafe { BorrowedFd::borrow_raw(fd) })
    }

    fn arm_interrupt(&mut self) {
        self.queue().set_completion_fd_enabled(true);
        if let Some(fd) = self.queue.as_ref().and_then(Blkioq::get_completion_fd) {
            drain_eventfd(fd);
        }
        // A completion that came before the fd was enabled signals nothing: look, and if
        // there is one, make the fd readable so the wait ends at once.
        self.kick_and_reap();
        if !self.early.is_empty() {
            if let Some(fd) = self.queue.as_ref().and_then(Blkioq::get_completion_fd) {
                signal_eventfd(fd);
            }
        }
    }

    fn disarm_interrupt(&mut self) {
        self.queue().set_completion_fd_enabled(false);
        if let Some(fd) = self.queue.as_ref().and_then(Blkioq::get_completion_fd) {
            drain_eventfd(fd);
        }
    }

    fn outstanding(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    fn depth(&self) -> usize {
        self.slots.len()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.ns
    }
}

/// Sets O_NONBLOCK on libblkio's completion eventfd: it is read only to reset it.
fn set_nonblocking(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: F_GETFL and F_SETFL on an fd the queue keeps open; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Resets an eventfd (non-blocking: nothing to read is fine).
fn drain_eventfd(fd: RawFd) {
    let mut value = 0u64;
    // SAFETY: reads 8 bytes into a live u64 from an open, non-blocking eventfd.
    unsafe { libc::read(fd, (&mut value as *mut u64).cast(), 8) };
}

/// Makes an eventfd readable.
fn signal_eventfd(fd: RawFd) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a live u64 to an open eventfd; a full counter is
    // readable already.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

#[cfg(test)]
mod tests {
    use crate::config::ConfigError;
    use crate::device::DeviceConfig;

    #[test]
    fn the_device_string_parses_and_prints_back() {
        for spec in [
            "vhost-user:/run/d.sock",
            "vhost-user:/run/d.sock,queues=4,depth=64",
        ] {
            let cfg: DeviceConfig = spec.parse().unwrap();
            assert_eq!(cfg.to_string(), spec);
        }
        for bad in [
            "vhost-user:",
            "vhost-user:/s,queues=0",
            "vhost-user:/s,queues=65",
            "vhost-user:/s,depth=100",
            "vhost-user:/s,size=1G",
        ] {
            let e = bad.parse::<DeviceConfig>().unwrap_err();
            assert!(
                matches!(
                    e,
                    ConfigError::BadValue { .. } | ConfigError::UnknownKey { .. }
                ),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn opening_a_socket_nobody_listens_on_fails_with_a_message() {
        let dir = tempfile::tempdir().unwrap();
        let spec = format!("vhost-user:{}", dir.path().join("none.sock").display());
        let cfg: DeviceConfig = spec.parse().unwrap();
        let e = cfg.open().err().expect("nothing listens there");
        assert!(e.to_string().contains("libblkio"), "{e}");
    }
}
