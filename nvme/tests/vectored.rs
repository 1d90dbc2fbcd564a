//! Vectored commands (`Command::readv`, `Command::writev`) on every device that runs here:
//! the bytes a vectored write puts down are the bytes single and vectored reads get back,
//! segment boundaries inside blocks included, and every broken rule is a refusal at
//! submission that posts no completion. vfio's PRP building from segments is a unit test of
//! its PRP builder (`vfio::prp`), as no NVMe device is here.

use std::io::{IoSlice, IoSliceMut};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use hypoll_nvme::{
    Command, EmuConfig, EmuController, IoBuf, NullConfig, NullController, QueuePair, SegmentError,
    Status, SubmitError, UringConfig, UringController, SEGMENTS_MAX,
};
use proptest::prelude::*;

/// Submits `cmd` and waits for its completion. A device that never answers aborts the test
/// process rather than unwind: the device may still use the command's memory.
fn run(qp: &mut dyn QueuePair, cmd: &Command<'_>) -> Result<Status, SubmitError> {
    // SAFETY: the completion is reaped below, while the command (and so every buffer it
    // borrows) is alive; a timeout aborts instead of returning.
    unsafe { qp.submit(cmd, 7) }?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut status = None;
    while status.is_none() {
        qp.process_completions(1, &mut |c| {
            assert_eq!(c.tag, 7);
            status = Some(c.status);
        });
        if Instant::now() > deadline {
            eprintln!("no completion within 10 s");
            std::process::abort();
        }
    }
    Ok(status.expect("set above"))
}

/// `data` cut at `cuts` (ascending offsets inside it) into segments.
fn pieces<'a>(data: &'a [u8], cuts: &[usize]) -> Vec<IoSlice<'a>> {
    let mut out = Vec::new();
    let mut at = 0;
    for &cut in cuts.iter().chain(std::iter::once(&data.len())) {
        out.push(IoSlice::new(&data[at..cut]));
        at = cut;
    }
    out
}

fn pieces_mut<'a>(mut data: &'a mut [u8], cuts: &[usize]) -> Vec<IoSliceMut<'a>> {
    let mut out = Vec::new();
    let mut at = 0;
    for &cut in cuts {
        let (head, tail) = data.split_at_mut(cut - at);
        out.push(IoSliceMut::new(head));
        data = tail;
        at = cut;
    }
    out.push(IoSliceMut::new(data));
    out
}

fn pattern(len: usize, seed: u8) -> IoBuf {
    let data: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect();
    IoBuf::from_slice(&data)
}

/// A vectored write at `slba` of `blocks` blocks of `lba` bytes, cut at `write_cuts`, then a
/// single read, and a vectored read cut at `read_cuts`, of the same blocks; and a single
/// read of the blocks on either side, which the write must have left alone.
fn write_then_read_back(
    qp: &mut dyn QueuePair,
    lba: usize,
    slba: u64,
    blocks: usize,
    write_cuts: &[usize],
    read_cuts: &[usize],
) {
    let len = blocks * lba;
    let nlb = blocks as u32;
    let mut around = IoBuf::zeroed(len + 2 * lba);
    assert_eq!(
        run(qp, &Command::read(slba - 1, nlb + 2, &mut around)),
        Ok(Status::SUCCESS)
    );
    let data = pattern(len, slba as u8);
    let segs = pieces(&data, write_cuts);
    assert_eq!(
        run(qp, &Command::writev(slba, nlb, &segs)),
        Ok(Status::SUCCESS)
    );
    let mut single = IoBuf::zeroed(len);
    assert_eq!(
        run(qp, &Command::read(slba, nlb, &mut single)),
        Ok(Status::SUCCESS)
    );
    assert!(single[..] == data[..], "single read of a vectored write");
    let mut back = IoBuf::zeroed(len);
    let mut segs = pieces_mut(&mut back, read_cuts);
    assert_eq!(
        run(qp, &Command::readv(slba, nlb, &mut segs)),
        Ok(Status::SUCCESS)
    );
    drop(segs);
    assert!(back[..] == data[..], "vectored read of a vectored write");
    let mut after = IoBuf::zeroed(len + 2 * lba);
    assert_eq!(
        run(qp, &Command::read(slba - 1, nlb + 2, &mut after)),
        Ok(Status::SUCCESS)
    );
    assert!(
        after[..lba] == around[..lba],
        "the block before is untouched"
    );
    assert!(
        after[lba + len..] == around[lba + len..],
        "the block after is untouched"
    );
}

