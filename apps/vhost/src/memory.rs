//! A guest's memory, twice over. The control side ([`MemoryTable`]) maps the regions the
//! front end hands over (SET_MEM_TABLE, ADD_MEM_REG, REM_MEM_REG: memfds mapped shared) and
//! translates the front end's addresses of the rings into guest addresses. The reactor side
//! ([`Space`]) registers those mappings with the device on each reactor that owns one of
//! the guest's queues, so that requests are vectored I/O straight into guest memory, and
//! turns a guest buffer into the registered slices the reactor submits.
//!
//! The table publishes each new memory map through [`ConnShared`]: a generation counter the
//! rings read before they walk new requests (one atomic load, no lock on the I/O path), and
//! the map itself behind a mutex taken only when the generation moved. It also carries the
//! connection's hold: while a message that replaces or removes memory waits for the rings,
//! they take no new chains (`control.rs`, `ring/quiesce.rs`).

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hypoll_reactor::nvme::region::REGION_BYTES_MAX;
use hypoll_reactor::REGION_ALIGN_BYTES;
use hypoll_reactor::{DeviceId, MemoryRegion, Reactor, RegionSlice, RegionUseError, REGIONS_MAX};
use vm_memory::mmap::MmapRegion;
use vm_memory::{
    Address, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap,
};

use crate::host::HostMemory;
use crate::walk::Buffer;

/// Most regions a guest's memory table holds (vhost-user's GET_MAX_MEM_SLOTS): QEMU offers 8
/// by default; each region may take several registrations on a device.
pub const MEM_SLOTS_MAX: usize = 32;

/// Why a region of the front end's memory table was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    #[error("a region of {0} bytes (1 byte to 1 TiB)")]
    Size(u64),
    #[error("mmap_offset {0:#x} is not a multiple of the page size")]
    Offset(u64),
    #[error("the table holds {0} regions already")]
    Full(usize),
    #[error("region {gpa:#x}+{len:#x} overlaps another")]
    Overlap { gpa: u64, len: u64 },
    #[error("no region {gpa:#x}+{len:#x} to remove")]
    NoSuchRegion { gpa: u64, len: u64 },
    #[error("mapping the region: {0}")]
    Map(String),
}

/// One mapped region: where the guest sees it, where the front end sees it, and our mapping.
#[derive(Clone)]
struct Mapped {
    user_addr: u64,
    region: Arc<GuestRegionMmap>,
}

/// The guest's memory as the control connection knows it.
#[derive(Default)]
pub struct MemoryTable {
    regions: Vec<Mapped>,
}

/// What a connection shares with the rings it runs: the latest memory map, and the hold.
pub struct ConnShared {
    generation: AtomicU64,
    memory: Mutex<Option<Arc<HostMemory>>>,
    /// The epoch of the hold in force (0: none): while the front end's message that
    /// replaces or removes memory waits, the rings take no new chains and each says when
    /// everything it took is answered.
    hold: AtomicU64,
}

impl ConnShared {
    pub fn new() -> Arc<ConnShared> {
        Arc::new(ConnShared {
            generation: AtomicU64::new(0),
            memory: Mutex::new(None),
            hold: AtomicU64::new(0),
        })
    }

    /// The epoch of the hold in force, 0 if none.
    pub fn hold(&self) -> u64 {
        self.hold.load(Ordering::Acquire)
    }

    /// Puts hold `epoch` in force (0 lifts it).
    pub(crate) fn set_hold(&self, epoch: u64) {
        self.hold.store(epoch, Ordering::Release);
    }

    /// The generation of the latest map: a ring whose map is older reloads it.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The latest map and its generation.
    pub fn memory(&self) -> (u64, Option<Arc<HostMemory>>) {
        let memory = self
            .memory
            .lock()
            .expect("the memory lock is never poisoned");
        (self.generation.load(Ordering::Acquire), memory.clone())
    }

