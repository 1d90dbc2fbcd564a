//! One front end's control connection: the vhost-user messages that set a device up
//! (features, the memory table, each ring's size, addresses, base and eventfds) as the
//! `vhost` crate's [`VhostUserBackendReqHandlerMut`], answered on the reactor that holds
//! the connection. A ring whose setup is complete and that is enabled starts on the reactor
//! that owns it (ring `i` on reactor `i % reactors`), by a message carrying everything it
//! needs; it stops the same way, and tells this reactor when it has. With INFLIGHT_SHMFD
//! each ring starts with its region of the front end's inflight area (`inflight.rs`).
//!
//! A message that replaces or removes guest memory while rings run (SET_MEM_TABLE,
//! REM_MEM_REG) is handled only once every running ring has answered all it took under
//! the old map (`Control::quiesce`; the connection waits out of the reactor's way,
//! `conn.rs`): its answer tells the front end that no request uses the old memory any
//! more, as the kernel's vhost ioctl returning does.

use std::fs::File;
use std::sync::{Arc, Mutex};

use hypoll_reactor::ReactorHandle;
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight,
    VhostUserLog, VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserSharedMsg, VhostUserSingleMemoryRegion, VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{
    BackendReqHandler, Error, GpuBackend, Result, VhostUserBackendReqHandlerMut,
};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use crate::blk::{Geometry, VHOST_USER_F_PROTOCOL_FEATURES};
use crate::inflight::{InflightArea, InflightQueue};
use crate::memory::{ConnShared, MemoryTable, MEM_SLOTS_MAX};
use crate::ring::{send, RingShared, RingStart};
use crate::shard::VhostState;

/// Largest queue a front end may set up: bounds what one ring reserves (a slot, a chain
/// entry and an inbox entry per descriptor).
pub const QUEUE_SIZE_MAX: u16 = 1024;

/// One ring as the front end set it up.
#[derive(Default)]
struct RingSetup {
    size: u16,
    /// Guest addresses of the descriptor table, avail and used rings, once set.
    addrs: Option<(u64, u64, u64)>,
    base: u16,
    kick: Option<File>,
    call: Option<File>,
    err: Option<File>,
    enabled: bool,
    /// A kick eventfd arrived since the ring last stopped (vhost-user starts a ring then).
    kicked: bool,
    running: Option<(usize, Arc<RingShared>)>,
}

/// The back end of one control connection, for the `vhost` crate's request handler.
pub struct Control<S> {
    export: usize,
    geometry: Geometry,
    handles: Arc<[ReactorHandle<S>]>,
    /// This connection's reactor and key there, for a ring to say it stopped.
    home: (usize, usize),
    features: u64,
    protocol: u64,
    table: MemoryTable,
    conn: Arc<ConnShared>,
    rings: Vec<RingSetup>,
    /// The front end's inflight area (GET_INFLIGHT_FD or SET_INFLIGHT_FD), if it uses one.
    inflight: Option<Arc<InflightArea>>,
    /// The last hold epoch used (see [`Control::quiesce`]).
    hold_epoch: u64,
    /// The server is stopping: no ring starts again.
    draining: bool,
}

/// The handler of one connection, as the reactor holds it.
pub(crate) type Handler<S> = BackendReqHandler<Mutex<Control<S>>>;

impl<S: VhostState> Control<S> {
    pub(crate) fn new(
        export: usize,
        geometry: Geometry,
        handles: Arc<[ReactorHandle<S>]>,
        home: (usize, usize),
    ) -> Control<S> {
        Control {
            export,
            geometry,
            handles,
            home,
            features: 0,
            protocol: 0,
            table: MemoryTable::default(),
            conn: ConnShared::new(),
            rings: (0..geometry.num_queues)
                .map(|_| RingSetup::default())
                .collect(),
            inflight: None,
            hold_epoch: 0,
            draining: false,
        }
    }

    fn ring(&mut self, index: u32) -> Result<&mut RingSetup> {
        self.rings
            .get_mut(index as usize)
            .ok_or(Error::InvalidParam)
    }

    fn acked(&self, bit: u32) -> bool {
        self.features & 1 << bit != 0
    }

