//! I/O through reactor threads: data reads back under every policy, a deep queue completes
//! every I/O, refusals come with a reason and the buffer back, write zeroes and deallocate
//! reach the device, and shutdown drains what completes and fails the rest.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hypoll_nvme::{IoBuf, SubmitError};
use hypoll_reactor::{
    Device, DeviceId, IoDone, IoFailure, IoOp, IoRequest, ReactorConfig, ReactorSet, ReactorTuning,
    RejectReason, Rejected,
};
use support::{config, drive, read_block, succeeded, write_block, write_then_read};

#[test]
fn data_written_through_a_reactor_reads_back_under_every_policy() {
    for policy in [
        "classic",
        "interrupt",
        "hybrid",
        "fixed:5",
        "hybrid-3/4",
        "hybrid-min",
        "uring-hybrid",
        "adaptive",
        "oracle",
    ] {
        let stats = write_then_read("emu:optane,size=64M", policy, 2_000, 8);
        assert_eq!(stats.counters.ios, 4_000, "{policy}");
        assert_eq!(stats.counters.io_errors, 0, "{policy}");
    }
}

#[test]
fn a_deep_queue_on_null_completes_every_io() {
    let device = Device::open("null").unwrap();
    let set = ReactorSet::start(config(1, "classic"), move |r| {
        r.attach(&device, 128)?;
        Ok(())
    })
    .unwrap();
    let failed = drive(&set.handles()[0], 200_000, 128, read_block, succeeded);
    assert_eq!(failed, 0);
    let stats = set.shutdown().exits[0].stats;
    assert_eq!(stats.counters.ios, 200_000);
}

#[test]
fn submissions_are_refused_with_reasons_and_the_buffer_back() {
    let device = Device::open("emu:optane,size=1M").unwrap();
    let set = ReactorSet::start(config(1, "classic"), move |r| {
        r.attach(&device, 2)?;
        Ok(())
    })
    .unwrap();
    let (tx, rx) = crossbeam_channel::bounded(1);
    set.handles()[0]
        .send(move |r, _| {
            let mut reasons = Vec::new();
            let mut note = |res: Result<(), Rejected>| {
                let e = res.unwrap_err();
                reasons.push((e.reason, e.buf.is_some()));
            };
            note(
                r.submit(
                    DeviceId::FIRST,
                    IoRequest::new(IoOp::Read, 0, 8),
                    None,
                    |_, _, _| {},
                )
                .map_err(Rejected::boxed),
            );
            note(
                r.flush(DeviceId::from_index(9), |_, _, _| {})
                    .map_err(Rejected::boxed),
            );
            note(
                r.read(DeviceId::FIRST, 0, 0, IoBuf::zeroed(4096), |_, _, _| {})
                    .map_err(Rejected::boxed),
            );
            let mut room = vec![r.has_room(DeviceId::FIRST)];
            r.flush(DeviceId::FIRST, |_, _, _| {}).unwrap();
            room.push(r.has_room(DeviceId::FIRST));
            r.flush(DeviceId::FIRST, |_, _, _| {}).unwrap();
            // Full: has_room says so before an I/O is built to be refused.
            room.push(r.has_room(DeviceId::FIRST));
            note(
                r.read(DeviceId::FIRST, 0, 8, IoBuf::zeroed(4096), |_, _, _| {})
                    .map_err(Rejected::boxed),
            );
            assert_eq!(room, [true, true, false]);
            tx.send(reasons).unwrap();
        })
        .unwrap();
    let reasons = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(
        reasons,
        vec![
            (RejectReason::Buffer, false),
            (RejectReason::UnknownDevice, false),
            (
                RejectReason::Submit(SubmitError::InvalidField("zero-length transfer (nlb = 0)")),
                true
            ),
            (
                RejectReason::Submit(SubmitError::QueueFull { depth: 2 }),
                true
            ),
        ]
    );
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn write_zeroes_and_deallocate_reach_the_device() {
    let device = Device::open("emu:optane,size=16M").unwrap();
    let set = ReactorSet::start(config(1, "classic"), move |r| {
        r.attach(&device, 8)?;
        Ok(())
    })
    .unwrap();
    let h = &set.handles()[0];
    assert_eq!(drive(h, 64, 8, write_block, succeeded), 0);
    let (tx, rx) = crossbeam_channel::bounded(2);
    h.send(move |r, _| {
        let tx2 = tx.clone();
        r.write_zeroes(DeviceId::FIRST, 0, 8 * 32, move |_, _, done| {
            tx.send(done.result).unwrap()
        })
        .unwrap();
        r.deallocate(DeviceId::FIRST, 8 * 32, 8 * 32, move |_, _, done| {
            tx2.send(done.result).unwrap()
        })
        .unwrap();
    })
    .unwrap();
    for _ in 0..2 {
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), Ok(()));
    }
    // Every block now reads back as zeroes.
    fn zeroed(_: u64, done: &IoDone) -> bool {
        done.result.is_ok()
            && done
                .buf
                .as_deref()
                .is_some_and(|b| b.iter().all(|&x| x == 0))
    }
    assert_eq!(drive(h, 64, 8, read_block, zeroed), 0);
    assert!(set.shutdown().panics.is_empty());
}

