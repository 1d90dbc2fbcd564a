//! Tests of the emulated controller: ring mechanics, the latency model as the host sees it,
//! data integrity, bad input, faults and interrupts. Virtual time keeps them deterministic.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;

use super::engine::SlotState;
use super::*;
use crate::buf::IoBuf;
use crate::clock::VirtualClock;
use crate::qpair::{Command, Completion, SubmitError};
use crate::spec::{
    CompletionEntry, DsmRange, Opcode, Status, SubmissionEntry, DSM_ATTR_DEALLOCATE,
};
use crate::sync::{IoError, SyncIo};
use crate::sys::{monotonic_ns, wait_readable};

fn cfg(device: &str) -> EmuConfig {
    match device.parse::<crate::DeviceConfig>().unwrap() {
        crate::DeviceConfig::Emu(cfg) => cfg,
        other => panic!("not emu: {other:?}"),
    }
}

fn virtual_controller(device: &str) -> (EmuController, VirtualClock) {
    let clock = VirtualClock::new(1_000_000);
    let ctrl = EmuController::with_clock(cfg(device), Clock::Virtual(clock.clone())).unwrap();
    (ctrl, clock)
}

/// Reaps everything visible now.
fn reap(qp: &mut EmuQueuePair) -> Vec<Completion> {
    let mut done = Vec::new();
    qp.process_completions(usize::MAX, &mut |c| done.push(c));
    done
}

/// Submits a command with no data buffer.
fn submit_nodata(qp: &mut EmuQueuePair, cmd: Command<'_>, tag: u64) -> Result<(), SubmitError> {
    assert!(cmd.buf_ptr().is_null());
    // SAFETY: the command carries no data buffer.
    unsafe { qp.submit(&cmd, tag) }
}

#[test]
fn rings_and_phase_stay_correct_across_many_wraps() {
    let (ctrl, clock) = virtual_controller("emu:optane,size=16M");
    let depth = 5; // ring of 6 entries: wraps every 6 completions
    let mut qp = ctrl.queue_pair(depth).unwrap();
    let mut next_tag = 0u64;
    let mut completed = vec![false; 0];
    let mut phase_flips = 0;
    let mut last_phase = qp.host_cq_phase;
    let mut batch = 1;
    while next_tag < 30_000 {
        // Vary the number in flight from 1 to depth so head and tail meet at every offset.
        for _ in 0..batch {
            if qp.outstanding() == depth {
                break;
            }
            submit_nodata(&mut qp, Command::write_zeroes(next_tag % 1000, 1), next_tag).unwrap();
            completed.push(false);
            next_tag += 1;
        }
        batch = batch % depth + 1;
        let deadline_ns = qp.oracle_next_deadline_ns().expect("pending commands");
        clock.advance_to(deadline_ns);
        // Reap one at a time so the head moves in single steps through the wrap.
        while qp.process_completions(1, &mut |c| {
            assert!(c.status.is_success(), "{}", c.status);
            assert!(!completed[c.tag as usize], "tag {} completed twice", c.tag);
            completed[c.tag as usize] = true;
        }) == 1
        {
            if qp.host_cq_phase != last_phase {
                phase_flips += 1;
                last_phase = qp.host_cq_phase;
            }
        }
        // Every entry the host consumed carries the controller's view of the SQ head.
        assert!(qp.host_sq_head < qp.ring_len());
    }
    while qp.outstanding() > 0 {
        clock.advance_to(qp.oracle_next_deadline_ns().unwrap());
        while qp.process_completions(1, &mut |c| completed[c.tag as usize] = true) == 1 {
            if qp.host_cq_phase != last_phase {
                phase_flips += 1;
                last_phase = qp.host_cq_phase;
            }
        }
    }
    assert!(completed.iter().all(|&c| c), "every command completed");
    // One flip per trip round the 6-entry ring.
    assert_eq!(phase_flips, next_tag as usize / (depth + 1));
    assert_eq!(qp.host_cq_head, qp.dev_cq_tail);
    assert_eq!(qp.host_sq_tail, qp.dev_sq_head);
}

#[test]
fn completion_entries_follow_the_spec_layout() {
    let (ctrl, clock) = virtual_controller("emu:optane,size=16M");
    let _first = ctrl.queue_pair(4).unwrap();
    let mut qp = ctrl.queue_pair(4).unwrap();
    assert_eq!(qp.qid(), 2);
    submit_nodata(&mut qp, Command::write_zeroes(0, 8), 77).unwrap();
    clock.advance_to(qp.oracle_next_deadline_ns().unwrap());
    let mut zero_budget_bytes = ZEROED_BYTES_PER_POLL_MAX;
    qp.advance(clock.now_ns(), &mut zero_budget_bytes);
    let cqe = qp.cq[0];
    assert_eq!(cqe.sq_id, 2);
    assert_eq!(cqe.sq_head, 1, "the controller consumed one entry");
    assert!(cqe.phase(), "first pass through the ring has phase 1");
    assert_eq!(qp.sq[0].opcode, Opcode::WriteZeroes as u8);
    assert_eq!(qp.sq[0].block_count(), 8);
    assert_eq!(
        reap(&mut qp),
        vec![Completion {
            tag: 77,
            status: Status::SUCCESS
        }]
    );
}

/// The completion entry as the bytes a controller writes (little-endian dwords).
fn cqe_dwords(cqe: &CompletionEntry) -> [u32; 4] {
    // SAFETY: CompletionEntry is repr(C), two u32s and four u16s: 16 bytes (asserted in
    // spec.rs) with no padding, so every byte is initialised.
    let bytes: [u8; 16] = unsafe { std::mem::transmute(*cqe) };
    std::array::from_fn(|i| u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()))
}

/// DW2 = SQ head | SQ id << 16, DW3 = command id | phase << 16 | status field << 17, checked
/// on the raw bytes of the entries the controller posts, across a phase flip.
#[cfg(target_endian = "little")]
#[test]
fn completion_entry_dwords_hold_the_spec_bit_layout() {
    // 2048 blocks; depth 2: a ring of 3 entries, so the 4th entry is written with phase 0.
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M");
    let mut qp = ctrl.queue_pair(2).unwrap();
    let cases = [
        (Command::write_zeroes(0, 1), Status::SUCCESS),
        (Command::write_zeroes(2048, 1), Status::LBA_OUT_OF_RANGE),
        (Command::write_zeroes(0, 1), Status::SUCCESS),
        (Command::write_zeroes(u64::MAX, 2), Status::LBA_OUT_OF_RANGE),
    ];
    for (i, (cmd, status)) in cases.into_iter().enumerate() {
        submit_nodata(&mut qp, cmd, i as u64).unwrap();
        let slot = qp.dev_cq_tail as usize;
        let phase = u32::from(qp.dev_cq_phase);
        let cid = u32::from(qp.sq[(qp.dev_sq_head as usize + 2) % 3].cid);
        clock.advance_to(qp.oracle_next_deadline_ns().unwrap());
        assert_eq!(
            reap(&mut qp),
            vec![Completion {
                tag: i as u64,
                status
            }]
        );
        let dw = cqe_dwords(&qp.cq[slot]);
        assert_eq!(
            dw[2],
            u32::from(qp.dev_sq_head) | (u32::from(qp.qid()) << 16)
        );
        let field = u32::from(status.to_field());
        assert_eq!(dw[3], cid | (phase << 16) | (field << 17), "entry {i}");
        assert_eq!(
            phase,
            u32::from(i < 3),
            "entry {i} is on pass {}",
            i / 3 + 1
        );
    }
    // LBA Out of Range with DNR: SC 0x80 at bit 17, SCT 0 at bit 25, DNR at bit 31.
    let dw3 = cqe_dwords(&qp.cq[1])[3];
    assert_eq!(dw3 >> 17, 0x80 | (1 << 14));
    assert_eq!(dw3 >> 31, 1, "do not retry");
}