    fn publish(&self, memory: Option<Arc<HostMemory>>) {
        let mut slot = self
            .memory
            .lock()
            .expect("the memory lock is never poisoned");
        *slot = memory;
        // After the map: a ring that sees the new generation finds the new map.
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}

impl MemoryTable {
    /// Maps `len` bytes of `file` from `mmap_offset` as guest addresses `gpa..`, which the
    /// front end sees at `user_addr`.
    pub fn add(
        &mut self,
        gpa: u64,
        len: u64,
        user_addr: u64,
        mmap_offset: u64,
        file: File,
    ) -> Result<(), MemoryError> {
        if len == 0 || len > 1 << 40 || gpa.checked_add(len).is_none() {
            return Err(MemoryError::Size(len));
        }
        if !mmap_offset.is_multiple_of(REGION_ALIGN_BYTES as u64) {
            return Err(MemoryError::Offset(mmap_offset));
        }
        if self.regions.len() >= MEM_SLOTS_MAX {
            return Err(MemoryError::Full(MEM_SLOTS_MAX));
        }
        let overlaps = self.regions.iter().any(|m| {
            let start = m.region.start_addr().raw_value();
            gpa < start + m.region.len() && start < gpa + len
        });
        if overlaps {
            return Err(MemoryError::Overlap { gpa, len });
        }
        let mapping = MmapRegion::build(
            Some(FileOffset::new(file, mmap_offset)),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_NORESERVE,
        )
        .map_err(|e| MemoryError::Map(e.to_string()))?;
        let region =
            GuestRegionMmap::new(mapping, GuestAddress(gpa)).ok_or(MemoryError::Size(len))?;
        self.regions.push(Mapped {
            user_addr,
            region: Arc::new(region),
        });
        Ok(())
    }

    /// Forgets the region at `gpa` of `len` bytes (rings still using it keep its mapping
    /// until they let go).
    pub fn remove(&mut self, gpa: u64, len: u64) -> Result<(), MemoryError> {
        let at = self
            .regions
            .iter()
            .position(|m| m.region.start_addr().raw_value() == gpa && m.region.len() == len)
            .ok_or(MemoryError::NoSuchRegion { gpa, len })?;
        self.regions.swap_remove(at);
        Ok(())
    }

    /// Forgets every region.
    pub fn clear(&mut self) {
        self.regions.clear();
    }

    /// Publishes the table to the rings through `shared`, with the host addresses of its
    /// regions resolved once for the rings' accesses.
    pub fn publish(&self, shared: &ConnShared) {
        let mut regions: Vec<_> = self.regions.iter().map(|m| m.region.clone()).collect();
        regions.sort_by_key(|r| r.start_addr());
        let memory = GuestMemoryMmap::from_arc_regions(regions)
            .ok()
            .map(|m| Arc::new(HostMemory::new(Arc::new(m))));
        shared.publish(memory);
    }

    /// The guest address the front end's address `user_addr` stands for (a ring's address
    /// in SET_VRING_ADDR), if some region holds it.
    pub fn user_to_guest(&self, user_addr: u64) -> Option<u64> {
        self.regions.iter().find_map(|m| {
            let offset = user_addr.checked_sub(m.user_addr)?;
            (offset < m.region.len()).then(|| m.region.start_addr().raw_value() + offset)
        })
    }

    /// Regions mapped.
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }
}

/// A piece of guest memory registered with one device on one reactor: at most
/// [`REGION_BYTES_MAX`] of one mapped region.
#[derive(Clone, Copy, Debug)]
struct Piece {
    gpa: u64,
    len: u64,
    host: usize,
    registered: MemoryRegion,
}

/// One connection's guest memory on one reactor, registered with the export's device
/// there, shared by the connection's rings on that reactor.
pub struct Space {
    pub conn: Arc<ConnShared>,
    pub device: DeviceId,
    generation: u64,
    memory: Option<Arc<HostMemory>>,
    pieces: Vec<Piece>,
    /// Registrations of regions the guest gave up, refused while I/O used them, with the
    /// memory they map (kept mapped until they go).
    retired: Vec<(MemoryRegion, Arc<HostMemory>)>,
    /// Rings of the connection on this reactor.
    pub rings: usize,
}

impl Space {
    pub fn new(conn: Arc<ConnShared>, device: DeviceId) -> Space {
        Space {
            conn,
            device,
            generation: u64::MAX,
            memory: None,
            pieces: Vec::with_capacity(REGIONS_MAX),
            retired: Vec::new(),
            rings: 0,
        }
    }

