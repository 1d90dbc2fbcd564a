//! Faults: malformed and out-of-sequence PDUs end the session with the termination request
//! the transport specification prescribes; digests; controllers ending under their queues;
//! the limits on controllers and commands.

use hypoll_nvme::tcp::{encode, Fes};

use super::*;

fn fatal(steps: &[Step], replies: &[Reply], fes: Fes, fei: u32) {
    assert!(
        matches!(steps.last(), Some(Step::Close(Close::Fatal { fes: f, .. })) if *f == fes),
        "{steps:?}"
    );
    assert_eq!(
        replies.last(),
        Some(&Reply::Term {
            fes: fes as u16,
            fei
        })
    );
}

#[test]
fn a_pdu_before_icreq_or_a_second_icreq_is_a_sequence_error() {
    let t = target();
    let mut c = Conn::new(&t);
    let (steps, replies) = c.send(&c.host.keep_alive(1));
    fatal(&steps, &replies, Fes::PduSequenceError, 0);
    // Closed for good: nothing more is consumed.
    let mut out = Vec::new();
    assert_eq!(
        c.s.step(&c.host.ic_req(0), 0, &mut out),
        (0, steps.last().unwrap().clone())
    );
    assert!(out.is_empty());

    let mut c = Conn::new(&t);
    c.init();
    let (steps, replies) = c.send(&c.host.ic_req(0));
    fatal(&steps, &replies, Fes::PduSequenceError, 0);
}

#[test]
fn malformed_headers_get_the_prescribed_fes_and_the_header_back() {
    let t = target();
    let mut c = Conn::new(&t);
    c.init();
    let mut pdu = c.host.keep_alive(1);
    pdu[2] = 70; // HLEN
    let mut out = Vec::new();
    let (used, step) = c.s.step(&pdu, 0, &mut out);
    assert_eq!(used, 0);
    assert!(matches!(step, Step::Close(Close::Fatal { .. })));
    let term = c.decode(&out);
    assert_eq!(
        term,
        [Reply::Term {
            fes: Fes::InvalidHeaderField as u16,
            fei: 2
        }]
    );
    // The termination request carries what was checked of the offending header: the
    // common header, whatever else has arrived.
    assert_eq!(&out[24..], &pdu[..8]);
    // A fault past the common header: the header is all there, and comes back whole.
    let mut c = Conn::new(&t);
    let mut req = c.host.ic_req(0);
    req[8] = 1; // PFV
    let mut out = Vec::new();
    c.s.step(&req, 0, &mut out);
    assert_eq!(
        c.decode(&out),
        [Reply::Term {
            fes: Fes::UnsupportedParameter as u16,
            fei: 8
        }]
    );
    assert_eq!(&out[24..], &req[..]);

    // An in-capsule payload beyond the admin queue's limit is refused from the header.
    let mut c = Conn::new(&t);
    c.admin(NQN, 0);
    let sqe = hypoll_nvme::spec::SubmissionEntry::default();
    let mut big = Vec::new();
    encode::capsule_cmd(&mut big, &Framing::default(), &sqe, &vec![0; 8200]);
    let (steps, replies) = c.send(&big[..16]);
    fatal(&steps, &replies, Fes::InvalidHeaderField, 4);
    assert!(
        t.controllers() == 0,
        "the controller ended with its admin queue"
    );
}

