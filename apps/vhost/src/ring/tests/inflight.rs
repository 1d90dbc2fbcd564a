//! A ring that records into an inflight area, abandoned with requests in flight (its
//! reactor never polled again, as if its process died), and a successor ring on another
//! reactor, over the same guest memory, device and area, that answers each of them exactly
//! once, in the order they were taken, before the guest's next request; and a successor
//! stopped before it ran them, which leaves them for the next.

use super::*;
use crate::inflight::{InflightArea, InflightQueue};

/// A reactor running ring 0 of `area` on `device`, over `conn`'s guest memory, from `base`.
fn start(
    device: &Device,
    conn: &Arc<ConnShared>,
    kick: &File,
    area: Arc<InflightArea>,
    base: u16,
) -> (Reactor<Standalone>, Standalone, Arc<RingShared>) {
    let (mut r, _handle) = Reactor::<Standalone>::standalone(StandaloneConfig {
        tuning: ReactorTuning {
            idle_spin_ns: 0,
            ..ReactorTuning::default()
        },
        ..StandaloneConfig::default()
    })
    .unwrap();
    let geometry = Geometry::new(&device.ctrl.namespace(), false, false, false, 1);
    let vhost = VhostShard::new(&mut r, &[("d".into(), device.clone(), geometry)], 32).unwrap();
    let mut state = Standalone { vhost };
    let shared = RingShared::new();
    let start = RingStart {
        export: 0,
        conn: conn.clone(),
        shared: shared.clone(),
        queue_size: SIZE,
        desc: DESC,
        avail: AVAIL,
        used: USED,
        base,
        event_idx: true,
        indirect: false,
        kick: kick.try_clone().unwrap(),
        call: Some(eventfd()),
        err: None,
        inflight: Some(InflightQueue::new(area, 0, SIZE).unwrap()),
        tell_control: Box::new(|| {}),
    };
    state.vhost.start_ring(&mut r, start);
    assert_eq!(state.vhost.rings(), 1);
    (r, state, shared)
}

/// Guest memory of 1 MiB published on a new connection, the guest, and an eventfd to kick.
fn guest() -> (Arc<ConnShared>, Guest, File) {
    let file = tempfile::tempfile().unwrap();
    file.set_len(1 << 20).unwrap();
    let mut table = MemoryTable::default();
    table.add(0, 1 << 20, 0x7000_0000, 0, file).unwrap();
    let conn = ConnShared::new();
    table.publish(&conn);
    let kick = eventfd();
    let guest = Guest {
        mem: conn.memory().1.unwrap().guest().clone(),
        posted: 0,
        kick: kick.try_clone().unwrap(),
    };
    (conn, guest, kick)
}

/// The heads of the guest's used elements `0..n`.
fn used_heads(guest: &Guest, n: u16) -> Vec<u16> {
    (0..n)
        .map(|i| {
            let at = GuestAddress(USED + 4 + 8 * u64::from(i));
            guest.mem.read_obj::<u32>(at).unwrap() as u16
        })
        .collect()
}

/// The head request slot `k` uses (`Guest::post`).
fn head(k: u16) -> u16 {
    3 * (k % 5)
}

