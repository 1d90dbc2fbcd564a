//! What a virtio-blk device shows its driver: the feature bits it offers, the limits it
//! promises in its config space, and the config space's bytes. The limits are chosen so that
//! every request a driver may send under them is one command on the device and one vectored
//! submission on the reactor: nothing is split, nothing copied.

use hypoll_reactor::{NamespaceInfo, SEGMENTS_MAX};
use virtio_bindings::virtio_blk as vb;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// virtio-blk addresses in sectors of this many bytes, whatever the device's block size.
pub const SECTOR_BYTES: u64 = 512;
/// Bytes of a request's header (type, reserved, sector).
pub const HEADER_BYTES: u32 = 16;
/// Bytes of one discard or write-zeroes range.
pub const RANGE_BYTES: u32 = 16;
/// Bytes of the device id a GET_ID request reads.
pub const ID_BYTES: u32 = vb::VIRTIO_BLK_ID_BYTES;
/// Most data descriptors one request may carry (the config space's `seg_max` is at most
/// this): half the reactor's segments per command, because one descriptor becomes two
/// segments where it crosses from one registered region of guest memory into the next.
pub const DATA_SEGMENTS_MAX: u32 = SEGMENTS_MAX as u32 / 2;
/// Largest read or write one request may carry, whatever larger transfer the device takes.
pub const REQUEST_BYTES_MAX: u32 = 1 << 20;
/// Smallest `size_max` offered: Linux takes no smaller segment limit than a page.
pub const SEGMENT_BYTES_MIN: u32 = 4096;
/// Ranges one discard or write-zeroes request may carry (`max_discard_seg`).
pub const RANGES_MAX: u32 = 1;
/// Bytes of the config space this device fills in (up to and including the secure-erase
/// and zoned fields it leaves zero).
pub const CONFIG_BYTES: usize = std::mem::size_of::<vb::virtio_blk_config>();

/// The vhost-user feature bit that says the back end speaks protocol features.
pub const VHOST_USER_F_PROTOCOL_FEATURES: u32 = 30;

/// Request status bytes.
pub const S_OK: u8 = vb::VIRTIO_BLK_S_OK as u8;
pub const S_IOERR: u8 = vb::VIRTIO_BLK_S_IOERR as u8;
pub const S_UNSUPP: u8 = vb::VIRTIO_BLK_S_UNSUPP as u8;

/// What one export looks like to a guest: its size, its block size, what it does, and the
/// limits on one request. Built from the device's namespace ([`Geometry::new`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub capacity_sectors: u64,
    /// The device's block size in bytes: a request's offset and length must be whole
    /// blocks of it.
    pub block_bytes: u32,
    pub read_only: bool,
    pub discard: bool,
    pub write_zeroes: bool,
    /// Most data descriptors in one read or write (`seg_max`).
    pub seg_max: u32,
    /// Largest data descriptor (`size_max`).
    pub size_max: u32,
    /// Largest read or write: `seg_max * size_max`, at most the device's transfer limit.
    pub request_bytes_max: u32,
    /// Largest discard or write-zeroes range, in sectors.
    pub range_sectors_max: u32,
    /// Queues offered (`num_queues`).
    pub num_queues: u16,
}

impl Geometry {
    /// The geometry of a device with namespace `ns`, which carries out discard
    /// (`discard`) and write zeroes (`write_zeroes`) or not, served on `num_queues` queues.
    pub fn new(
        ns: &NamespaceInfo,
        read_only: bool,
        discard: bool,
        write_zeroes: bool,
        num_queues: u16,
    ) -> Geometry {
        let block_bytes = ns.lba_size_bytes;
        // One request is one command: no larger than the device's transfer limit, in whole
        // pages so the segment limit below is too.
        let transfer = ns.transfer_bytes_max.min(REQUEST_BYTES_MAX) & !(SEGMENT_BYTES_MIN - 1);
        let transfer = transfer.max(SEGMENT_BYTES_MIN);
        let size_max =
            (transfer / DATA_SEGMENTS_MAX).max(SEGMENT_BYTES_MIN) & !(SEGMENT_BYTES_MIN - 1);
        let seg_max = (transfer / size_max).clamp(1, DATA_SEGMENTS_MAX);
        // One command's block count is 16 bits (NVMe's NLB): a range is at most that many
        // blocks, in sectors.
        let range_bytes = u64::from(hypoll_reactor::nvme::spec::NLB_MAX) * u64::from(block_bytes);
        let range_sectors_max = u32::try_from(range_bytes / SECTOR_BYTES).unwrap_or(u32::MAX);
        let geometry = Geometry {
            capacity_sectors: ns.capacity_bytes() / SECTOR_BYTES,
            block_bytes,
            read_only,
            discard: discard && !read_only,
            write_zeroes: write_zeroes && !read_only,
            seg_max,
            size_max,
            request_bytes_max: seg_max * size_max,
            range_sectors_max,
            num_queues: num_queues.max(1),
        };
        // Any request within the limits fits one vectored command.
        debug_assert!(geometry.request_bytes_max <= ns.transfer_bytes_max.max(SEGMENT_BYTES_MIN));
        debug_assert!(geometry.seg_max * 2 <= SEGMENTS_MAX as u32);
        geometry
    }

