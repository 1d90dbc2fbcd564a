//! I/O futures on real reactors and devices: owned buffers in and out, waiting for room on
//! a full queue pair, refusals, and futures dropped with their I/O in flight (on every
//! device a test can reach, and under injected faults).

mod common;

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use common::{serial, start, App};
use hypoll_async::{run_now, IoError, Local, SpawnExt};
use hypoll_reactor::{Device, DeviceId, DeviceOptions, IoBuf, IoFailure, RejectReason};

const DEV: DeviceId = DeviceId::FIRST;

fn pattern(seed: u64, len: usize) -> IoBuf {
    let bytes: Vec<u8> = (0..len).map(|i| (seed as usize * 31 + i) as u8).collect();
    IoBuf::from_slice(&bytes)
}

/// Polls a future once, then drops it: an I/O future dropped just after it submitted.
struct PollOnceThenDrop<F>(Option<F>);

impl<F: Future + Unpin> Future for PollOnceThenDrop<F> {
    type Output = bool;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<bool> {
        let mut inner = self.0.take().expect("polled once");
        let ready = Pin::new(&mut inner).poll(cx).is_ready();
        drop(inner);
        Poll::Ready(ready)
    }
}

/// Blocks per 4 KiB on the reactor's device.
fn blocks_4k(io: &Local<App>) -> u32 {
    4096 / io.with(|r, _| r.lba_bytes(DEV).unwrap())
}

