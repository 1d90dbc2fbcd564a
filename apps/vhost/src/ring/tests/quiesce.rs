//! A ring with a slow write in flight when its memory changes: a new map is taken only once
//! the write is answered (no chain is taken meanwhile), and then serves the guest's next
//! requests, into memory only the new map has; under a hold the ring takes nothing, and
//! says once that all it took is answered.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::blk::ID_BYTES;

/// Every write takes 300 ms: one is surely in flight for a while.
const SLOW_WRITES: &str = "emu:dram,size=1M,write_us=300000,jitter=0,tail_pct=0";
/// Where the second region (a hot-plugged one) starts in guest memory.
const C: u64 = 1 << 20;

fn parked() -> StandaloneConfig {
    StandaloneConfig {
        tuning: ReactorTuning {
            idle_spin_ns: 0,
            ..ReactorTuning::default()
        },
        ..StandaloneConfig::default()
    }
}

/// Polls for `d` of wall time.
fn poll_for(rig: &mut Rig, d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        rig.r.poll(&mut rig.state);
    }
}

/// The head of used element `i`.
fn used_head(guest: &Guest, i: u16) -> u16 {
    let at = GuestAddress(USED + 4 + 8 * u64::from(i));
    guest.mem.read_obj::<u32>(at).unwrap() as u16
}

/// Posts a write of `byte`s to sector 8 and lets the ring take it.
fn write_in_flight(rig: &mut Rig, byte: u8) {
    rig.guest.post(vb::VIRTIO_BLK_T_OUT, 8, 512, Some(byte));
    for _ in 0..3 {
        rig.r.poll(&mut rig.state);
    }
    assert_eq!(rig.guest.used_idx(), 0, "the write is in flight");
}

/// The front end adds 1 MiB of memory at [`C`] (published as ADD_MEM_REG does, with no
/// hold) and the guest at once posts a GET_ID into it (answered as soon as it is taken).
fn add_region_and_get_id(rig: &mut Rig) {
    let file = tempfile::tempfile().unwrap();
    file.set_len(1 << 20).unwrap();
    rig.table.add(C, 1 << 20, 0x7010_0000, 0, file).unwrap();
    rig.table.publish(&rig.conn);
    rig.guest.mem = rig.conn.memory().1.unwrap().guest().clone();
    rig.guest
        .post_at(vb::VIRTIO_BLK_T_GET_ID, 0, ID_BYTES, C + 0x100, None);
}

#[test]
fn a_new_map_is_taken_only_once_the_old_maps_request_is_answered() {
    let mut rig = rig(SLOW_WRITES, parked(), |_| {});
    write_in_flight(&mut rig, 0x5a);

    // The front end adds a region (memory hot-plugged) and the guest at once posts
    // requests into it: a GET_ID (answered as soon as it is taken) and a read of the
    // write's sector.
    add_region_and_get_id(&mut rig);
    rig.guest
        .post_at(vb::VIRTIO_BLK_T_IN, 8, 512, C + 0x1000, None);

    // While the write taken under the old map is in flight, no chain is taken.
    poll_for(&mut rig, Duration::from_millis(100));
    assert_eq!(
        rig.guest.used_idx(),
        0,
        "nothing taken before the old map's write is answered"
    );

    // Then the write is answered, the new map taken, and the requests served through it.
    answered(&mut rig.r, &mut rig.state, &rig.guest, 3);
    assert_eq!(
        (0..3).map(|i| used_head(&rig.guest, i)).collect::<Vec<_>>(),
        [0, 3, 6],
        "the write first, then the new map's requests"
    );
    assert!((0..3).all(|k| rig.guest.status(k) == S_OK));
    let mut id = [0u8; 1];
    rig.guest
        .mem
        .read_slice(&mut id, GuestAddress(C + 0x100))
        .unwrap();
    assert_eq!(&id, b"d", "GET_ID wrote into the new region");
    let mut got = [0u8; 512];
    rig.guest
        .mem
        .read_slice(&mut got, GuestAddress(C + 0x1000))
        .unwrap();
    assert!(
        got.iter().all(|b| *b == 0x5a),
        "the read found the write's data"
    );
}

#[test]
fn a_held_ring_takes_nothing_and_says_once_when_all_it_took_is_answered() {
    let told = Arc::new(AtomicUsize::new(0));
    let counter = told.clone();
    let mut rig = rig(SLOW_WRITES, parked(), move |start| {
        start.tell_control = Box::new(move || {
            counter.fetch_add(1, Ordering::Relaxed);
        });
    });
    write_in_flight(&mut rig, 0x33);

    // A front end's message that replaces memory waits: the rings are held.
    rig.conn.set_hold(7);
    rig.guest.post(vb::VIRTIO_BLK_T_GET_ID, 0, ID_BYTES, None);
    poll_for(&mut rig, Duration::from_millis(100));
    assert_eq!(rig.guest.used_idx(), 0, "nothing taken under the hold");
    assert_eq!((rig.shared.quiet(), told.load(Ordering::Relaxed)), (0, 0));

    // The write is answered: the ring says it is quiet, once, and still takes nothing.
    answered(&mut rig.r, &mut rig.state, &rig.guest, 1);
    poll_for(&mut rig, Duration::from_millis(20));
    assert_eq!(rig.shared.quiet(), 7);
    assert_eq!(told.load(Ordering::Relaxed), 1);
    assert_eq!(rig.guest.used_idx(), 1, "the GET_ID waits for the hold");

    // The hold lifted, the ring goes on.
    rig.conn.set_hold(0);
    answered(&mut rig.r, &mut rig.state, &rig.guest, 2);
    assert_eq!(told.load(Ordering::Relaxed), 1);
}

/// What a test's tracing subscriber wrote.
#[derive(Clone, Default)]
struct Log(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_ring_that_waits_past_the_bound_says_so_and_keeps_waiting() {
    // A write that takes longer than the bound, the reactor driven as its thread would
    // (it parks while the device works).
    let device = "emu:dram,size=1M,write_us=1300000,jitter=0,tail_pct=0";
    let log = Log::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let started = Instant::now();
    tracing::subscriber::with_default(subscriber, || {
        let mut rig = rig(device, parked(), |_| {});
        write_in_flight(&mut rig, 0x77);
        add_region_and_get_id(&mut rig);
        run_until_answered(&mut rig.r, &mut rig.state, &rig.guest, 2);
        assert_eq!(
            (used_head(&rig.guest, 0), used_head(&rig.guest, 1)),
            (0, 3),
            "the write, then the request under the new map: nothing dropped"
        );
        assert!((0..2).all(|k| rig.guest.status(k) == S_OK));
    });
    assert!(started.elapsed() >= Duration::from_millis(1300));
    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    assert_eq!(
        text.matches("waits for the device").count(),
        1,
        "said once that it still waits: {text}"
    );
    assert!(text.contains("requests=1"), "{text}");
    assert!(
        text.contains("waited for are answered"),
        "and when they were: {text}"
    );
}
