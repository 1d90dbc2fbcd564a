//! Memory the application owns, registered with a queue pair: the bookkeeping every device
//! shares.
//!
//! An embedder (or a front end whose data lives in a guest's memory or a socket buffer)
//! registers a region it allocated with [`QueuePair::register_memory`] and gets a
//! [`MemoryRegion`]; reads and writes whose buffer or segments lie inside it then point
//! straight into it (a fixed buffer on `uring`, an IOVA mapping on `vfio`, the memory itself
//! on `emu` and `null`). [`RegionTable`] keeps the regions of one queue pair and, per command
//! slot, which regions the command's memory lies in, so unregistering a region that a
//! command still uses is refused ([`UnregisterError::InUse`]) instead of letting the device
//! write memory the application is about to free.
//!
//! Registration is per queue pair, not per controller: a queue pair belongs to one thread,
//! so counting a region's commands in flight costs no atomic and no lock on the I/O path;
//! io_uring's fixed buffers belong to one ring (and a single-issuer ring takes registrations
//! from its owner only); and a front end's shard, which owns the memory it serves, lives on
//! one reactor with one queue pair per device. A region several reactors serve is registered
//! with each of their queue pairs.
//!
//! [`QueuePair::register_memory`]: crate::QueuePair::register_memory

/// Start and length of every region must be multiples of this: an IOMMU maps, and io_uring
/// pins, whole pages, and requiring it on every device keeps a region that works on `emu`
/// working on `vfio`. An mmapped region always meets it.
pub const REGION_ALIGN_BYTES: usize = 4096;
/// Most regions one queue pair holds at once. A QEMU guest's memory is a handful of regions
/// (vhost-user offers 8 by default); each command records its regions in one 64-bit mask.
pub const REGIONS_MAX: usize = 64;
/// Largest region: io_uring registers at most 1 GiB per fixed buffer. A larger area is
/// registered as several regions.
pub const REGION_BYTES_MAX: usize = 1 << 30;

/// A region registered with one queue pair: its memory and the identity under which that
/// queue pair knows it. Copy it freely; it stays meaningful until unregistered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRegion {
    base: usize,
    len_bytes: usize,
    /// Unique within the queue pair's table, never reused: a stale handle is refused.
    id: u64,
    index: u8,
}

impl MemoryRegion {
    /// The region's first byte.
    pub fn ptr(&self) -> *mut u8 {
        self.base as *mut u8
    }

    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// The region's slot in its queue pair's table (0..[`REGIONS_MAX`]): a device names
    /// the region by it (the `uring` fixed-buffer index is this plus one).
    pub fn index(&self) -> usize {
        usize::from(self.index)
    }

    /// Whether `len_bytes` at `ptr` lie wholly inside the region.
    pub fn contains(&self, ptr: *const u8, len_bytes: usize) -> bool {
        let at = ptr as usize;
        at >= self.base && (at - self.base).saturating_add(len_bytes) <= self.len_bytes
    }
}

/// Why a region could not be registered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    #[error("a region of zero bytes")]
    Empty,
    #[error(
        "region of {len_bytes} bytes at {addr:#x} is not aligned: start and length must be \
         multiples of {align_bytes} bytes"
    )]
    Misaligned {
        addr: usize,
        len_bytes: usize,
        align_bytes: usize,
    },
    #[error("region of {len_bytes} bytes is over the largest, {max_bytes}")]
    TooLarge { len_bytes: usize, max_bytes: usize },
    #[error("region at {addr:#x} wraps around the address space")]
    Wraps { addr: usize },
    #[error(
        "region {addr:#x}..{end:#x} overlaps one already registered \
         ({other_addr:#x}..{other_end:#x})"
    )]
    Overlaps {
        addr: usize,
        end: usize,
        other_addr: usize,
        other_end: usize,
    },
    #[error("the queue pair holds {max} regions already")]
    TooMany { max: usize },
    /// The device could not map or register it (a memlock limit, an exhausted IOVA space).
    #[error("the device could not register the region: {0}")]
    Device(String),
    /// The queue pair's device does not take registered memory.
    #[error("this device does not take registered memory")]
    Unsupported,
}

