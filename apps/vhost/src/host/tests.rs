use super::*;
use crate::testkit::{guest, HIGH_END, HIGH_START, LOW_END, TABLE};
use vm_memory::{Bytes, GuestAddress};

fn memory() -> Arc<HostMemory> {
    Arc::new(HostMemory::new(Arc::new(guest())))
}

#[test]
fn a_range_is_translated_only_wholly_inside_one_region() {
    let m = memory();
    assert!(m.holds(0, LOW_END));
    assert!(m.holds(LOW_END - 16, 16));
    assert!(
        !m.holds(LOW_END - 15, 16),
        "straddles the end of the first region"
    );
    assert!(!m.holds(HIGH_START - 1, 2), "starts in the hole");
    assert!(m.holds(HIGH_END - 1, 1));
    assert!(!m.holds(HIGH_END - 1, 2), "runs past the last region");
    assert!(!m.holds(HIGH_END, 1), "past the last region");
    assert!(!m.holds(u64::MAX, 1));
    assert!(m.read::<16>(LOW_END - 15).is_none());
    assert!(m.read::<16>(HIGH_END - 8).is_none());
    assert!(m.read::<16>(u64::MAX - 7).is_none());
    assert!(!m.write(LOW_END - 1, &[1, 2]));
    assert!(!m.write(HIGH_END, &[1]));
    assert!(m.span(LOW_END - 8, 16, 2).is_none());
    assert!(m.span(HIGH_END - 8, 16, 2).is_none());
    assert!(m.span(HIGH_START + 1, 4, 2).is_none(), "misaligned");
    // Nothing next to the refused ranges was written.
    let g = m.guest();
    assert_eq!(g.read_obj::<u8>(GuestAddress(LOW_END - 1)).unwrap(), 0);
    assert_eq!(g.read_obj::<u8>(GuestAddress(HIGH_END - 1)).unwrap(), 0);
}

#[test]
fn reads_and_writes_land_where_vm_memory_sees_them() {
    let m = memory();
    let g = m.guest().clone();
    let bytes: [u8; 16] = std::array::from_fn(|i| i as u8 + 1);
    assert!(m.write(HIGH_START + 3, &bytes));
    let mut back = [0u8; 16];
    g.read_slice(&mut back, GuestAddress(HIGH_START + 3))
        .unwrap();
    assert_eq!(back, bytes);
    assert_eq!(m.read::<16>(HIGH_START + 3), Some(bytes), "unaligned");
    g.write_slice(&bytes, GuestAddress(0x40)).unwrap();
    assert_eq!(m.read::<16>(0x40), Some(bytes), "aligned");
    let span = m.span(0x40, 16, 4).unwrap();
    assert_eq!(span.load_u16(2, Ordering::Acquire), Some(0x0403));
    assert_eq!(span.load_u16(1, Ordering::Acquire), None, "misaligned");
    assert_eq!(span.load_u16(15, Ordering::Acquire), None, "past the end");
    assert!(span.store_u16(14, 0xbeef, Ordering::Release));
    assert!(span.write_u32(8, 0x1234_5678));
    assert!(!span.write_u32(16, 0), "past the end");
    assert_eq!(g.read_obj::<u16>(GuestAddress(0x4e)).unwrap(), 0xbeef);
    assert_eq!(g.read_obj::<u32>(GuestAddress(0x48)).unwrap(), 0x1234_5678);
    assert_eq!(
        g.read_obj::<u8>(GuestAddress(0x50)).unwrap(),
        0,
        "nothing past it"
    );
}

#[test]
fn a_small_range_across_adjacent_regions_is_copied_byte_by_byte() {
    let g =
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1000), (GuestAddress(0x1000), 0x1000)])
            .unwrap();
    let m = Arc::new(HostMemory::new(Arc::new(g)));
    let bytes: [u8; 16] = std::array::from_fn(|i| 0xa0 + i as u8);
    assert!(m.holds(0xff8, 16));
    assert!(m.write(0xff8, &bytes));
    assert_eq!(m.read::<16>(0xff8), Some(bytes));
    assert!(
        m.span(0xff8, 16, 2).is_none(),
        "a ring lies inside one region"
    );
    assert!(!m.holds(0x1ff8, 16), "past the last region");
}

/// A descriptor table of `n` entries at `TABLE` in `m`, entry `i` holding address
/// `tag + i`, and the table resolved as a ring resolves it.
fn table_in(m: &Arc<HostMemory>, n: u16, tag: u64) -> Span {
    for i in 0..n {
        crate::testkit::put_desc(m.guest(), TABLE, i, tag + u64::from(i), 16, 0, 0);
    }
    m.span(TABLE, 16 * u64::from(n), 16).unwrap()
}

