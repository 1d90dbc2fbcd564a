//! Codec tests: every PDU type round-trips under every framing, every prefix asks for the
//! rest, and every malformed header is refused with the error (and FES/FEI) it deserves.

use proptest::prelude::*;

use super::decode::*;
use super::encode::{self, Framing};
use super::pdu::*;
use crate::spec::{CompletionEntry, Status, SubmissionEntry};

const CAPSULE_MAX: u32 = 8192;
const DATA_MAX: u32 = 65536;

fn framings() -> Vec<Framing> {
    let mut v = Vec::new();
    for (header, data) in [(false, false), (true, false), (false, true), (true, true)] {
        for pda in [0u8, 1, 7, PDA_MAX] {
            v.push(Framing {
                digests: Digests { header, data },
                pda_bytes: pda_bytes(pda),
            });
        }
    }
    v
}

fn decoder(role: Role, f: &Framing) -> Decoder {
    Decoder {
        digests: f.digests,
        pda_bytes: f.pda_bytes,
        ..Decoder::new(role, CAPSULE_MAX, DATA_MAX)
    }
}

fn decode_whole<'a>(d: &Decoder, wire: &'a [u8]) -> Decoded<'a> {
    // Every proper prefix asks for exactly what is missing, or at least the common header.
    for cut in 0..wire.len() {
        match d.decode(&wire[..cut]) {
            Ok(Decode::NeedMore(n)) => {
                if cut >= COMMON_HEADER_BYTES {
                    assert_eq!(n, wire.len() - cut, "prefix of {cut}");
                } else {
                    assert_eq!(n, COMMON_HEADER_BYTES - cut);
                }
            }
            other => panic!("prefix of {cut} of {}: {other:?}", wire.len()),
        }
    }
    // Trailing bytes of the next PDU are not touched.
    let mut longer = wire.to_vec();
    longer.extend_from_slice(&[0xee; 9]);
    let Ok(Decode::Pdu(p)) = d.decode(&longer) else {
        panic!("{:?}", d.decode(&longer))
    };
    assert_eq!(p.len, wire.len());
    let Ok(Decode::Pdu(p)) = d.decode(wire) else {
        unreachable!()
    };
    assert!(p.data_digest_ok);
    p
}

fn sqe(cid: u16) -> SubmissionEntry {
    SubmissionEntry {
        opcode: 0x01,
        flags: 0x40,
        cid,
        nsid: 1,
        cdw10: 8,
        cdw12: 7,
        ..Default::default()
    }
}