/// Why a region could not be unregistered. It stays registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UnregisterError {
    /// Commands whose memory lies in the region are still outstanding: the device may still
    /// read or write it. Reap their completions, then unregister.
    #[error("{commands} commands using the region are still outstanding")]
    InUse { commands: u32 },
    /// Not registered with this queue pair (never, or unregistered already).
    #[error("the region is not registered with this queue pair")]
    Unknown,
    /// The device could not let go of the region (an IOMMU unmap failed): it stays
    /// registered, and the memory must stay mapped.
    #[error("the device could not let go of the region: {0}")]
    Device(&'static str),
}

/// Why a command's memory was refused against the registered regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegionError {
    /// Part of a buffer lies in a registered region and part outside it: the device would
    /// be told to use memory the application did not register.
    #[error(
        "{len_bytes} bytes at {addr:#x} run past the end of the registered region they \
         start in (or start before one they end in)"
    )]
    Straddles { addr: usize, len_bytes: usize },
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    base: usize,
    end: usize,
    id: u64,
    /// Commands outstanding whose memory lies (partly) in this region.
    in_flight: u32,
}

/// The regions of one queue pair, and which of them each command slot uses.
#[derive(Debug)]
pub struct RegionTable {
    /// Which entries are registered, one bit per index: a lookup visits only those, and
    /// none registered (0) is the one test the I/O path pays.
    occupied: u64,
    /// On the heap: a queue pair that registers nothing keeps its hot fields together.
    entries: Box<[Option<Entry>; REGIONS_MAX]>,
    count: usize,
    next_id: u64,
    /// Per command slot: the regions its command uses, one bit per table index.
    slot_masks: Box<[u64]>,
}

const _: () = assert!(REGIONS_MAX <= 64, "a slot's regions are one u64 mask");

impl RegionTable {
    /// A table for a queue pair of `slots` command slots.
    pub fn new(slots: usize) -> RegionTable {
        RegionTable {
            occupied: 0,
            entries: Box::new([None; REGIONS_MAX]),
            count: 0,
            next_id: 1,
            slot_masks: vec![0; slots].into_boxed_slice(),
        }
    }

