//! From a walked chain to a typed virtio-blk request: the 16-byte header first (readable),
//! the data buffers (writable for a read, readable for a write), the one status byte last
//! (writable). Everything a guest could get wrong has a typed error: one that leaves the
//! status byte trustworthy is answered there ([`RequestError::status`]); one that does not
//! is a [`ChainError`], and breaks the queue. Every buffer a request hands on lies inside
//! guest memory, and every limit of the [`Geometry`] holds.

use std::ops::Range;

use virtio_bindings::virtio_blk as vb;
use vm_memory::GuestAddress;

use crate::blk::{
    Geometry, HEADER_BYTES, ID_BYTES, RANGES_MAX, RANGE_BYTES, SECTOR_BYTES, S_IOERR, S_UNSUPP,
};
use crate::walk::{Buffer, ChainError, GuestView};

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
    GetId,
    Discard,
    /// `unmap`: the blocks may be deallocated, as long as they read back as zeroes.
    WriteZeroes {
        unmap: bool,
    },
}

/// A well-formed request, within the device's limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    /// First sector (512 bytes) it touches; 0 for flush and GET_ID.
    pub sector: u64,
    /// Sectors it touches; 0 for flush and GET_ID.
    pub sectors: u64,
    /// Its data buffers: indices into the walked chain (empty for flush, discard and write
    /// zeroes, whose range is in `sector` and `sectors`).
    pub data: Range<usize>,
    /// Bytes of data the device writes into guest memory on success (a read's, GET_ID's).
    pub written_bytes: u32,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

/// Why a request is refused while its status byte can still say so.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    #[error("a chain of only its status byte: no header")]
    NoHeader,
    #[error("the header is device-writable")]
    HeaderWritable,
    #[error("the header descriptor holds {len} bytes, not 16")]
    HeaderSize { len: u32 },
    #[error("the header lies outside guest memory")]
    HeaderOutsideMemory,
    #[error("the status descriptor holds {len} bytes, not 1")]
    StatusSize { len: u32 },
    #[error("data buffer {index} lies outside guest memory")]
    BufferOutsideMemory { index: usize },
    #[error("data buffer {index} is empty")]
    EmptyBuffer { index: usize },
    #[error("data buffer {index} goes the wrong way for the request")]
    WrongDirection { index: usize },
    #[error("{count} data buffers, over seg_max {max}")]
    TooManySegments { count: usize, max: u32 },
    #[error("a data buffer of {len} bytes, over size_max {max}")]
    SegmentTooLarge { len: u32, max: u32 },
    #[error("{bytes} bytes of data, over the most one request carries ({max})")]
    TooLarge { bytes: u64, max: u32 },
    #[error("a read or write of no data")]
    NoData,
    #[error("{bytes} bytes at sector {sector} is not whole blocks of {block_bytes} bytes")]
    NotWholeBlocks {
        sector: u64,
        bytes: u64,
        block_bytes: u32,
    },
    #[error("sectors {sector}..+{sectors} run past the capacity, {capacity} sectors")]
    PastCapacity {
        sector: u64,
        sectors: u64,
        capacity: u64,
    },
    #[error("the export is read-only")]
    ReadOnly,
    #[error("a flush that carries data")]
    FlushWithData,
    #[error("GET_ID wants one writable buffer")]
    IdLayout,
    #[error("{bytes} bytes of ranges: one range is one buffer of 16 bytes")]
    RangeLayout { bytes: u64 },
    #[error("{count} ranges, over max_discard_seg / max_write_zeroes_seg ({max})")]
    TooManyRanges { count: u64, max: u32 },
    #[error("a range of {sectors} sectors (1 to {max})")]
    RangeSize { sectors: u32, max: u32 },
    #[error("range flags {flags:#x}: reserved bits, or unmap on a discard")]
    RangeFlags { flags: u32 },
    #[error("request type {0} is not one this device carries out")]
    Unsupported(u32),
}

impl RequestError {
    /// The status the request is answered with: UNSUPP for what this device does not do,
    /// IOERR for what no device could.
    pub fn status(&self) -> u8 {
        match self {
            RequestError::Unsupported(_) | RequestError::RangeFlags { .. } => S_UNSUPP,
            _ => S_IOERR,
        }
    }
}

/// Why a walked chain is not a request to carry out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Answer it: `status` is trustworthy.
    #[error("{error}")]
    Refused {
        status: GuestAddress,
        error: RequestError,
    },
    /// The queue is broken.
    #[error(transparent)]
    Chain(#[from] ChainError),
}

