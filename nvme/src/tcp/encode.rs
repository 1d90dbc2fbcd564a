//! The PDU encoder: appends whole PDUs to an output buffer, with the digests and data
//! alignment negotiated for the connection. A data PDU's header can also be framed alone
//! ([`data_pdu_head`]) for a sender that sends the data from its own buffers.

use super::digest;
use super::pdu::*;
use crate::spec::{CompletionEntry, SubmissionEntry};

/// How this end frames what it sends: the digests in force and the data alignment the
/// receiving end asked for (HPDA for a controller's PDUs, CPDA for a host's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Framing {
    pub digests: Digests,
    pub pda_bytes: usize,
}

impl Default for Framing {
    /// Before the IC exchange: no digests, no alignment.
    fn default() -> Framing {
        Framing {
            digests: Digests::default(),
            pda_bytes: pda_bytes(0),
        }
    }
}

impl Framing {
    fn header_digest_bytes(&self) -> usize {
        if self.digests.header {
            DIGEST_BYTES
        } else {
            0
        }
    }

    /// Where data starts in a PDU with a header of `hlen` bytes: after the header digest,
    /// padded to the receiver's alignment.
    pub fn data_offset(&self, hlen: usize) -> usize {
        (hlen + self.header_digest_bytes()).next_multiple_of(self.pda_bytes)
    }

    /// Bytes a data PDU (H2CData, C2HData) adds around `data_bytes` of data.
    pub fn data_pdu_overhead_bytes(&self) -> usize {
        self.data_offset(DATA_HEADER_BYTES) + if self.digests.data { DIGEST_BYTES } else { 0 }
    }

    fn digest_flags(&self, pdu_type: PduType, has_data: bool) -> u8 {
        let allowed = pdu_type.flags_allowed();
        let mut f = 0;
        if self.digests.header {
            f |= flags::HDGSTF;
        }
        if self.digests.data && has_data {
            f |= flags::DDGSTF;
        }
        f & allowed
    }
}

/// Starts a header of `hlen` bytes: the common header, then zeroes for the type's fields.
/// Returns where it starts.
fn begin(out: &mut Vec<u8>, ch: CommonHeader) -> usize {
    let start = out.len();
    out.extend_from_slice(&ch.to_bytes());
    out.resize(start + usize::from(ch.hlen), 0);
    start
}

/// Ends a header begun at `start`: its digest if the flags say so, then padding to PDO.
fn end_header(out: &mut Vec<u8>, start: usize) {
    let ch = CommonHeader::parse(&out[start..]);
    let hlen = usize::from(ch.hlen);
    if ch.flags & flags::HDGSTF != 0 {
        let d = digest::crc32c(&out[start..start + hlen]);
        out.extend_from_slice(&d.to_le_bytes());
    }
    if ch.pdo != 0 {
        out.resize(start + usize::from(ch.pdo), 0);
    }
}

/// Appends a 24-byte header built whole on the stack (the common header's flags say
/// whether a header digest follows), then padding to `pdo` when it is past the header: the
/// per-I/O PDUs (responses, data headers) take this path, one copy each.
fn push_short_header(out: &mut Vec<u8>, h: &[u8; 24], pdo: usize) {
    let start = out.len();
    out.extend_from_slice(h);
    if h[1] & flags::HDGSTF != 0 {
        out.extend_from_slice(&digest::crc32c(h).to_le_bytes());
    }
    if pdo > out.len() - start {
        out.resize(start + pdo, 0);
    }
}