    /// No region registered: commands need no lookup.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.occupied == 0
    }

    pub fn len(&self) -> usize {
        self.count
    }

    /// Checks `len_bytes` at `ptr` against the bounds and the regions held, and takes a
    /// free index for it; the device then registers it (and calls [`RegionTable::undo`] if
    /// that fails).
    pub fn add(&mut self, ptr: *mut u8, len_bytes: usize) -> Result<MemoryRegion, RegisterError> {
        let addr = ptr as usize;
        if len_bytes == 0 {
            return Err(RegisterError::Empty);
        }
        if !addr.is_multiple_of(REGION_ALIGN_BYTES) || !len_bytes.is_multiple_of(REGION_ALIGN_BYTES)
        {
            return Err(RegisterError::Misaligned {
                addr,
                len_bytes,
                align_bytes: REGION_ALIGN_BYTES,
            });
        }
        if len_bytes > REGION_BYTES_MAX {
            return Err(RegisterError::TooLarge {
                len_bytes,
                max_bytes: REGION_BYTES_MAX,
            });
        }
        let end = addr
            .checked_add(len_bytes)
            .ok_or(RegisterError::Wraps { addr })?;
        if let Some(other) = self
            .entries
            .iter()
            .flatten()
            .find(|e| e.base < end && addr < e.end)
        {
            return Err(RegisterError::Overlaps {
                addr,
                end,
                other_addr: other.base,
                other_end: other.end,
            });
        }
        let index = self
            .entries
            .iter()
            .position(Option::is_none)
            .ok_or(RegisterError::TooMany { max: REGIONS_MAX })?;
        let id = self.next_id;
        self.next_id += 1;
        self.entries[index] = Some(Entry {
            base: addr,
            end,
            id,
            in_flight: 0,
        });
        self.occupied |= 1 << index;
        self.count += 1;
        debug_assert!(self.count <= REGIONS_MAX);
        Ok(MemoryRegion {
            base: addr,
            len_bytes,
            id,
            index: index as u8,
        })
    }

    /// Forgets a region [`RegionTable::add`] just took, when the device could not register it.
    pub fn undo(&mut self, region: &MemoryRegion) {
        // Just added, so no command can use it yet: removing it is always allowed.
        self.remove(region);
    }

    /// Whether `region` may be unregistered now: known, and no command uses it.
    pub fn check_remove(&self, region: &MemoryRegion) -> Result<(), UnregisterError> {
        match self.entries.get(region.index()).copied().flatten() {
            Some(e) if e.id == region.id && e.in_flight > 0 => Err(UnregisterError::InUse {
                commands: e.in_flight,
            }),
            Some(e) if e.id == region.id => Ok(()),
            _ => Err(UnregisterError::Unknown),
        }
    }

    /// Checks and removes `region` at once, for a device that holds nothing of a region
    /// beside this table's entry.
    pub fn unregister(&mut self, region: &MemoryRegion) -> Result<(), UnregisterError> {
        self.check_remove(region)?;
        self.remove(region);
        Ok(())
    }

    /// Removes `region` after [`RegionTable::check_remove`] allowed it and the device let
    /// go of it.
    pub fn remove(&mut self, region: &MemoryRegion) {
        debug_assert_eq!(self.check_remove(region), Ok(()));
        self.entries[region.index()] = None;
        self.occupied &= !(1 << region.index());
        self.count -= 1;
    }

    /// The region `len_bytes` at `ptr` lie in: `Ok(None)` outside every region, an error
    /// when they straddle a region's edge.
    pub fn find(&self, ptr: *const u8, len_bytes: usize) -> Result<Option<usize>, RegionError> {
        let at = ptr as usize;
        let end = at.saturating_add(len_bytes);
        let mut bits = self.occupied;
        while bits != 0 {
            let index = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            let Some(e) = &self.entries[index] else {
                debug_assert!(false, "occupied index {index} holds no region");
                continue;
            };
            if e.base < end && at < e.end {
                return if at >= e.base && end <= e.end {
                    Ok(Some(index))
                } else {
                    Err(RegionError::Straddles {
                        addr: at,
                        len_bytes,
                    })
                };
            }
        }
        Ok(None)
    }

    /// The regions the memory of a command lies in, as a mask: every piece is either inside
    /// one region or outside all of them.
    pub fn mask_of<'a>(
        &self,
        pieces: impl IntoIterator<Item = (*const u8, usize)> + 'a,
    ) -> Result<u64, RegionError> {
        let mut mask = 0u64;
        for (ptr, len) in pieces {
            if let Some(index) = self.find(ptr, len)? {
                mask |= 1 << index;
            }
        }
        Ok(mask)
    }

    /// The regions the memory of a Read or Write moving `data_bytes` lies in, as a mask.
    /// Out of line: only a queue pair with regions registered calls it, and the submit
    /// path of one without stays as small as before.
    #[inline(never)]
    pub fn command_mask(
        &self,
        cmd: &crate::Command<'_>,
        data_bytes: usize,
    ) -> Result<u64, RegionError> {
        self.mask_of(pieces(cmd, data_bytes))
    }

    /// Records that the command in `slot` uses the regions of `mask`, until
    /// [`RegionTable::release`].
    pub fn charge(&mut self, slot: usize, mask: u64) {
        debug_assert_eq!(self.slot_masks[slot], 0, "slot {slot} charged twice");
        self.slot_masks[slot] = mask;
        let mut bits = mask;
        while bits != 0 {
            let index = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            let e = self.entries[index]
                .as_mut()
                .expect("a charged region is registered");
            e.in_flight += 1;
        }
    }

    /// The command in `slot` completed: its regions are free of it.
    #[inline]
    pub fn release(&mut self, slot: usize) {
        let mut bits = std::mem::take(&mut self.slot_masks[slot]);
        while bits != 0 {
            let index = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            let e = self.entries[index]
                .as_mut()
                .expect("a region in use stays registered");
            debug_assert!(e.in_flight > 0);
            e.in_flight -= 1;
        }
    }

    /// The regions the command in `slot` uses.
    pub fn mask(&self, slot: usize) -> u64 {
        self.slot_masks[slot]
    }

    /// The registered region at `index`: (start, length).
    pub fn region(&self, index: usize) -> Option<(usize, usize)> {
        self.entries[index].map(|e| (e.base, e.end - e.base))
    }
}

