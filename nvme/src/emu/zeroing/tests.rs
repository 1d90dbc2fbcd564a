//! Zeroing commands far larger than a poll's budget: what each poll costs, what waits behind
//! them, and what they leave.

use std::collections::HashMap;

use super::*;
use crate::buf::IoBuf;
use crate::clock::{Clock, VirtualClock};
use crate::emu::store::Store;
use crate::emu::{EmuController, EmuQueuePair};
use crate::qpair::{Command, QueuePair};
use crate::spec::{Status, NLB_MAX};
use crate::sync::SyncIo;

fn virtual_controller(device: &str) -> (EmuController, VirtualClock) {
    let crate::DeviceConfig::Emu(cfg) = device.parse::<crate::DeviceConfig>().unwrap() else {
        panic!("not emu: {device}");
    };
    let clock = VirtualClock::new(1_000_000);
    let ctrl = EmuController::with_clock(cfg, Clock::Virtual(clock.clone())).unwrap();
    (ctrl, clock)
}

/// Submits `cmd`, which carries no data buffer.
fn submit_nodata(qp: &mut EmuQueuePair, cmd: Command<'_>, tag: u64) {
    assert!(cmd.buf_ptr().is_null());
    // SAFETY: the command carries no data buffer.
    unsafe { qp.submit(&cmd, tag) }.unwrap();
}

/// Polls until every command is reaped, checking that no poll zeroes more than the budget.
/// Returns each tag's status and the index of the poll that reaped it, and the polls taken.
fn poll_to_the_end(
    qp: &mut EmuQueuePair,
    polls_max: usize,
) -> (HashMap<u64, (Status, usize)>, usize) {
    let mut done = HashMap::new();
    let mut polls = 0;
    while qp.outstanding() > 0 {
        assert!(polls < polls_max, "still outstanding after {polls} polls");
        let before_bytes = qp.zeroed_bytes();
        qp.process_completions(usize::MAX, &mut |c| {
            assert!(
                done.insert(c.tag, (c.status, polls)).is_none(),
                "tag {} twice",
                c.tag
            );
        });
        let zeroed_bytes = qp.zeroed_bytes() - before_bytes;
        assert!(
            zeroed_bytes <= ZEROED_BYTES_PER_POLL_MAX,
            "poll {polls} zeroed {zeroed_bytes} bytes, over the {ZEROED_BYTES_PER_POLL_MAX} a \
             poll may"
        );
        polls += 1;
    }
    (done, polls)
}

/// Issue 28: one 512 MiB Write Zeroes on a file backing held its reactor for 0.85 s. Here a
/// Write Zeroes and a Deallocate of 32 MiB each, due at once, zero at most the budget a poll
/// between them, a read due after them completes in the first poll, and each completes once
/// with its whole range zeroed (the FUA one synced once, at its end).
#[test]
fn a_huge_write_zeroes_costs_each_poll_at_most_the_budget_and_holds_nothing_up() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns.img");
    let (ctrl, clock) = virtual_controller(&format!(
        "emu:dram,size=80M,lba=512,backing=file:{}",
        path.display()
    ));
    let blocks = u64::from(NLB_MAX);
    let range_bytes = blocks * 512;
    let mut qp = ctrl.queue_pair(8).unwrap();
    // Data at both ends of both ranges, to see the zeroes land.
    let marks = [0, blocks - 1, blocks, 2 * blocks - 1];
    {
        let mut io = SyncIo::virtual_time(&mut qp, clock.clone());
        for slba in marks {
            io.write(slba, &[0xa5; 512]).unwrap();
        }
        io.write(2 * blocks, &[0x5a; 512]).unwrap();
    }
    submit_nodata(&mut qp, Command::write_zeroes(0, NLB_MAX).with_fua(true), 1);
    submit_nodata(&mut qp, Command::deallocate(blocks, NLB_MAX), 2);
    let mut buf = IoBuf::zeroed(512);
    // SAFETY: `buf` lives until every command is reaped, below.
    unsafe { qp.submit(&Command::read(2 * blocks, 1, &mut buf), 3) }.unwrap();
    clock.advance_by(1_000_000_000);
    let syncs_before = ctrl.backing_syncs();

    let polls_needed = (2 * range_bytes / ZEROED_BYTES_PER_POLL_MAX) as usize;
    let (done, polls) = poll_to_the_end(&mut qp, polls_needed + 2);
    assert_eq!(
        done[&3],
        (Status::SUCCESS, 0),
        "the read waits behind nothing"
    );
    assert!(buf[..] == [0x5a; 512]);
    assert_eq!(done[&1].0, Status::SUCCESS);
    assert_eq!(done[&2].0, Status::SUCCESS);
    assert_eq!(polls, polls_needed, "a poll takes a whole budget's steps");
    assert_eq!(qp.zeroed_bytes(), 2 * range_bytes);
    assert_eq!(
        ctrl.backing_syncs() - syncs_before,
        1,
        "FUA syncs once, at the end"
    );
    let mut io = SyncIo::virtual_time(&mut qp, clock);
    for slba in marks {
        assert!(
            io.read(slba, 1).unwrap()[..] == [0; 512],
            "block {slba} not zeroed"
        );
    }
}

