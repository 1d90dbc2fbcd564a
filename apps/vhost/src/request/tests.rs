//! The list of bad input, one case each, and the good requests beside them: a
//! chain walked out of a fake guest's memory, then parsed.

use virtio_bindings::virtio_blk as vb;
use vm_memory::GuestAddress;

use super::*;
use crate::blk::{S_IOERR, S_UNSUPP};
use crate::host::HostMemory;
use crate::testkit::*;
use crate::walk::{walk_chain, ChainLimits, GuestView};

const QUEUE: u16 = 16;

fn geometry() -> Geometry {
    Geometry {
        capacity_sectors: 1024,
        block_bytes: 512,
        read_only: false,
        discard: true,
        write_zeroes: true,
        seg_max: 4,
        size_max: 4096,
        request_bytes_max: 16384,
        range_sectors_max: 256,
        num_queues: 1,
    }
}

fn limits() -> ChainLimits {
    ChainLimits {
        queue_size: QUEUE,
        indirect: true,
    }
}

/// Walks the chain at descriptor 0 of `TABLE` and parses it, through the back end's host
/// pointers and through vm-memory's accessors, which must agree.
fn walk_and_parse(mem: &vm_memory::GuestMemoryMmap, g: &Geometry) -> Result<Request, ParseError> {
    let host = HostMemory::new(std::sync::Arc::new(mem.clone()));
    let by_host = walk_and_parse_in(&host, TABLE, g);
    assert_eq!(
        by_host,
        walk_and_parse_in(mem, TABLE, g),
        "host pointers = vm-memory"
    );
    by_host
}

fn walk_and_parse_in<M: GuestView + ?Sized>(
    mem: &M,
    table: u64,
    g: &Geometry,
) -> Result<Request, ParseError> {
    let mut chain = Vec::with_capacity(QUEUE as usize);
    walk_chain(mem, GuestAddress(table), limits(), 0, &mut chain)?;
    parse(mem, &chain, g)
}

/// A request of `kind` at `sector` with `data` buffers between header and status.
fn request(kind: u32, sector: u64, data: &[(u64, u32, bool)]) -> Result<Request, ParseError> {
    let mem = guest();
    put_header(&mem, HEADER, kind, sector);
    let mut bufs = vec![(HEADER, 16, false)];
    bufs.extend_from_slice(data);
    bufs.push((STATUS, 1, true));
    put_chain(&mem, TABLE, &bufs);
    walk_and_parse(&mem, &geometry())
}

