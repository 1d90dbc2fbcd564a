//! The guest's memory through host pointers: every pointer the back end makes from a guest
//! address, and every load and store through one, is in this module.
//!
//! [`HostMemory`] is built once per memory map the front end publishes (SET_MEM_TABLE,
//! ADD_MEM_REG, REM_MEM_REG): a sorted table of the mapped regions, each its guest-physical
//! base, its length and its host address, with the mappings kept alive by the table. A guest
//! address range becomes a host pointer only if it lies wholly inside one region; a range
//! that runs into a hole or past the last region is refused, so no byte outside the guest's
//! memory is ever read or written. A small range that crosses from one region into the next
//! adjacent one (vm-memory's accessors allow that) is copied a byte at a time, each byte
//! translated on its own; the rings themselves must each lie inside one region ([`Span`]).
//! A pass over a ring's requests reads through a [`RingView`]: the descriptor table
//! resolved once per map, and the region of its last address remembered for the next.
//!
//! The guest writes its memory while we read it, from another process and another CPU, so
//! nothing here ever makes a Rust reference into guest memory: plain data moves by volatile
//! loads and stores (the compiler may neither elide nor merge them, and a torn value is only
//! a wrong value, which every caller checks as hostile input), and the ring indices that
//! order the two sides move by atomic loads and stores (the avail index loaded with
//! Acquire, the used index stored with Release after the used elements), with the fences
//! virtio requires left to the ring code (`split.rs`).

use std::cell::Cell;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;

