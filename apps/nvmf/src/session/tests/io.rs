//! I/O queues: Connect's checks, each I/O command, in-capsule and solicited writes, reads,
//! completions, and the per-connection R2T limits.

use super::*;

/// An admin queue with a ready controller and an I/O queue on it.
fn io_pair(t: &Arc<Target>) -> (Conn, Conn) {
    let mut a = Conn::new(t);
    let cntlid = a.admin(NQN, 0);
    let mut q = Conn::new(t);
    assert_eq!(q.io(cntlid, 1), Status::SUCCESS);
    (a, q)
}

fn io(steps: &[Step]) -> &IoCommand {
    match steps.first() {
        Some(Step::Io(c)) => c,
        other => panic!("{other:?}"),
    }
}

#[test]
fn io_queues_connect_to_a_ready_controller_of_the_same_host() {
    let t = target();
    let mut a = Conn::new(&t);
    a.init();
    let cntlid = a
        .ask(&a.host.connect(1, 0, 31, 0, CNTLID_DYNAMIC, NQN))
        .dw0() as u16;
    let mut q = Conn::new(&t);
    assert_eq!(
        q.io(cntlid, 1),
        Status::COMMAND_SEQUENCE_ERROR,
        "not enabled"
    );
    a.ask(&a.host.enable(2));
    // Another host, an unknown controller, a queue ID beyond the grant, a taken one.
    let mut q = Conn::new(&t);
    q.host.hostnqn = "nqn.2014-08.org.nvmexpress:uuid:other".into();
    q.init();
    let r = q.ask(&q.host.connect(1, 1, 31, 0, cntlid, NQN));
    assert_eq!(r.status(), Status::CONNECT_INVALID_PARAMETERS);
    assert_eq!(r.dw0(), connect_invalid_parameter_dw0(512, true));
    let mut q = Conn::new(&t);
    q.init();
    let r = q.ask(&q.host.connect(1, 1, 31, 0, cntlid + 1, NQN));
    assert_eq!(r.dw0(), connect_invalid_parameter_dw0(16, true));
    let r = a.ask(
        &a.host
            .set_features(3, feature::NUMBER_OF_QUEUES, 1 | 1 << 16),
    );
    assert_eq!(r.dw0(), 1 | 1 << 16, "two queues");
    let mut q3 = Conn::new(&t);
    q3.init();
    let r = q3.ask(&q3.host.connect(1, 3, 31, 0, cntlid, NQN));
    assert_eq!(
        r.dw0(),
        connect_invalid_parameter_dw0(CONNECT_QID_OFFSET, false)
    );
    let mut q1 = Conn::new(&t);
    assert_eq!(q1.io(cntlid, 1), Status::SUCCESS);
    let mut again = Conn::new(&t);
    assert_eq!(again.io(cntlid, 1), Status::CONNECT_INVALID_PARAMETERS);
    assert_eq!(t.io_queues(cntlid), 1);
    // Once a queue is connected the grant cannot change.
    let r = a.ask(&a.host.set_features(4, feature::NUMBER_OF_QUEUES, 0));
    assert_eq!(r.status(), Status::COMMAND_SEQUENCE_ERROR);
    // A queue of too many entries, and a wrong subsystem.
    let mut q = Conn::new(&t);
    q.init();
    let r = q.ask(&q.host.connect(1, 2, 128, 0, cntlid, NQN));
    assert_eq!(
        r.dw0(),
        connect_invalid_parameter_dw0(CONNECT_SQSIZE_OFFSET, false)
    );
    let r = q.ask(
        &q.host
            .connect(2, 2, 31, 0, cntlid, "nqn.2026-12.io.hypoll:other"),
    );
    assert_eq!(r.dw0(), connect_invalid_parameter_dw0(256, true));
    // A closed I/O queue frees its ID.
    drop(q1);
    assert_eq!(t.io_queues(cntlid), 0);
    let mut again = Conn::new(&t);
    assert_eq!(again.io(cntlid, 1), Status::SUCCESS);
}