#[test]
fn a_write_then_a_read_hand_the_same_buffer_back_and_forth() {
    let _serial = serial();
    let device = Device::open("emu:optane,size=16M").unwrap();
    let set = start(1, Some((device, DeviceOptions::new(8))));
    let task = set.handles()[0]
        .spawn(|io| async move {
            let nlb = blocks_4k(&io);
            let mut checked = 0;
            for i in 0..64u64 {
                let written = pattern(i, 4096);
                let buf = io.write(DEV, i * 8, nlb, written).await.unwrap();
                assert_eq!(&buf[..], &pattern(i, 4096)[..]);
                let back = io.read(DEV, i * 8, nlb, IoBuf::zeroed(4096)).await.unwrap();
                assert_eq!(&back[..], &pattern(i, 4096)[..], "block {i}");
                checked += 1;
            }
            io.flush(DEV).await.unwrap();
            io.write_zeroes(DEV, 0, nlb).await.unwrap();
            let zero = io.read(DEV, 0, nlb, pattern(9, 4096)).await.unwrap();
            assert!(zero.iter().all(|&b| b == 0));
            io.deallocate(DEV, 8, nlb).await.unwrap();
            checked
        })
        .unwrap();
    assert_eq!(task.wait(), Ok(64));
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn on_a_full_queue_pair_futures_wait_for_room_instead_of_failing() {
    let _serial = serial();
    // Depth 2, no wait queue: 64 tasks at once find it full nearly every time.
    let device = Device::open("emu:optane,size=16M").unwrap();
    let set = start(1, Some((device, DeviceOptions::new(2))));
    let task = set.handles()[0]
        .spawn(|io| async move {
            let nlb = blocks_4k(&io);
            let mut joins = Vec::new();
            for t in 0..64u64 {
                let io2 = io.clone();
                joins.push(
                    io.spawn_local(async move {
                        let mut buf = IoBuf::zeroed(4096);
                        for k in 0..20u64 {
                            buf = io2.read(DEV, (t * 20 + k) * 8, nlb, buf).await.unwrap();
                        }
                    })
                    .unwrap(),
                );
            }
            for join in joins {
                join.await.unwrap();
            }
            io.ios_in_flight()
        })
        .unwrap();
    assert_eq!(task.wait(), Ok(0));
    let report = set.shutdown();
    assert_eq!(report.exits[0].stats.counters.ios, 64 * 20);
    assert_eq!(report.exits[0].stats.counters.io_errors, 0);
}

#[test]
fn a_refused_io_fails_at_once_with_its_reason_and_its_buffer_back() {
    let _serial = serial();
    let device = Device::open("null,size=1M").unwrap();
    let set = start(1, Some((device, DeviceOptions::new(4))));
    let task = set.handles()[0]
        .spawn(|io| async move {
            let past_the_end = 1 << 30;
            let err = io
                .read(DEV, past_the_end, 8, IoBuf::zeroed(4096))
                .await
                .unwrap_err();
            let unknown = io
                .write(DeviceId::from_index(7), 0, 8, IoBuf::zeroed(4096))
                .await
                .unwrap_err();
            (err.error(), err.buf().map(|b| b.len()), unknown.error())
        })
        .unwrap();
    let (error, buf_len, unknown) = task.wait().unwrap();
    // `null` checks the range as it completes the command, other devices as they take it.
    assert!(
        matches!(
            error,
            IoError::Refused(RejectReason::Submit(_)) | IoError::Failed(IoFailure::Device(_))
        ),
        "{error}"
    );
    assert_eq!(buf_len, Some(4096));
    assert_eq!(unknown, IoError::Refused(RejectReason::UnknownDevice));
    assert!(set.shutdown().panics.is_empty());
}

/// A task whose only I/O in flight completes is polled in that completion's callback, as a
/// callback would run: before the callbacks of the completions after it in the same batch
/// (here a callback I/O submitted just after the task's read). A task awaiting two I/Os
/// that one batch completes is polled once for both, after the batch.
#[test]
fn a_task_awaiting_one_io_runs_in_its_completion_and_one_awaiting_two_after_the_batch() {
    let _serial = serial();
    let device = Device::open("null").unwrap();
    let set = start(1, Some((device, DeviceOptions::new(8))));
    let (tx, rx) = std::sync::mpsc::channel();
    set.handles()[0]
        .send(move |r, app| {
            let nlb = 4096 / r.lba_bytes(DEV).unwrap();
            let resumed = Rc::new(Cell::new(false));
            let io = app.executor.local();
            let flag = resumed.clone();
            let one = async move {
                io.read(DEV, 0, nlb, IoBuf::zeroed(4096)).await.unwrap();
                flag.set(true);
            };
            drop(app.executor.spawn_local(one).unwrap());
            // The task submits its read now; the callback's read goes in after it, and
            // the next turn reaps both in one batch.
            assert_eq!(run_now(r, app), 1);
            let seen = resumed.clone();
            r.read(DEV, 8, nlb, IoBuf::zeroed(4096), move |_, _, done| {
                assert!(done.result.is_ok());
                tx.send(seen.get()).unwrap();
            })
            .unwrap();
        })
        .unwrap();
    let resumed_first = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(
        resumed_first,
        "the task ran after the batch's next callback"
    );

    let task = set.handles()[0]
        .spawn(|io| async move {
            let nlb = blocks_4k(&io);
            // Polls counted before this one, and at the end (this poll not counted yet).
            let before = io.counters().polls;
            let mut a = io.read(DEV, 0, nlb, IoBuf::zeroed(4096));
            let mut b = io.read(DEV, u64::from(nlb), nlb, IoBuf::zeroed(4096));
            let (mut done_a, mut done_b) = (false, false);
            std::future::poll_fn(|cx| {
                done_a = done_a || Pin::new(&mut a).poll(cx).is_ready();
                done_b = done_b || Pin::new(&mut b).poll(cx).is_ready();
                if done_a && done_b {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
            io.counters().polls - before
        })
        .unwrap();
    assert_eq!(
        task.wait(),
        Ok(1),
        "polled once more, after both completions"
    );
    assert!(set.shutdown().panics.is_empty());
}

/// Futures dropped just after they submitted: the reactor completes their I/O, drops their
/// buffers, and the executor's cells all come back; the reactor is still usable after.
fn dropped_futures_leave_nothing_behind(spec: &str, depth: usize) {
    let device = Device::open(spec).unwrap();
    let set = start(1, Some((device, DeviceOptions::new(depth))));
    let h = set.handles()[0].clone();
    let submitted = h
        .spawn(|io| async move {
            let nlb = blocks_4k(&io);
            let mut ready = 0;
            for i in 0..200u64 {
                let buf = pattern(i, 4096);
                let write = Box::pin(io.write(DEV, (i % 64) * 8, nlb, buf));
                ready += u32::from(PollOnceThenDrop(Some(write)).await);
                let read = Box::pin(io.read(DEV, (i % 64) * 8, nlb, IoBuf::zeroed(4096)));
                ready += u32::from(PollOnceThenDrop(Some(read)).await);
            }
            (ready, io.ios_in_flight())
        })
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        submitted.0, 0,
        "{spec}: no I/O completes within its first poll"
    );
    assert!(
        submitted.1 > 0,
        "{spec}: the dropped futures' I/Os are in flight"
    );
    let left = h
        .spawn(|io| async move {
            while io.ios_in_flight() > 0 {
                io.sleep(Duration::from_millis(1)).await;
            }
            let outstanding = io.with(|r, _| r.outstanding());
            // The reactor and the executor go on as before.
            let nlb = blocks_4k(&io);
            let buf = io.write(DEV, 0, nlb, pattern(1, 4096)).await.unwrap();
            let back = io.read(DEV, 0, nlb, buf).await.unwrap();
            (outstanding, back[..] == pattern(1, 4096)[..])
        })
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(left, (0, true), "{spec}");
    let report = set.shutdown();
    assert!(report.panics.is_empty());
    assert_eq!(report.exits[0].failed_ios, 0, "{spec}");
}

#[test]
fn dropping_futures_with_io_in_flight_is_safe_on_null() {
    let _serial = serial();
    dropped_futures_leave_nothing_behind("null,size=1M", 16);
}

#[test]
fn dropping_futures_with_io_in_flight_is_safe_on_emu() {
    let _serial = serial();
    dropped_futures_leave_nothing_behind("emu:nand,size=16M,read_us=200,write_us=200", 16);
}

#[test]
fn dropping_futures_with_io_in_flight_is_safe_on_uring() {
    let _serial = serial();
    let file = tempfile::NamedTempFile::new().unwrap();
    file.as_file().set_len(16 << 20).unwrap();
    let spec = format!("uring:{},direct=0,lba=512", file.path().display());
    if Device::open(&spec).is_err() {
        eprintln!("io_uring is not available here: skipped");
        return;
    }
    dropped_futures_leave_nothing_behind(&spec, 16);
}

/// Under injected errors and lost commands, with short timeouts, many tasks do I/O and
/// time half of it out (dropping those futures mid-flight): every future resolves, every
/// I/O is accounted for, and the reactor ends with nothing outstanding.
#[test]
fn dropping_futures_under_injected_faults_accounts_for_every_io() {
    let _serial = serial();
    let device = Device::open("emu:optane,size=16M,err_pct=5,lost_pct=1,seed=7").unwrap();
    let options = DeviceOptions::new(16)
        .with_io_timeout(Some(Duration::from_millis(20)))
        .with_abort_timeout(Duration::from_millis(10))
        .with_reset_timeout(Duration::from_millis(10));
    let set = start(1, Some((device, options)));
    let h = set.handles()[0].clone();
    let tally = h
        .spawn(|io| async move {
            let nlb = blocks_4k(&io);
            let mut joins = Vec::new();
            for t in 0..32u64 {
                let io2 = io.clone();
                joins.push(
                    io.spawn_local(async move {
                        let mut tally = [0u32; 4]; // ok, failed, timed out, buffers back
                        let mut buf = IoBuf::zeroed(4096);
                        for k in 0..40u64 {
                            let slba = ((t * 40 + k) % 2048) * 8;
                            let limit = Duration::from_micros(if k % 2 == 0 { 5 } else { 50_000 });
                            match io2.timeout(limit, io2.read(DEV, slba, nlb, buf)).await {
                                Ok(Ok(back)) => {
                                    tally[0] += 1;
                                    tally[3] += 1;
                                    buf = back;
                                }
                                Ok(Err(e)) => {
                                    tally[1] += 1;
                                    assert!(matches!(e.error(), IoError::Failed(_)), "{e}");
                                    let error = e.error();
                                    match e.into_buf() {
                                        Some(back) => {
                                            tally[3] += 1;
                                            buf = back;
                                        }
                                        None => {
                                            assert_eq!(
                                                error,
                                                IoError::Failed(IoFailure::Abandoned)
                                            );
                                            buf = IoBuf::zeroed(4096);
                                        }
                                    }
                                }
                                Err(_elapsed) => {
                                    tally[2] += 1;
                                    buf = IoBuf::zeroed(4096);
                                }
                            }
                        }
                        tally
                    })
                    .unwrap(),
                );
            }
            let mut total = [0u32; 4];
            for join in joins {
                let tally = join.await.unwrap();
                for (t, n) in total.iter_mut().zip(tally) {
                    *t += n;
                }
            }
            // The timed-out reads finish (or are recovered) under the device.
            while io.ios_in_flight() > 0 {
                io.sleep(Duration::from_millis(1)).await;
            }
            (total, io.with(|r, _| r.outstanding()), io.counters())
        })
        .unwrap()
        .wait()
        .unwrap();
    let ([ok, failed, timed_out, back], outstanding, executor) = tally;
    assert_eq!(ok + failed + timed_out, 32 * 40, "every future resolved");
    assert_eq!(
        back,
        ok + failed,
        "every completed read but an abandoned one gave its buffer back"
    );
    assert!(timed_out > 0 && ok > 0, "{tally:?}");
    assert!(
        executor.ios_orphaned > 0,
        "some timed-out reads were in flight: {executor:?}"
    );
    assert_eq!(outstanding, 0);
    let report = set.shutdown();
    assert!(report.panics.is_empty());
    let counters = report.exits[0].stats.counters;
    // Timed-out reads still in line for room never reached the reactor; every other one
    // completed there exactly once.
    assert_eq!(counters.ios, executor.ios, "{counters:?} {executor:?}");
}