/// A poll posts what was due at the last clock reading without reading the clock, and
/// still reads it when something else is pending: one poll sees everything due by now.
#[test]
fn a_poll_posts_everything_due_whether_or_not_it_reads_the_clock() {
    let (ctrl, clock) =
        virtual_controller("emu:optane,size=1M,parallel=1,write_us=10,jitter=0,tail_pct=0");
    let mut qp = ctrl.queue_pair(4).unwrap();
    let t0 = clock.now_ns();
    submit_nodata(&mut qp, Command::write_zeroes(0, 1), 1).unwrap(); // due t0 + 10 us
    clock.advance_to(t0 + 20_000);
    submit_nodata(&mut qp, Command::write_zeroes(0, 1), 2).unwrap(); // due t0 + 30 us
    assert_eq!(
        qp.last_clock_ns,
        t0 + 20_000,
        "1 was due at the last reading"
    );
    clock.advance_to(t0 + 30_000);
    let tags: Vec<u64> = reap(&mut qp).iter().map(|c| c.tag).collect();
    assert_eq!(tags, vec![1, 2]);
    // Zero latency: due at the submission's own reading, posted without another.
    let zero = EmuConfig {
        size_bytes: 1 << 20,
        ..EmuConfig::zero_latency()
    };
    let ctrl = EmuController::with_clock(zero, Clock::Virtual(VirtualClock::new(5))).unwrap();
    let mut qp = ctrl.queue_pair(4).unwrap();
    let mut buf = IoBuf::zeroed(128 << 10);
    // SAFETY: `buf` outlives the command, reaped below.
    unsafe { qp.submit(&Command::read(0, 256, &mut buf), 3) }.unwrap();
    assert_eq!(qp.oracle_next_deadline_ns(), Some(qp.last_clock_ns));
    assert_eq!(reap(&mut qp).len(), 1, "128 KiB costs nothing either");
}

/// Qid 0 is the admin queue: after 65 535 I/O queues the ids wrap to 1, not to 0.
#[test]
fn queue_ids_wrap_within_1_to_65535() {
    let (ctrl, _clock) = virtual_controller("emu:optane,size=1M");
    assert_eq!(ctrl.queue_pair(1).unwrap().qid(), 1);
    ctrl.shared.queues_created.store(65_534, Ordering::Relaxed);
    assert_eq!(ctrl.queue_pair(1).unwrap().qid(), 65_535);
    assert_eq!(ctrl.queue_pair(1).unwrap().qid(), 1);
    assert_eq!(ctrl.queue_pair(1).unwrap().qid(), 2);
}

#[test]
fn a_completion_is_invisible_until_its_deadline() {
    let (ctrl, clock) = virtual_controller("emu:nand,size=16M");
    let mut qp = ctrl.queue_pair(8).unwrap();
    let t0 = clock.now_ns();
    submit_nodata(&mut qp, Command::write_zeroes(0, 1), 1).unwrap();
    let deadline_ns = qp.oracle_next_deadline_ns().unwrap();
    assert_eq!(qp.oracle_deadline_ns_of(1), Some(deadline_ns));
    assert!(deadline_ns > t0 + 10_000, "nand write takes ~20 us");
    clock.advance_to(deadline_ns - 1);
    assert!(reap(&mut qp).is_empty());
    assert_eq!(qp.outstanding(), 1);
    clock.advance_to(deadline_ns);
    assert_eq!(reap(&mut qp).len(), 1);
    assert_eq!(qp.outstanding(), 0);
    assert_eq!(qp.oracle_next_deadline_ns(), None);
}

/// Standard normal quantiles.
const Z50: f64 = 0.0;
const Z90: f64 = 1.281_551_565_5;
const Z99: f64 = 2.326_347_874;

/// The modelled drives' published figures for 4 KiB I/O at queue depth 1, in microseconds:
/// for each profile and direction, (quantile, lowest, highest). They pin the profiles to the
/// drives they model, whatever their parameters become.
const DRIVE_FIGURES_US: &[(&str, &str, f64, f64, f64)] = &[
    ("optane", "read", 0.50, 8.0, 10.0),
    ("optane", "read", 0.99, 10.0, 12.0),
    ("p5800x", "read", 0.50, 5.0, 6.0),
    ("zssd", "read", 0.50, 15.0 * 0.85, 15.0 * 1.15),
    ("nand", "read", 0.50, 80.0 * 0.85, 80.0 * 1.15),
    ("nand", "write", 0.50, 20.0 * 0.85, 20.0 * 1.15),
    ("dram", "read", 0.50, 3.0 * 0.85, 3.0 * 1.15),
];

/// Over 100 000 commands per profile and direction, at queue depth 1 in virtual time, the
/// latency the host sees has median, p90 and (where the slow path is too rare to move it)
/// p99 within 15 % of what the profile's parameters say, the slow path fires at its rate,
/// and the drives' published figures hold.
#[test]
fn each_profile_meets_its_latency_quantiles() {
    const N: usize = 100_000;
    let mut checked_figures = 0;
    for name in config::profile_names() {
        let (ctrl, clock) = virtual_controller(&format!("emu:{name},size=64M,lba=4096"));
        let cfg = ctrl.config().clone();
        let mut qp = ctrl.queue_pair(1).unwrap();
        let mut buf = IoBuf::zeroed(4096);
        let sigma = (1.0 + cfg.jitter * cfg.jitter).ln().sqrt();
        for (read, median_us) in [(true, cfg.read_us), (false, cfg.write_us)] {
            let mut lat_ns: Vec<u64> = Vec::with_capacity(N);
            for i in 0..N as u64 {
                let t0 = clock.now_ns();
                let cmd = if read {
                    Command::read(i % 1000, 1, &mut buf)
                } else {
                    Command::write(i % 1000, 1, &buf)
                };
                // SAFETY: `buf` outlives the command, which completes within this iteration.
                unsafe { qp.submit(&cmd, i) }.unwrap();
                clock.advance_to(qp.oracle_next_deadline_ns().unwrap());
                assert_eq!(reap(&mut qp).len(), 1);
                lat_ns.push(clock.now_ns() - t0);
            }
            lat_ns.sort_unstable();
            let kind = if read { "read" } else { "write" };
            for &(_, _, q, low_us, high_us) in DRIVE_FIGURES_US
                .iter()
                .filter(|f| f.0 == name && f.1 == kind)
            {
                let measured_us = lat_ns[((N - 1) as f64 * q) as usize] as f64 / 1_000.0;
                assert!(
                    (low_us..=high_us).contains(&measured_us),
                    "{name} 4 KiB {kind} p{}: {measured_us} us, the drive class says {low_us}..={high_us}",
                    q * 100.0
                );
                checked_figures += 1;
            }
            let tail = cfg.tail_pct / 100.0;
            for (q, z) in [(0.5, Z50), (0.9, Z90), (0.99, Z99)] {
                if q > 1.0 - 5.0 * tail {
                    continue; // the slow path owns this quantile
                }
                let expected = median_us * 1_000.0 * (z * sigma).exp();
                let measured = lat_ns[((N - 1) as f64 * q) as usize] as f64;
                assert!(
                    (measured - expected).abs() <= 0.15 * expected,
                    "{name} {kind} p{}: measured {measured} ns, expected {expected:.0} ns",
                    q * 100.0
                );
            }
            // Slow-path rate: samples nearer the slow median than the fast one.
            let (fast_ns, slow_ns) = (median_us * 1_000.0, cfg.tail_us * 1_000.0);
            if slow_ns > 2.0 * fast_ns {
                let cut = (fast_ns * slow_ns).sqrt() as u64;
                let slow = lat_ns.iter().filter(|&&l| l >= cut).count() as f64;
                let expected = N as f64 * tail;
                let allowed = (0.15 * expected).max(4.0 * expected.sqrt());
                assert!(
                    (slow - expected).abs() <= allowed,
                    "{name} {kind}: {slow} slow commands, expected {expected}"
                );
            }
        }
    }
    assert_eq!(
        checked_figures,
        DRIVE_FIGURES_US.len(),
        "every figure was checked"
    );
}