    /// Sectors per device block.
    pub fn block_sectors(&self) -> u64 {
        u64::from(self.block_bytes) / SECTOR_BYTES
    }

    /// `sectors` in whole device blocks (rounded down). A shift where the block size is a
    /// power of two, as every NVMe format's is: a request pays this twice, and a 64-bit
    /// division takes many times a shift's cycles.
    #[inline]
    pub fn blocks(&self, sectors: u64) -> u64 {
        let block = self.block_sectors();
        if block.is_power_of_two() {
            sectors >> block.trailing_zeros()
        } else {
            sectors / block
        }
    }

    /// Whether `n` is a multiple of `unit` (by a mask where `unit` is a power of two; see
    /// [`Geometry::blocks`]).
    #[inline]
    pub fn is_multiple(n: u64, unit: u64) -> bool {
        if unit.is_power_of_two() {
            n & (unit - 1) == 0
        } else {
            n.is_multiple_of(unit)
        }
    }

    /// The virtio feature bits offered (vhost-user's PROTOCOL_FEATURES among them).
    pub fn features(&self) -> u64 {
        let mut bits = [
            VIRTIO_F_VERSION_1,
            VIRTIO_RING_F_EVENT_IDX,
            VIRTIO_RING_F_INDIRECT_DESC,
            VHOST_USER_F_PROTOCOL_FEATURES,
            vb::VIRTIO_BLK_F_SIZE_MAX,
            vb::VIRTIO_BLK_F_SEG_MAX,
            vb::VIRTIO_BLK_F_BLK_SIZE,
            vb::VIRTIO_BLK_F_FLUSH,
            vb::VIRTIO_BLK_F_TOPOLOGY,
            vb::VIRTIO_BLK_F_MQ,
        ]
        .iter()
        .fold(0u64, |acc, bit| acc | 1 << bit);
        if self.read_only {
            bits |= 1 << vb::VIRTIO_BLK_F_RO;
        }
        if self.discard {
            bits |= 1 << vb::VIRTIO_BLK_F_DISCARD;
        }
        if self.write_zeroes {
            bits |= 1 << vb::VIRTIO_BLK_F_WRITE_ZEROES;
        }
        bits
    }