/// The pieces of memory a Read or Write points at: its buffer, or each of its segments.
fn pieces<'c>(
    cmd: &'c crate::Command<'_>,
    data_bytes: usize,
) -> impl Iterator<Item = (*const u8, usize)> + 'c {
    let single = cmd
        .segments()
        .is_none()
        .then(|| (cmd.buf_ptr().cast_const(), data_bytes));
    single.into_iter().chain(
        cmd.segments()
            .unwrap_or(&[])
            .iter()
            .map(|s| (s.ptr().cast_const(), s.len_bytes())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: usize = REGION_ALIGN_BYTES;

    fn at(addr: usize) -> *mut u8 {
        addr as *mut u8
    }

    #[test]
    fn bad_regions_are_refused_clearly() {
        let mut t = RegionTable::new(4);
        assert!(matches!(t.add(at(P), 0), Err(RegisterError::Empty)));
        assert!(matches!(
            t.add(at(P + 4), P),
            Err(RegisterError::Misaligned { .. })
        ));
        assert!(matches!(
            t.add(at(P), 100),
            Err(RegisterError::Misaligned { .. })
        ));
        assert!(matches!(
            t.add(at(P), REGION_BYTES_MAX + P),
            Err(RegisterError::TooLarge { .. })
        ));
        assert!(matches!(
            t.add(at(usize::MAX - P + 1), 2 * P),
            Err(RegisterError::Wraps { .. })
        ));
        let a = t.add(at(16 * P), 4 * P).unwrap();
        assert!(matches!(
            t.add(at(19 * P), 2 * P),
            Err(RegisterError::Overlaps { .. })
        ));
        assert!(matches!(
            t.add(at(12 * P), 8 * P),
            Err(RegisterError::Overlaps { .. })
        ));
        // Neighbours touching the region are not overlaps.
        t.add(at(20 * P), P).unwrap();
        t.add(at(15 * P), P).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(a.index(), 0);
    }

    #[test]
    fn a_table_holds_at_most_regions_max() {
        let mut t = RegionTable::new(1);
        for i in 0..REGIONS_MAX {
            t.add(at((i + 1) * 2 * P), P).unwrap();
        }
        assert!(matches!(
            t.add(at(1000 * P), P),
            Err(RegisterError::TooMany { max: REGIONS_MAX })
        ));
    }

    #[test]
    fn a_region_in_use_cannot_be_removed_until_its_commands_complete() {
        let mut t = RegionTable::new(4);
        let a = t.add(at(16 * P), 4 * P).unwrap();
        let b = t.add(at(32 * P), 4 * P).unwrap();
        // Two segments, one in each region, and one outside both.
        let mask = t
            .mask_of([
                (at(17 * P).cast_const(), 100),
                (at(33 * P).cast_const(), P),
                (at(100 * P).cast_const(), P),
            ])
            .unwrap();
        assert_eq!(mask, 0b11);
        t.charge(2, mask);
        assert_eq!(
            t.check_remove(&a),
            Err(UnregisterError::InUse { commands: 1 })
        );
        assert_eq!(
            t.check_remove(&b),
            Err(UnregisterError::InUse { commands: 1 })
        );
        t.release(2);
        assert_eq!(t.check_remove(&a), Ok(()));
        t.remove(&a);
        assert_eq!(t.check_remove(&a), Err(UnregisterError::Unknown));
        // A new region at the freed index is a new identity: the old handle stays stale.
        let c = t.add(at(16 * P), 4 * P).unwrap();
        assert_eq!(c.index(), a.index());
        assert_eq!(t.check_remove(&a), Err(UnregisterError::Unknown));
        assert_eq!(t.check_remove(&c), Ok(()));
    }

    #[test]
    fn a_buffer_across_a_region_edge_is_refused() {
        let mut t = RegionTable::new(1);
        t.add(at(16 * P), 4 * P).unwrap();
        assert_eq!(t.find(at(16 * P), 4 * P), Ok(Some(0)));
        assert_eq!(t.find(at(8 * P), 4 * P), Ok(None));
        assert!(matches!(
            t.find(at(19 * P), 2 * P),
            Err(RegionError::Straddles { .. })
        ));
        assert!(matches!(
            t.find(at(15 * P), 2 * P),
            Err(RegionError::Straddles { .. })
        ));
    }
}