    /// The memory map, reloaded and registered when the connection published a new one.
    /// A region that cannot be registered is logged and left out: requests into it fail.
    pub fn refresh<S>(&mut self, r: &mut Reactor<S>) -> Option<&Arc<HostMemory>> {
        if self.conn.generation() != self.generation {
            let (generation, memory) = self.conn.memory();
            self.generation = generation;
            self.register(r, memory);
        }
        self.retry_retired(r);
        self.memory.as_ref()
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Registers the regions of `memory` not registered yet; retires those it no longer has.
    fn register<S>(&mut self, r: &mut Reactor<S>, memory: Option<Arc<HostMemory>>) {
        let old = std::mem::replace(&mut self.memory, memory);
        let keep = |p: &Piece, memory: &Option<Arc<HostMemory>>| {
            memory.as_ref().is_some_and(|m| {
                m.guest().iter().any(|region| {
                    region.start_addr().raw_value() <= p.gpa
                        && p.gpa + p.len <= region.start_addr().raw_value() + region.len()
                        && region.as_ptr() as usize
                            == p.host - (p.gpa - region.start_addr().raw_value()) as usize
                })
            })
        };
        let mut kept = Vec::with_capacity(REGIONS_MAX);
        for p in self.pieces.drain(..) {
            if keep(&p, &self.memory) {
                kept.push(p);
            } else if let Some(old) = &old {
                self.retired.push((p.registered, old.clone()));
            }
        }
        self.pieces = kept;
        let Some(memory) = self.memory.clone() else {
            return;
        };
        for region in memory.guest().iter() {
            let gpa = region.start_addr().raw_value();
            if self
                .pieces
                .iter()
                .any(|p| p.gpa == gpa && p.host == region.as_ptr() as usize)
            {
                continue;
            }
            if let Err(e) = self.register_region(r, gpa, region.as_ptr(), region.len()) {
                tracing::warn!(
                    gpa,
                    len = region.len(),
                    "registering guest memory with the device failed ({e}): requests into \
                     it fail with IOERR"
                );
            }
        }
    }

    /// Registers one region, in pieces of at most `REGION_BYTES_MAX`, the last rounded up
    /// to whole pages (the mapping covers them).
    fn register_region<S>(
        &mut self,
        r: &mut Reactor<S>,
        gpa: u64,
        host: *mut u8,
        len: u64,
    ) -> Result<(), RegionUseError> {
        let align = REGION_ALIGN_BYTES as u64;
        let len_pages = len.div_ceil(align) * align;
        let mut at = 0u64;
        while at < len_pages {
            let piece = (len_pages - at).min(REGION_BYTES_MAX as u64);
            let ptr = host.wrapping_add(at as usize);
            // SAFETY: `ptr..ptr + piece` lies in a shared mapping of the guest's memory
            // (mmap maps whole pages, so the rounded-up tail is mapped too) that this space
            // keeps alive (`self.memory`, then `self.retired`) until the registration is
            // undone or the reactor, whose queue pairs go before its state, is gone. The
            // guest may write any of it at any time: that is a guest's own data race on its
            // own buffers, which the device reads or writes as the guest asked.
            let registered = unsafe { r.register_memory(self.device, ptr, piece as usize) }?;
            self.pieces.push(Piece {
                gpa: gpa + at,
                len: piece.min(len - at),
                host: ptr as usize,
                registered,
            });
            at += piece;
        }
        Ok(())
    }

    /// Unregisters what it can of the registrations of regions the guest gave up (those
    /// I/O still used when the map changed); nothing to do costs a length check.
    pub fn tidy<S>(&mut self, r: &mut Reactor<S>) {
        self.retry_retired(r);
    }

    /// Unregisters what it can of the retired registrations.
    fn retry_retired<S>(&mut self, r: &mut Reactor<S>) {
        if self.retired.is_empty() {
            return;
        }
        let device = self.device;
        self.retired
            .retain(|(region, _)| r.unregister_memory(device, *region).is_err());
    }

    /// Unregisters everything; returns whether all went (the caller keeps the space, and
    /// its mappings, while some are still in use).
    pub fn release<S>(&mut self, r: &mut Reactor<S>) -> bool {
        if let Some(memory) = self.memory.take() {
            for p in self.pieces.drain(..) {
                self.retired.push((p.registered, memory.clone()));
            }
        }
        self.retry_retired(r);
        self.retired.is_empty()
    }

    /// Appends the registered slices that hold `buf` to `out`. Returns false (nothing
    /// appended past `out`'s length at the call) if part of it is not registered, or the
    /// slices would run past `max`.
    pub fn slices(&self, buf: &Buffer, out: &mut Vec<RegionSlice>, max: usize) -> bool {
        let start_len = out.len();
        let mut gpa = buf.addr;
        let mut left = u64::from(buf.len);
        while left > 0 {
            let Some(p) = self
                .pieces
                .iter()
                .find(|p| p.gpa <= gpa && gpa < p.gpa + p.len)
            else {
                out.truncate(start_len);
                return false;
            };
            let offset = gpa - p.gpa;
            let take = left.min(p.len - offset);
            let slice = RegionSlice::new(p.registered, offset as usize, take as usize);
            match slice {
                Some(s) if out.len() < max => out.push(s),
                _ => {
                    out.truncate(start_len);
                    return false;
                }
            }
            gpa += take;
            left -= take;
        }
        true
    }
}