    /// Starts ring `index` on its reactor if its setup is complete and it may run.
    fn maybe_start(&mut self, index: usize) {
        let reactors = self.handles.len();
        let may_run = self.acked(VHOST_USER_F_PROTOCOL_FEATURES);
        let event_idx = self.acked(VIRTIO_RING_F_EVENT_IDX);
        let indirect = self.acked(VIRTIO_RING_F_INDIRECT_DESC);
        let memory = !self.table.is_empty();
        let home = self.handles[self.home.0].clone();
        let key = self.home.1;
        let area = self.inflight.clone();
        let ring = &mut self.rings[index];
        let ready =
            ring.kicked && (ring.enabled || !may_run) && ring.running.is_none() && !self.draining;
        let (Some((desc, avail, used)), Some(kick), true, true) =
            (ring.addrs, &ring.kick, ready && ring.size > 0, memory)
        else {
            return;
        };
        let clone = |f: &Option<File>| f.as_ref().and_then(|f| f.try_clone().ok());
        let Ok(kick) = kick.try_clone() else {
            tracing::warn!("duplicating a kick eventfd failed");
            return;
        };
        let inflight = area.and_then(|area| {
            let q = InflightQueue::new(area, index as u16, ring.size);
            if q.is_none() {
                tracing::warn!(
                    ring = index,
                    "the inflight area has no region for this ring: its requests are not tracked"
                );
            }
            q
        });
        let shared = RingShared::new();
        let start = RingStart {
            export: self.export,
            conn: self.conn.clone(),
            shared: shared.clone(),
            queue_size: ring.size,
            desc,
            avail,
            used,
            base: ring.base,
            event_idx,
            indirect,
            kick,
            call: clone(&ring.call),
            err: clone(&ring.err),
            inflight,
            tell_control: Box::new(move || {
                send(&home, move |r, s: &mut S| s.vhost().resume_control(r, key));
            }),
        };
        let owner = index % reactors;
        if send(&self.handles[owner], move |r, s: &mut S| {
            s.vhost().start_ring(r, start)
        }) {
            ring.running = Some((owner, shared));
        }
    }

    /// Asks ring `index` to stop if it runs. Returns whether it runs still (the caller
    /// waits for it before answering GET_VRING_BASE).
    pub(crate) fn stop_ring(&mut self, index: usize) -> bool {
        let Some(RingSetup {
            running: Some((owner, shared)),
            ..
        }) = self.rings.get(index)
        else {
            return false;
        };
        if shared.stopped().is_some() {
            return false;
        }
        shared.request_stop();
        // Wake the owner, which may be parked.
        send(&self.handles[*owner], |_, _| {});
        true
    }

    /// Asks every running ring to stop (the connection closed or the owner reset it).
    pub(crate) fn stop_all(&mut self) {
        for i in 0..self.rings.len() {
            self.stop_ring(i);
        }
    }

    /// Holds the rings before a message that replaces or removes guest memory: each running
    /// ring takes no new chain and, once all it took is answered, tells this connection.
    /// Returns whether some ring has not yet (the connection waits for it before it reads
    /// the message). No running ring: nothing to wait for. On a stopping server the rings
    /// are stopping already (each answers what it took, then tells this connection): the
    /// message waits until every one has stopped, not only the first.
    pub(crate) fn quiesce(&mut self) -> bool {
        if self.draining {
            return self.rings.iter().any(RingSetup::runs);
        }
        if self.conn.hold() == 0 {
            if !self.rings.iter().any(|r| r.runs()) {
                return false;
            }
            self.hold_epoch += 1;
            self.conn.set_hold(self.hold_epoch);
            // Wake the owners: a parked ring with nothing in flight says so at once.
            self.wake_rings();
        }
        let epoch = self.conn.hold();
        self.rings.iter().any(|r| {
            r.running
                .as_ref()
                .is_some_and(|(_, s)| s.stopped().is_none() && s.quiet() != epoch)
        })
    }

    /// Lifts the hold, if any: the rings take the new map and go on.
    pub(crate) fn release(&mut self) {
        if self.conn.hold() != 0 {
            self.conn.set_hold(0);
            self.wake_rings();
        }
    }