use vm_memory::{Address, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::walk::{words, GuestView, DESCRIPTOR_BYTES};

/// One mapped region of the guest's memory.
#[derive(Clone, Copy, Debug)]
struct Region {
    gpa: u64,
    len: u64,
    host: *mut u8,
}

impl Region {
    /// Whether guest address `gpa` lies in the region.
    #[inline]
    fn holds(&self, gpa: u64) -> bool {
        gpa >= self.gpa && gpa - self.gpa < self.len
    }
}

/// The guest's memory as host pointers; see the module's documentation.
pub struct HostMemory {
    /// Sorted by `gpa`, none overlapping another.
    regions: Vec<Region>,
    /// Owns the mappings the regions point into.
    guest: Arc<GuestMemoryMmap>,
}

// SAFETY: the raw pointers point into shared mappings owned by `guest`, which is itself Send
// and Sync and lives as long as this table; every access through them is a volatile or
// atomic one made by this module, never a Rust reference, so any number of threads may use
// the table at once (the guest does so too).
unsafe impl Send for HostMemory {}
// SAFETY: as for Send.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// The table of `guest`'s regions.
    pub fn new(guest: Arc<GuestMemoryMmap>) -> HostMemory {
        let mut regions: Vec<Region> = guest
            .iter()
            .map(|r| Region {
                gpa: r.start_addr().raw_value(),
                len: r.len(),
                host: r.as_ptr(),
            })
            .collect();
        regions.sort_by_key(|r| r.gpa);
        // vm-memory refuses overlapping regions and regions whose end overflows.
        debug_assert!(regions.iter().all(|r| r.gpa.checked_add(r.len).is_some()));
        debug_assert!(regions.windows(2).all(|w| w[0].gpa + w[0].len <= w[1].gpa));
        HostMemory { regions, guest }
    }

    /// The mappings themselves (to register them with a device).
    pub fn guest(&self) -> &Arc<GuestMemoryMmap> {
        &self.guest
    }

    /// The region holding guest address `gpa`: the one at index `hint` if it holds it (a
    /// pass over a ring finds most of its addresses in the region of the last one), else
    /// the first that does, whose index then goes to `hint`. A hint is only ever an index
    /// into this table, checked before use: a wrong one costs a search, never a wrong answer.
    #[inline]
    fn region_of(&self, gpa: u64, hint: &Cell<usize>) -> Option<&Region> {
        if let Some(r) = self.regions.get(hint.get()) {
            if r.holds(gpa) {
                return Some(r);
            }
        }
        let i = self.regions.iter().position(|r| r.holds(gpa))?;
        hint.set(i);
        Some(&self.regions[i])
    }

    /// The host address of the `len` bytes at `gpa`, if they lie wholly inside one region.
    #[inline]
    fn host(&self, gpa: u64, len: u64, hint: &Cell<usize>) -> Option<*mut u8> {
        let r = self.region_of(gpa, hint)?;
        let offset = gpa - r.gpa;
        // `offset < r.len`, so neither side overflows.
        (len <= r.len - offset).then(|| r.host.wrapping_add(offset as usize))
    }

    /// Whether the `len` bytes at `gpa` lie inside guest memory, in one region or in
    /// adjacent ones. An empty range is inside if its address is.
    pub fn holds(&self, gpa: u64, len: u64) -> bool {
        self.holds_near(gpa, len, &Cell::new(0))
    }

    #[inline]
    fn holds_near(&self, gpa: u64, len: u64, hint: &Cell<usize>) -> bool {
        self.host(gpa, len, hint).is_some() || self.holds_across(gpa, len, hint)
    }

    /// Whether the `len` bytes at `gpa` lie inside adjacent regions (or one).
    #[cold]
    fn holds_across(&self, gpa: u64, len: u64, hint: &Cell<usize>) -> bool {
        let mut at = gpa;
        let mut left = len;
        // Each step moves to the region after the last one, so there are at most as many
        // steps as regions.
        for _ in 0..self.regions.len() {
            let Some(r) = self.region_of(at, hint) else {
                return false;
            };
            let room = r.len - (at - r.gpa);
            if left <= room {
                return true;
            }
            left -= room;
            at = r.gpa + r.len;
        }
        false
    }

    /// The `N` bytes at `gpa`, if they lie inside guest memory.
    pub fn read<const N: usize>(&self, gpa: u64) -> Option<[u8; N]> {
        self.read_near(gpa, &Cell::new(0))
    }

    fn read_near<const N: usize>(&self, gpa: u64, hint: &Cell<usize>) -> Option<[u8; N]> {
        if let Some(p) = self.host(gpa, N as u64, hint) {
            // SAFETY: `p..p + N` lies inside one mapped region (`host`), kept mapped by
            // `self.guest` while `self` lives.
            return Some(unsafe { load(p) });
        }
        // Across adjacent regions (or not inside at all): byte by byte.
        let mut out = [0u8; N];
        for (i, b) in out.iter_mut().enumerate() {
            let p = self.host(gpa.checked_add(i as u64)?, 1, hint)?;
            // SAFETY: `p` is one byte inside a mapped region (`host`).
            *b = unsafe { p.read_volatile() };
        }
        Some(out)
    }

    /// The 16 bytes at `gpa` as two little-endian words ([`GuestView::read16`]): two
    /// aligned loads where they lie inside one region 8-byte aligned, as descriptors do;
    /// three where they are not aligned (a driver may put a request header anywhere) and
    /// the aligned words around them lie inside the region; byte by byte otherwise.
    #[inline]
    fn read16_near(&self, gpa: u64, hint: &Cell<usize>) -> Option<[u64; 2]> {
        if let Some(r) = self.region_of(gpa, hint) {
            let offset = gpa - r.gpa;
            // `offset < r.len`: no overflow. The aligned words holding the 16 bytes, as
            // offsets into the region: `first..first + span_bytes` (no `first` where the
            // word before the bytes would begin before the region).
            let misaligned = (r.host as u64).wrapping_add(offset) % 8;
            let span_bytes = if misaligned == 0 { 16 } else { 24 };
            let first = offset.checked_sub(misaligned);
            if let Some(first) = first.filter(|first| first + span_bytes <= r.len) {
                let p = r.host.wrapping_add(first as usize);
                // SAFETY: `p..p + 16` (or `p..p + 24`) lies inside the region, which
                // `self.guest` keeps mapped, and `p` is 8-byte aligned.
                return Some(unsafe {
                    if misaligned == 0 {
                        load_words(p)
                    } else {
                        load_words_shifted(p, misaligned as u32 * 8)
                    }
                });
            }
        }
        self.read_near::<16>(gpa, hint).map(words)
    }

    /// Writes `bytes` at `gpa`; returns false, having written nothing, if they do not lie
    /// inside guest memory.
    #[inline]
    pub fn write(&self, gpa: u64, bytes: &[u8]) -> bool {
        self.write_near(gpa, bytes, &Cell::new(0))
    }

    #[inline]
    fn write_near(&self, gpa: u64, bytes: &[u8], hint: &Cell<usize>) -> bool {
        if let Some(p) = self.host(gpa, bytes.len() as u64, hint) {
            for (i, b) in bytes.iter().enumerate() {
                // SAFETY: `p..p + bytes.len()` lies inside one mapped region (`host`).
                unsafe { p.add(i).write_volatile(*b) };
            }
            return true;
        }
        self.write_across(gpa, bytes, hint)
    }

    /// Writes `bytes` across adjacent regions, a byte at a time.
    #[cold]
    fn write_across(&self, gpa: u64, bytes: &[u8], hint: &Cell<usize>) -> bool {
        if !self.holds_across(gpa, bytes.len() as u64, hint) {
            return false;
        }
        for (i, b) in bytes.iter().enumerate() {
            // `holds_across` saw every byte inside guest memory.
            let Some(p) = self.host(gpa + i as u64, 1, hint) else {
                debug_assert!(false, "a byte `holds` saw inside is outside");
                return false;
            };
            // SAFETY: `p` is one byte inside a mapped region (`host`).
            unsafe { p.write_volatile(*b) };
        }
        true
    }

    /// The `len` bytes at `gpa` as a span the rings read and write through, if they lie
    /// inside one region and start at a multiple of `align` bytes of the host's addresses
    /// (guest regions are page-aligned in both address spaces, so that is the guest
    /// address's alignment as well).
    pub fn span(self: &Arc<Self>, gpa: u64, len: u64, align: usize) -> Option<Span> {
        let p = self.host(gpa, len, &Cell::new(0))?;
        (p as usize).is_multiple_of(align).then(|| Span {
            ptr: p,
            len: len as usize,
            _memory: self.clone(),
        })
    }
}