#[test]
fn internal_units_saturate_iops_under_deep_queues() {
    // 4 units, 10 us each, no jitter: 32 commands at once finish in 8 waves of 4.
    let (ctrl, clock) =
        virtual_controller("emu:optane,size=16M,parallel=4,write_us=10,jitter=0,tail_pct=0");
    let mut qp = ctrl.queue_pair(32).unwrap();
    let t0 = clock.now_ns();
    for tag in 0..32 {
        submit_nodata(&mut qp, Command::write_zeroes(tag, 1), tag).unwrap();
    }
    let mut waves = Vec::new();
    while qp.outstanding() > 0 {
        clock.advance_to(qp.oracle_next_deadline_ns().unwrap());
        waves.push((clock.now_ns() - t0, reap(&mut qp).len()));
    }
    let expected: Vec<(u64, usize)> = (1..=8).map(|w| (w * 10_000, 4)).collect();
    assert_eq!(waves, expected);
}

/// A reset gives the aborted commands' units back: with one unit of 100 us, a command
/// submitted after the reset is done 100 us later, not 200 us.
#[test]
fn a_reset_frees_the_units_of_the_commands_it_aborts() {
    let (ctrl, clock) =
        virtual_controller("emu:optane,size=1M,parallel=1,write_us=100,jitter=0,tail_pct=0");
    let mut qp = ctrl.queue_pair(4).unwrap();
    let t0 = clock.now_ns();
    submit_nodata(&mut qp, Command::write_zeroes(0, 1), 1).unwrap();
    assert_eq!(qp.oracle_deadline_ns_of(1), Some(t0 + 100_000));
    assert_eq!(qp.reset(), 1);
    submit_nodata(&mut qp, Command::write_zeroes(0, 1), 2).unwrap();
    assert_eq!(qp.oracle_deadline_ns_of(2), Some(t0 + 100_000));
    let statuses: Vec<(u64, Status)> = reap(&mut qp).iter().map(|c| (c.tag, c.status)).collect();
    assert_eq!(statuses, vec![(1, Status::ABORTED_SQ_DELETION)]);
}

/// Units belong to a queue pair: a busy queue pair does not slow another one down.
#[test]
fn each_queue_pair_has_its_own_units() {
    let (ctrl, clock) =
        virtual_controller("emu:optane,size=1M,parallel=1,write_us=100,jitter=0,tail_pct=0");
    let mut a = ctrl.queue_pair(4).unwrap();
    let mut b = ctrl.queue_pair(4).unwrap();
    let t0 = clock.now_ns();
    for tag in 0..3 {
        submit_nodata(&mut a, Command::write_zeroes(0, 1), tag).unwrap();
    }
    assert_eq!(
        a.oracle_deadline_ns_of(2),
        Some(t0 + 300_000),
        "a queues inside"
    );
    submit_nodata(&mut b, Command::write_zeroes(0, 1), 9).unwrap();
    assert_eq!(
        b.oracle_deadline_ns_of(9),
        Some(t0 + 100_000),
        "b starts at once"
    );
}

/// The longest latencies the configuration allows, at the end of the timeline: deadlines
/// saturate at `u64::MAX` instead of wrapping to before the submission.
#[test]
fn deadlines_saturate_instead_of_wrapping() {
    let clock = VirtualClock::new(u64::MAX - 1_000);
    let device = "emu:nand,size=1M,write_us=10000000,tail_us=10000000,tail_pct=50,jitter=10";
    let ctrl = EmuController::with_clock(cfg(device), Clock::Virtual(clock.clone())).unwrap();
    let mut qp = ctrl.queue_pair(4).unwrap();
    for tag in 0..200 {
        let t0 = clock.now_ns();
        submit_nodata(&mut qp, Command::write_zeroes(tag, 1), tag).unwrap();
        let deadline_ns = qp.oracle_next_deadline_ns().unwrap();
        assert!(
            deadline_ns >= t0,
            "deadline {deadline_ns} before submission {t0}"
        );
        assert!(reap(&mut qp).is_empty() || deadline_ns == t0);
        clock.advance_to(deadline_ns);
        if qp.outstanding() > 0 {
            assert_eq!(reap(&mut qp).len(), 1);
        }
    }
    assert_eq!(clock.now_ns(), u64::MAX, "most deadlines saturated");
}

#[test]
fn queue_full_and_queue_limits_are_errors_not_blocks() {
    let (ctrl, _clock) = virtual_controller("emu:optane,size=16M,queues=2");
    let mut qp = ctrl.queue_pair(2).unwrap();
    submit_nodata(&mut qp, Command::flush(), 1).unwrap();
    submit_nodata(&mut qp, Command::flush(), 2).unwrap();
    assert_eq!(
        submit_nodata(&mut qp, Command::flush(), 3),
        Err(SubmitError::QueueFull { depth: 2 })
    );
    assert!(matches!(
        ctrl.queue_pair(0),
        Err(QueuePairError::BadDepth { depth: 0, .. })
    ));
    assert!(matches!(
        ctrl.queue_pair(QUEUE_DEPTH_MAX + 1),
        Err(QueuePairError::BadDepth { .. })
    ));
    let second = ctrl.queue_pair(2).unwrap();
    assert!(matches!(
        ctrl.queue_pair(2),
        Err(QueuePairError::NoQueuesLeft { max: 2 })
    ));
    drop(second);
    ctrl.queue_pair(2)
        .expect("a dropped queue pair gives its queue back");
}