    /// Sends an empty message to the owner of every running ring (it may be parked).
    fn wake_rings(&self) {
        for ring in &self.rings {
            if let Some((owner, _)) = &ring.running {
                send(&self.handles[*owner], |_, _| {});
            }
        }
    }

    /// The server is stopping: every ring stops (answering what it took) and none starts
    /// again.
    pub(crate) fn drain(&mut self) {
        self.draining = true;
        self.release();
        self.stop_all();
    }

    /// Forgets the rings that have stopped, keeping each one's next avail index as its base.
    fn reap_stopped(&mut self, index: usize) -> Option<u16> {
        let ring = self.rings.get_mut(index)?;
        let (_, shared) = ring.running.as_ref()?;
        let base = shared.stopped()?;
        ring.running = None;
        ring.kicked = false;
        if let Some(base) = base {
            ring.base = base;
        }
        Some(ring.base)
    }
}

impl RingSetup {
    /// Whether the ring runs (started, and not stopped).
    fn runs(&self) -> bool {
        self.running
            .as_ref()
            .is_some_and(|(_, s)| s.stopped().is_none())
    }
}

impl<S: VhostState> VhostUserBackendReqHandlerMut for Control<S> {
    fn set_owner(&mut self) -> Result<()> {
        Ok(())
    }

    fn reset_owner(&mut self) -> Result<()> {
        self.stop_all();
        Ok(())
    }

    fn reset_device(&mut self) -> Result<()> {
        self.stop_all();
        Ok(())
    }

    fn get_features(&mut self) -> Result<u64> {
        Ok(self.geometry.features())
    }