#[test]
fn h2cdata_must_answer_an_r2t_in_order_and_in_range() {
    let t = target();
    let mut a = Conn::new(&t);
    let cntlid = a.admin(NQN, 0);
    let io_queue = |t: &Arc<Target>| {
        let mut q = Conn::new(t);
        assert_eq!(q.io(cntlid, 1), Status::SUCCESS);
        let (_, r) = q.send(&q.host.write_solicited(1, 1, 0, 8, 512));
        let [Reply::R2t(r)] = r[..] else { panic!() };
        (q, r.ttag)
    };
    type Build = dyn Fn(&Host, u16) -> Vec<u8>;
    let cases: [(&Build, Fes, u32); 6] = [
        (
            &|h, tt| h.h2c_data(2, tt, 0, &[0; 512], false),
            Fes::InvalidHeaderField,
            8,
        ),
        (
            &|h, tt| h.h2c_data(1, tt + 1, 0, &[0; 512], false),
            Fes::InvalidHeaderField,
            10,
        ),
        (
            &|h, tt| h.h2c_data(1, tt, 3900, &[0; 512], false),
            Fes::DataOutOfRange,
            0,
        ),
        (
            &|h, tt| h.h2c_data(1, tt, 512, &[0; 512], false),
            Fes::PduSequenceError,
            0,
        ),
        (
            &|h, tt| h.h2c_data(1, tt, 0, &[0; 512], true),
            Fes::PduSequenceError,
            0,
        ),
        (
            &|h, tt| h.h2c_data(1, tt, 0, &[0; 4096], false),
            Fes::PduSequenceError,
            0,
        ),
    ];
    for (pdu, fes, fei) in cases {
        let (mut q, ttag) = io_queue(&t);
        let (steps, replies) = q.send(&pdu(&q.host, ttag));
        fatal(&steps, &replies, fes, fei);
        // The queue's ID is free again.
        assert_eq!(t.io_queues(cntlid), 0);
    }
    // H2CData for a read: no R2T asked for it.
    let mut q = Conn::new(&t);
    q.io(cntlid, 1);
    q.send(&q.host.read(5, 1, 0, 1, 512));
    let (steps, replies) = q.send(&q.host.h2c_data(5, 0, 0, &[0; 512], true));
    fatal(&steps, &replies, Fes::InvalidHeaderField, 8);
}

#[test]
fn more_commands_than_the_queue_holds_is_fatal() {
    let t = target();
    let mut a = Conn::new(&t);
    let cntlid = a.admin(NQN, 0);
    let mut q = Conn::new(&t);
    q.init();
    assert_eq!(
        q.ask(&q.host.connect(1, 1, 3, 0, cntlid, NQN)).status(),
        Status::SUCCESS
    );
    for cid in 0..4 {
        let (steps, _) = q.send(&q.host.read(cid, 1, 0, 1, 512));
        assert!(matches!(steps[0], Step::Io(_)));
    }
    let (steps, replies) = q.send(&q.host.read(9, 1, 0, 1, 512));
    fatal(&steps, &replies, Fes::PduSequenceError, 0);
    let mut out = Vec::new();
    assert_eq!(
        q.s.complete(0, Status::SUCCESS, &mut out),
        Err(CompleteError::Closed)
    );
}

#[test]
fn a_host_termination_request_ends_the_session_quietly() {
    let t = target();
    let mut c = Conn::new(&t);
    c.admin(NQN, 0);
    let (steps, replies) = c.send(&c.host.term_req(Fes::HeaderDigestError));
    assert_eq!(steps, [Step::Close(Close::HostTerminated { fes: 3 })]);
    assert!(replies.is_empty());
    assert_eq!(t.controllers(), 0);
    // One whose length is out of bounds: closed without a word.
    let mut c = Conn::new(&t);
    c.init();
    let mut pdu = c.host.term_req(Fes::HeaderDigestError);
    pdu[4] = 200;
    let (steps, replies) = c.send(&pdu);
    assert!(matches!(steps[..], [Step::Close(Close::Protocol(_))]));
    assert!(replies.is_empty());
}