impl GuestView for HostMemory {
    #[inline]
    fn read16(&self, addr: u64) -> Option<[u64; 2]> {
        self.read16_near(addr, &Cell::new(0))
    }

    #[inline]
    fn holds(&self, addr: u64, len: u64, _write: bool) -> bool {
        // Every region is mapped for reading and writing.
        self.holds_near(addr, len, &Cell::new(0))
    }
}

/// The guest's memory for one pass over a ring's requests: the ring's descriptor table
/// resolved once per memory map (a descriptor is a bound check and two loads), and the
/// region of the last address remembered for the next (headers, status bytes, data
/// buffers). Made afresh for each pass from the memory map the ring reads and written
/// nowhere else, so what it remembers never outlives the map it was learnt from.
pub struct RingView<'a> {
    memory: &'a HostMemory,
    /// The descriptor table's guest address and, if it was resolved in `memory`, its host
    /// address and entries (null and 0 if not: it is read through `memory` like any other
    /// table).
    table_gpa: u64,
    table: *const u8,
    table_entries: u16,
    hint: Cell<usize>,
}

impl<'a> RingView<'a> {
    /// A view of `memory` for a ring whose descriptor table is at `table_gpa`, resolved
    /// (`table`, a span of whole descriptors) when the ring was mapped. A span resolved in
    /// another memory map (one the ring has since left) is not used.
    pub fn new(memory: &'a Arc<HostMemory>, table_gpa: u64, table: Option<&Span>) -> Self {
        let resolved =
            table.filter(|t| Arc::ptr_eq(&t._memory, memory) && (t.ptr as usize).is_multiple_of(8));
        let (ptr, entries) = resolved.map_or((std::ptr::null(), 0), |t| {
            let entries = (t.len as u64 / DESCRIPTOR_BYTES).min(u64::from(u16::MAX));
            (t.ptr.cast_const(), entries as u16)
        });
        RingView {
            memory,
            table_gpa,
            table: ptr,
            table_entries: entries,
            hint: Cell::new(0),
        }
    }

    /// Writes `bytes` at `gpa` ([`HostMemory::write`]).
    #[inline]
    pub fn write(&self, gpa: u64, bytes: &[u8]) -> bool {
        self.memory.write_near(gpa, bytes, &self.hint)
    }
}

impl GuestView for RingView<'_> {
    #[inline]
    fn read16(&self, addr: u64) -> Option<[u64; 2]> {
        self.memory.read16_near(addr, &self.hint)
    }

    #[inline]
    fn descriptor(&self, table: u64, index: u16) -> Option<[u64; 2]> {
        if table == self.table_gpa && index < self.table_entries {
            // SAFETY: `table_entries` descriptors at `self.table` lie inside a region of
            // `self.memory` (the span was resolved in it, `new`), 8-byte aligned, and
            // `self.memory` is borrowed for the view's life.
            let p = unsafe {
                self.table
                    .add(usize::from(index) * DESCRIPTOR_BYTES as usize)
            };
            // SAFETY: as above.
            return Some(unsafe { load_words(p) });
        }
        self.read16(table.checked_add(u64::from(index) * DESCRIPTOR_BYTES)?)
    }

    #[inline]
    fn holds(&self, addr: u64, len: u64, _write: bool) -> bool {
        self.memory.holds_near(addr, len, &self.hint)
    }
}