#[test]
fn bad_input_gets_what_a_real_controller_returns() {
    // 1 MiB namespace of 512-byte blocks = 2048 blocks; MDTS 128 KiB = 256 blocks.
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M,mdts=128k");
    let mut qp = ctrl.queue_pair(8).unwrap();
    let mut io = SyncIo::virtual_time(&mut qp, clock);
    let status = |r: Result<(), IoError>| match r {
        Err(IoError::Status(s)) => s,
        other => panic!("expected a status, got {other:?}"),
    };
    assert_eq!(
        status(io.write(2047, &[0u8; 1024])),
        Status::LBA_OUT_OF_RANGE
    );
    assert_eq!(
        status(io.read(u64::MAX - 1, 4).map(drop)),
        Status::LBA_OUT_OF_RANGE,
        "slba + nlb overflow is out of range, not a wrap"
    );
    assert_eq!(status(io.write_zeroes(2000, 49)), Status::LBA_OUT_OF_RANGE);
    assert_eq!(status(io.deallocate(2040, 9)), Status::LBA_OUT_OF_RANGE);
    io.read(0, 256).expect("exactly MDTS is fine");
    io.write_zeroes(0, 2048)
        .expect("write zeroes is not bound by MDTS");
    assert_eq!(
        io.read(0, 0).map(drop),
        Err(IoError::Submit(SubmitError::InvalidField(
            "zero-length transfer (nlb = 0)"
        )))
    );
    // A misaligned buffer is refused before it reaches the device.
    let mut buf = IoBuf::zeroed(1024);
    // SAFETY: the command is refused, so the device never sees the buffer.
    let r = unsafe {
        io.queue_pair()
            .submit(&Command::read(0, 1, &mut buf[1..600]), 9)
    };
    assert!(
        matches!(r, Err(SubmitError::MisalignedBuffer { .. })),
        "{r:?}"
    );
    // SAFETY: as above.
    let r = unsafe {
        io.queue_pair()
            .submit(&Command::read(0, 2, &mut buf[..600]), 9)
    };
    assert_eq!(
        r,
        Err(SubmitError::BufferTooSmall {
            need_bytes: 1024,
            have_bytes: 600
        })
    );
    assert_eq!(io.queue_pair().outstanding(), 0);
}

/// Writes a hand-crafted submission entry, as a buggy host could, and rings the doorbell.
/// `fill` gets the entry with its command id and namespace set, and the command id.
fn submit_raw(
    qp: &mut EmuQueuePair,
    now_ns: u64,
    tag: u64,
    fill: impl FnOnce(&mut SubmissionEntry, &EmuQueuePair),
) {
    let cid = qp.free_cids.pop().unwrap();
    qp.tags[cid as usize] = tag;
    qp.in_use[cid as usize] = true;
    qp.outstanding += 1;
    let mut sqe = SubmissionEntry {
        cid,
        nsid: NSID,
        ..Default::default()
    };
    fill(&mut sqe, qp);
    let tail = qp.host_sq_tail as usize;
    qp.sq[tail] = sqe;
    qp.host_sq_tail = (qp.host_sq_tail + 1) % qp.ring_len();
    qp.sq_tail_doorbell = qp.host_sq_tail;
    qp.sq_doorbell(now_ns);
}

#[test]
fn invalid_opcodes_and_namespaces_are_answered_by_the_controller() {
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M");
    let mut qp = ctrl.queue_pair(4).unwrap();
    for (tag, (opcode, nsid)) in [(0x7fu8, NSID), (Opcode::Flush as u8, 9)]
        .into_iter()
        .enumerate()
    {
        submit_raw(&mut qp, clock.now_ns(), tag as u64, |sqe, _| {
            sqe.opcode = opcode;
            sqe.nsid = nsid;
        });
    }
    let statuses: Vec<Status> = reap(&mut qp).iter().map(|c| c.status).collect();
    assert_eq!(
        statuses,
        vec![Status::INVALID_OPCODE, Status::INVALID_NAMESPACE]
    );
}

/// A Dataset Management entry pointing at the queue pair's own range for its command id.
fn dsm_entry(sqe: &mut SubmissionEntry, qp: &EmuQueuePair, nr: u32, attributes: u32) {
    sqe.opcode = Opcode::DatasetManagement as u8;
    sqe.prp1 = &qp.dsm_ranges[sqe.cid as usize] as *const DsmRange as u64;
    sqe.cdw10 = nr;
    sqe.cdw11 = attributes;
}

#[test]
fn dataset_management_takes_one_deallocate_range_only() {
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M");
    let mut qp = ctrl.queue_pair(4).unwrap();
    let now_ns = clock.now_ns();
    // Two ranges (NR is 0-based), deallocate: hypoll's host side never sends that.
    submit_raw(&mut qp, now_ns, 0, |sqe, qp| {
        dsm_entry(sqe, qp, 1, DSM_ATTR_DEALLOCATE)
    });
    // One range without the Deallocate attribute (integral read only: a hint we ignore).
    submit_raw(&mut qp, now_ns, 1, |sqe, qp| dsm_entry(sqe, qp, 0, 1));
    // One range, deallocate: accepted.
    submit_raw(&mut qp, now_ns, 2, |sqe, qp| {
        dsm_entry(sqe, qp, 0, DSM_ATTR_DEALLOCATE)
    });
    let mut done = reap(&mut qp);
    clock.advance_to(qp.oracle_next_deadline_ns().unwrap());
    done.extend(reap(&mut qp));
    let statuses: Vec<(u64, Status)> = done.iter().map(|c| (c.tag, c.status)).collect();
    assert_eq!(
        statuses,
        vec![
            (0, Status::INVALID_FIELD),
            (1, Status::INVALID_FIELD),
            (2, Status::SUCCESS)
        ]
    );
}

#[test]
#[should_panic(expected = "PRP1 must point at its queue pair's range list")]
fn a_dataset_management_prp1_elsewhere_is_a_host_bug_not_a_read() {
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M");
    let mut qp = ctrl.queue_pair(4).unwrap();
    let elsewhere = DsmRange::default();
    submit_raw(&mut qp, clock.now_ns(), 0, |sqe, qp| {
        dsm_entry(sqe, qp, 0, DSM_ATTR_DEALLOCATE);
        sqe.prp1 = &elsewhere as *const DsmRange as u64;
    });
}

/// The controller answers a Read or a Write over MDTS with Invalid Field (SyncIo refuses
/// them before submitting, so this goes through `submit`).
#[test]
fn reads_and_writes_over_mdts_get_invalid_field() {
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M,mdts=128k");
    let mut qp = ctrl.queue_pair(8).unwrap();
    let mut read_buf = IoBuf::zeroed(257 * 512);
    let write_buf = IoBuf::zeroed(257 * 512);
    // SAFETY: both buffers outlive the commands, which are reaped below.
    unsafe {
        qp.submit(&Command::read(0, 257, &mut read_buf), 1).unwrap();
        qp.submit(&Command::write(0, 257, &write_buf), 2).unwrap();
        qp.submit(&Command::write(0, 256, &write_buf), 3).unwrap();
    }
    let mut done = Vec::new();
    while qp.outstanding() > 0 {
        if let Some(deadline_ns) = qp.oracle_next_deadline_ns() {
            clock.advance_to(deadline_ns);
        }
        done.extend(reap(&mut qp).into_iter().map(|c| (c.tag, c.status)));
    }
    done.sort_by_key(|&(tag, _)| tag);
    assert_eq!(
        done,
        vec![
            (1, Status::INVALID_FIELD),
            (2, Status::INVALID_FIELD),
            (3, Status::SUCCESS)
        ],
        "one block over MDTS, either way; exactly MDTS is fine"
    );
}

