//! The vhost-user inflight area (VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD), split rings only:
//! shared memory the back end allocates (GET_INFLIGHT_FD) and the front end keeps and hands
//! back on every start (SET_INFLIGHT_FD), so that a back end that died with requests in
//! flight is succeeded by one that knows which chains the guest still waits for.
//!
//! One region per queue, each 64-byte aligned: a 16-byte header (features u64, version
//! u16, desc_num u16, last_batch_head u16, used_idx u16), then 16 bytes per descriptor
//! (inflight u8, 5 bytes of padding, next u16, counter u64), little-endian.
//!
//! A ring records, for each head it takes off the avail ring, `inflight = 1` and the next
//! counter; when it answers one it records the head as `last_batch_head`, publishes the
//! used element and the guest's used index, then clears the head and records the used
//! index it published. A back end that dies between the guest's used index and the clear
//! leaves `used_idx` behind the guest's: its successor clears `last_batch_head`. Every
//! head still marked is then a chain the guest made available and was never answered:
//! the successor runs them again in the order they were taken (by counter), before any
//! new avail entry, and takes the avail ring from the guest's used index plus their
//! number (each chain taken is either answered or still marked).
//!
//! The area is touched only through `vm-memory`'s volatile and atomic accessors.

use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vm_memory::mmap::MmapRegion;
use vm_memory::{Bytes, FileOffset, VolatileMemory, VolatileSlice};

/// The layout version this back end writes and reads.
pub const INFLIGHT_VERSION: u16 = 1;
/// Bytes of a queue region's header and of one descriptor's state.
const HEADER_BYTES: usize = 16;
const DESC_BYTES: usize = 16;
/// Each queue's region starts on this boundary (as the protocol's reference back end does).
const QUEUE_ALIGN_BYTES: usize = 64;
/// Header fields' offsets.
const VERSION_AT: usize = 8;
const DESC_NUM_AT: usize = 10;
const LAST_BATCH_HEAD_AT: usize = 12;
const USED_IDX_AT: usize = 14;
/// Offsets in a descriptor's state.
const INFLIGHT_AT: usize = 0;
const COUNTER_AT: usize = 8;
/// Most queues an area may describe (a front end's request is bounded by it).
pub const INFLIGHT_QUEUES_MAX: u16 = 64;

/// Why an inflight area was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InflightError {
    #[error("an inflight area of {num_queues} queues of {queue_size} is out of bounds")]
    Shape { num_queues: u16, queue_size: u16 },
    #[error("an inflight area of {got} bytes where {want} are needed")]
    Size { got: u64, want: u64 },
    #[error("allocating or mapping the inflight area: {0}")]
    Map(String),
}

/// Bytes of one queue's region for a queue of `queue_size` descriptors.
pub fn queue_region_bytes(queue_size: u16) -> usize {
    let bytes = HEADER_BYTES + DESC_BYTES * usize::from(queue_size);
    bytes.div_ceil(QUEUE_ALIGN_BYTES) * QUEUE_ALIGN_BYTES
}

/// A mapped inflight area: every queue's region, shared with the front end.
pub struct InflightArea {
    mapping: MmapRegion,
    num_queues: u16,
    queue_size: u16,
}

impl InflightArea {
    /// A new, zeroed area of `num_queues` regions of `queue_size` descriptors, each header
    /// stamped with the version and the size (GET_INFLIGHT_FD). Returns the area and the
    /// file to hand the front end.
    pub fn create(
        num_queues: u16,
        queue_size: u16,
    ) -> Result<(Arc<InflightArea>, File), InflightError> {
        Self::check_shape(num_queues, queue_size)?;
        let file = crate::sys::memfd("hypoll-vhost-inflight")
            .map_err(|e| InflightError::Map(e.to_string()))?;
        let bytes = Self::bytes(num_queues, queue_size);
        file.set_len(bytes as u64)
            .map_err(|e| InflightError::Map(e.to_string()))?;
        let ours = file
            .try_clone()
            .map_err(|e| InflightError::Map(e.to_string()))?;
        let area = Self::map(ours, 0, num_queues, queue_size)?;
        for q in 0..num_queues {
            let region = area.region(q);
            region
                .store(INFLIGHT_VERSION.to_le(), VERSION_AT, Ordering::Relaxed)
                .map_err(|e| InflightError::Map(e.to_string()))?;
            region
                .store(queue_size.to_le(), DESC_NUM_AT, Ordering::Relaxed)
                .map_err(|e| InflightError::Map(e.to_string()))?;
        }
        Ok((Arc::new(area), file))
    }