    /// The config space, little-endian as VERSION_1 has it.
    pub fn config(&self) -> [u8; CONFIG_BYTES] {
        let mut c = [0u8; CONFIG_BYTES];
        let mut put = |at: usize, bytes: &[u8]| c[at..at + bytes.len()].copy_from_slice(bytes);
        put(0, &self.capacity_sectors.to_le_bytes());
        put(8, &self.size_max.to_le_bytes());
        put(12, &self.seg_max.to_le_bytes());
        put(20, &self.block_bytes.to_le_bytes());
        // Topology: the block is the smallest unit of I/O; one block per physical block.
        put(24, &[0, 0]);
        let block_sectors = u16::try_from(self.block_sectors()).unwrap_or(u16::MAX);
        put(26, &block_sectors.to_le_bytes());
        put(34, &self.num_queues.to_le_bytes());
        let align = u32::try_from(self.block_sectors()).unwrap_or(u32::MAX);
        if self.discard {
            put(36, &self.range_sectors_max.to_le_bytes());
            put(40, &RANGES_MAX.to_le_bytes());
            put(44, &align.to_le_bytes());
        }
        if self.write_zeroes {
            put(48, &self.range_sectors_max.to_le_bytes());
            put(52, &RANGES_MAX.to_le_bytes());
            // The unmap flag becomes a write zeroes that may deallocate.
            put(56, &[1]);
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use std::mem::offset_of;

    use super::*;

    fn ns(lba: u32, transfer: u32) -> NamespaceInfo {
        NamespaceInfo {
            nsid: 1,
            lba_size_bytes: lba,
            capacity_lbas: 1 << 20,
            transfer_bytes_max: transfer,
        }
    }

    #[test]
    fn the_config_fields_sit_where_the_virtio_headers_put_them() {
        let g = Geometry::new(&ns(4096, 1 << 20), false, true, true, 3);
        let c = g.config();
        let u32_at = |at: usize| u32::from_le_bytes(c[at..at + 4].try_into().unwrap());
        let u16_at = |at: usize| u16::from_le_bytes(c[at..at + 2].try_into().unwrap());
        type C = vb::virtio_blk_config;
        let capacity = offset_of!(C, capacity);
        assert_eq!(
            u64::from_le_bytes(c[capacity..capacity + 8].try_into().unwrap()),
            (1u64 << 20) * 4096 / 512
        );
        assert_eq!(u32_at(offset_of!(C, size_max)), g.size_max);
        assert_eq!(u32_at(offset_of!(C, seg_max)), g.seg_max);
        assert_eq!(u32_at(offset_of!(C, blk_size)), 4096);
        assert_eq!(u16_at(offset_of!(C, min_io_size)), 8);
        assert_eq!(u16_at(offset_of!(C, num_queues)), 3);
        assert_eq!(
            u32_at(offset_of!(C, max_discard_sectors)),
            g.range_sectors_max
        );
        assert_eq!(u32_at(offset_of!(C, max_discard_seg)), RANGES_MAX);
        assert_eq!(u32_at(offset_of!(C, discard_sector_alignment)), 8);
        assert_eq!(
            u32_at(offset_of!(C, max_write_zeroes_sectors)),
            g.range_sectors_max
        );
        assert_eq!(u32_at(offset_of!(C, max_write_zeroes_seg)), RANGES_MAX);
        assert_eq!(c[offset_of!(C, write_zeroes_may_unmap)], 1);
    }

    #[test]
    fn every_request_within_the_limits_fits_one_command() {
        for transfer in [4096, 128 << 10, 132 << 10, 1 << 20, 8 << 20, u32::MAX] {
            let g = Geometry::new(&ns(512, transfer), false, false, false, 1);
            assert!(g.seg_max >= 1 && g.seg_max <= DATA_SEGMENTS_MAX, "{g:?}");
            assert!(
                g.size_max >= SEGMENT_BYTES_MIN && g.size_max.is_multiple_of(4096),
                "{g:?}"
            );
            assert_eq!(g.request_bytes_max, g.seg_max * g.size_max);
            assert!(
                g.request_bytes_max <= transfer.clamp(4096, REQUEST_BYTES_MAX),
                "{g:?}"
            );
        }
    }

    #[test]
    fn blocks_and_multiples_are_what_division_says() {
        // Powers of two (shifts and masks) and sizes that are not (divisions).
        for block_bytes in [512u32, 1024, 4096, 65536, 1536, 2560] {
            let mut g = Geometry::new(&ns(512, 1 << 20), false, false, false, 1);
            g.block_bytes = block_bytes;
            let block = g.block_sectors();
            for n in [0u64, 1, 7, 8, 9, 24, 4095, 1 << 40, u64::MAX - 1, u64::MAX] {
                assert_eq!(
                    g.blocks(n),
                    n / block,
                    "{n} sectors, blocks of {block_bytes}"
                );
                for unit in [1u64, 3, 8, 512, u64::from(block_bytes)] {
                    assert_eq!(
                        Geometry::is_multiple(n, unit),
                        n % unit == 0,
                        "{n} of {unit}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_read_only_export_offers_ro_and_nothing_that_writes() {
        let g = Geometry::new(&ns(512, 1 << 20), true, true, true, 1);
        let f = g.features();
        assert_ne!(f & 1 << vb::VIRTIO_BLK_F_RO, 0);
        assert_eq!(f & 1 << vb::VIRTIO_BLK_F_DISCARD, 0);
        assert_eq!(f & 1 << vb::VIRTIO_BLK_F_WRITE_ZEROES, 0);
        let rw = Geometry::new(&ns(512, 1 << 20), false, true, true, 1).features();
        assert_eq!(rw & 1 << vb::VIRTIO_BLK_F_RO, 0);
        assert_ne!(rw & 1 << vb::VIRTIO_BLK_F_DISCARD, 0);
    }
}