fn refused(result: Result<Request, ParseError>) -> RequestError {
    match result {
        Err(ParseError::Refused { status, error }) => {
            assert_eq!(status, GuestAddress(STATUS));
            error
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn well_formed_requests_of_every_type_parse() {
    let read = request(
        vb::VIRTIO_BLK_T_IN,
        8,
        &[(DATA, 4096, true), (DATA + 4096, 512, true)],
    );
    let read = read.unwrap();
    assert_eq!((read.op, read.sector, read.sectors), (Op::Read, 8, 9));
    assert_eq!((read.data, read.written_bytes), (1..3, 4608));
    let write = request(vb::VIRTIO_BLK_T_OUT, 0, &[(HIGH_START, 1024, false)]).unwrap();
    assert_eq!(
        (write.op, write.sectors, write.written_bytes),
        (Op::Write, 2, 0)
    );
    assert_eq!(
        request(vb::VIRTIO_BLK_T_FLUSH, 0, &[]).unwrap().op,
        Op::Flush
    );
    let id = request(vb::VIRTIO_BLK_T_GET_ID, 0, &[(DATA, 20, true)]).unwrap();
    assert_eq!((id.op, id.written_bytes), (Op::GetId, 20));

    let mem = guest();
    put_header(&mem, HEADER, vb::VIRTIO_BLK_T_WRITE_ZEROES, 0);
    put_range(&mem, DATA, 16, 32, vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP);
    put_chain(
        &mem,
        TABLE,
        &[(HEADER, 16, false), (DATA, 16, false), (STATUS, 1, true)],
    );
    let wz = walk_and_parse(&mem, &geometry()).unwrap();
    assert_eq!(
        (wz.op, wz.sector, wz.sectors),
        (Op::WriteZeroes { unmap: true }, 16, 32)
    );
    put_header(&mem, HEADER, vb::VIRTIO_BLK_T_DISCARD, 0);
    put_range(&mem, DATA, 1000, 24, 0);
    let discard = walk_and_parse(&mem, &geometry()).unwrap();
    assert_eq!(
        (discard.op, discard.sector, discard.sectors),
        (Op::Discard, 1000, 24)
    );
}

#[test]
fn an_indirect_table_holds_the_whole_request() {
    let mem = guest();
    put_header(&mem, HEADER, vb::VIRTIO_BLK_T_IN, 0);
    let indirect = 0x2000;
    put_chain(
        &mem,
        indirect,
        &[(HEADER, 16, false), (DATA, 512, true), (STATUS, 1, true)],
    );
    put_desc(&mem, TABLE, 0, indirect, 3 * 16, INDIRECT, 0);
    let r = walk_and_parse(&mem, &geometry()).unwrap();
    assert_eq!((r.op, r.sectors), (Op::Read, 1));
}

#[test]
fn a_descriptor_pointing_outside_guest_memory_is_refused() {
    // Into the hole between the regions, past the end, and straddling a region's end.
    for addr in [LOW_END, HIGH_END, LOW_END - 256, u64::MAX - 100] {
        let e = refused(request(vb::VIRTIO_BLK_T_IN, 0, &[(addr, 512, true)]));
        assert_eq!(
            e,
            RequestError::BufferOutsideMemory { index: 0 },
            "{addr:#x}"
        );
        assert_eq!(e.status(), S_IOERR);
    }
    // The header too: refused before any of it is read.
    let mem = guest();
    put_chain(&mem, TABLE, &[(LOW_END + 8, 16, false), (STATUS, 1, true)]);
    assert_eq!(
        refused(walk_and_parse(&mem, &geometry())),
        RequestError::HeaderOutsideMemory
    );
    // A status byte outside memory leaves nothing to answer in.
    put_chain(&mem, TABLE, &[(HEADER, 16, false), (HIGH_END, 1, true)]);
    assert_eq!(
        walk_and_parse(&mem, &geometry()),
        Err(ParseError::Chain(ChainError::StatusOutsideMemory {
            addr: HIGH_END
        }))
    );
    // So does a descriptor table outside memory.
    let mut chain = Vec::new();
    assert_eq!(
        walk_chain(&mem, GuestAddress(LOW_END), limits(), 3, &mut chain),
        Err(ChainError::DescriptorOutsideMemory {
            index: 3,
            addr: LOW_END + 48
        })
    );
}

#[test]
fn a_chain_that_loops_or_outruns_the_queue_breaks_the_queue() {
    let mem = guest();
    // 0 -> 1 -> 2 -> 0 ...
    for i in 0..3u16 {
        put_desc(&mem, TABLE, i, HEADER, 16, NEXT, (i + 1) % 3);
    }
    let mut chain = Vec::with_capacity(QUEUE as usize);
    assert_eq!(
        walk_chain(&mem, GuestAddress(TABLE), limits(), 0, &mut chain),
        Err(ChainError::TooLong { max: QUEUE })
    );
    assert_eq!(
        chain.len(),
        QUEUE as usize,
        "the walk stopped at the queue's size"
    );
    // A next index past the table, and a head past it.
    put_desc(&mem, TABLE, 0, HEADER, 16, NEXT, QUEUE);
    assert_eq!(
        walk_chain(&mem, GuestAddress(TABLE), limits(), 0, &mut chain),
        Err(ChainError::NextOutOfRange {
            index: 0,
            next: QUEUE,
            size: QUEUE
        })
    );
    assert_eq!(
        walk_chain(&mem, GuestAddress(TABLE), limits(), QUEUE, &mut chain),
        Err(ChainError::HeadOutOfRange {
            head: QUEUE,
            size: QUEUE
        })
    );
}

#[test]
fn indirect_tables_are_followed_once_and_only_when_negotiated() {
    let mem = guest();
    let mut chain = Vec::new();
    let walk =
        |mem, limits, chain: &mut Vec<_>| walk_chain(mem, GuestAddress(TABLE), limits, 0, chain);
    put_desc(&mem, TABLE, 0, 0x2000, 32, INDIRECT, 0);
    put_desc(&mem, 0x2000, 0, 0x3000, 32, INDIRECT, 0);
    assert_eq!(
        walk(&mem, limits(), &mut chain),
        Err(ChainError::IndirectNested)
    );
    let no_indirect = ChainLimits {
        indirect: false,
        ..limits()
    };
    assert_eq!(
        walk(&mem, no_indirect, &mut chain),
        Err(ChainError::IndirectNotNegotiated)
    );
    put_desc(&mem, TABLE, 0, 0x2000, 32, INDIRECT | NEXT, 1);
    assert_eq!(
        walk(&mem, limits(), &mut chain),
        Err(ChainError::IndirectWithNext)
    );
    for len in [0, 24, 16 * (u32::from(QUEUE) + 1)] {
        put_desc(&mem, TABLE, 0, 0x2000, len, INDIRECT, 0);
        assert_eq!(
            walk(&mem, limits(), &mut chain),
            Err(ChainError::IndirectTableSize { len })
        );
    }
}

#[test]
fn wrong_direction_buffers_are_refused() {
    let e = refused(request(vb::VIRTIO_BLK_T_IN, 0, &[(DATA, 512, false)]));
    assert_eq!(e, RequestError::WrongDirection { index: 0 });
    let e = refused(request(
        vb::VIRTIO_BLK_T_OUT,
        0,
        &[(DATA, 512, false), (DATA + 512, 512, true)],
    ));
    assert_eq!(e, RequestError::WrongDirection { index: 1 });
    let e = refused(request(vb::VIRTIO_BLK_T_GET_ID, 0, &[(DATA, 20, false)]));
    assert_eq!(e, RequestError::IdLayout);
    // A writable header.
    let mem = guest();
    put_chain(&mem, TABLE, &[(HEADER, 16, true), (STATUS, 1, true)]);
    assert_eq!(
        refused(walk_and_parse(&mem, &geometry())),
        RequestError::HeaderWritable
    );
    // A readable status: nothing to answer in.
    put_chain(&mem, TABLE, &[(HEADER, 16, false), (STATUS, 1, false)]);
    assert_eq!(
        walk_and_parse(&mem, &geometry()),
        Err(ParseError::Chain(ChainError::NoStatus))
    );
}

#[test]
fn a_header_or_status_of_the_wrong_size_is_refused() {
    let mem = guest();
    put_header(&mem, HEADER, vb::VIRTIO_BLK_T_FLUSH, 0);
    for len in [8, 15, 17, 32] {
        put_chain(&mem, TABLE, &[(HEADER, len, false), (STATUS, 1, true)]);
        assert_eq!(
            refused(walk_and_parse(&mem, &geometry())),
            RequestError::HeaderSize { len }
        );
    }
    // A status of more than one byte: refused in its last byte, where virtio puts it.
    put_chain(&mem, TABLE, &[(HEADER, 16, false), (STATUS - 3, 4, true)]);
    assert_eq!(
        refused(walk_and_parse(&mem, &geometry())),
        RequestError::StatusSize { len: 4 }
    );
    put_chain(&mem, TABLE, &[(HEADER, 16, false), (STATUS, 0, true)]);
    assert_eq!(
        walk_and_parse(&mem, &geometry()),
        Err(ParseError::Chain(ChainError::NoStatus))
    );
}

#[test]
fn a_request_past_capacity_is_refused() {
    let e = refused(request(vb::VIRTIO_BLK_T_IN, 1023, &[(DATA, 1024, true)]));
    assert!(
        matches!(e, RequestError::PastCapacity { sector: 1023, .. }),
        "{e:?}"
    );
    let e = refused(request(
        vb::VIRTIO_BLK_T_OUT,
        u64::MAX,
        &[(DATA, 512, false)],
    ));
    assert!(matches!(e, RequestError::PastCapacity { .. }), "{e:?}");
    // The last sector is in.
    request(vb::VIRTIO_BLK_T_IN, 1023, &[(DATA, 512, true)]).unwrap();
    let mem = guest();
    put_header(&mem, HEADER, vb::VIRTIO_BLK_T_DISCARD, 0);
    put_range(&mem, DATA, 1000, 25, 0);
    put_chain(
        &mem,
        TABLE,
        &[(HEADER, 16, false), (DATA, 16, false), (STATUS, 1, true)],
    );
    assert!(matches!(
        refused(walk_and_parse(&mem, &geometry())),
        RequestError::PastCapacity { .. }
    ));
}

#[test]
fn an_unknown_request_type_is_unsupported() {
    for kind in [
        2,
        3,
        vb::VIRTIO_BLK_T_SECURE_ERASE,
        vb::VIRTIO_BLK_T_ZONE_APPEND,
        u32::MAX,
    ] {
        let e = refused(request(kind, 0, &[]));
        assert_eq!(e, RequestError::Unsupported(kind));
        assert_eq!(e.status(), S_UNSUPP);
    }
    // Discard on a device without it.
    let mem = guest();
    put_header(&mem, HEADER, vb::VIRTIO_BLK_T_DISCARD, 0);
    put_range(&mem, DATA, 0, 8, 0);
    put_chain(
        &mem,
        TABLE,
        &[(HEADER, 16, false), (DATA, 16, false), (STATUS, 1, true)],
    );
    let g = Geometry {
        discard: false,
        ..geometry()
    };
    let e = refused(walk_and_parse(&mem, &g));
    assert_eq!(e.status(), S_UNSUPP);
    // Unmap on a discard, and reserved flag bits.
    put_range(&mem, DATA, 0, 8, vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP);
    assert_eq!(
        refused(walk_and_parse(&mem, &geometry())).status(),
        S_UNSUPP
    );
    put_header(&mem, HEADER, vb::VIRTIO_BLK_T_WRITE_ZEROES, 0);
    put_range(&mem, DATA, 0, 8, 4);
    assert_eq!(
        refused(walk_and_parse(&mem, &geometry())).status(),
        S_UNSUPP
    );
}

#[test]
fn the_limits_on_one_request_hold() {
    let five: Vec<_> = (0..5).map(|i| (DATA + i * 512, 512, true)).collect();
    let e = refused(request(vb::VIRTIO_BLK_T_IN, 0, &five));
    assert_eq!(e, RequestError::TooManySegments { count: 5, max: 4 });
    let e = refused(request(vb::VIRTIO_BLK_T_IN, 0, &[(DATA, 8192, true)]));
    assert_eq!(
        e,
        RequestError::SegmentTooLarge {
            len: 8192,
            max: 4096
        }
    );
    // GET_ID's buffer too (found by the fuzzer: every buffer handed on keeps size_max).
    let e = refused(request(vb::VIRTIO_BLK_T_GET_ID, 0, &[(DATA, 4116, true)]));
    assert_eq!(
        e,
        RequestError::SegmentTooLarge {
            len: 4116,
            max: 4096
        }
    );
    let e = refused(request(vb::VIRTIO_BLK_T_IN, 0, &[(DATA, 100, true)]));
    assert!(matches!(e, RequestError::NotWholeBlocks { .. }), "{e:?}");
    let e = refused(request(vb::VIRTIO_BLK_T_IN, 0, &[]));
    assert_eq!(e, RequestError::NoData);
    let e = refused(request(vb::VIRTIO_BLK_T_FLUSH, 0, &[(DATA, 512, true)]));
    assert_eq!(e, RequestError::FlushWithData);
    let e = refused(request(vb::VIRTIO_BLK_T_IN, 0, &[(DATA, 0, true)]));
    assert_eq!(e, RequestError::EmptyBuffer { index: 0 });
    // Two ranges where one is allowed.
    let e = refused(request(
        vb::VIRTIO_BLK_T_WRITE_ZEROES,
        0,
        &[(DATA, 32, false)],
    ));
    assert_eq!(e, RequestError::TooManyRanges { count: 2, max: 1 });
}

#[test]
fn a_read_only_export_refuses_whatever_writes() {
    let g = Geometry {
        read_only: true,
        discard: false,
        write_zeroes: false,
        ..geometry()
    };
    let mem = guest();
    put_header(&mem, HEADER, vb::VIRTIO_BLK_T_OUT, 0);
    put_chain(
        &mem,
        TABLE,
        &[(HEADER, 16, false), (DATA, 512, false), (STATUS, 1, true)],
    );
    assert_eq!(refused(walk_and_parse(&mem, &g)), RequestError::ReadOnly);
    put_header(&mem, HEADER, vb::VIRTIO_BLK_T_WRITE_ZEROES, 0);
    put_range(&mem, DATA, 0, 8, 0);
    put_chain(
        &mem,
        TABLE,
        &[(HEADER, 16, false), (DATA, 16, false), (STATUS, 1, true)],
    );
    assert_eq!(refused(walk_and_parse(&mem, &g)), RequestError::ReadOnly);
    // Reads still go.
    put_header(&mem, HEADER, vb::VIRTIO_BLK_T_IN, 0);
    put_chain(
        &mem,
        TABLE,
        &[(HEADER, 16, false), (DATA, 512, true), (STATUS, 1, true)],
    );
    assert_eq!(walk_and_parse(&mem, &g).unwrap().op, Op::Read);
}

#[test]
fn through_host_pointers_a_range_straddling_a_region_end_or_past_the_last_is_refused() {
    let mem = guest();
    let host = HostMemory::new(std::sync::Arc::new(mem.clone()));
    let g = geometry();
    // The descriptor itself: a table whose first entry straddles the first region's end, or
    // lies past the last region.
    for table in [LOW_END - 8, HIGH_END - 8, HIGH_END] {
        assert_eq!(
            walk_and_parse_in(&host, table, &g),
            Err(ParseError::Chain(ChainError::DescriptorOutsideMemory {
                index: 0,
                addr: table
            })),
            "table at {table:#x}"
        );
    }
    // A header straddling the first region's end, or running past the last region.
    for at in [LOW_END - 8, HIGH_END - 8] {
        put_chain(&mem, TABLE, &[(at, 16, false), (STATUS, 1, true)]);
        assert_eq!(
            refused(walk_and_parse_in(&host, TABLE, &g)),
            RequestError::HeaderOutsideMemory,
            "header at {at:#x}"
        );
    }
    // A data buffer doing either, a range of a discard, an indirect table.
    put_header(&mem, HEADER, vb::VIRTIO_BLK_T_IN, 0);
    for at in [LOW_END - 256, HIGH_END - 256, HIGH_END] {
        put_chain(
            &mem,
            TABLE,
            &[(HEADER, 16, false), (at, 512, true), (STATUS, 1, true)],
        );
        assert_eq!(
            refused(walk_and_parse_in(&host, TABLE, &g)),
            RequestError::BufferOutsideMemory { index: 0 },
            "data at {at:#x}"
        );
    }
    put_header(&mem, HEADER, vb::VIRTIO_BLK_T_DISCARD, 0);
    put_chain(
        &mem,
        TABLE,
        &[
            (HEADER, 16, false),
            (HIGH_END - 8, 16, false),
            (STATUS, 1, true),
        ],
    );
    assert_eq!(
        refused(walk_and_parse_in(&host, TABLE, &g)),
        RequestError::BufferOutsideMemory { index: 0 },
        "a discard's range"
    );
    // An indirect table whose first entry ends the first region and whose second lies in
    // the hole.
    put_desc(&mem, TABLE, 0, LOW_END - 16, 32, INDIRECT, 0);
    put_desc(&mem, LOW_END - 16, 0, HEADER, 16, NEXT, 1);
    assert_eq!(
        walk_and_parse_in(&host, TABLE, &g),
        Err(ParseError::Chain(ChainError::DescriptorOutsideMemory {
            index: 1,
            addr: LOW_END
        }))
    );
    // The status byte just past the last region.
    put_header(&mem, HEADER, vb::VIRTIO_BLK_T_FLUSH, 0);
    put_chain(&mem, TABLE, &[(HEADER, 16, false), (HIGH_END, 1, true)]);
    assert_eq!(
        walk_and_parse_in(&host, TABLE, &g),
        Err(ParseError::Chain(ChainError::StatusOutsideMemory {
            addr: HIGH_END
        }))
    );
    // And each of the last bytes inside is fine: a flush whose header ends the first region
    // and whose status is the last byte of the last.
    put_header(&mem, LOW_END - 16, vb::VIRTIO_BLK_T_FLUSH, 0);
    put_chain(
        &mem,
        TABLE,
        &[(LOW_END - 16, 16, false), (HIGH_END - 1, 1, true)],
    );
    let flush = walk_and_parse_in(&host, TABLE, &g).unwrap();
    assert_eq!(
        (flush.op, flush.status),
        (Op::Flush, GuestAddress(HIGH_END - 1))
    );
}