#[test]
fn sync_io_checks_sizes_before_it_allocates_or_submits() {
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M,mdts=128k");
    let mut qp = ctrl.queue_pair(8).unwrap();
    let mut io = SyncIo::virtual_time(&mut qp, clock);
    // 2^32 - 1 blocks would be a 2 TiB buffer: refused before any allocation.
    assert_eq!(
        io.read(0, u32::MAX).map(drop),
        Err(IoError::Submit(SubmitError::InvalidField(
            crate::qpair::NLB_TOO_LARGE
        )))
    );
    assert_eq!(
        io.read(0, 257).map(drop),
        Err(IoError::OverMaxTransfer {
            len_bytes: 257 * 512,
            transfer_bytes_max: 128 << 10
        })
    );
    assert_eq!(
        io.write(0, &[0u8; 257 * 512]),
        Err(IoError::OverMaxTransfer {
            len_bytes: 257 * 512,
            transfer_bytes_max: 128 << 10
        })
    );
    // A write is never silently truncated to whole blocks.
    assert_eq!(
        io.write(0, &[7u8; 1000]),
        Err(IoError::NotBlockMultiple {
            len_bytes: 1000,
            lba_bytes: 512
        })
    );
    assert_eq!(
        io.write(0, &[]),
        Err(IoError::Submit(SubmitError::InvalidField(
            crate::qpair::ZERO_NLB
        )))
    );
    assert_eq!(
        io.queue_pair().outstanding(),
        0,
        "nothing reached the device"
    );
    assert!(io.read(0, 2).unwrap().iter().all(|&b| b == 0));
}

#[derive(Clone, Debug)]
enum Op {
    Write { slba: u64, nlb: u32, seed: u8 },
    Read { slba: u64, nlb: u32 },
    Zeroes { slba: u64, nlb: u32 },
    Dealloc { slba: u64, nlb: u32 },
    Flush,
}

/// The data tests' namespace: 2 MiB, which crosses a 1 MiB store chunk.
const NS_BYTES: u64 = 2 << 20;
/// MDTS of the data tests (the default): the largest transfer SyncIo accepts.
const MDTS_BYTES: u64 = 128 << 10;

/// Commands on a namespace of `blocks` blocks, each moving at most `nlb_max` blocks.
fn op_strategy(blocks: u64, nlb_max: u32) -> impl Strategy<Value = Op> {
    let range = (0..blocks).prop_flat_map(move |slba| {
        (
            Just(slba),
            1..=(blocks - slba).min(u64::from(nlb_max)) as u32,
        )
    });
    prop_oneof![
        4 => (range.clone(), any::<u8>()).prop_map(|((slba, nlb), seed)| Op::Write { slba, nlb, seed }),
        4 => range.clone().prop_map(|(slba, nlb)| Op::Read { slba, nlb }),
        1 => range.clone().prop_map(|(slba, nlb)| Op::Zeroes { slba, nlb }),
        1 => range.prop_map(|(slba, nlb)| Op::Dealloc { slba, nlb }),
        1 => Just(Op::Flush),
    ]
}

/// A block size and commands for it: up to 64 blocks per command, within MDTS.
fn lba_and_ops() -> impl Strategy<Value = (u32, Vec<Op>)> {
    prop_oneof![Just(512u32), Just(4096u32)].prop_flat_map(|lba| {
        let blocks = NS_BYTES / u64::from(lba);
        let nlb_max = (MDTS_BYTES / u64::from(lba)).min(64) as u32;
        (
            Just(lba),
            proptest::collection::vec(op_strategy(blocks, nlb_max), 1..60),
        )
    })
}

/// Distinct bytes for `nlb` blocks of `lba_bytes` at `slba`.
fn pattern_lba(slba: u64, nlb: u32, seed: u8, lba_bytes: u32) -> Vec<u8> {
    (0..nlb as usize * lba_bytes as usize)
        .map(|i| (i as u64 / 7 + slba * 31 + u64::from(seed)) as u8)
        .collect()
}

fn pattern(slba: u64, nlb: u32, seed: u8) -> Vec<u8> {
    pattern_lba(slba, nlb, seed, 512)
}

/// Runs a random command sequence against a shadow copy and checks every read.
fn check_against_shadow(backing: &str, lba_bytes: u32, ops: &[Op], seed: u64) {
    let (ctrl, clock) = virtual_controller(&format!(
        "emu:nand,size={NS_BYTES},lba={lba_bytes},seed={seed},backing={backing}"
    ));
    let mut qp = ctrl.queue_pair(4).unwrap();
    let mut io = SyncIo::virtual_time(&mut qp, clock);
    let lba = lba_bytes as usize;
    let mut shadow = vec![0u8; NS_BYTES as usize];
    for op in ops {
        match *op {
            Op::Write { slba, nlb, seed } => {
                let data = pattern_lba(slba, nlb, seed, lba_bytes);
                io.write(slba, &data).unwrap();
                let at = slba as usize * lba;
                shadow[at..at + data.len()].copy_from_slice(&data);
            }
            Op::Read { slba, nlb } => {
                let got = io.read(slba, nlb).unwrap();
                let at = slba as usize * lba;
                assert!(
                    got[..] == shadow[at..at + nlb as usize * lba],
                    "read {nlb} blocks of {lba} at {slba} differs from what was written"
                );
            }
            Op::Zeroes { slba, nlb } | Op::Dealloc { slba, nlb } => {
                if matches!(op, Op::Zeroes { .. }) {
                    io.write_zeroes(slba, nlb).unwrap();
                } else {
                    io.deallocate(slba, nlb).unwrap();
                }
                let at = slba as usize * lba;
                shadow[at..at + nlb as usize * lba].fill(0);
            }
            Op::Flush => io.flush().unwrap(),
        }
    }
    // Finally the whole namespace matches, read MDTS at a time.
    let chunk_blocks = (MDTS_BYTES / u64::from(lba_bytes)) as u32;
    for slba in (0..NS_BYTES / u64::from(lba_bytes)).step_by(chunk_blocks as usize) {
        let got = io.read(slba, chunk_blocks).unwrap();
        let at = slba as usize * lba;
        assert!(
            got[..] == shadow[at..at + MDTS_BYTES as usize],
            "final scan at block {slba} of {lba}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn data_read_back_equals_data_written(
        (lba_bytes, ops) in lba_and_ops(),
        seed in any::<u64>(),
        backing in prop_oneof![Just("sparse"), Just("ram")],
    ) {
        check_against_shadow(backing, lba_bytes, &ops, seed);
    }

    /// Many commands in flight at once, on disjoint ranges, complete in deadline order, not
    /// submission order; every write still lands and every read sees the state before the
    /// batch.
    #[test]
    fn concurrent_commands_on_disjoint_ranges_keep_their_data(
        seeds in proptest::collection::vec(any::<u8>(), 16),
        seed in any::<u64>(),
    ) {
        let (ctrl, clock) = virtual_controller(&format!("emu:nand,size=2M,seed={seed}"));
        let mut qp = ctrl.queue_pair(32).unwrap();
        // Batch 1: 16 writes of 8 blocks each at stride 64.
        let bufs: Vec<IoBuf> = seeds
            .iter()
            .enumerate()
            .map(|(i, &s)| IoBuf::from_slice(&pattern(i as u64 * 64, 8, s)))
            .collect();
        for (i, buf) in bufs.iter().enumerate() {
            // SAFETY: `bufs` lives until every command completed (the loop below).
            unsafe { qp.submit(&Command::write(i as u64 * 64, 8, buf), i as u64) }.unwrap();
        }
        let mut order = Vec::new();
        while qp.outstanding() > 0 {
            clock.advance_to(qp.oracle_next_deadline_ns().unwrap());
            order.extend(reap(&mut qp).into_iter().map(|c| c.tag));
        }
        let mut sorted = order.clone();
        sorted.sort_unstable();
        prop_assert_eq!(sorted, (0..16).collect::<Vec<u64>>());
        // Batch 2: read them all back concurrently.
        let mut reads: Vec<IoBuf> = (0..16).map(|_| IoBuf::zeroed(8 * 512)).collect();
        for (i, buf) in reads.iter_mut().enumerate() {
            // SAFETY: `reads` lives until every command completed (the loop below).
            unsafe { qp.submit(&Command::read(i as u64 * 64, 8, buf), i as u64) }.unwrap();
        }
        let mut statuses = HashMap::new();
        while qp.outstanding() > 0 {
            clock.advance_to(qp.oracle_next_deadline_ns().unwrap());
            for c in reap(&mut qp) {
                statuses.insert(c.tag, c.status);
            }
        }
        for (i, buf) in reads.iter().enumerate() {
            prop_assert_eq!(statuses[&(i as u64)], Status::SUCCESS);
            prop_assert!(buf[..] == bufs[i][..], "block range {} differs", i);
        }
    }
}

#[test]
fn file_backing_keeps_data_across_controllers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns.img");
    let device = format!("emu:dram,size=4M,backing=file:{}", path.display());
    let data = pattern(100, 16, 9);
    {
        let (ctrl, clock) = virtual_controller(&device);
        let mut qp = ctrl.queue_pair(4).unwrap();
        let mut io = SyncIo::virtual_time(&mut qp, clock);
        io.write(100, &data).unwrap();
        io.flush().unwrap();
    }
    let (ctrl, clock) = virtual_controller(&device);
    let mut qp = ctrl.queue_pair(4).unwrap();
    let mut io = SyncIo::virtual_time(&mut qp, clock);
    assert!(io.read(100, 16).unwrap()[..] == data[..]);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 4 << 20);
}