#[test]
fn a_ring_view_reads_its_resolved_table_and_nothing_past_it() {
    let m = memory();
    let span = table_in(&m, 4, 0xa0);
    // A descriptor past the resolved entries, which the view must read by address.
    crate::testkit::put_desc(m.guest(), TABLE, 4, 0xb4, 16, 0, 0);
    let view = RingView::new(&m, TABLE, Some(&span));
    for i in 0..5u16 {
        assert_eq!(
            view.descriptor(TABLE, i),
            m.read16(TABLE + 16 * u64::from(i)),
            "entry {i}"
        );
    }
    assert_eq!(view.descriptor(TABLE, 1).unwrap()[0], 0xa1);
    assert_eq!(view.descriptor(TABLE, 4).unwrap()[0], 0xb4);
    // Another table (an indirect one) is read by address, inside memory or not.
    assert_eq!(view.descriptor(TABLE + 16, 0), m.read16(TABLE + 16));
    assert_eq!(view.descriptor(LOW_END - 16, 1), None);
    assert_eq!(view.descriptor(u64::MAX - 15, 1), None);
}

#[test]
fn a_table_resolved_in_an_earlier_memory_map_is_not_used() {
    // The map the ring resolved its table in, and the one the front end sent since: the
    // same guest address, other bytes.
    let old = memory();
    let old_span = table_in(&old, 4, 0xa0);
    let new = memory();
    table_in(&new, 4, 0xc0);
    let view = RingView::new(&new, TABLE, Some(&old_span));
    assert_eq!(
        view.descriptor(TABLE, 2).unwrap()[0],
        0xc2,
        "read in the new map"
    );
    // A new map without the table's region: nothing is read from the old one.
    let small = Arc::new(HostMemory::new(Arc::new(
        GuestMemoryMmap::from_ranges(&[(GuestAddress(HIGH_START), 0x1000)]).unwrap(),
    )));
    let view = RingView::new(&small, TABLE, Some(&old_span));
    assert_eq!(view.descriptor(TABLE, 0), None);
}

#[test]
fn a_ring_view_remembers_a_region_but_never_answers_from_it_wrongly() {
    let m = memory();
    let g = m.guest().clone();
    let high: [u8; 16] = std::array::from_fn(|i| 0x10 + i as u8);
    let low: [u8; 16] = std::array::from_fn(|i| 0x40 + i as u8);
    g.write_slice(&high, GuestAddress(HIGH_START + 0x40))
        .unwrap();
    g.write_slice(&low, GuestAddress(0x40)).unwrap();
    let view = RingView::new(&m, TABLE, None);
    // Alternate between the regions, the hole, past the end, and an address that is
    // inside the remembered region's length from the wrong side.
    for _ in 0..2 {
        assert_eq!(view.read16(HIGH_START + 0x40), Some(words(high)));
        assert_eq!(view.read16(HIGH_START - 0x40), None, "the hole");
        assert!(!view.holds(HIGH_END - 8, 16, false), "past the last region");
        assert!(view.holds(HIGH_END - 16, 16, true));
        assert_eq!(view.read16(0x40), Some(words(low)));
        assert_eq!(view.read16(LOW_END - 8), None, "runs into the hole");
        assert!(view.write(LOW_END - 1, &[7]));
        assert!(!view.write(LOW_END, &[7]), "the hole");
        assert!(view.write(HIGH_START, &[9]));
    }
    assert_eq!(g.read_obj::<u8>(GuestAddress(LOW_END - 1)).unwrap(), 7);
    assert_eq!(g.read_obj::<u8>(GuestAddress(HIGH_START)).unwrap(), 9);
}

#[test]
fn an_unaligned_read_is_the_same_words_and_stays_inside_its_region() {
    let m = memory();
    let g = m.guest().clone();
    let bytes: [u8; 40] = std::array::from_fn(|i| 0x80 + i as u8);
    g.write_slice(&bytes, GuestAddress(0x200)).unwrap();
    for at in 0x200..0x218 {
        assert_eq!(
            m.read16(at),
            g.read16(at),
            "at {at:#x}, as vm-memory reads it"
        );
    }
    let view = RingView::new(&m, 0x203, None);
    assert_eq!(view.descriptor(0x203, 0), g.read16(0x203));
    // The last 16 bytes of a region whose end is not a word's: the aligned words around
    // them would run past it, so they are read some other way, and right.
    let g = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1003)]).unwrap();
    let tail: [u8; 16] = std::array::from_fn(|i| 0x30 + i as u8);
    g.write_slice(&tail, GuestAddress(0xff3)).unwrap();
    let m = Arc::new(HostMemory::new(Arc::new(g.clone())));
    assert_eq!(m.read16(0xff3), Some(words(tail)));
    assert_eq!(m.read16(0xff4), None, "past the end");
}