/// The request a walked chain (`chain`, at least one buffer) carries, checked against
/// `geometry` and `mem`.
pub fn parse<M: GuestView + ?Sized>(
    mem: &M,
    chain: &[Buffer],
    geometry: &Geometry,
) -> Result<Request, ParseError> {
    let status = status_of(mem, chain)?;
    let refuse = |error| ParseError::Refused { status, error };
    let request = parse_body(mem, chain, geometry, status).map_err(refuse)?;
    // What a request hands on lies inside guest memory and within the limits.
    debug_assert!(chain[request.data.clone()].iter().all(|b| mem.holds(
        b.addr,
        u64::from(b.len),
        b.writable
    )));
    debug_assert!(request.sector.saturating_add(request.sectors) <= geometry.capacity_sectors);
    Ok(request)
}

/// Where the status byte is: the last byte of the last buffer, which must be writable and
/// in guest memory, or nothing in the chain can be answered.
#[inline]
fn status_of<M: GuestView + ?Sized>(mem: &M, chain: &[Buffer]) -> Result<GuestAddress, ChainError> {
    let last = chain.last().ok_or(ChainError::NoStatus)?;
    if !last.writable || last.len == 0 {
        return Err(ChainError::NoStatus);
    }
    let addr = last
        .addr
        .checked_add(u64::from(last.len) - 1)
        .ok_or(ChainError::StatusOutsideMemory { addr: last.addr })?;
    if !mem.holds(addr, 1, true) {
        return Err(ChainError::StatusOutsideMemory { addr });
    }
    Ok(GuestAddress(addr))
}

fn parse_body<M: GuestView + ?Sized>(
    mem: &M,
    chain: &[Buffer],
    geometry: &Geometry,
    status: GuestAddress,
) -> Result<Request, RequestError> {
    if chain.len() < 2 {
        return Err(RequestError::NoHeader);
    }
    let header = chain[0];
    if header.writable {
        return Err(RequestError::HeaderWritable);
    }
    if header.len != HEADER_BYTES {
        return Err(RequestError::HeaderSize { len: header.len });
    }
    let status_len = chain[chain.len() - 1].len;
    if status_len != 1 {
        return Err(RequestError::StatusSize { len: status_len });
    }
    // Type (32 bits), reserved (32), sector (64), little-endian.
    let [first, sector] = mem
        .read16(header.addr)
        .ok_or(RequestError::HeaderOutsideMemory)?;
    let kind = first as u32;
    let data = 1..chain.len() - 1;
    for (i, b) in chain[data.clone()].iter().enumerate() {
        if b.len == 0 {
            return Err(RequestError::EmptyBuffer { index: i });
        }
        if !mem.holds(b.addr, u64::from(b.len), b.writable) {
            return Err(RequestError::BufferOutsideMemory { index: i });
        }
    }
    let mut request = Request {
        op: Op::Flush,
        sector: 0,
        sectors: 0,
        data: data.start..data.start,
        written_bytes: 0,
        status,
    };
    match kind {
        vb::VIRTIO_BLK_T_IN | vb::VIRTIO_BLK_T_OUT => {
            let write = kind == vb::VIRTIO_BLK_T_OUT;
            if write && geometry.read_only {
                return Err(RequestError::ReadOnly);
            }
            let bytes = data_bytes(&chain[data.clone()], geometry, !write)?;
            let sectors = check_range(sector, bytes, geometry)?;
            request.op = if write { Op::Write } else { Op::Read };
            request.sector = sector;
            request.sectors = sectors;
            request.data = data;
            request.written_bytes = if write { 0 } else { bytes as u32 };
        }
        vb::VIRTIO_BLK_T_FLUSH => {
            if !data.is_empty() {
                return Err(RequestError::FlushWithData);
            }
        }
        vb::VIRTIO_BLK_T_GET_ID => {
            let [id] = &chain[data.clone()] else {
                return Err(RequestError::IdLayout);
            };
            if !id.writable {
                return Err(RequestError::IdLayout);
            }
            if id.len > geometry.size_max {
                return Err(RequestError::SegmentTooLarge {
                    len: id.len,
                    max: geometry.size_max,
                });
            }
            request.op = Op::GetId;
            request.data = data;
            request.written_bytes = id.len.min(ID_BYTES);
        }
        vb::VIRTIO_BLK_T_DISCARD | vb::VIRTIO_BLK_T_WRITE_ZEROES => {
            let discard = kind == vb::VIRTIO_BLK_T_DISCARD;
            if (discard && !geometry.discard) || (!discard && !geometry.write_zeroes) {
                // A read-only export offers neither: say so rather than "unsupported".
                return Err(if geometry.read_only {
                    RequestError::ReadOnly
                } else {
                    RequestError::Unsupported(kind)
                });
            }
            let (first, sectors, flags) = read_range(mem, &chain[data.clone()], geometry)?;
            let unmap = flags & vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
            if flags & !vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0 || (discard && unmap) {
                return Err(RequestError::RangeFlags { flags });
            }
            check_range(first, u64::from(sectors) * SECTOR_BYTES, geometry)?;
            request.op = if discard {
                Op::Discard
            } else {
                Op::WriteZeroes { unmap }
            };
            request.sector = first;
            request.sectors = u64::from(sectors);
        }
        other => return Err(RequestError::Unsupported(other)),
    }
    Ok(request)
}