#[test]
fn a_fua_write_is_durable_before_it_completes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns.img");
    let (ctrl, clock) = virtual_controller(&format!(
        "emu:dram,size=4M,lba=512,backing=file:{}",
        path.display()
    ));
    let mut qp = ctrl.queue_pair(4).unwrap();
    let data = pattern(8, 1, 3);
    let mut run = |cmd: Command<'_>, tag: u64| {
        // SAFETY: `data` outlives the command, which completes before `run` returns.
        unsafe { qp.submit(&cmd, tag) }.unwrap();
        clock.advance_to(qp.oracle_next_deadline_ns().unwrap());
        let done = reap(&mut qp);
        assert_eq!(done.len(), 1);
        assert!(done[0].status.is_success(), "{}", done[0].status);
    };
    run(Command::write(8, 1, &data), 1);
    assert_eq!(ctrl.backing_syncs(), 0, "a plain write waits for a flush");
    run(Command::write(8, 1, &data).with_fua(true), 2);
    assert_eq!(ctrl.backing_syncs(), 1, "a FUA write is synced");
    run(Command::write_zeroes(16, 4).with_fua(true), 3);
    assert_eq!(ctrl.backing_syncs(), 2, "so is a FUA Write Zeroes");
    run(Command::flush(), 4);
    assert_eq!(ctrl.backing_syncs(), 3);
}

/// Runs `n` single-block reads at queue depth 16 in virtual time; returns the statuses and
/// the number of commands that never completed.
fn run_with_faults(ctrl: &EmuController, clock: &VirtualClock, n: u64) -> (Vec<Status>, usize) {
    let mut qp = ctrl.queue_pair(16).unwrap();
    let mut bufs: Vec<IoBuf> = (0..16).map(|_| IoBuf::zeroed(512)).collect();
    let mut statuses = Vec::new();
    let mut tag = 0u64;
    while tag < n {
        // Keep the queue full; lost commands hold their slot until the next reset.
        while qp.outstanding() < 16 && tag < n {
            let buf = &mut bufs[(tag % 16) as usize];
            // SAFETY: read buffers are only reused after their command completed; a lost
            // command's buffer stays untouched until the queue pair is reset below.
            unsafe { qp.submit(&Command::read(tag % 2048, 1, buf), tag) }.unwrap();
            tag += 1;
        }
        match qp.oracle_next_deadline_ns() {
            Some(deadline_ns) => clock.advance_to(deadline_ns),
            // Only lost commands remain: abort them, as a driver's timeout would.
            None => {
                qp.reset();
            }
        }
        statuses.extend(reap(&mut qp).into_iter().map(|c| c.status));
    }
    // Let what is pending complete, then abort what was lost.
    while let Some(deadline_ns) = qp.oracle_next_deadline_ns() {
        clock.advance_to(deadline_ns);
        statuses.extend(reap(&mut qp).into_iter().map(|c| c.status));
    }
    let lost_at_end = qp.outstanding();
    qp.reset();
    statuses.extend(reap(&mut qp).into_iter().map(|c| c.status));
    (statuses, lost_at_end)
}

fn fraction(statuses: &[Status], status: Status) -> f64 {
    statuses.iter().filter(|&&s| s == status).count() as f64 / statuses.len() as f64
}

#[test]
fn error_faults_fire_at_their_configured_rate() {
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M,err_pct=5");
    let (statuses, _) = run_with_faults(&ctrl, &clock, 40_000);
    assert_eq!(
        statuses.len(),
        40_000,
        "every command completed exactly once"
    );
    let rate = fraction(&statuses, Status::UNRECOVERED_READ_ERROR);
    assert!((rate - 0.05).abs() < 0.05 * 0.15, "error rate {rate}");
    assert_eq!(fraction(&statuses, Status::ABORTED_SQ_DELETION), 0.0);
}

#[test]
fn lost_commands_never_complete_until_a_reset_aborts_them() {
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M,lost_pct=2");
    let (statuses, _) = run_with_faults(&ctrl, &clock, 40_000);
    assert_eq!(statuses.len(), 40_000);
    // A lost command is answered only by a reset, which aborts it.
    let rate = fraction(&statuses, Status::ABORTED_SQ_DELETION);
    assert!((rate - 0.02).abs() < 0.02 * 0.15, "lost rate {rate}");

    // Without a reset, a lost command simply never completes.
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M,lost_pct=100");
    let mut qp = ctrl.queue_pair(4).unwrap();
    submit_nodata(&mut qp, Command::flush(), 1).unwrap();
    assert_eq!(qp.oracle_next_deadline_ns(), None);
    clock.advance_by(1_000_000_000);
    assert!(reap(&mut qp).is_empty());
    assert_eq!(qp.outstanding(), 1);
    assert_eq!(qp.reset(), 1);
    assert_eq!(
        reap(&mut qp),
        vec![Completion {
            tag: 1,
            status: Status::ABORTED_SQ_DELETION
        }]
    );
}

#[test]
fn injected_resets_abort_everything_outstanding_at_their_rate() {
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M,reset_pct=1");
    let mut qp = ctrl.queue_pair(16).unwrap();
    let mut aborted = 0;
    let mut total = 0;
    let n = 40_000u64;
    for tag in 0..n {
        if qp.outstanding() == 16 {
            clock.advance_to(qp.oracle_next_deadline_ns().unwrap());
            total += reap(&mut qp).len();
        }
        let resets_before = qp.resets();
        let in_flight_before = qp.outstanding();
        submit_nodata(&mut qp, Command::write_zeroes(tag % 2048, 1), tag).unwrap();
        let done = reap(&mut qp);
        if qp.resets() > resets_before {
            // The reset aborted the new command and everything still in flight with it.
            assert_eq!(done.len(), in_flight_before + 1);
            assert!(done.iter().all(|c| c.status == Status::ABORTED_SQ_DELETION));
        }
        aborted += done
            .iter()
            .filter(|c| c.status == Status::ABORTED_SQ_DELETION)
            .count();
        total += done.len();
    }
    let rate = qp.resets() as f64 / n as f64;
    assert!((rate - 0.01).abs() < 0.01 * 0.15, "reset rate {rate}");
    assert!(
        aborted > qp.resets() as usize,
        "resets abort more than their own command"
    );
    total += qp.outstanding();
    assert_eq!(total as u64, n);
}

