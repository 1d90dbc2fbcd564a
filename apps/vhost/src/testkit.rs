//! A fake guest for tests and the fuzzer: guest memory of two regions with a hole between
//! them, and helpers that write descriptors, request headers and ranges into it as a
//! driver would. Not part of the API.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use virtio_queue::desc::split::Descriptor;

/// First region: guest addresses `0..LOW_END`.
pub const LOW_END: u64 = 0x1_0000;
/// Second region: `HIGH_START..HIGH_END`; nothing is mapped between the two.
pub const HIGH_START: u64 = 0x2_0000;
pub const HIGH_END: u64 = 0x3_0000;
/// Where tests put the descriptor table.
pub const TABLE: u64 = 0x100;
/// Where tests put a request's header.
pub const HEADER: u64 = 0x1000;
/// Where tests put a request's status byte.
pub const STATUS: u64 = 0x1100;
/// Where tests put data buffers.
pub const DATA: u64 = 0x4000;

/// Descriptor flags.
pub const NEXT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;
pub const WRITE: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16;
pub const INDIRECT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;

/// Fresh guest memory, zeroed.
pub fn guest() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), LOW_END as usize),
        (GuestAddress(HIGH_START), (HIGH_END - HIGH_START) as usize),
    ])
    .expect("anonymous guest memory")
}

/// Writes descriptor `index` of the table at `table`.
pub fn put_desc(
    mem: &GuestMemoryMmap,
    table: u64,
    index: u16,
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
) {
    let desc = Descriptor::new(addr, len, flags, next);
    mem.write_obj(desc, GuestAddress(table + 16 * u64::from(index)))
        .expect("the table lies in guest memory");
}

/// Writes a request header (type, reserved, sector) at `addr`.
pub fn put_header(mem: &GuestMemoryMmap, addr: u64, kind: u32, sector: u64) {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&h, GuestAddress(addr))
        .expect("the header lies in guest memory");
}

/// Writes a discard or write-zeroes range at `addr`.
pub fn put_range(mem: &GuestMemoryMmap, addr: u64, sector: u64, sectors: u32, flags: u32) {
    let mut r = [0u8; 16];
    r[0..8].copy_from_slice(&sector.to_le_bytes());
    r[8..12].copy_from_slice(&sectors.to_le_bytes());
    r[12..16].copy_from_slice(&flags.to_le_bytes());
    mem.write_slice(&r, GuestAddress(addr))
        .expect("the range lies in guest memory");
}

/// Writes a chain at `table`, descriptors `0..bufs.len()` linked in order, each
/// `(addr, len, writable)`.
pub fn put_chain(mem: &GuestMemoryMmap, table: u64, bufs: &[(u64, u32, bool)]) {
    for (i, &(addr, len, writable)) in bufs.iter().enumerate() {
        let last = i + 1 == bufs.len();
        let flags = if writable { WRITE } else { 0 } | if last { 0 } else { NEXT };
        put_desc(mem, table, i as u16, addr, len, flags, (i + 1) as u16);
    }
}
