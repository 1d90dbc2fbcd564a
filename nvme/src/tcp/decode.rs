//! The PDU decoder: finds one whole PDU at the front of a byte stream, or says how many more
//! bytes it needs, or says what is wrong with it in a typed error that names the
//! termination request's FES and FEI the specification prescribes.
//!
//! It keeps no state between calls: the caller keeps the bytes it has not consumed and calls
//! again after the next read, so any chunking of the stream decodes alike. The common header
//! is checked as soon as its 8 bytes are in, before any more is buffered: a PDU longer than
//! the configured bounds is refused from its header alone. Header fields are checked in the
//! order they lie in the header, so the lowest faulty field is the one reported.

use std::ops::Range;

use thiserror::Error;

use super::digest;
use super::pdu::*;
use crate::spec::{CompletionEntry, SubmissionEntry};

/// Which end is receiving: a controller receives host-to-controller PDUs, a host the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Controller,
    Host,
}

/// What the receiving end accepts: the digests and data alignment negotiated for the
/// connection, and the bounds on data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decoder {
    pub role: Role,
    /// Digests in force: none until the ICReq/ICResp exchange.
    pub digests: Digests,
    /// The data alignment this end asked for (CPDA for a controller, HPDA for a host), in
    /// bytes: [`pda_bytes`] of it.
    pub pda_bytes: usize,
    /// Most in-capsule data in a command capsule.
    pub capsule_data_bytes_max: u32,
    /// Most data in one H2CData (MAXH2CDATA) or C2HData PDU.
    pub data_pdu_bytes_max: u32,
}

/// The outcome of [`Decoder::decode`] when nothing is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decode<'a> {
    /// At least this many more bytes are needed before anything can be said.
    NeedMore(usize),
    Pdu(Decoded<'a>),
}