#[test]
fn a_successor_answers_what_a_dead_ring_left_in_flight_exactly_once_and_in_order() {
    let device = Device::open("emu:dram,size=1M").unwrap();
    let (conn, mut guest, kick) = guest();
    let (area, area_file) = InflightArea::create(1, SIZE).unwrap();

    // Two writes with a GET_ID after each: the ring takes all four in one poll and answers
    // the GET_IDs at once, so the guest holds answers out of the order it posted.
    let (mut r, mut state, _) = start(&device, &conn, &kick, area, 0);
    let id = vb::VIRTIO_BLK_T_GET_ID;
    guest.post(vb::VIRTIO_BLK_T_OUT, 0, 512, Some(0xa0));
    guest.post(id, 0, crate::blk::ID_BYTES, None);
    guest.post(vb::VIRTIO_BLK_T_OUT, 2, 512, Some(0xa2));
    guest.post(id, 0, crate::blk::ID_BYTES, None);
    r.poll(&mut state);
    assert_eq!(
        guest.used_idx(),
        2,
        "the GET_IDs answered, the writes in flight"
    );
    assert_eq!(used_heads(&guest, 2), [head(1), head(3)]);
    assert_eq!((guest.status(0), guest.status(2)), (0xee, 0xee));
    // The back end dies: its reactor is never polled again.
    std::mem::forget((r, state));

    // The front end hands the same area to a successor, with the guest's used index as
    // the base (what QEMU has once its back end is gone). Restarting at that index alone
    // would take request 2 (answered) and 3 (in flight) off the avail ring again.
    let size = crate::inflight::queue_region_bytes(SIZE) as u64;
    let area = InflightArea::open(area_file, 0, size, 1, SIZE).unwrap();
    let (mut r, mut state, _) = start(&device, &conn, &kick, area.clone(), 2);
    run_until_answered(&mut r, &mut state, &guest, 4);
    assert_eq!(
        used_heads(&guest, 4),
        [head(1), head(3), head(0), head(2)],
        "each write answered once, in the order taken"
    );
    assert!((0..4).all(|k| guest.status(k) == S_OK));

    // The guest's next requests are the next avail entries: reads of what was written.
    guest.post(vb::VIRTIO_BLK_T_IN, 0, 512, None);
    guest.post(vb::VIRTIO_BLK_T_IN, 2, 512, None);
    run_until_answered(&mut r, &mut state, &guest, 6);
    quiet(&mut r, &mut state);
    assert_eq!(guest.used_idx(), 6, "nothing answered twice");
    assert_eq!(used_heads(&guest, 6)[4..], [head(4), head(5)]);
    for (k, byte) in [(4, 0xa0u8), (5, 0xa2)] {
        let mut got = [0u8; 512];
        guest
            .mem
            .read_slice(&mut got, GuestAddress(data(k)))
            .unwrap();
        assert!(got.iter().all(|b| *b == byte), "read {k} found the write");
    }
    let left = InflightQueue::new(area, 0, SIZE).unwrap();
    assert!(
        (0..SIZE).all(|h| !left.is_inflight(h)),
        "nothing left marked"
    );
}

#[test]
fn a_ring_stopped_before_it_resubmitted_leaves_the_heads_marked_for_the_next_start() {
    let device = Device::open("emu:dram,size=1M").unwrap();
    let (conn, mut guest, kick) = guest();
    let (area, _file) = InflightArea::create(1, SIZE).unwrap();
    // A back end took two writes and died without answering either.
    let mut dead = InflightQueue::new(area.clone(), 0, SIZE).unwrap();
    dead.recover(0);
    for k in 0..2 {
        guest.post(
            vb::VIRTIO_BLK_T_OUT,
            u64::from(k),
            512,
            Some(0xc0 + k as u8),
        );
        dead.take(head(k));
    }
    // Its successor is stopped (GET_VRING_BASE) before it ran them: it answers nothing,
    // and leaves them marked.
    let (mut r, mut state, shared) = start(&device, &conn, &kick, area.clone(), 0);
    shared.request_stop();
    let deadline = Instant::now() + Duration::from_secs(5);
    while shared.stopped().is_none() {
        assert!(Instant::now() < deadline, "the ring stopped in time");
        r.poll(&mut state);
    }
    assert_eq!(guest.used_idx(), 0);
    let marks = InflightQueue::new(area.clone(), 0, SIZE).unwrap();
    assert!(marks.is_inflight(head(0)) && marks.is_inflight(head(1)));
    // The next start, from the base that stop published, runs both, once each, in order.
    let base = shared.stopped().unwrap().unwrap();
    let (mut r, mut state, _) = start(&device, &conn, &kick, area, base);
    run_until_answered(&mut r, &mut state, &guest, 2);
    quiet(&mut r, &mut state);
    assert_eq!(guest.used_idx(), 2);
    assert_eq!(used_heads(&guest, 2), [head(0), head(1)]);
    assert!(!marks.is_inflight(head(0)) && !marks.is_inflight(head(1)));
}