#[test]
fn every_pdu_round_trips_under_every_framing() {
    let data: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
    for f in framings() {
        let ctrl = decoder(Role::Controller, &f);
        let host = decoder(Role::Host, &f);

        // IC PDUs carry no digests whatever was negotiated.
        let req = IcReq {
            pfv: 0,
            hpda: 3,
            digests: Digests {
                header: true,
                data: false,
            },
            maxr2t: 5,
        };
        let mut w = Vec::new();
        encode::ic_req(&mut w, &req);
        assert_eq!(w.len(), IC_PDU_BYTES);
        assert_eq!(decode_whole(&ctrl, &w).pdu, Pdu::IcReq(req));
        let resp = IcResp {
            pfv: 0,
            cpda: 0,
            digests: Digests::default(),
            maxh2cdata: 131072,
        };
        let mut w = Vec::new();
        encode::ic_resp(&mut w, &resp);
        assert_eq!(decode_whole(&host, &w).pdu, Pdu::IcResp(resp));

        for payload in [&[][..], &data[..1], &data[..]] {
            let mut w = Vec::new();
            encode::capsule_cmd(&mut w, &f, &sqe(9), payload);
            let p = decode_whole(&ctrl, &w);
            assert_eq!(p.pdu, Pdu::CapsuleCmd(sqe(9)));
            assert_eq!(&w[p.data.clone()], payload);
            if !payload.is_empty() {
                assert_eq!(p.data.start % f.pda_bytes, 0, "data aligned as asked");
            }
        }

        let cqe = CompletionEntry {
            dw0: 0x1234,
            cid: 9,
            sq_head: 2,
            status_phase: CompletionEntry::pack_status(Status::INVALID_FIELD, false),
            ..Default::default()
        };
        let mut w = Vec::new();
        encode::capsule_resp(&mut w, &f, &cqe);
        assert_eq!(decode_whole(&host, &w).pdu, Pdu::CapsuleResp(cqe));

        let r = R2t {
            cccid: 9,
            ttag: 3,
            r2to: 4096,
            r2tl: 8192,
        };
        let mut w = Vec::new();
        encode::r2t(&mut w, &f, &r);
        assert_eq!(decode_whole(&host, &w).pdu, Pdu::R2T(r));

        for (ty, d, success) in [
            (PduType::H2CData, &ctrl, false),
            (PduType::C2HData, &host, false),
            (PduType::C2HData, &host, true),
        ] {
            let h = DataHeader {
                cccid: 9,
                ttag: if ty == PduType::H2CData { 3 } else { 0 },
                datao: 512,
                datal: data.len() as u32,
                last: true,
                success,
            };
            let mut w = Vec::new();
            encode::data_pdu(&mut w, &f, ty, &h, &data);
            let p = decode_whole(d, &w);
            let expect = if ty == PduType::H2CData {
                Pdu::H2CData(h)
            } else {
                Pdu::C2HData(h)
            };
            assert_eq!(p.pdu, expect);
            assert_eq!(&w[p.data.clone()], &data[..]);
            assert_eq!(
                w.len(),
                data.len() + f.data_pdu_overhead_bytes(),
                "the overhead the framing announces"
            );
        }

        let mut w = Vec::new();
        encode::term_req(
            &mut w,
            PduType::C2HTermReq,
            Fes::PduSequenceError,
            0,
            &[1; 200],
        );
        assert_eq!(
            w.len(),
            TERM_REQ_HEADER_BYTES + TERM_REQ_ERROR_DATA_BYTES_MAX
        );
        let Pdu::C2HTermReq(t) = decode_whole(&host, &w).pdu else {
            panic!()
        };
        assert_eq!((t.fes, t.fei, t.error_data), (2, 0, &[1u8; 128][..]));
    }
}

/// A valid H2CData PDU of `n` data bytes under `f`, to break.
fn h2c(f: &Framing, n: usize) -> Vec<u8> {
    let mut w = Vec::new();
    let h = DataHeader {
        cccid: 1,
        ttag: 1,
        datao: 0,
        datal: n as u32,
        last: true,
        success: false,
    };
    encode::data_pdu(&mut w, f, PduType::H2CData, &h, &vec![0x11; n]);
    w
}

fn err(d: &Decoder, w: &[u8]) -> PduError {
    match d.decode(w) {
        Err(e) => e,
        other => panic!("{other:?}"),
    }
}

#[test]
fn malformed_common_headers_name_the_lowest_faulty_field() {
    let plain = Framing::default();
    let digests = Framing {
        digests: Digests {
            header: true,
            data: true,
        },
        ..plain
    };
    let d = decoder(Role::Controller, &plain);
    let dd = decoder(Role::Controller, &digests);
    let good = h2c(&plain, 16);

    // Type: unknown, or one a controller never receives.
    for t in [
        0x08,
        0x0a,
        0xff,
        PduType::C2HData as u8,
        PduType::IcResp as u8,
    ] {
        let mut w = good.clone();
        w[0] = t;
        let e = err(&d, &w);
        assert_eq!(
            (e, e.fes(), e.fei()),
            (PduError::Type(t), Some(Fes::InvalidHeaderField), 0)
        );
    }
    // Flags: unknown bits, SUCCESS on H2CData, digest flags not negotiated or missing.
    for (dec, wire, flags) in [
        (&d, &good, 0x10),
        (&d, &good, flags::SUCCESS | flags::LAST_PDU),
        (&d, &good, flags::HDGSTF),
        (&d, &good, flags::DDGSTF),
        (&dd, &h2c(&digests, 16), flags::DDGSTF | flags::LAST_PDU),
    ] {
        let mut w = wire.clone();
        w[1] = flags;
        let e = err(dec, &w);
        assert!(matches!(e, PduError::Flags { .. }), "{flags:#x}: {e:?}");
        assert_eq!((e.fes(), e.fei()), (Some(Fes::InvalidHeaderField), 1));
    }
    // Data without its digest where data digests were negotiated.
    let headers_only = Framing {
        digests: Digests {
            header: true,
            data: false,
        },
        ..plain
    };
    let e = err(&dd, &h2c(&headers_only, 16));
    assert!(matches!(e, PduError::Flags { .. }), "{e:?}");
    // Header length.
    let mut w = good.clone();
    w[2] = 28;
    let e = err(&d, &w);
    assert_eq!((e.fes(), e.fei()), (Some(Fes::InvalidHeaderField), 2));
    // Data offset: inside the header, misaligned, past the end, or zero with data.
    for pdo in [0u8, 20, 26, 255] {
        let mut w = good.clone();
        w[3] = pdo;
        let e = err(&d, &w);
        assert!(matches!(e, PduError::DataOffset { .. }), "pdo {pdo}: {e:?}");
        assert_eq!(e.fei(), 3);
    }
    let aligned = decoder(
        Role::Controller,
        &Framing {
            pda_bytes: pda_bytes(7),
            ..plain
        },
    );
    assert!(matches!(err(&aligned, &good), PduError::DataOffset { .. }));
    // Length: shorter than the header, or a data digest with no room for data.
    let mut w = good.clone();
    w[4..8].copy_from_slice(&20u32.to_le_bytes());
    let e = err(&d, &w);
    assert_eq!((e.fes(), e.fei()), (Some(Fes::InvalidHeaderField), 4));
    let mut w = h2c(&digests, 16);
    let pdo = u32::from(w[3]);
    w[4..8].copy_from_slice(&(pdo + 4).to_le_bytes());
    assert!(matches!(err(&dd, &w), PduError::Length { .. }));
    // A response capsule (host side) of the wrong length.
    let host = decoder(Role::Host, &plain);
    let mut w = Vec::new();
    encode::capsule_resp(&mut w, &plain, &CompletionEntry::default());
    w[4] = 40;
    assert!(matches!(err(&host, &w), PduError::Length { .. }));
    w[4] = 24;
    w[3] = 24;
    assert!(matches!(err(&host, &w), PduError::DataOffset { .. }));
}