/// What is wrong with a PDU. Each maps to the termination request the receiver sends
/// ([`PduError::fes`], [`PduError::fei`]) before it closes the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum PduError {
    #[error("PDU type {0:#04x} is unknown or does not travel to this end")]
    Type(u8),
    #[error("flags {flags:#04x} are invalid on {pdu_type:?} (digests negotiated or not)")]
    Flags { pdu_type: PduType, flags: u8 },
    #[error("{pdu_type:?} with header length {hlen}, expected {expected}")]
    HeaderLength {
        pdu_type: PduType,
        hlen: u8,
        expected: u8,
    },
    #[error("{pdu_type:?} of {plen} bytes with data offset {pdo}")]
    DataOffset {
        pdu_type: PduType,
        pdo: u8,
        plen: u32,
    },
    #[error("{pdu_type:?} with PDU length {plen}")]
    Length { pdu_type: PduType, plen: u32 },
    #[error("{pdu_type:?} carries {data_bytes} data bytes, more than the {max} allowed")]
    TooLong {
        pdu_type: PduType,
        data_bytes: u32,
        max: u32,
    },
    /// A termination request whose length is out of bounds: the connection is closed
    /// without an answer.
    #[error("termination request of {plen} bytes")]
    TermReqLength { plen: u32 },
    #[error("header digest {received:#010x}, computed {computed:#010x}")]
    HeaderDigest { received: u32, computed: u32 },
    #[error("{what} (header byte {offset}) is invalid")]
    Field { offset: u32, what: &'static str },
    #[error("{what} (header byte {offset}) is not supported")]
    Unsupported { offset: u32, what: &'static str },
}

impl PduError {
    /// The fatal error status to send, or `None` where the specification says to close
    /// without a termination request.
    pub fn fes(&self) -> Option<Fes> {
        Some(match self {
            PduError::TermReqLength { .. } => return None,
            PduError::HeaderDigest { .. } => Fes::HeaderDigestError,
            PduError::TooLong {
                pdu_type: PduType::H2CData,
                ..
            } => Fes::DataLimitExceeded,
            PduError::Unsupported { .. } => Fes::UnsupportedParameter,
            _ => Fes::InvalidHeaderField,
        })
    }

    /// Whether the error was found in the common header alone (before the rest of the PDU
    /// arrived): a termination request then echoes those 8 bytes, so what it says does not
    /// depend on how the stream was cut.
    pub fn in_common_header(&self) -> bool {
        !matches!(
            self,
            PduError::HeaderDigest { .. } | PduError::Field { .. } | PduError::Unsupported { .. }
        )
    }

    /// The fatal error information: the faulty field's offset for FES 1 and 6, else 0.
    pub fn fei(&self) -> u32 {
        match self {
            PduError::Type(_) => field::PDU_TYPE,
            PduError::Flags { .. } => field::FLAGS,
            PduError::HeaderLength { .. } => field::HLEN,
            PduError::DataOffset { .. } => field::PDO,
            PduError::Length { .. } => field::PLEN,
            PduError::TooLong { pdu_type, .. } if *pdu_type != PduType::H2CData => field::PLEN,
            PduError::Field { offset, .. } | PduError::Unsupported { offset, .. } => *offset,
            _ => 0,
        }
    }
}

/// Where a PDU's parts lie, from its common header.
struct Layout {
    pdu_type: PduType,
    plen: usize,
    /// Header length with its digest.
    header_bytes: usize,
    data: Range<usize>,
    data_digest: bool,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

impl Decoder {
    /// A decoder for a connection's first PDU: no digests, no alignment.
    pub fn new(role: Role, capsule_data_bytes_max: u32, data_pdu_bytes_max: u32) -> Decoder {
        Decoder {
            role,
            digests: Digests::default(),
            pda_bytes: pda_bytes(0),
            capsule_data_bytes_max,
            data_pdu_bytes_max,
        }
    }

    /// The longest PDU this decoder accepts: a caller's input buffer must hold one.
    pub fn pdu_bytes_max(&self) -> usize {
        let data = self.capsule_data_bytes_max.max(self.data_pdu_bytes_max) as usize;
        // The data offset is one byte, and a data digest may follow the data.
        let data_pdu = usize::from(u8::MAX) + data + DIGEST_BYTES;
        data_pdu
            .max(IC_PDU_BYTES)
            .max(TERM_REQ_HEADER_BYTES + TERM_REQ_ERROR_DATA_BYTES_MAX)
    }

    /// Decodes the PDU at the front of `input`, if it is all there.
    pub fn decode<'a>(&self, input: &'a [u8]) -> Result<Decode<'a>, PduError> {
        if input.len() < COMMON_HEADER_BYTES {
            return Ok(Decode::NeedMore(COMMON_HEADER_BYTES - input.len()));
        }
        let layout = self.layout(CommonHeader::parse(input))?;
        debug_assert!(layout.plen <= self.pdu_bytes_max());
        if input.len() < layout.plen {
            return Ok(Decode::NeedMore(layout.plen - input.len()));
        }
        let b = &input[..layout.plen];
        let hlen = layout.pdu_type.header_bytes();
        if layout.header_bytes > hlen {
            let received = u32_at(b, hlen);
            let computed = digest::crc32c(&b[..hlen]);
            if received != computed {
                return Err(PduError::HeaderDigest { received, computed });
            }
        }
        let pdu = self.fields(layout.pdu_type, b, &layout)?;
        let data = layout.data.clone();
        let data_digest_ok =
            !layout.data_digest || digest::matches(&b[data.clone()], &b[data.end..data.end + 4]);
        Ok(Decode::Pdu(Decoded {
            len: layout.plen,
            pdu,
            data,
            data_digest_ok,
        }))
    }

    /// Checks the common header and finds the PDU's parts.
    fn layout(&self, ch: CommonHeader) -> Result<Layout, PduError> {
        let pdu_type = match PduType::from_u8(ch.pdu_type) {
            Some(t) if t.host_to_controller() == (self.role == Role::Controller) => t,
            _ => return Err(PduError::Type(ch.pdu_type)),
        };
        let flags = ch.flags;
        let bad_flags = PduError::Flags { pdu_type, flags };
        let allowed = pdu_type.flags_allowed();
        if flags & !allowed != 0 {
            return Err(bad_flags);
        }
        let header_digest = flags & flags::HDGSTF != 0;
        let data_digest = flags & flags::DDGSTF != 0;
        if allowed & flags::HDGSTF != 0 && header_digest != self.digests.header {
            return Err(bad_flags);
        }
        if data_digest && !self.digests.data {
            return Err(bad_flags);
        }
        if flags & (flags::SUCCESS | flags::LAST_PDU) == flags::SUCCESS {
            return Err(bad_flags);
        }
        let hlen = pdu_type.header_bytes();
        if usize::from(ch.hlen) != hlen {
            return Err(PduError::HeaderLength {
                pdu_type,
                hlen: ch.hlen,
                expected: hlen as u8,
            });
        }
        let header_bytes = hlen + if header_digest { DIGEST_BYTES } else { 0 };
        let (pdo, plen) = (usize::from(ch.pdo), ch.plen as usize);
        let bad_pdo = PduError::DataOffset {
            pdu_type,
            pdo: ch.pdo,
            plen: ch.plen,
        };
        let bad_plen = PduError::Length {
            pdu_type,
            plen: ch.plen,
        };
        if !pdu_type.carries_data() {
            if pdo != 0 {
                return Err(bad_pdo);
            }
            let fits = match pdu_type {
                PduType::H2CTermReq | PduType::C2HTermReq => {
                    if !(hlen..=hlen + TERM_REQ_ERROR_DATA_BYTES_MAX).contains(&plen) {
                        return Err(PduError::TermReqLength { plen: ch.plen });
                    }
                    true
                }
                _ => plen == header_bytes,
            };
            if !fits {
                return Err(bad_plen);
            }
            // A termination request's "data" is its error data, which has no digest.
            let data = header_bytes..plen;
            return Ok(Layout {
                pdu_type,
                plen,
                header_bytes,
                data,
                data_digest: false,
            });
        }
        if plen < header_bytes {
            return Err(bad_plen);
        }
        if plen == header_bytes {
            // No data: the data offset is 0 (or points at the end) and no data digest.
            if pdo != 0 && pdo != header_bytes {
                return Err(bad_pdo);
            }
            if data_digest {
                return Err(bad_plen);
            }
            return Ok(Layout {
                pdu_type,
                plen,
                header_bytes,
                data: plen..plen,
                data_digest: false,
            });
        }
        if pdo < header_bytes || pdo >= plen || pdo % self.pda_bytes != 0 {
            return Err(bad_pdo);
        }
        let digest_bytes = if data_digest { DIGEST_BYTES } else { 0 };
        if plen - pdo <= digest_bytes {
            return Err(bad_plen);
        }
        if self.digests.data && !data_digest {
            // Data travels without the digest the connection negotiated.
            return Err(bad_flags);
        }
        let data_bytes = plen - pdo - digest_bytes;
        let max = match pdu_type {
            PduType::CapsuleCmd => self.capsule_data_bytes_max,
            _ => self.data_pdu_bytes_max,
        };
        if data_bytes > max as usize {
            return Err(PduError::TooLong {
                pdu_type,
                data_bytes: u32::try_from(data_bytes).unwrap_or(u32::MAX),
                max,
            });
        }
        Ok(Layout {
            pdu_type,
            plen,
            header_bytes,
            data: pdo..pdo + data_bytes,
            data_digest,
        })
    }

    /// Reads and checks the type's own header fields.
    fn fields<'a>(
        &self,
        pdu_type: PduType,
        b: &'a [u8],
        layout: &Layout,
    ) -> Result<Pdu<'a>, PduError> {
        let data_bytes = layout.data.len() as u32;
        Ok(match pdu_type {
            PduType::IcReq | PduType::IcResp => {
                let pfv = u16_at(b, 8);
                if pfv != PFV_1_0 {
                    return Err(PduError::Unsupported {
                        offset: field::PFV,
                        what: "PDU format version",
                    });
                }
                let pda = b[10];
                if pda > PDA_MAX {
                    return Err(PduError::Field {
                        offset: field::PDA,
                        what: "PDU data alignment",
                    });
                }
                if b[11] & !3 != 0 {
                    return Err(PduError::Field {
                        offset: field::DGST,
                        what: "digest reserved bits",
                    });
                }
                let digests = Digests::from_byte(b[11]);
                let word = u32_at(b, 12);
                if pdu_type == PduType::IcReq {
                    Pdu::IcReq(IcReq {
                        pfv,
                        hpda: pda,
                        digests,
                        maxr2t: word,
                    })
                } else {
                    if word < MAXH2CDATA_BYTES_MIN || !word.is_multiple_of(4) {
                        return Err(PduError::Field {
                            offset: field::MAXR2T_OR_MAXH2CDATA,
                            what: "MAXH2CDATA",
                        });
                    }
                    Pdu::IcResp(IcResp {
                        pfv,
                        cpda: pda,
                        digests,
                        maxh2cdata: word,
                    })
                }
            }
            PduType::H2CTermReq | PduType::C2HTermReq => {
                let t = TermReq {
                    fes: u16_at(b, 8),
                    fei: u32_at(b, 10),
                    error_data: &b[layout.data.clone()],
                };
                if pdu_type == PduType::H2CTermReq {
                    Pdu::H2CTermReq(t)
                } else {
                    Pdu::C2HTermReq(t)
                }
            }
            PduType::CapsuleCmd => {
                let sqe: &[u8; 64] = b[8..72].try_into().expect("72-byte header");
                Pdu::CapsuleCmd(SubmissionEntry::from_le_bytes(sqe))
            }
            PduType::CapsuleResp => {
                let cqe: &[u8; 16] = b[8..24].try_into().expect("24-byte header");
                Pdu::CapsuleResp(CompletionEntry::from_le_bytes(cqe))
            }
            PduType::H2CData | PduType::C2HData => {
                let datal = u32_at(b, 16);
                if datal != data_bytes || datal == 0 {
                    return Err(PduError::Field {
                        offset: field::DATAL,
                        what: "data length",
                    });
                }
                let flags = b[1];
                let h = DataHeader {
                    cccid: u16_at(b, 8),
                    ttag: if pdu_type == PduType::H2CData {
                        u16_at(b, 10)
                    } else {
                        0
                    },
                    datao: u32_at(b, 12),
                    datal,
                    last: flags & flags::LAST_PDU != 0,
                    success: flags & flags::SUCCESS != 0,
                };
                if pdu_type == PduType::H2CData {
                    Pdu::H2CData(h)
                } else {
                    Pdu::C2HData(h)
                }
            }
            PduType::R2T => {
                let r = R2t {
                    cccid: u16_at(b, 8),
                    ttag: u16_at(b, 10),
                    r2to: u32_at(b, 12),
                    r2tl: u32_at(b, 16),
                };
                if r.r2tl == 0 {
                    return Err(PduError::Field {
                        offset: field::DATAL,
                        what: "R2T length",
                    });
                }
                Pdu::R2T(r)
            }
        })
    }
}