/// The 16 bytes `shift_bits / 8` bytes past `p` as two little-endian words, by three
/// volatile loads of the aligned words around them.
///
/// # Safety
/// `p..p + 24` lies inside a live mapping, `p` is 8-byte aligned, and `shift_bits` is 8 to
/// 56.
#[inline]
unsafe fn load_words_shifted(p: *const u8, shift_bits: u32) -> [u64; 2] {
    debug_assert!((8..64).contains(&shift_bits));
    let p = p.cast::<u64>();
    // SAFETY: the three words lie inside `p..p + 24`, aligned (the caller's promise).
    let [a, b, c] = unsafe {
        [
            u64::from_le(p.read_volatile()),
            u64::from_le(p.add(1).read_volatile()),
            u64::from_le(p.add(2).read_volatile()),
        ]
    };
    // Little-endian: a later byte is a higher bit.
    [
        a >> shift_bits | b << (64 - shift_bits),
        b >> shift_bits | c << (64 - shift_bits),
    ]
}

/// The 16 bytes at `p` as two little-endian words, by two volatile loads.
///
/// # Safety
/// `p..p + 16` lies inside a live mapping, and `p` is 8-byte aligned.
#[inline]
unsafe fn load_words(p: *const u8) -> [u64; 2] {
    let p = p.cast::<u64>();
    // SAFETY: both words lie inside `p..p + 16`, aligned (the caller's promise).
    unsafe {
        [
            u64::from_le(p.read_volatile()),
            u64::from_le(p.add(1).read_volatile()),
        ]
    }
}

/// `N` bytes at `p`, by volatile loads: whole aligned words where it can.
///
/// # Safety
/// `p..p + N` lies inside a live mapping.
#[inline]
unsafe fn load<const N: usize>(p: *const u8) -> [u8; N] {
    let mut out = [0u8; N];
    if N.is_multiple_of(8) && (p as usize).is_multiple_of(8) {
        for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
            // SAFETY: word `i` of `N / 8` aligned words inside `p..p + N`.
            let word = unsafe { (p as *const u64).add(i).read_volatile() };
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
    } else {
        for (i, b) in out.iter_mut().enumerate() {
            // SAFETY: byte `i` of `p..p + N`.
            *b = unsafe { p.add(i).read_volatile() };
        }
    }
    out
}

/// A range of guest memory inside one region, resolved once (a ring), that keeps its
/// mapping alive. Its accessors take byte offsets into the span and refuse (None, false)
/// an access that would run past its end or is not aligned to its size.
pub struct Span {
    ptr: *mut u8,
    len: usize,
    _memory: Arc<HostMemory>,
}

// SAFETY: as for HostMemory: `ptr..ptr + len` lies inside a mapping `_memory` keeps alive,
// accessed only by this module's volatile and atomic operations.
unsafe impl Send for Span {}

impl Span {
    /// The host address of `size` bytes at `offset`, inside the span and aligned to `size`.
    #[inline]
    fn at(&self, offset: usize, size: usize) -> Option<*mut u8> {
        let end = offset.checked_add(size)?;
        let p = self.ptr.wrapping_add(offset);
        (end <= self.len && (p as usize).is_multiple_of(size)).then_some(p)
    }

    /// The little-endian `u16` at `offset`, loaded atomically with `order`.
    #[inline]
    pub fn load_u16(&self, offset: usize, order: Ordering) -> Option<u16> {
        let p = self.at(offset, 2)?;
        // SAFETY: `p` is 2 bytes inside the mapping, aligned for a u16 (`at`); the mapping
        // outlives the reference, which does not leave this function. The guest writes these
        // bytes only with whole, aligned stores of its own (virtio's rule for ring indices).
        let atomic = unsafe { AtomicU16::from_ptr(p.cast::<u16>()) };
        Some(u16::from_le(atomic.load(order)))
    }

    /// Stores `value` little-endian at `offset`, atomically with `order`.
    #[inline]
    pub fn store_u16(&self, offset: usize, value: u16, order: Ordering) -> bool {
        let Some(p) = self.at(offset, 2) else {
            return false;
        };
        // SAFETY: as in `load_u16`.
        let atomic = unsafe { AtomicU16::from_ptr(p.cast::<u16>()) };
        atomic.store(value.to_le(), order);
        true
    }

    /// Writes `value` little-endian at `offset` by a volatile store.
    #[inline]
    pub fn write_u32(&self, offset: usize, value: u32) -> bool {
        let Some(p) = self.at(offset, 4) else {
            return false;
        };
        // SAFETY: `p` is 4 bytes inside the mapping, aligned for a u32 (`at`).
        unsafe { p.cast::<u32>().write_volatile(value.to_le()) };
        true
    }
}

#[cfg(test)]
mod tests;