/// Every refusal the command itself can see, on any device: each one posts no completion.
fn refusals_common_to_every_device(qp: &mut dyn QueuePair, lba: usize) {
    let data = IoBuf::zeroed(4 * lba);
    let refused = |qp: &mut dyn QueuePair, cmd: &Command<'_>| {
        let e = run(qp, cmd).expect_err("refused");
        assert_eq!(qp.outstanding(), 0, "a refusal posts no completion");
        match e {
            SubmitError::Segment(e) => e,
            other => panic!("not a segment refusal: {other}"),
        }
    };
    // One more segment than the limit.
    let many: Vec<IoSlice<'_>> = (0..=SEGMENTS_MAX)
        .map(|i| IoSlice::new(&data[i * 4..i * 4 + 4]))
        .collect();
    assert_eq!(
        refused(qp, &Command::writev(0, 1, &many)),
        SegmentError::TooMany {
            count: SEGMENTS_MAX + 1,
            max: SEGMENTS_MAX
        }
    );
    // An empty segment between two good ones.
    let empty = [
        IoSlice::new(&data[..lba]),
        IoSlice::new(&data[lba..lba]),
        IoSlice::new(&data[lba..2 * lba]),
    ];
    assert_eq!(
        refused(qp, &Command::writev(0, 2, &empty)),
        SegmentError::Empty { index: 1 }
    );
    // Segments that hold a byte too few, or a block too many.
    let short = [
        IoSlice::new(&data[..lba]),
        IoSlice::new(&data[lba..2 * lba - 4]),
    ];
    assert_eq!(
        refused(qp, &Command::writev(0, 2, &short)),
        SegmentError::LengthMismatch {
            need_bytes: 2 * lba as u64,
            have_bytes: 2 * lba as u64 - 4
        }
    );
    let mut long = IoBuf::zeroed(3 * lba);
    let mut long_segs = [IoSliceMut::new(&mut long)];
    assert_eq!(
        refused(qp, &Command::readv(0, 2, &mut long_segs)),
        SegmentError::LengthMismatch {
            need_bytes: 2 * lba as u64,
            have_bytes: 3 * lba as u64
        }
    );
    // A segment that does not start on a dword, as NVMe asks of every data pointer.
    let odd = [IoSlice::new(&data[..2]), IoSlice::new(&data[2..lba])];
    assert!(matches!(
        refused(qp, &Command::writev(0, 1, &odd)),
        SegmentError::Misaligned {
            index: 1,
            align_bytes: 4,
            ..
        }
    ));
    // No segments at all holds no bytes.
    assert!(matches!(
        refused(qp, &Command::writev(0, 1, &[])),
        SegmentError::LengthMismatch { have_bytes: 0, .. }
    ));
}

fn emu(lba: u32) -> EmuController {
    EmuController::new(EmuConfig {
        size_bytes: 64 << 20,
        lba_bytes: lba,
        ..EmuConfig::zero_latency()
    })
    .expect("emulated controller")
}

#[test]
fn emu_vectored_writes_read_back_with_segments_that_split_blocks() {
    for lba in [512usize, 4096] {
        let ctrl = emu(lba as u32);
        let mut qp = ctrl.queue_pair(8).unwrap();
        // Four blocks cut inside blocks and across block boundaries, read back cut elsewhere.
        let len = 4 * lba;
        write_then_read_back(
            &mut qp,
            lba,
            10,
            4,
            &[100, 800, 836, len - 4],
            &[8, lba + 12, 3 * lba],
        );
        // One segment, and one segment per block.
        write_then_read_back(&mut qp, lba, 20, 2, &[], &[lba]);
        // The most segments a command carries, of one dword each but the last.
        let cuts: Vec<usize> = (1..SEGMENTS_MAX).map(|i| i * 4).collect();
        write_then_read_back(&mut qp, lba, 30, 1, &cuts, &cuts);
    }
}

#[test]
fn emu_refuses_what_breaks_a_rule() {
    let ctrl = emu(512);
    let mut qp = ctrl.queue_pair(8).unwrap();
    refusals_common_to_every_device(&mut qp, 512);
    // Past the namespace: a status, as for a single buffer.
    let data = IoBuf::zeroed(1024);
    let segs = pieces(&data, &[512]);
    let end = (64 << 20) / 512;
    assert_eq!(
        run(&mut qp, &Command::writev(end - 1, 2, &segs)),
        Ok(Status::LBA_OUT_OF_RANGE)
    );
}

#[test]
fn null_takes_vectored_commands_moves_nothing_and_refuses_the_same() {
    let ctrl = NullController::new(&NullConfig::default());
    let mut qp = ctrl.queue_pair(8).unwrap();
    let data = pattern(2048, 1);
    let segs = pieces(&data, &[100, 600]);
    assert_eq!(
        run(&mut qp, &Command::writev(4, 4, &segs)),
        Ok(Status::SUCCESS)
    );
    let mut back = pattern(2048, 2);
    let before = back[..].to_vec();
    let mut segs = pieces_mut(&mut back, &[1000]);
    assert_eq!(
        run(&mut qp, &Command::readv(4, 4, &mut segs)),
        Ok(Status::SUCCESS)
    );
    drop(segs);
    assert!(
        back[..] == before[..],
        "null moves no data (reads_fill_buffer is false)"
    );
    refusals_common_to_every_device(&mut qp, 512);
}