    /// Maps the area a front end handed back (SET_INFLIGHT_FD): `size` bytes of `file`
    /// from `offset`, which must hold `num_queues` regions of `queue_size`.
    pub fn open(
        file: File,
        offset: u64,
        size: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Result<Arc<InflightArea>, InflightError> {
        Self::check_shape(num_queues, queue_size)?;
        let want = Self::bytes(num_queues, queue_size) as u64;
        if size < want {
            return Err(InflightError::Size { got: size, want });
        }
        Ok(Arc::new(Self::map(file, offset, num_queues, queue_size)?))
    }

    fn check_shape(num_queues: u16, queue_size: u16) -> Result<(), InflightError> {
        let ok = (1..=INFLIGHT_QUEUES_MAX).contains(&num_queues)
            && queue_size > 0
            && queue_size <= crate::control::QUEUE_SIZE_MAX;
        ok.then_some(()).ok_or(InflightError::Shape {
            num_queues,
            queue_size,
        })
    }

    fn bytes(num_queues: u16, queue_size: u16) -> usize {
        usize::from(num_queues) * queue_region_bytes(queue_size)
    }

    fn map(
        file: File,
        offset: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Result<InflightArea, InflightError> {
        let mapping = MmapRegion::build(
            Some(FileOffset::new(file, offset)),
            Self::bytes(num_queues, queue_size),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
        )
        .map_err(|e| InflightError::Map(e.to_string()))?;
        Ok(InflightArea {
            mapping,
            num_queues,
            queue_size,
        })
    }

    /// Bytes of the whole area.
    pub fn size_bytes(&self) -> u64 {
        Self::bytes(self.num_queues, self.queue_size) as u64
    }

    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    fn region(&self, queue: u16) -> VolatileSlice<'_> {
        debug_assert!(queue < self.num_queues);
        let bytes = queue_region_bytes(self.queue_size);
        self.mapping
            .get_slice(usize::from(queue) * bytes, bytes)
            .expect("the area holds every queue's region")
    }
}

/// One ring's region of an inflight area, as the ring's reactor records into it.
pub struct InflightQueue {
    area: Arc<InflightArea>,
    queue: u16,
    /// Heads this ring may record: the ring's size (at most the region's).
    heads: u16,
    /// The counter the next head taken gets.
    counter: u64,
}

/// What a ring resumes with ([`InflightQueue::recover`]).
#[derive(Debug, PartialEq, Eq)]
pub struct Recovery {
    /// Heads the guest still waits for, in the order they were first taken.
    pub resubmit: Vec<u16>,
    /// Where the ring takes the avail ring from: the guest's used index plus their number.
    pub next_avail: u16,
}

impl InflightQueue {
    /// Queue `queue`'s region of `area`, for a ring of `ring_size` descriptors; None if the
    /// area has no such queue or its regions are smaller than the ring.
    pub fn new(area: Arc<InflightArea>, queue: u16, ring_size: u16) -> Option<InflightQueue> {
        (queue < area.num_queues && ring_size <= area.queue_size).then_some(InflightQueue {
            area,
            queue,
            heads: ring_size,
            counter: 0,
        })
    }

    fn region(&self) -> VolatileSlice<'_> {
        self.area.region(self.queue)
    }

    fn desc_at(head: u16) -> usize {
        HEADER_BYTES + DESC_BYTES * usize::from(head)
    }