#[test]
fn a_controller_reset_aborts_everything_on_every_queue_pair() {
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M,lost_pct=30,seed=3");
    let mut a = ctrl.queue_pair(8).unwrap();
    let mut b = ctrl.queue_pair(8).unwrap();
    for tag in 0..6 {
        submit_nodata(&mut a, Command::write_zeroes(tag, 1), tag).unwrap();
        submit_nodata(&mut b, Command::write_zeroes(tag, 1), 100 + tag).unwrap();
    }
    let lost = |qp: &EmuQueuePair| {
        qp.slots
            .iter()
            .filter(|s| s.state == SlotState::Lost)
            .count()
    };
    assert!(lost(&a) + lost(&b) > 0, "some commands are lost (seed 3)");
    assert!(a.pending.len() + b.pending.len() > 0, "some are pending");
    ctrl.reset();
    assert_eq!(ctrl.resets(), 1);
    // Long after every deadline: still, the reset's aborts are all each queue pair reaps.
    clock.advance_by(1_000_000_000);
    for (qp, first_tag) in [(&mut a, 0), (&mut b, 100)] {
        let mut done: Vec<(u64, Status)> = reap(qp).iter().map(|c| (c.tag, c.status)).collect();
        done.sort_unstable_by_key(|&(tag, _)| tag);
        let expected: Vec<(u64, Status)> = (first_tag..first_tag + 6)
            .map(|tag| (tag, Status::ABORTED_SQ_DELETION))
            .collect();
        assert_eq!(done, expected);
        assert_eq!(qp.outstanding(), 0);
        assert_eq!(qp.resets(), 1);
    }
    // A queue pair that submits first carries out the reset before taking the command.
    ctrl.reset();
    submit_nodata(&mut a, Command::flush(), 7).unwrap();
    assert_eq!(a.resets(), 2);
    let lost_now = lost(&a);
    clock.advance_by(1_000_000_000);
    assert_eq!(
        reap(&mut a).len(),
        1 - lost_now,
        "the new command is not aborted"
    );
    // A queue pair created after a reset has nothing to catch up with.
    let c = ctrl.queue_pair(8).unwrap();
    assert_eq!(c.reset_generation_seen, 2);
}

/// reset_pct injects controller resets: another queue pair's commands are aborted too.
#[test]
fn injected_resets_reset_the_whole_controller() {
    // Find a seed (deterministically) where b's submission is spared and a's is not.
    for seed in 1..200 {
        let (ctrl, clock) =
            virtual_controller(&format!("emu:optane,size=1M,reset_pct=50,seed={seed}"));
        let mut a = ctrl.queue_pair(4).unwrap();
        let mut b = ctrl.queue_pair(4).unwrap();
        submit_nodata(&mut b, Command::write_zeroes(0, 1), 1).unwrap();
        if b.resets() > 0 {
            continue;
        }
        submit_nodata(&mut a, Command::write_zeroes(0, 1), 2).unwrap();
        if a.resets() == 0 {
            continue;
        }
        assert_eq!(ctrl.resets(), 1);
        clock.advance_by(1_000_000_000);
        assert_eq!(
            reap(&mut b),
            vec![Completion {
                tag: 1,
                status: Status::ABORTED_SQ_DELETION
            }],
            "seed {seed}"
        );
        assert_eq!(b.resets(), 1);
        return;
    }
    panic!("no seed below 200 spares b and resets a");
}

#[test]
fn a_reset_fires_an_armed_interrupt() {
    let ctrl =
        EmuController::new(cfg("emu:nand,size=16M,read_us=200000,jitter=0,tail_pct=0")).unwrap();
    let fd_ready = |qp: &EmuQueuePair, ms| wait_readable(qp.interrupt_fd().unwrap(), ms).unwrap();
    let mut buf = IoBuf::zeroed(512);
    let mut qp = ctrl.queue_pair(4).unwrap();
    // SAFETY: `buf` outlives the command, which the reset aborts and is reaped below.
    unsafe { qp.submit(&Command::read(0, 1, &mut buf), 1) }.unwrap();
    qp.arm_interrupt();
    assert!(!fd_ready(&qp, 0), "200 ms to go");
    assert_eq!(qp.reset(), 1);
    assert!(
        fd_ready(&qp, 100),
        "the abort is posted: the interrupt fires at once"
    );
    assert_eq!(
        reap(&mut qp),
        vec![Completion {
            tag: 1,
            status: Status::ABORTED_SQ_DELETION
        }]
    );
    assert!(!fd_ready(&qp, 0), "reaping disarms");
}

/// A queue pair blocked on its interrupt with only a lost command outstanding (no deadline
/// to wake it) is woken by a controller reset from another thread.
#[test]
fn a_controller_reset_wakes_a_queue_pair_blocked_on_its_interrupt() {
    let ctrl = EmuController::new(cfg("emu:optane,size=16M,lost_pct=100")).unwrap();
    let mut qp = ctrl.queue_pair(4).unwrap();
    let idle = ctrl.queue_pair(4).unwrap(); // not armed: must not be woken
    submit_nodata(&mut qp, Command::flush(), 1).unwrap();
    assert_eq!(qp.oracle_next_deadline_ns(), None, "lost");
    qp.arm_interrupt();
    assert!(!wait_readable(qp.interrupt_fd().unwrap(), 5).unwrap());
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(5));
            ctrl.reset();
        });
        assert!(
            wait_readable(qp.interrupt_fd().unwrap(), 2_000).unwrap(),
            "woken by the reset"
        );
    });
    assert_eq!(
        reap(&mut qp),
        vec![Completion {
            tag: 1,
            status: Status::ABORTED_SQ_DELETION
        }]
    );
    assert!(!wait_readable(idle.interrupt_fd().unwrap(), 0).unwrap());
}

/// Armed at a late deadline, the interrupt moves to an earlier one when a command that
/// completes sooner is fetched.
#[test]
fn a_fetched_command_due_sooner_re_arms_the_interrupt_earlier() {
    let ctrl = EmuController::new(cfg(
        "emu:nand,size=16M,read_us=200000,write_us=5000,jitter=0,tail_pct=0",
    ))
    .unwrap();
    let fd_ready = |qp: &EmuQueuePair, ms| wait_readable(qp.interrupt_fd().unwrap(), ms).unwrap();
    let mut buf = IoBuf::zeroed(512);
    let mut qp = ctrl.queue_pair(4).unwrap();
    // SAFETY: `buf` is declared before `qp`, so it outlives the queue pair, and dropping the
    // queue pair stops the device from touching it.
    unsafe { qp.submit(&Command::read(0, 1, &mut buf), 1) }.unwrap();
    qp.arm_interrupt();
    let read_deadline_ns = qp.oracle_deadline_ns_of(1).unwrap();
    assert_eq!(qp.irq_armed_at_ns, Some(read_deadline_ns));
    submit_nodata(&mut qp, Command::write_zeroes(0, 1), 2).unwrap();
    let write_deadline_ns = qp.oracle_deadline_ns_of(2).unwrap();
    assert!(write_deadline_ns < read_deadline_ns);
    assert_eq!(
        qp.irq_armed_at_ns,
        Some(write_deadline_ns),
        "re-armed earlier"
    );
    assert!(
        fd_ready(&qp, 150),
        "fires at the write's deadline, not the read's"
    );
    assert!(monotonic_ns() >= write_deadline_ns);
    assert!(monotonic_ns() < read_deadline_ns);
    assert_eq!(
        reap(&mut qp),
        vec![Completion {
            tag: 2,
            status: Status::SUCCESS
        }]
    );
    drop(qp);
}