/// A file of `blocks` 4 KiB blocks of zeroes, written (never sparse), in the target's
/// temporary directory (tmpfs has no O_DIRECT).
fn data_file(blocks: usize) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir");
    let path = dir.path().join("disk.img");
    std::fs::write(&path, vec![0u8; blocks * 4096]).expect("write data file");
    (dir, path)
}

fn uring(path: &std::path::Path, direct: bool) -> UringController {
    let mut cfg = UringConfig::new(path);
    cfg.set("direct", if direct { "1" } else { "0" }).unwrap();
    UringController::open(&cfg).expect("open uring device")
}

#[test]
fn uring_vectored_writes_read_back_through_the_page_cache_with_any_cut() {
    let (_dir, path) = data_file(64);
    let ctrl = uring(&path, false);
    let mut qp = ctrl.queue_pair(8).unwrap();
    let lba = 4096;
    write_then_read_back(&mut qp, lba, 5, 3, &[100, 4100, 9000], &[4, 6000]);
    let cuts: Vec<usize> = (1..SEGMENTS_MAX).map(|i| i * 32).collect();
    write_then_read_back(&mut qp, lba, 20, 1, &cuts, &[2048]);
    refusals_common_to_every_device(&mut qp, lba);
    // What the file holds is what was written.
    let file = std::fs::read(&path).unwrap();
    assert!(file[5 * lba..8 * lba] == pattern(3 * lba, 5)[..]);
}

#[test]
fn uring_with_o_direct_takes_block_aligned_segments_and_refuses_others() {
    let (_dir, path) = data_file(64);
    let ctrl = uring(&path, true);
    let mut qp = ctrl.queue_pair(8).unwrap();
    let lba = 4096;
    // Block-aligned segments in separate buffers.
    write_then_read_back(&mut qp, lba, 5, 3, &[lba], &[2 * lba]);
    // Misaligned for O_DIRECT: a length, then an address, not a multiple of the block.
    let data = IoBuf::zeroed(3 * lba);
    let short_first = pieces(&data[..2 * lba], &[512]);
    let shifted = [
        IoSlice::new(&data[512..512 + lba]),
        IoSlice::new(&data[512 + lba..512 + 2 * lba]),
    ];
    for (segs, addr, len_bytes) in [
        (&short_first[..], data.as_ptr() as usize, 512),
        (&shifted[..], data.as_ptr() as usize + 512, lba),
    ] {
        let e = run(&mut qp, &Command::writev(0, 2, segs)).expect_err("refused");
        assert_eq!(
            e,
            SubmitError::Segment(SegmentError::NotBlockAligned {
                index: 0,
                addr,
                len_bytes,
                block_bytes: 4096
            }),
            "{e}"
        );
        assert!(e.to_string().contains("O_DIRECT"), "{e}");
    }
    assert_eq!(qp.outstanding(), 0);
    // One segment in the pinned pool goes through the registered buffer, as a single
    // buffer does.
    let pinned = IoBuf::pinned(lba);
    if qp.has_fixed_buffers() && pinned.is_pinned() {
        let fixed_before = qp.fixed_ios();
        let segs = [IoSlice::new(&pinned)];
        assert_eq!(
            run(&mut qp, &Command::writev(40, 1, &segs)),
            Ok(Status::SUCCESS)
        );
        assert_eq!(qp.fixed_ios(), fixed_before + 1);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any cut of a write into dword-aligned segments puts down the same bytes, and any cut
    /// of the read gets them back.
    #[test]
    fn emu_any_segmentation_round_trips(
        blocks in 1usize..=16,
        write_cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..SEGMENTS_MAX),
        read_cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
        slba in 1u64..1000,
    ) {
        let lba = 512;
        let len = blocks * lba;
        let cut = |picks: &[prop::sample::Index]| {
            let mut cuts: Vec<usize> = picks
                .iter()
                .map(|p| 4 * (1 + p.index(len / 4 - 1)))
                .filter(|&c| c < len)
                .collect();
            cuts.sort_unstable();
            cuts.dedup();
            cuts
        };
        let ctrl = emu(lba as u32);
        let mut qp = ctrl.queue_pair(4).unwrap();
        write_then_read_back(&mut qp, lba, slba, blocks, &cut(&write_cuts), &cut(&read_cuts));
    }
}