fn put_u16(out: &mut [u8], at: usize, v: u16) {
    out[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put_u32(out: &mut [u8], at: usize, v: u32) {
    out[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn ic(out: &mut Vec<u8>, pdu_type: PduType, pfv: u16, pda: u8, dgst: Digests, word: u32) {
    let start = begin(
        out,
        CommonHeader {
            pdu_type: pdu_type as u8,
            flags: 0,
            hlen: IC_PDU_BYTES as u8,
            pdo: 0,
            plen: IC_PDU_BYTES as u32,
        },
    );
    let h = &mut out[start..];
    put_u16(h, 8, pfv);
    h[10] = pda;
    h[11] = dgst.to_byte();
    put_u32(h, 12, word);
}

pub fn ic_req(out: &mut Vec<u8>, r: &IcReq) {
    ic(out, PduType::IcReq, r.pfv, r.hpda, r.digests, r.maxr2t);
}

pub fn ic_resp(out: &mut Vec<u8>, r: &IcResp) {
    ic(out, PduType::IcResp, r.pfv, r.cpda, r.digests, r.maxh2cdata);
}

/// A termination request (`pdu_type` says which way); `error_data` is cut to what the
/// specification allows.
pub fn term_req(out: &mut Vec<u8>, pdu_type: PduType, fes: Fes, fei: u32, error_data: &[u8]) {
    debug_assert!(matches!(
        pdu_type,
        PduType::H2CTermReq | PduType::C2HTermReq
    ));
    let error_data = &error_data[..error_data.len().min(TERM_REQ_ERROR_DATA_BYTES_MAX)];
    let start = begin(
        out,
        CommonHeader {
            pdu_type: pdu_type as u8,
            flags: 0,
            hlen: TERM_REQ_HEADER_BYTES as u8,
            pdo: 0,
            plen: (TERM_REQ_HEADER_BYTES + error_data.len()) as u32,
        },
    );
    let h = &mut out[start..];
    put_u16(h, 8, fes as u16);
    put_u32(h, 10, fei);
    out.extend_from_slice(error_data);
}

/// A command capsule with its in-capsule data (none for an empty slice).
pub fn capsule_cmd(out: &mut Vec<u8>, framing: &Framing, sqe: &SubmissionEntry, data: &[u8]) {
    let has_data = !data.is_empty();
    let hlen = CAPSULE_CMD_HEADER_BYTES;
    let (pdo, plen) = if has_data {
        let pdo = framing.data_offset(hlen);
        let ddgst = if framing.digests.data {
            DIGEST_BYTES
        } else {
            0
        };
        (pdo, pdo + data.len() + ddgst)
    } else {
        (0, hlen + framing.header_digest_bytes())
    };
    let start = begin(
        out,
        CommonHeader {
            pdu_type: PduType::CapsuleCmd as u8,
            flags: framing.digest_flags(PduType::CapsuleCmd, has_data),
            hlen: hlen as u8,
            pdo: pdo as u8,
            plen: plen as u32,
        },
    );
    out[start + 8..start + 72].copy_from_slice(&sqe.to_le_bytes());
    end_header(out, start);
    if has_data {
        out.extend_from_slice(data);
        if framing.digests.data {
            out.extend_from_slice(&digest::crc32c(data).to_le_bytes());
        }
    }
    debug_assert_eq!(out.len() - start, plen);
}

/// A response capsule.
pub fn capsule_resp(out: &mut Vec<u8>, framing: &Framing, cqe: &CompletionEntry) {
    let hlen = CAPSULE_RESP_HEADER_BYTES;
    let mut h = [0u8; CAPSULE_RESP_HEADER_BYTES];
    h[..COMMON_HEADER_BYTES].copy_from_slice(
        &CommonHeader {
            pdu_type: PduType::CapsuleResp as u8,
            flags: framing.digest_flags(PduType::CapsuleResp, false),
            hlen: hlen as u8,
            pdo: 0,
            plen: (hlen + framing.header_digest_bytes()) as u32,
        }
        .to_bytes(),
    );
    h[8..24].copy_from_slice(&cqe.to_le_bytes());
    push_short_header(out, &h, 0);
}

/// An R2T.
pub fn r2t(out: &mut Vec<u8>, framing: &Framing, r: &R2t) {
    let hlen = R2T_HEADER_BYTES;
    let start = begin(
        out,
        CommonHeader {
            pdu_type: PduType::R2T as u8,
            flags: framing.digest_flags(PduType::R2T, false),
            hlen: hlen as u8,
            pdo: 0,
            plen: (hlen + framing.header_digest_bytes()) as u32,
        },
    );
    let h = &mut out[start..];
    put_u16(h, 8, r.cccid);
    put_u16(h, 10, r.ttag);
    put_u32(h, 12, r.r2to);
    put_u32(h, 16, r.r2tl);
    end_header(out, start);
}

/// The header of a data PDU (`pdu_type` H2CData or C2HData) for `h.datal` bytes of data:
/// the common header, the fields, the header digest and the padding. The sender follows it
/// with exactly `h.datal` bytes of data and, where data digests are on, their digest
/// ([`digest::crc32c_pieces`], little-endian).
pub fn data_pdu_head(out: &mut Vec<u8>, framing: &Framing, pdu_type: PduType, h: &DataHeader) {
    debug_assert!(matches!(pdu_type, PduType::H2CData | PduType::C2HData));
    debug_assert!(h.datal > 0, "a data PDU carries data");
    let hlen = DATA_HEADER_BYTES;
    let pdo = framing.data_offset(hlen);
    let ddgst = if framing.digests.data {
        DIGEST_BYTES
    } else {
        0
    };
    let mut f = framing.digest_flags(pdu_type, true);
    if h.last {
        f |= flags::LAST_PDU;
    }
    if h.success && pdu_type == PduType::C2HData {
        f |= flags::SUCCESS;
    }
    let mut b = [0u8; DATA_HEADER_BYTES];
    b[..COMMON_HEADER_BYTES].copy_from_slice(
        &CommonHeader {
            pdu_type: pdu_type as u8,
            flags: f,
            hlen: hlen as u8,
            pdo: pdo as u8,
            plen: (pdo + h.datal as usize + ddgst) as u32,
        }
        .to_bytes(),
    );
    put_u16(&mut b, 8, h.cccid);
    if pdu_type == PduType::H2CData {
        put_u16(&mut b, 10, h.ttag);
    }
    put_u32(&mut b, 12, h.datao);
    put_u32(&mut b, 16, h.datal);
    push_short_header(out, &b, pdo);
}

/// A whole data PDU: its header, `data` (exactly `h.datal` bytes) and the data digest.
pub fn data_pdu(
    out: &mut Vec<u8>,
    framing: &Framing,
    pdu_type: PduType,
    h: &DataHeader,
    data: &[u8],
) {
    assert_eq!(
        data.len(),
        h.datal as usize,
        "DATAL says how much data follows"
    );
    data_pdu_head(out, framing, pdu_type, h);
    out.extend_from_slice(data);
    if framing.digests.data {
        out.extend_from_slice(&digest::crc32c(data).to_le_bytes());
    }
}