/// The bytes a read's or write's data buffers carry, each of the right direction and
/// within the segment limits.
#[inline]
fn data_bytes(data: &[Buffer], geometry: &Geometry, writable: bool) -> Result<u64, RequestError> {
    if data.is_empty() {
        return Err(RequestError::NoData);
    }
    if data.len() > geometry.seg_max as usize {
        return Err(RequestError::TooManySegments {
            count: data.len(),
            max: geometry.seg_max,
        });
    }
    let mut bytes = 0u64;
    for (index, b) in data.iter().enumerate() {
        if b.writable != writable {
            return Err(RequestError::WrongDirection { index });
        }
        if b.len > geometry.size_max {
            return Err(RequestError::SegmentTooLarge {
                len: b.len,
                max: geometry.size_max,
            });
        }
        bytes += u64::from(b.len);
    }
    if bytes > u64::from(geometry.request_bytes_max) {
        return Err(RequestError::TooLarge {
            bytes,
            max: geometry.request_bytes_max,
        });
    }
    Ok(bytes)
}

/// `bytes` at `sector`, as whole device blocks inside the capacity. Returns the sectors.
#[inline]
fn check_range(sector: u64, bytes: u64, geometry: &Geometry) -> Result<u64, RequestError> {
    let block_sectors = geometry.block_sectors();
    let not_whole = RequestError::NotWholeBlocks {
        sector,
        bytes,
        block_bytes: geometry.block_bytes,
    };
    if !Geometry::is_multiple(bytes, u64::from(geometry.block_bytes))
        || !Geometry::is_multiple(sector, block_sectors)
    {
        return Err(not_whole);
    }
    let sectors = bytes / SECTOR_BYTES;
    let end = sector.checked_add(sectors);
    if end.is_none_or(|end| end > geometry.capacity_sectors) {
        return Err(RequestError::PastCapacity {
            sector,
            sectors,
            capacity: geometry.capacity_sectors,
        });
    }
    Ok(sectors)
}

/// The one range of a discard or write zeroes: (sector, sectors, flags).
fn read_range<M: GuestView + ?Sized>(
    mem: &M,
    data: &[Buffer],
    geometry: &Geometry,
) -> Result<(u64, u32, u32), RequestError> {
    let bytes: u64 = data.iter().map(|b| u64::from(b.len)).sum();
    let count = bytes / u64::from(RANGE_BYTES);
    if count > u64::from(RANGES_MAX) && bytes.is_multiple_of(u64::from(RANGE_BYTES)) {
        return Err(RequestError::TooManyRanges {
            count,
            max: RANGES_MAX,
        });
    }
    let [range] = data else {
        return Err(RequestError::RangeLayout { bytes });
    };
    if range.len != RANGE_BYTES || range.writable {
        return Err(RequestError::RangeLayout { bytes });
    }
    // Sector (64 bits), sectors (32), flags (32), little-endian.
    let [sector, rest] = mem
        .read16(range.addr)
        .ok_or(RequestError::BufferOutsideMemory { index: 0 })?;
    let sectors = rest as u32;
    let flags = (rest >> 32) as u32;
    if sectors == 0 || sectors > geometry.range_sectors_max {
        return Err(RequestError::RangeSize {
            sectors,
            max: geometry.range_sectors_max,
        });
    }
    Ok((sector, sectors, flags))
}

#[cfg(test)]
mod tests;