#[test]
fn interrupt_fd_fires_when_the_completion_is_due() {
    let ctrl =
        EmuController::new(cfg("emu:nand,size=16M,read_us=20000,jitter=0,tail_pct=0")).unwrap();
    let mut qp = ctrl.queue_pair(4).unwrap();
    let mut buf = IoBuf::zeroed(512);
    // SAFETY: `buf` outlives the command, reaped below.
    unsafe { qp.submit(&Command::read(0, 1, &mut buf), 5) }.unwrap();
    let deadline_ns = qp.oracle_next_deadline_ns().unwrap();
    let fd_ready = |qp: &EmuQueuePair, ms| wait_readable(qp.interrupt_fd().unwrap(), ms).unwrap();
    assert!(!fd_ready(&qp, 2), "not armed: no interrupt");
    qp.arm_interrupt();
    assert!(!fd_ready(&qp, 0), "armed, not yet due");
    assert!(fd_ready(&qp, 1_000), "fires by the deadline");
    assert!(monotonic_ns() >= deadline_ns, "never before the deadline");
    assert_eq!(
        reap(&mut qp),
        vec![Completion {
            tag: 5,
            status: Status::SUCCESS
        }]
    );
    assert!(!fd_ready(&qp, 0), "reaping disarms");
    // Armed while a completion already waits: fires at once.
    // SAFETY: as above.
    unsafe { qp.submit(&Command::read(0, 1, &mut buf), 6) }.unwrap();
    std::thread::sleep(Duration::from_millis(25));
    qp.arm_interrupt();
    assert!(fd_ready(&qp, 100));
    assert_eq!(reap(&mut qp).len(), 1);
    // Armed before anything is submitted: the next submission sets the deadline.
    qp.arm_interrupt();
    // SAFETY: as above.
    unsafe { qp.submit(&Command::read(0, 1, &mut buf), 7) }.unwrap();
    assert!(fd_ready(&qp, 1_000));
    assert_eq!(reap(&mut qp).len(), 1);
}

#[test]
fn queue_pairs_on_several_threads_share_one_namespace() {
    let ctrl = EmuController::new(cfg("emu:dram,size=8M")).unwrap();
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let ctrl = ctrl.clone();
            s.spawn(move || {
                let mut qp = ctrl.queue_pair(8).unwrap();
                let mut io = SyncIo::new(&mut qp, Duration::from_secs(5));
                for i in 0..200 {
                    let slba = t * 4096 + i * 8;
                    io.write(slba, &pattern(slba, 8, t as u8)).unwrap();
                }
            });
        }
    });
    let mut qp = ctrl.queue_pair(8).unwrap();
    let mut io = SyncIo::new(&mut qp, Duration::from_secs(5));
    for t in 0..2u64 {
        for i in 0..200 {
            let slba = t * 4096 + i * 8;
            assert!(io.read(slba, 8).unwrap()[..] == pattern(slba, 8, t as u8)[..]);
        }
    }
}

#[test]
fn drift_makes_every_latency_grow_with_the_controllers_age() {
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M,jitter=0,tail_pct=0,drift_pct=50");
    let mut qp = ctrl.queue_pair(1).unwrap();
    let mut latency_at = |age_ns: u64| {
        clock.advance_to(1_000_000 + age_ns);
        let t0 = clock.now_ns();
        submit_nodata(&mut qp, Command::write_zeroes(0, 1), 0).unwrap();
        let deadline_ns = qp.oracle_next_deadline_ns().unwrap();
        clock.advance_to(deadline_ns);
        assert_eq!(reap(&mut qp).len(), 1);
        deadline_ns - t0
    };
    assert_eq!(latency_at(0), 10_000);
    // +50 % per second: 1.5x after one second, 2x after two.
    assert_eq!(latency_at(1_000_000_000), 15_000);
    assert_eq!(latency_at(2_000_000_000), 20_000);
}

/// An Abort completes a pending or lost command at once with "Command Abort Requested" and
/// moves no data; a stuck command ignores it and only a reset completes it; aborting a
/// command that already completed does nothing.
#[test]
fn aborts_reach_pending_and_lost_commands_but_not_stuck_ones() {
    // Pending: a write aborted before its deadline never reaches the store.
    let (ctrl, clock) = virtual_controller("emu:optane,size=1M");
    let mut qp = ctrl.queue_pair(4).unwrap();
    let data = IoBuf::from_slice(&[0x5a; 512]);
    // SAFETY: `data` outlives the queue pair's use of it: the command is aborted and reaped
    // below before `data` is dropped.
    unsafe { qp.submit(&Command::write(3, 1, &data), 1) }.unwrap();
    submit_nodata(&mut qp, Command::flush(), 2).unwrap();
    assert!(qp.abort_command(1));
    assert!(
        QueuePair::abort(&mut qp, 99).is_ok(),
        "unknown tag: nothing to do"
    );
    clock.advance_by(1_000_000_000);
    let mut done = reap(&mut qp);
    done.sort_by_key(|c| c.tag);
    assert_eq!(
        done,
        vec![
            Completion {
                tag: 1,
                status: Status::ABORT_REQUESTED
            },
            Completion {
                tag: 2,
                status: Status::SUCCESS
            }
        ]
    );
    assert!(!qp.abort_command(2), "already completed");
    assert_eq!(qp.aborts(), (3, 1));
    let mut back = IoBuf::from_slice(&[0xff; 512]);
    // SAFETY: `back` is reaped below before it is read or dropped.
    unsafe { qp.submit(&Command::read(3, 1, &mut back), 3) }.unwrap();
    clock.advance_by(1_000_000_000);
    assert_eq!(reap(&mut qp).len(), 1);
    assert_eq!(&back[..], &[0u8; 512][..], "no data moved");

    // Lost: an abort completes it; stuck: only a reset does.
    let (ctrl, _clock) = virtual_controller("emu:optane,size=1M,lost_pct=100,stuck_pct=50");
    let mut qp = ctrl.queue_pair(64).unwrap();
    for tag in 0..64 {
        submit_nodata(&mut qp, Command::write_zeroes(tag, 1), tag).unwrap();
    }
    let stuck = qp
        .slots
        .iter()
        .filter(|s| s.state == SlotState::Stuck)
        .count();
    assert!((10..=54).contains(&stuck), "about half stuck: {stuck}");
    for tag in 0..64 {
        QueuePair::abort(&mut qp, tag).unwrap();
    }
    let aborted = reap(&mut qp);
    assert_eq!(aborted.len(), 64 - stuck);
    assert!(aborted.iter().all(|c| c.status == Status::ABORT_REQUESTED));
    assert_eq!(qp.outstanding(), stuck);
    QueuePair::reset(&mut qp).unwrap();
    let reset = reap(&mut qp);
    assert_eq!(reset.len(), stuck);
    assert!(reset
        .iter()
        .all(|c| c.status == Status::ABORTED_SQ_DELETION));
    assert_eq!(qp.outstanding(), 0);
}