/// Steps never split a store chunk, so a Deallocate carried out over many polls still frees
/// every whole chunk it covers, even when it starts inside one.
#[test]
fn a_deallocate_in_steps_frees_every_whole_chunk_it_covers() {
    let (ctrl, clock) = virtual_controller("emu:dram,size=8M,lba=4096,backing=sparse");
    let mut qp = ctrl.queue_pair(4).unwrap();
    {
        let mut io = SyncIo::virtual_time(&mut qp, clock.clone());
        for chunk in 0..8 {
            io.write(chunk * 256, &[1; 4096]).unwrap();
        }
    }
    let Store::Memory(store) = &ctrl.shared.store else {
        panic!("sparse is memory");
    };
    assert_eq!(store.allocated_chunks(), 8);
    // From the middle of chunk 1 to the middle of chunk 6: chunks 2 to 5 are whole.
    submit_nodata(&mut qp, Command::deallocate(256 + 128, 5 * 256), 1);
    clock.advance_by(1_000_000_000);
    let (done, polls) = poll_to_the_end(&mut qp, 16);
    assert_eq!(done[&1].0, Status::SUCCESS);
    assert!(
        polls > 1,
        "5 MiB in steps of at most {ZEROED_BYTES_PER_POLL_MAX} bytes"
    );
    assert_eq!(
        store.allocated_chunks(),
        4,
        "chunks 0, 1, 6 and 7 keep their memory"
    );
}

/// An Abort reaches a zeroing command between its steps: it completes once, as aborted,
/// and takes no more steps.
#[test]
fn an_abort_between_steps_completes_the_command_once() {
    let (ctrl, clock) = virtual_controller("emu:dram,size=64M,lba=512,backing=sparse");
    let mut qp = ctrl.queue_pair(4).unwrap();
    submit_nodata(&mut qp, Command::write_zeroes(0, NLB_MAX), 1);
    clock.advance_by(1_000_000_000);
    assert_eq!(qp.process_completions(usize::MAX, &mut |_| {}), 0);
    assert_eq!(qp.zeroed_bytes(), ZEROED_BYTES_PER_POLL_MAX);
    assert!(qp.abort_command(1));
    let (done, _) = poll_to_the_end(&mut qp, 1);
    assert_eq!(done[&1].0, Status::ABORT_REQUESTED);
    assert_eq!(qp.zeroed_bytes(), ZEROED_BYTES_PER_POLL_MAX);
}

/// A queue pair waiting on its interrupt while a zeroing command is unfinished is woken at
/// once, so a reactor that waits rather than spins keeps it going.
#[test]
fn an_unfinished_zeroing_command_keeps_the_interrupt_firing() {
    let ctrl = EmuController::new(
        match "emu:dram,read_us=0,write_us=0,jitter=0,tail_pct=0,size=64M,lba=512"
            .parse::<crate::DeviceConfig>()
            .unwrap()
        {
            crate::DeviceConfig::Emu(cfg) => cfg,
            other => panic!("not emu: {other:?}"),
        },
    )
    .unwrap();
    let mut qp = ctrl.queue_pair(4).unwrap();
    submit_nodata(&mut qp, Command::write_zeroes(0, NLB_MAX), 1);
    let mut polls = 0;
    while qp.outstanding() > 0 {
        polls += 1;
        assert!(polls <= 64, "not done after {polls} polls");
        qp.arm_interrupt();
        let fd = qp.interrupt_fd().expect("a real clock has interrupts");
        assert!(
            crate::sys::wait_readable(fd, 10_000).unwrap(),
            "no interrupt while the command is due"
        );
        qp.process_completions(usize::MAX, &mut |c| assert!(c.status.is_success()));
    }
    assert_eq!(polls, 32, "32 MiB in steps of 1 MiB");
}