#[test]
fn digests_protect_headers_fatally_and_data_per_command() {
    let t = target();
    let digests = Digests {
        header: true,
        data: true,
    };
    let mut a = Conn::new(&t);
    a.host = Host::new(digests);
    let cntlid = a.admin(NQN, 0);
    let mut q = Conn::new(&t);
    q.host = Host::new(digests);
    assert_eq!(q.io(cntlid, 1), Status::SUCCESS);
    // Replies carry digests (the decoder of `send` checks them).
    let (steps, _) = q.send(&q.host.read(1, 1, 0, 1, 512));
    assert!(matches!(steps[0], Step::Io(_)));
    let mut out = Vec::new();
    q.s.complete_read(1, &[&[9; 512]], &mut out).unwrap();
    assert_eq!(q.decode(&out).len(), 2);
    // Bad in-capsule data: the command fails, the queue goes on.
    let mut pdu = q.host.write(2, 1, 0, &[1; 512], 512);
    let n = pdu.len();
    pdu[n - 10] ^= 1;
    assert_eq!(q.ask(&pdu).status(), Status::TRANSIENT_TRANSPORT_ERROR);
    // Bad solicited data: the write is aborted once its last piece is in.
    let (_, r) = q.send(&q.host.write_solicited(3, 1, 0, 2, 512));
    let [Reply::R2t(r)] = r[..] else { panic!() };
    let mut bad = q.host.h2c_data(3, r.ttag, 0, &[2; 512], false);
    let n = bad.len();
    bad[n - 5] ^= 1;
    let (steps, replies) = q.send(&bad);
    assert_eq!((steps[0].clone(), replies.len()), (Step::Handled, 0));
    let (steps, replies) = q.send(&q.host.h2c_data(3, r.ttag, 512, &[2; 512], true));
    assert_eq!(steps[0], Step::WriteAborted { cid: 3 });
    assert_eq!(replies[0].status(), Status::TRANSIENT_TRANSPORT_ERROR);
    assert_eq!((q.s.commands_inflight(), q.s.held_bytes()), (0, 0));
    // A bad header digest is fatal.
    let mut pdu = q.host.flush(4, 1);
    pdu[20] ^= 1;
    let (steps, replies) = q.send(&pdu);
    fatal(&steps, &replies, Fes::HeaderDigestError, 0);
}

#[test]
fn a_controller_reset_or_its_admin_queue_closing_ends_its_io_queues() {
    let t = target();
    let mut a = Conn::new(&t);
    let cntlid = a.admin(NQN, 0);
    let mut q = Conn::new(&t);
    q.io(cntlid, 1);
    assert_eq!(
        a.ask(&a.host.property_set(3, property::CC, 0)).status(),
        Status::SUCCESS
    );
    assert_eq!(q.s.poll(0), Some(Close::ControllerGone));
    assert_eq!(t.io_queues(cntlid), 0);
    // Enabled again, the same controller takes new I/O queues.
    assert_eq!(a.ask(&a.host.enable(4)).status(), Status::SUCCESS);
    let mut q = Conn::new(&t);
    assert_eq!(q.io(cntlid, 1), Status::SUCCESS);
    drop(a);
    assert_eq!(t.controllers(), 0);
    let (steps, _) = q.send(&q.host.flush(5, 1));
    assert_eq!(steps, [Step::Close(Close::ControllerGone)]);
}

#[test]
fn controllers_are_bounded_and_their_ids_reused() {
    let mut cfg = config();
    cfg.limits.controllers_max = 2;
    let t = Target::new(cfg).unwrap();
    let mut a = Conn::new(&t);
    let mut b = Conn::new(&t);
    assert_eq!((a.admin(NQN, 0), b.admin(DISCOVERY_NQN, 0)), (1, 2));
    let mut c = Conn::new(&t);
    c.init();
    let r = c.ask(&c.host.connect(1, 0, 31, 0, CNTLID_DYNAMIC, NQN));
    assert_eq!(r.status(), Status::CONNECT_CONTROLLER_BUSY);
    drop(a);
    let r = c.ask(&c.host.connect(2, 0, 31, 0, CNTLID_DYNAMIC, NQN));
    assert_eq!((r.status(), r.dw0()), (Status::SUCCESS, 1));
    // An admin Connect that names a controller is refused.
    let mut d = Conn::new(&t);
    d.init();
    let r = d.ask(&d.host.connect(1, 0, 31, 0, 1, NQN));
    assert_eq!(r.dw0(), connect_invalid_parameter_dw0(16, true));
}