#[test]
fn oversized_pdus_are_refused_from_their_header_alone() {
    let d = decoder(Role::Controller, &Framing::default());
    // An H2CData one byte over MAXH2CDATA: Data Transfer Limit Exceeded.
    let w = h2c(&Framing::default(), DATA_MAX as usize + 1);
    let e = err(&d, &w[..COMMON_HEADER_BYTES]);
    assert_eq!(
        e,
        PduError::TooLong {
            pdu_type: PduType::H2CData,
            data_bytes: DATA_MAX + 1,
            max: DATA_MAX
        }
    );
    assert_eq!((e.fes(), e.fei()), (Some(Fes::DataLimitExceeded), 0));
    // A capsule over the in-capsule limit: its length field is at fault.
    let mut w = Vec::new();
    encode::capsule_cmd(
        &mut w,
        &Framing::default(),
        &sqe(1),
        &[0; CAPSULE_MAX as usize + 4],
    );
    let e = err(&d, &w[..COMMON_HEADER_BYTES]);
    assert!(matches!(e, PduError::TooLong { .. }));
    assert_eq!((e.fes(), e.fei()), (Some(Fes::InvalidHeaderField), 4));
    // A plen of 4 GiB is refused, not waited for.
    let mut w = h2c(&Framing::default(), 16);
    w[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        err(&d, &w[..COMMON_HEADER_BYTES]),
        PduError::TooLong { .. }
    ));
    // Exactly at the limit is fine, and fits the buffer the decoder asks for.
    let w = h2c(&Framing::default(), DATA_MAX as usize);
    assert!(matches!(d.decode(&w), Ok(Decode::Pdu(_))));
    assert!(w.len() <= d.pdu_bytes_max());
}

#[test]
fn termination_requests_of_bad_length_close_without_an_answer() {
    let d = decoder(Role::Controller, &Framing::default());
    for plen in [8u32, 23, 153, 1 << 20] {
        let mut w = Vec::new();
        encode::term_req(&mut w, PduType::H2CTermReq, Fes::InvalidHeaderField, 0, &[]);
        w[4..8].copy_from_slice(&plen.to_le_bytes());
        let e = err(&d, &w);
        assert_eq!(e, PduError::TermReqLength { plen });
        assert_eq!(e.fes(), None);
    }
    // With digests negotiated, a termination request still carries none.
    let mut w = Vec::new();
    encode::term_req(
        &mut w,
        PduType::H2CTermReq,
        Fes::PduSequenceError,
        0,
        &[5; 8],
    );
    w[1] = flags::HDGSTF;
    let dd = decoder(
        Role::Controller,
        &Framing {
            digests: Digests {
                header: true,
                data: true,
            },
            ..Framing::default()
        },
    );
    assert!(matches!(err(&dd, &w), PduError::Flags { .. }));
}