    fn set_features(&mut self, features: u64) -> Result<()> {
        if features & !self.geometry.features() != 0 {
            return Err(Error::InvalidParam);
        }
        self.features = features;
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        regions: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy: Option<bool>,
    ) -> Result<Option<Vec<VhostUserMemoryRegionBase>>> {
        if regions.len() != files.len() {
            return Err(Error::InvalidParam);
        }
        self.table.clear();
        for (region, file) in regions.iter().zip(files) {
            let added = self.table.add(
                region.guest_phys_addr,
                region.memory_size,
                region.user_addr,
                region.mmap_offset,
                file,
            );
            if let Err(e) = added {
                tracing::warn!("a front end's memory region was refused: {e}");
                return Err(Error::InvalidParam);
            }
        }
        self.table.publish(&self.conn);
        for i in 0..self.rings.len() {
            self.maybe_start(i);
        }
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> Result<()> {
        if num == 0 || num > u32::from(QUEUE_SIZE_MAX) || !num.is_power_of_two() {
            return Err(Error::InvalidParam);
        }
        self.ring(index)?.size = num as u16;
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> Result<()> {
        let guest = |a| self.table.user_to_guest(a).ok_or(Error::InvalidParam);
        let addrs = (guest(descriptor)?, guest(available)?, guest(used)?);
        self.ring(index)?.addrs = Some(addrs);
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> Result<()> {
        self.ring(index)?.base = u16::try_from(base).map_err(|_| Error::InvalidParam)?;
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> Result<VhostUserVringState> {
        // The connection waited for the ring to stop before it read this message.
        let base = match self.reap_stopped(index as usize) {
            Some(base) => base,
            None => {
                let ring = self.ring(index)?;
                if ring.running.is_some() {
                    return Err(Error::InvalidOperation("the ring has not stopped"));
                }
                ring.kicked = false;
                ring.base
            }
        };
        Ok(VhostUserVringState::new(index, u32::from(base)))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        let Some(fd) = fd else {
            // Polling without a kick eventfd is not offered.
            return Err(Error::InvalidParam);
        };
        let ring = self.ring(u32::from(index))?;
        ring.kick = Some(fd);
        ring.kicked = true;
        self.maybe_start(usize::from(index));
        Ok(())
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        let handles = self.handles.clone();
        let ring = self.ring(u32::from(index))?;
        if let Some((owner, shared)) = &ring.running {
            shared.set_call(fd.as_ref().and_then(|f| f.try_clone().ok()));
            send(&handles[*owner], |_, _| {});
        }
        ring.call = fd;
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        self.ring(u32::from(index))?.err = fd;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> Result<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD)
    }

    fn set_protocol_features(&mut self, features: u64) -> Result<()> {
        self.protocol = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> Result<u64> {
        Ok(u64::from(self.geometry.num_queues))
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> Result<()> {
        self.ring(index)?.enabled = enable;
        if enable {
            self.maybe_start(index as usize);
        } else {
            self.stop_ring(index as usize);
        }
        Ok(())
    }

    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> Result<Vec<u8>> {
        let config = self.geometry.config();
        let end = offset.checked_add(size).ok_or(Error::InvalidParam)? as usize;
        config
            .get(offset as usize..end)
            .map(<[u8]>::to_vec)
            .ok_or(Error::InvalidParam)
    }

    fn set_config(
        &mut self,
        _offset: u32,
        _buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> Result<()> {
        Err(Error::InvalidOperation("the config space is read-only"))
    }

    fn set_gpu_socket(&mut self, _gpu: GpuBackend) -> Result<()> {
        Err(Error::InvalidOperation("not a GPU"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> Result<File> {
        Err(Error::InvalidOperation("no shared objects"))
    }

    fn get_inflight_fd(
        &mut self,
        inflight: &VhostUserInflight,
    ) -> Result<(VhostUserInflight, File)> {
        let (area, file) =
            InflightArea::create(inflight.num_queues, inflight.queue_size).map_err(|e| {
                tracing::warn!("a front end's inflight area was refused: {e}");
                Error::InvalidParam
            })?;
        let answer =
            VhostUserInflight::new(area.size_bytes(), 0, area.num_queues(), area.queue_size());
        self.inflight = Some(area);
        Ok((answer, file))
    }

    fn set_inflight_fd(&mut self, inflight: &VhostUserInflight, file: File) -> Result<()> {
        let area = InflightArea::open(
            file,
            inflight.mmap_offset,
            inflight.mmap_size,
            inflight.num_queues,
            inflight.queue_size,
        )
        .map_err(|e| {
            tracing::warn!("a front end's inflight area was refused: {e}");
            Error::InvalidParam
        })?;
        // Rings started from here on record into it (and resume from what it holds).
        self.inflight = Some(area);
        Ok(())
    }

    fn get_max_mem_slots(&mut self) -> Result<u64> {
        Ok(MEM_SLOTS_MAX as u64)
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        _postcopy: Option<bool>,
    ) -> Result<Option<VhostUserMemoryRegionBase>> {
        let added = self.table.add(
            region.guest_phys_addr,
            region.memory_size,
            region.user_addr,
            region.mmap_offset,
            fd,
        );
        if let Err(e) = added {
            tracing::warn!("a front end's memory region was refused: {e}");
            return Err(Error::InvalidParam);
        }
        // A front end adds its regions one by one when it connects, and again when the
        // guest's memory is plugged in: an operator sees both.
        log_region("added", region, self.table.len());
        // Published before the answer: a request the front end posts into the region
        // after it read the answer finds the region in the ring's map.
        self.table.publish(&self.conn);
        for i in 0..self.rings.len() {
            self.maybe_start(i);
        }
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> Result<()> {
        self.table
            .remove(region.guest_phys_addr, region.memory_size)
            .map_err(|_| Error::InvalidParam)?;
        log_region("removed", region, self.table.len());
        self.table.publish(&self.conn);
        Ok(())
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> Result<Option<File>> {
        Err(Error::InvalidOperation("DEVICE_STATE is not offered"))
    }

    fn check_device_state(&mut self) -> Result<()> {
        Err(Error::InvalidOperation("DEVICE_STATE is not offered"))
    }

    fn get_shmem_config(&mut self) -> Result<VhostUserShMemConfig> {
        Err(Error::InvalidOperation("no shared memory regions"))
    }

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> Result<()> {
        Err(Error::InvalidOperation("LOG_SHMFD is not offered"))
    }
}

/// Logs (at info) that a front end `did` ("added", "removed") `region`, leaving `regions`.
fn log_region(did: &str, region: &VhostUserSingleMemoryRegion, regions: usize) {
    // The message is packed: its fields are copied out, not borrowed.
    let (gpa, size) = (region.guest_phys_addr, region.memory_size);
    tracing::info!(
        gpa = format_args!("{gpa:#x}"),
        size_kib = size >> 10,
        regions,
        "a front end {did} a memory region"
    );
}