    fn set_inflight(&self, head: u16, on: bool) {
        let _ = self.region().store(
            u8::from(on),
            Self::desc_at(head) + INFLIGHT_AT,
            Ordering::Release,
        );
    }

    fn header_u16(&self, at: usize) -> u16 {
        u16::from_le(self.region().load(at, Ordering::Acquire).unwrap_or(0))
    }

    fn set_header_u16(&self, at: usize, value: u16) {
        let _ = self.region().store(value.to_le(), at, Ordering::Release);
    }

    /// Whether `head` is marked in flight.
    pub fn is_inflight(&self, head: u16) -> bool {
        head < self.heads
            && self
                .region()
                .load::<u8>(Self::desc_at(head) + INFLIGHT_AT, Ordering::Acquire)
                .is_ok_and(|b| b == 1)
    }

    /// Records that `head` was taken off the avail ring (before its I/O is submitted).
    pub fn take(&mut self, head: u16) {
        if head >= self.heads {
            return;
        }
        let at = Self::desc_at(head) + COUNTER_AT;
        let _ = self
            .region()
            .store(self.counter.to_le(), at, Ordering::Relaxed);
        self.counter += 1;
        self.set_inflight(head, true);
    }

    /// Forgets `head`, taken but never submitted and given back to the avail ring.
    pub fn untake(&mut self, head: u16) {
        if head < self.heads {
            self.set_inflight(head, false);
        }
    }

    /// Before `head`'s used element and the guest's used index are written.
    pub fn before_put(&self, head: u16) {
        self.set_header_u16(LAST_BATCH_HEAD_AT, head);
    }

    /// After the guest's used index became `used_idx` with `head`'s element.
    pub fn after_put(&self, head: u16, used_idx: u16) {
        if head < self.heads {
            self.set_inflight(head, false);
        }
        self.set_header_u16(USED_IDX_AT, used_idx);
    }

    /// Reads what a predecessor left, given the guest's used index now: repairs an answer
    /// it published without clearing, and returns the heads to run again.
    pub fn recover(&mut self, guest_used_idx: u16) -> Recovery {
        if self.header_u16(VERSION_AT) != INFLIGHT_VERSION {
            // Never written by a back end of this layout: nothing is known to be in flight.
            let region = self.region();
            for head in 0..self.heads {
                self.set_inflight(head, false);
            }
            let _ = region.store(INFLIGHT_VERSION.to_le(), VERSION_AT, Ordering::Relaxed);
            let _ = region.store(self.area.queue_size.to_le(), DESC_NUM_AT, Ordering::Relaxed);
            self.set_header_u16(USED_IDX_AT, guest_used_idx);
            self.counter = 0;
            return Recovery {
                resubmit: Vec::new(),
                next_avail: guest_used_idx,
            };
        }
        if self.header_u16(USED_IDX_AT) != guest_used_idx {
            // The last answer reached the guest but its head was not cleared.
            let last = self.header_u16(LAST_BATCH_HEAD_AT);
            if last < self.heads {
                self.set_inflight(last, false);
            }
            self.set_header_u16(USED_IDX_AT, guest_used_idx);
        }
        let mut marked: Vec<(u64, u16)> = (0..self.heads)
            .filter(|&h| self.is_inflight(h))
            .map(|h| {
                let at = Self::desc_at(h) + COUNTER_AT;
                let counter = self.region().load::<u64>(at, Ordering::Relaxed);
                (u64::from_le(counter.unwrap_or(0)), h)
            })
            .collect();
        marked.sort_unstable();
        self.counter = marked.last().map_or(0, |&(c, _)| c.wrapping_add(1));
        let resubmit: Vec<u16> = marked.into_iter().map(|(_, h)| h).collect();
        debug_assert!(resubmit.len() <= usize::from(self.heads));
        Recovery {
            next_avail: guest_used_idx.wrapping_add(resubmit.len() as u16),
            resubmit,
        }
    }
}

#[cfg(test)]
mod tests;
