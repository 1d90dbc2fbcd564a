//! The inflight area's bookkeeping: what a ring records, and what its successor recovers
//! from it, including a death between the guest's used index and the clear.

use super::*;

/// A ring of 8 on queue 1 of a new area of two queues of 8, and the area's file.
fn queue() -> (InflightQueue, File) {
    let (area, file) = InflightArea::create(2, 8).unwrap();
    (InflightQueue::new(area, 1, 8).unwrap(), file)
}

/// Answers `head` as a ring does, the guest's used index becoming `used_idx`.
fn answer(q: &InflightQueue, head: u16, used_idx: u16) {
    q.before_put(head);
    q.after_put(head, used_idx);
}

/// The successor's view: the same file mapped again.
fn successor(file: &File) -> InflightQueue {
    let size = 2 * queue_region_bytes(8) as u64;
    let area = InflightArea::open(file.try_clone().unwrap(), 0, size, 2, 8).unwrap();
    InflightQueue::new(area, 1, 8).unwrap()
}

#[test]
fn a_new_area_is_aligned_per_queue_and_stamped_with_version_and_size() {
    assert_eq!(queue_region_bytes(8), 192);
    assert_eq!(queue_region_bytes(256), 16 + 16 * 256 + 48);
    let (q, file) = queue();
    assert_eq!(file.metadata().unwrap().len(), 2 * 192);
    assert_eq!(q.area.size_bytes(), 2 * 192);
    for queue in 0..2 {
        let r = q.area.region(queue);
        assert_eq!(r.load::<u16>(VERSION_AT, Ordering::Relaxed).unwrap(), 1);
        assert_eq!(r.load::<u16>(DESC_NUM_AT, Ordering::Relaxed).unwrap(), 8);
    }
    assert!((0..8).all(|h| !q.is_inflight(h)));
}

#[test]
fn out_of_bounds_shapes_and_short_areas_are_refused() {
    assert!(InflightArea::create(0, 8).is_err());
    assert!(InflightArea::create(1, 0).is_err());
    assert!(InflightArea::create(INFLIGHT_QUEUES_MAX + 1, 8).is_err());
    assert!(InflightArea::create(1, crate::control::QUEUE_SIZE_MAX + 1).is_err());
    let (area, file) = InflightArea::create(2, 8).unwrap();
    let short = InflightArea::open(file, 0, 2 * 192 - 1, 2, 8);
    assert!(matches!(short, Err(InflightError::Size { .. })));
    assert!(
        InflightQueue::new(area.clone(), 2, 8).is_none(),
        "no queue 2"
    );
    assert!(
        InflightQueue::new(area, 0, 16).is_none(),
        "a ring larger than the region"
    );
}

#[test]
fn heads_answered_out_of_order_leave_the_others_to_resubmit_in_the_order_taken() {
    let (mut q, file) = queue();
    for head in [3, 1, 2, 0] {
        q.take(head);
    }
    // Two answered out of order, the guest's used index at 2.
    answer(&q, 2, 1);
    answer(&q, 0, 2);
    assert!(q.is_inflight(3) && q.is_inflight(1) && !q.is_inflight(2) && !q.is_inflight(0));
    let mut next = successor(&file);
    let rec = next.recover(2);
    assert_eq!(
        rec,
        Recovery {
            resubmit: vec![3, 1],
            next_avail: 4
        }
    );
    // The successor's own heads come after the resubmitted ones.
    next.take(5);
    let counter = |q: &InflightQueue, h: u16| {
        q.region()
            .load::<u64>(InflightQueue::desc_at(h) + COUNTER_AT, Ordering::Relaxed)
            .unwrap()
    };
    assert!(counter(&next, 5) > counter(&next, 1));
    assert!(counter(&next, 1) > counter(&next, 3));
}

#[test]
fn a_death_after_the_used_index_and_before_the_clear_is_not_answered_twice() {
    let (mut q, file) = queue();
    q.take(5);
    q.take(6);
    // The ring published 6's element and the guest's used index (now 1), then died.
    q.before_put(6);
    let rec = successor(&file).recover(1);
    assert_eq!(
        rec,
        Recovery {
            resubmit: vec![5],
            next_avail: 2
        }
    );
    // And the repair is recorded: a second successor agrees.
    assert_eq!(successor(&file).recover(1).resubmit, vec![5]);
}

#[test]
fn a_death_before_the_used_index_runs_the_head_again() {
    let (mut q, file) = queue();
    q.take(5);
    q.take(6);
    // The element may be written, but the guest's used index never moved.
    q.before_put(6);
    let rec = successor(&file).recover(0);
    assert_eq!(
        rec,
        Recovery {
            resubmit: vec![5, 6],
            next_avail: 2
        }
    );
}

#[test]
fn a_clean_stop_and_an_untaken_head_leave_nothing_and_other_queues_are_untouched() {
    let (mut q, file) = queue();
    q.take(4);
    q.take(7);
    answer(&q, 4, 1);
    answer(&q, 7, 2);
    q.take(1);
    q.untake(1);
    let rec = successor(&file).recover(2);
    assert_eq!(
        rec,
        Recovery {
            resubmit: vec![],
            next_avail: 2
        }
    );
    let size = 2 * queue_region_bytes(8) as u64;
    let area = InflightArea::open(file, 0, size, 2, 8).unwrap();
    let mut other = InflightQueue::new(area, 0, 8).unwrap();
    assert_eq!(other.recover(0).resubmit, Vec::<u16>::new());
}

#[test]
fn an_area_never_stamped_is_taken_as_holding_nothing() {
    let file = crate::sys::memfd("t").unwrap();
    file.set_len(queue_region_bytes(8) as u64).unwrap();
    let area = InflightArea::open(file, 0, queue_region_bytes(8) as u64, 1, 8).unwrap();
    // Garbage marks without a version: not trusted.
    let _ = area
        .region(0)
        .store(1u8, InflightQueue::desc_at(3), Ordering::Relaxed);
    let mut q = InflightQueue::new(area, 0, 8).unwrap();
    let rec = q.recover(7);
    assert_eq!(rec.resubmit, Vec::<u16>::new());
    assert_eq!(rec.next_avail, 7);
    assert!(!q.is_inflight(3));
}