#[test]
fn shutdown_drains_what_completes_and_fails_the_rest_with_a_clear_status() {
    // Commands on this device never complete; the shutdown waits 200 ms, then fails them.
    let device = Device::open("emu:optane,size=16M,lost_pct=100").unwrap();
    let cfg = ReactorConfig {
        tuning: ReactorTuning {
            shutdown_timeout: Duration::from_millis(200),
            ..ReactorTuning::default()
        },
        ..config(1, "classic")
    };
    let set = ReactorSet::start(cfg, move |r| {
        r.attach(&device, 16)?;
        Ok(())
    })
    .unwrap();
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let sink = outcomes.clone();
    let (submitted_tx, submitted_rx) = crossbeam_channel::bounded(1);
    set.handles()[0]
        .send(move |r, _| {
            for i in 0..10u64 {
                let sink = sink.clone();
                r.read(
                    DeviceId::FIRST,
                    i * 8,
                    8,
                    IoBuf::zeroed(4096),
                    move |_, _, done| {
                        sink.lock()
                            .unwrap()
                            .push((done.user, done.result, done.buf.is_some()));
                    },
                )
                .unwrap();
            }
            submitted_tx.send(r.outstanding()).unwrap();
        })
        .unwrap();
    let in_flight = submitted_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(in_flight, 10);
    let t0 = Instant::now();
    let report = set.shutdown();
    assert!(t0.elapsed() >= Duration::from_millis(200));
    assert_eq!(report.exits[0].failed_ios, 10);
    assert_eq!(report.exits[0].drained_ios, 0);
    let outcomes = outcomes.lock().unwrap();
    assert_eq!(outcomes.len(), 10, "every I/O's callback ran");
    for (_, result, buf_back) in outcomes.iter() {
        assert_eq!(*result, Err(IoFailure::Shutdown));
        assert!(buf_back, "the buffer came back");
    }

    // A slow device whose I/O completes within the timeout is drained, not failed (slow
    // enough that the shutdown begins before it completes, on a busy machine too).
    let device = Device::open("emu:nand,size=16M,read_us=300000,jitter=0,tail_pct=0").unwrap();
    let set = ReactorSet::start(config(1, "classic"), move |r| {
        r.attach(&device, 16)?;
        Ok(())
    })
    .unwrap();
    let (submitted_tx, submitted_rx) = crossbeam_channel::bounded(1);
    set.handles()[0]
        .send(move |r, _| {
            for i in 0..5u64 {
                r.read(
                    DeviceId::FIRST,
                    i * 8,
                    8,
                    IoBuf::zeroed(4096),
                    |_, _, done| {
                        assert!(done.result.is_ok());
                    },
                )
                .unwrap();
            }
            submitted_tx.send(r.outstanding()).unwrap();
        })
        .unwrap();
    let in_flight = submitted_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(in_flight, 5);
    let report = set.shutdown();
    assert_eq!(report.exits[0].drained_ios, 5);
    assert_eq!(report.exits[0].failed_ios, 0);
    assert!(report.panics.is_empty());
}