#[test]
fn reads_come_back_as_data_then_a_response() {
    let t = target();
    let (_a, mut q) = io_pair(&t);
    let (steps, replies) = q.send(&q.host.read(7, 1, 8, 4, 512));
    assert!(replies.is_empty());
    let cmd = io(&steps).clone();
    assert_eq!(
        cmd,
        IoCommand {
            cid: 7,
            nsid: 1,
            op: IoOp::Read {
                slba: 8,
                blocks: 4,
                fua: false
            }
        }
    );
    let data: Vec<u8> = (0..2048).map(|i| i as u8).collect();
    let mut out = Vec::new();
    assert_eq!(
        q.s.complete(7, Status::SUCCESS, &mut out),
        Err(CompleteError::ReadNeedsData(7))
    );
    assert_eq!(
        q.s.complete_read(7, &[&data[..100]], &mut out),
        Err(CompleteError::Length {
            cid: 7,
            expected: 2048,
            given: 100
        })
    );
    q.s.complete_read(7, &[&data[..1000], &data[1000..]], &mut out)
        .unwrap();
    let replies = q.decode(&out);
    match &replies[..] {
        [Reply::Data(h, d), Reply::Resp(c)] => {
            assert_eq!((h.cccid, h.datao, h.last, h.success), (7, 0, true, false));
            assert_eq!(d, &data);
            assert_eq!((c.cid, c.sq_id, c.status()), (7, 1, Status::SUCCESS));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(q.s.commands_inflight(), 0);
    assert_eq!(
        q.s.complete(7, Status::SUCCESS, &mut out),
        Err(CompleteError::Unknown(7))
    );
    // A failed read is a response alone.
    let (steps, _) = q.send(&q.host.read(8, 1, 0, 1, 512));
    io(&steps);
    let mut out = Vec::new();
    q.s.complete(8, Status::UNRECOVERED_READ_ERROR, &mut out)
        .unwrap();
    assert_eq!(q.decode(&out)[0].status(), Status::UNRECOVERED_READ_ERROR);
}

#[test]
fn writes_in_the_capsule_point_at_their_data() {
    let t = target();
    let (_a, mut q) = io_pair(&t);
    let data = vec![0xa5u8; 1024];
    let pdu = q.host.write(3, 1, 100, &data, 512);
    let (steps, replies) = q.send(&pdu);
    assert!(replies.is_empty());
    let IoOp::Write {
        slba: 100,
        blocks: 2,
        fua: false,
        data: WriteData::InCapsule(range),
    } = &io(&steps).op
    else {
        panic!("{steps:?}")
    };
    assert_eq!(&pdu[range.clone()], &data[..]);
    assert_eq!(q.s.held_bytes(), 1024);
    let mut out = Vec::new();
    q.s.complete(3, Status::SUCCESS, &mut out).unwrap();
    assert_eq!(q.decode(&out)[0].status(), Status::SUCCESS);
    assert_eq!(q.s.held_bytes(), 0);
}

#[test]
fn solicited_writes_get_an_r2t_and_their_data_in_pieces() {
    let t = target();
    let (_a, mut q) = io_pair(&t);
    let (steps, replies) = q.send(&q.host.write_solicited(4, 1, 0, 16, 512));
    assert!(matches!(
        io(&steps).op,
        IoOp::Write {
            data: WriteData::Solicited,
            ..
        }
    ));
    let [Reply::R2t(r)] = &replies[..] else {
        panic!("{replies:?}")
    };
    assert_eq!((r.cccid, r.r2to, r.r2tl), (4, 0, 8192));
    let data: Vec<u8> = (0..8192).map(|i| (i / 7) as u8).collect();
    let mut got = vec![0u8; 8192];
    for (i, chunk) in data.chunks(3000).enumerate() {
        let off = i as u32 * 3000;
        let last = off as usize + chunk.len() == data.len();
        let pdu = q.host.h2c_data(4, r.ttag, off, chunk, last);
        let (steps, replies) = q.send(&pdu);
        assert!(replies.is_empty());
        match &steps[0] {
            Step::WriteData {
                cid: 4,
                offset,
                data: d,
                last: l,
            } => {
                assert_eq!((*offset, *l), (off, last));
                got[*offset as usize..][..d.len()].copy_from_slice(&pdu[d.clone()]);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got, data);
    let mut out = Vec::new();
    q.s.complete(4, Status::SUCCESS, &mut out).unwrap();
    assert_eq!(q.decode(&out)[0].status(), Status::SUCCESS);
    assert_eq!((q.s.held_bytes(), q.s.commands_inflight()), (0, 0));
}

#[test]
fn solicited_bytes_wait_for_room() {
    let mut cfg = config();
    cfg.limits.r2t_bytes_max = 64 << 10;
    cfg.limits.r2ts_max = 2;
    let t = Target::new(cfg).unwrap();
    let (_a, mut q) = io_pair(&t);
    // Three 32 KiB writes: two R2Ts fit, the third waits for a completion.
    let mut r2ts = Vec::new();
    for cid in 1..=3 {
        let (_, replies) = q.send(&q.host.write_solicited(cid, 1, 0, 64, 512));
        r2ts.extend(replies);
    }
    assert_eq!(r2ts.len(), 2);
    let Reply::R2t(first) = r2ts[0].clone() else {
        panic!()
    };
    let (steps, replies) = q.send(&q.host.h2c_data(1, first.ttag, 0, &[1; 32768], true));
    assert!(matches!(steps[0], Step::WriteData { last: true, .. }));
    assert!(
        replies.is_empty(),
        "the bytes are held until the write is answered"
    );
    let mut out = Vec::new();
    q.s.complete(1, Status::SUCCESS, &mut out).unwrap();
    match &q.decode(&out)[..] {
        [Reply::Resp(c), Reply::R2t(r)] => {
            assert_eq!(c.cid, 1);
            assert_eq!((r.cccid, r.r2tl), (3, 32768));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn flush_write_zeroes_and_deallocate() {
    let t = target();
    let (_a, mut q) = io_pair(&t);
    let (steps, _) = q.send(&q.host.flush(1, 1));
    assert_eq!(io(&steps).op, IoOp::Flush);
    let (steps, _) = q.send(&q.host.write_zeroes(2, 1, 10, 20, true));
    assert_eq!(
        io(&steps).op,
        IoOp::WriteZeroes {
            slba: 10,
            blocks: 20,
            deallocate: true,
            fua: false
        }
    );
    let ranges = [
        BlockRange { slba: 0, blocks: 8 },
        BlockRange {
            slba: 100,
            blocks: 0,
        },
        BlockRange {
            slba: 2040,
            blocks: 8,
        },
    ];
    let (steps, _) = q.send(&q.host.deallocate(3, 1, &ranges, true));
    let IoOp::Deallocate { ranges: got } = &io(&steps).op else {
        panic!()
    };
    assert_eq!(got, &[ranges[0], ranges[2]], "empty ranges dropped");
    // The same, solicited: the session gathers the ranges itself.
    let (steps, replies) = q.send(&q.host.deallocate(4, 1, &ranges, false));
    assert_eq!(steps[0], Step::Handled);
    let [Reply::R2t(r)] = &replies[..] else {
        panic!()
    };
    let (steps, _) = q.send(&q.host.deallocate_data(4, r.ttag, &ranges));
    assert!(matches!(&io(&steps).op, IoOp::Deallocate { ranges: g } if g.len() == 2));
    let mut out = Vec::new();
    for cid in 1..=4 {
        q.s.complete(cid, Status::SUCCESS, &mut out).unwrap();
    }
    assert_eq!(q.decode(&out).len(), 4);
    // Out of range.
    let bad = [BlockRange {
        slba: 2047,
        blocks: 2,
    }];
    let r = q.ask(&q.host.deallocate(5, 1, &bad, true));
    assert_eq!(r.status(), Status::LBA_OUT_OF_RANGE);
}

#[test]
fn bad_commands_get_a_status_and_the_queue_goes_on() {
    let t = target();
    let (_a, mut q) = io_pair(&t);
    let cases = [
        (q.host.read(1, 1, 2047, 2, 512), Status::LBA_OUT_OF_RANGE),
        (
            q.host.read(2, 1, u64::MAX, 1, 512),
            Status::LBA_OUT_OF_RANGE,
        ),
        (q.host.read(3, 9, 0, 1, 512), Status::INVALID_NAMESPACE),
        (
            q.host.read(4, 1, 0, 1, 4096),
            Status::DATA_SGL_LENGTH_INVALID,
        ),
        (q.host.read(5, 1, 0, 256, 512), Status::INVALID_FIELD),
        (
            q.host.write(6, 2, 0, &[0; 512], 512),
            Status::NAMESPACE_WRITE_PROTECTED,
        ),
        (
            q.host.write_zeroes(7, 2, 0, 1, false),
            Status::NAMESPACE_WRITE_PROTECTED,
        ),
        (q.host.keep_alive(8), Status::INVALID_OPCODE),
        (
            q.host.property_get(9, property::CAP, true),
            Status::INVALID_OPCODE,
        ),
    ];
    for (pdu, status) in cases {
        assert_eq!(q.ask(&pdu).status(), status);
    }
    t.set_namespace_ready(1, false);
    assert_eq!(
        q.ask(&q.host.read(10, 1, 0, 1, 512)).status(),
        Status::NAMESPACE_NOT_READY
    );
    t.set_namespace_ready(1, true);
    let (steps, _) = q.send(&q.host.read(11, 1, 0, 1, 512));
    io(&steps);
    assert_eq!(
        q.ask(&q.host.read(11, 1, 0, 1, 512)).status(),
        Status::COMMAND_ID_CONFLICT
    );
    // A disconnect answers, then closes.
    let (steps, replies) = q.send(&q.host.disconnect(12));
    assert_eq!(steps, [Step::Close(Close::Disconnect)]);
    assert_eq!(replies[0].status(), Status::SUCCESS);
}

#[test]
fn without_sq_flow_control_a_read_ends_with_its_data() {
    let t = target();
    let mut a = Conn::new(&t);
    let cntlid = a.admin(NQN, 0);
    let mut q = Conn::new(&t);
    q.init();
    let mut pdu = q.host.connect(1, 1, 31, 0, cntlid, NQN);
    pdu[8 + 46] = CATTR_DISABLE_SQ_FLOW_CONTROL; // CATTR, byte 46 of the command
    assert_eq!(q.ask(&pdu).status(), Status::SUCCESS);
    let (steps, _) = q.send(&q.host.read(2, 1, 0, 1, 512));
    io(&steps);
    let mut out = Vec::new();
    q.s.complete_read(2, &[&[7; 512]], &mut out).unwrap();
    match &q.decode(&out)[..] {
        [Reply::Data(h, _)] => assert!(h.last && h.success),
        other => panic!("{other:?}"),
    }
}