#[test]
fn digests_are_checked() {
    let f = Framing {
        digests: Digests {
            header: true,
            data: true,
        },
        ..Framing::default()
    };
    let d = decoder(Role::Controller, &f);
    let good = h2c(&f, 64);
    // A flipped header bit: a header digest error, fatal.
    let mut w = good.clone();
    w[12] ^= 1;
    let e = err(&d, &w);
    assert!(matches!(e, PduError::HeaderDigest { .. }));
    assert_eq!(e.fes(), Some(Fes::HeaderDigestError));
    // A flipped digest bit: the same.
    let mut w = good.clone();
    w[DATA_HEADER_BYTES] ^= 0x80;
    assert!(matches!(err(&d, &w), PduError::HeaderDigest { .. }));
    // A flipped data bit: the PDU decodes, its data marked bad.
    let mut w = good.clone();
    let last = w.len() - 5;
    w[last] ^= 1;
    let Ok(Decode::Pdu(p)) = d.decode(&w) else {
        panic!()
    };
    assert!(!p.data_digest_ok);
}

#[test]
fn type_specific_fields_are_checked() {
    let d = decoder(Role::Controller, &Framing::default());
    let ic = |mutate: &dyn Fn(&mut Vec<u8>)| {
        let mut w = Vec::new();
        let r = IcReq {
            pfv: 0,
            hpda: 0,
            digests: Digests::default(),
            maxr2t: 0,
        };
        encode::ic_req(&mut w, &r);
        mutate(&mut w);
        err(&d, &w)
    };
    let e = ic(&|w| w[8] = 1);
    assert_eq!((e.fes(), e.fei()), (Some(Fes::UnsupportedParameter), 8));
    let e = ic(&|w| w[10] = 32);
    assert_eq!((e.fes(), e.fei()), (Some(Fes::InvalidHeaderField), 10));
    let e = ic(&|w| w[11] = 4);
    assert_eq!((e.fes(), e.fei()), (Some(Fes::InvalidHeaderField), 11));
    let e = ic(&|w| w[1] = flags::HDGSTF);
    assert_eq!(e.fei(), 1, "no digests on ICReq");
    let e = ic(&|w| w[4] = 132);
    assert_eq!(e.fei(), 4);

    // DATAL that disagrees with the PDU's data.
    let mut w = h2c(&Framing::default(), 16);
    w[16] = 17;
    let e = err(&d, &w);
    assert_eq!((e.fes(), e.fei()), (Some(Fes::InvalidHeaderField), 16));

    // ICResp with a MAXH2CDATA below the minimum, and an R2T of no length (host side).
    let host = decoder(Role::Host, &Framing::default());
    let mut w = Vec::new();
    let r = IcResp {
        pfv: 0,
        cpda: 0,
        digests: Digests::default(),
        maxh2cdata: 4092,
    };
    encode::ic_resp(&mut w, &r);
    assert_eq!(err(&host, &w).fei(), 12);
    let mut w = Vec::new();
    let r = R2t {
        cccid: 1,
        ttag: 1,
        r2to: 0,
        r2tl: 0,
    };
    encode::r2t(&mut w, &Framing::default(), &r);
    assert_eq!(err(&host, &w).fei(), 16);
}

proptest! {
    /// Whatever the bytes, the decoder answers without panicking, never asks for more than
    /// its bound, and a PDU it returns lies within the input.
    #[test]
    fn random_bytes_decode_or_fail_cleanly(
        bytes in prop::collection::vec(any::<u8>(), 0..600),
        header in any::<bool>(),
        data in any::<bool>(),
        host in any::<bool>(),
    ) {
        let f = Framing { digests: Digests { header, data }, ..Framing::default() };
        let d = decoder(if host { Role::Host } else { Role::Controller }, &f);
        match d.decode(&bytes) {
            Ok(Decode::NeedMore(n)) => prop_assert!(bytes.len() + n <= d.pdu_bytes_max()),
            Ok(Decode::Pdu(p)) => {
                prop_assert!(p.len <= bytes.len());
                prop_assert!(p.data.end <= p.len);
            }
            Err(_) => {}
        }
    }
}
