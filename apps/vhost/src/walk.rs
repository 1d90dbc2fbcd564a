//! Walking one descriptor chain of a split virtqueue, as a hostile guest may have written
//! it: every descriptor is read through the guest's memory map ([`GuestView`]) (a read outside it is an
//! error, never a fault), a chain may not run longer than the queue (so a loop ends), an
//! indirect table is followed once and only where it was negotiated, and a next index
//! outside its table stops the walk. The result is the chain's buffers in order, each an
//! address range in guest memory and a direction; what they mean is `request.rs`'s
//! business.
//!
//! This is not `virtio_queue::DescriptorChain`: that iterator ends a chain silently on any
//! malformation (a descriptor it cannot read, a next index out of range, a loop), so a
//! truncated chain would look like a short, well-formed one. Here each ending has its name.

use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, Permissions};

use virtio_queue::desc::split::Descriptor;

/// Bytes of one descriptor in a table.
pub const DESCRIPTOR_BYTES: u64 = 16;

/// What the walker and the parser need of guest memory: the back end's own table of host
/// pointers (`host.rs`, and its [`crate::host::RingView`] for one pass over a ring), or any of
/// vm-memory's (the tests compare them).
pub trait GuestView {
    /// The 16 bytes at guest address `addr` (a descriptor, a request header, a range) as two
    /// little-endian 64-bit words, if they lie inside guest memory.
    fn read16(&self, addr: u64) -> Option<[u64; 2]>;

    /// Descriptor `index` of the table at guest address `table`, as [`GuestView::read16`]
    /// reads it. A view that resolved a table once reads it from there.
    #[inline]
    fn descriptor(&self, table: u64, index: u16) -> Option<[u64; 2]> {
        self.read16(table.checked_add(u64::from(index) * DESCRIPTOR_BYTES)?)
    }

    /// Whether the `len` bytes at `addr` lie inside guest memory, for the device to write
    /// (`write`) or read.
    fn holds(&self, addr: u64, len: u64, write: bool) -> bool;
}

impl<M: GuestMemory + ?Sized> GuestView for M {
    fn read16(&self, addr: u64) -> Option<[u64; 2]> {
        let mut bytes = [0u8; 16];
        self.read_slice(&mut bytes, GuestAddress(addr)).ok()?;
        Some(words(bytes))
    }

    fn holds(&self, addr: u64, len: u64, write: bool) -> bool {
        let access = if write {
            Permissions::Write
        } else {
            Permissions::Read
        };
        usize::try_from(len).is_ok_and(|len| self.check_range(GuestAddress(addr), len, access))
    }
}

/// 16 bytes of guest memory as [`GuestView::read16`] hands them on: two little-endian words.
#[inline]
pub fn words(bytes: [u8; 16]) -> [u64; 2] {
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    [word(0), word(8)]
}

/// One buffer of a chain: `len` bytes at guest address `addr`, written by the device
/// (`writable`) or read by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buffer {
    pub addr: u64,
    pub len: u32,
    pub writable: bool,
}

/// What bounds a walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainLimits {
    /// The queue's size: no chain has more descriptors, and no index reaches it.
    pub queue_size: u16,
    /// Whether VIRTIO_RING_F_INDIRECT_DESC was negotiated.
    pub indirect: bool,
}

/// Why a chain could not be walked: nothing in it can be trusted, not even where its
/// status byte is, so the request cannot be answered and the queue is broken (virtio's
/// DEVICE_NEEDS_RESET; vhost-user signals it on the queue's error eventfd).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChainError {
    #[error("the avail ring names head {head}, outside a queue of {size}")]
    HeadOutOfRange { head: u16, size: u16 },
    #[error("descriptor {index} names next {next}, outside its table of {size}")]
    NextOutOfRange { index: u16, next: u16, size: u16 },
    #[error("the chain runs past {max} descriptors (it loops, or is longer than the queue)")]
    TooLong { max: u16 },
    #[error("descriptor {index} at {addr:#x} lies outside guest memory")]
    DescriptorOutsideMemory { index: u16, addr: u64 },
    #[error("an indirect descriptor, but VIRTIO_RING_F_INDIRECT_DESC was not negotiated")]
    IndirectNotNegotiated,
    #[error("an indirect descriptor inside an indirect table")]
    IndirectNested,
    #[error("an indirect descriptor that also has NEXT set")]
    IndirectWithNext,
    #[error(
        "an indirect table of {len} bytes (a whole number of descriptors, 1 to the queue's size)"
    )]
    IndirectTableSize { len: u32 },
    #[error("the request's last buffer is not a device-writable byte (no status to answer in)")]
    NoStatus,
    #[error("the status byte at {addr:#x} lies outside guest memory")]
    StatusOutsideMemory { addr: u64 },
}

/// Walks the chain that starts at `head` of the descriptor table at `table`, pushing its
/// buffers onto `out` (emptied first). `out` never grows past `limits.queue_size`
/// buffers, so a caller that reserved that many allocates nothing here.
pub fn walk_chain<M: GuestView + ?Sized>(
    mem: &M,
    table: GuestAddress,
    limits: ChainLimits,
    head: u16,
    out: &mut Vec<Buffer>,
) -> Result<(), ChainError> {
    out.clear();
    let max = limits.queue_size;
    if head >= max {
        return Err(ChainError::HeadOutOfRange { head, size: max });
    }
    let mut table = table;
    let mut size = max;
    let mut index = head;
    let mut in_indirect = false;
    loop {
        let desc = read_descriptor(mem, table, index)?;
        if desc.refers_to_indirect_table() {
            if !limits.indirect {
                return Err(ChainError::IndirectNotNegotiated);
            }
            if in_indirect {
                return Err(ChainError::IndirectNested);
            }
            if desc.has_next() {
                return Err(ChainError::IndirectWithNext);
            }
            let len = desc.len();
            let entries = u64::from(len) / DESCRIPTOR_BYTES;
            if len == 0 || u64::from(len) % DESCRIPTOR_BYTES != 0 || entries > u64::from(max) {
                return Err(ChainError::IndirectTableSize { len });
            }
            // Followed once: a second indirect descriptor is refused above, so the
            // switch cannot loop.
            table = desc.addr();
            size = entries as u16;
            index = 0;
            in_indirect = true;
            continue;
        }
        if out.len() >= usize::from(max) {
            return Err(ChainError::TooLong { max });
        }
        out.push(Buffer {
            addr: desc.addr().raw_value(),
            len: desc.len(),
            writable: desc.is_write_only(),
        });
        if !desc.has_next() {
            break;
        }
        let next = desc.next();
        if next >= size {
            return Err(ChainError::NextOutOfRange { index, next, size });
        }
        index = next;
    }
    // A chain of at least one buffer and at most the queue's size.
    debug_assert!(!out.is_empty() && out.len() <= usize::from(max));
    Ok(())
}

/// Descriptor `index` of the table at `table`, read through guest memory.
#[inline]
fn read_descriptor<M: GuestView + ?Sized>(
    mem: &M,
    table: GuestAddress,
    index: u16,
) -> Result<Descriptor, ChainError> {
    let Some([addr, rest]) = mem.descriptor(table.raw_value(), index) else {
        return Err(ChainError::DescriptorOutsideMemory {
            index,
            addr: table
                .raw_value()
                .wrapping_add(u64::from(index) * DESCRIPTOR_BYTES),
        });
    };
    // The second word: length (32 bits), flags (16), next (16), little-endian.
    Ok(Descriptor::new(
        addr,
        rest as u32,
        (rest >> 32) as u16,
        (rest >> 48) as u16,
    ))
}
