//! NVMe/TCP PDU layouts (NVMe/TCP Transport Specification 1.0, "PDU Header Formats"): the
//! common header, each PDU type's header fields, the flags and the termination requests'
//! error codes. All multi-byte fields are little-endian.

use crate::spec::{CompletionEntry, SubmissionEntry};

/// Bytes of the common header every PDU starts with: type, flags, HLEN, PDO, PLEN.
pub const COMMON_HEADER_BYTES: usize = 8;
/// Bytes of a header or data digest (CRC32C).
pub const DIGEST_BYTES: usize = 4;
/// ICReq and ICResp are this long, header and all; they carry no digests.
pub const IC_PDU_BYTES: usize = 128;
/// Header length (HLEN) of a command capsule: common header and the 64-byte SQE.
pub const CAPSULE_CMD_HEADER_BYTES: usize = 72;
/// Header length of a response capsule: common header and the 16-byte CQE.
pub const CAPSULE_RESP_HEADER_BYTES: usize = 24;
/// Header length of H2CData, C2HData and R2T.
pub const DATA_HEADER_BYTES: usize = 24;
pub const R2T_HEADER_BYTES: usize = 24;
/// Header length of a termination request; its error data follows.
pub const TERM_REQ_HEADER_BYTES: usize = 24;
/// Most bytes of a termination request's error data (the offending PDU's header): a
/// termination request is at most 152 bytes long.
pub const TERM_REQ_ERROR_DATA_BYTES_MAX: usize = 128;
/// Smallest MAXH2CDATA a controller may announce.
pub const MAXH2CDATA_BYTES_MIN: u32 = 4096;
/// Largest HPDA or CPDA (0's based dwords): data may be aligned to at most 128 bytes.
pub const PDA_MAX: u8 = 31;
/// The only PDU format version there is.
pub const PFV_1_0: u16 = 0;

/// Bytes a PDA value (0's based dwords) asks data to be aligned to.
pub fn pda_bytes(pda: u8) -> usize {
    (usize::from(pda.min(PDA_MAX)) + 1) * 4
}

/// PDU types (the common header's first byte). Bit 0 is the direction: host to
/// controller types are even, controller to host odd.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PduType {
    IcReq = 0x00,
    IcResp = 0x01,
    H2CTermReq = 0x02,
    C2HTermReq = 0x03,
    CapsuleCmd = 0x04,
    CapsuleResp = 0x05,
    H2CData = 0x06,
    C2HData = 0x07,
    R2T = 0x09,
}

impl PduType {
    pub fn from_u8(b: u8) -> Option<PduType> {
        Some(match b {
            0x00 => PduType::IcReq,
            0x01 => PduType::IcResp,
            0x02 => PduType::H2CTermReq,
            0x03 => PduType::C2HTermReq,
            0x04 => PduType::CapsuleCmd,
            0x05 => PduType::CapsuleResp,
            0x06 => PduType::H2CData,
            0x07 => PduType::C2HData,
            0x09 => PduType::R2T,
            _ => return None,
        })
    }

    /// Whether a controller receives this type (the host sends it).
    pub fn host_to_controller(self) -> bool {
        (self as u8) & 1 == 0
    }

    /// The header length (HLEN) the type must carry.
    pub fn header_bytes(self) -> usize {
        match self {
            PduType::IcReq | PduType::IcResp => IC_PDU_BYTES,
            PduType::CapsuleCmd => CAPSULE_CMD_HEADER_BYTES,
            PduType::H2CTermReq
            | PduType::C2HTermReq
            | PduType::CapsuleResp
            | PduType::H2CData
            | PduType::C2HData
            | PduType::R2T => DATA_HEADER_BYTES,
        }
    }

    /// Flags the type may carry (digest flags only where digests apply to it).
    pub fn flags_allowed(self) -> u8 {
        match self {
            PduType::IcReq | PduType::IcResp | PduType::H2CTermReq | PduType::C2HTermReq => 0,
            PduType::CapsuleCmd => flags::HDGSTF | flags::DDGSTF,
            PduType::CapsuleResp | PduType::R2T => flags::HDGSTF,
            PduType::H2CData => flags::HDGSTF | flags::DDGSTF | flags::LAST_PDU,
            PduType::C2HData => flags::HDGSTF | flags::DDGSTF | flags::LAST_PDU | flags::SUCCESS,
        }
    }

    /// Whether the type may carry data after its header.
    pub fn carries_data(self) -> bool {
        matches!(
            self,
            PduType::CapsuleCmd | PduType::H2CData | PduType::C2HData
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            PduType::IcReq => "ICReq",
            PduType::IcResp => "ICResp",
            PduType::H2CTermReq => "H2CTermReq",
            PduType::C2HTermReq => "C2HTermReq",
            PduType::CapsuleCmd => "CapsuleCmd",
            PduType::CapsuleResp => "CapsuleResp",
            PduType::H2CData => "H2CData",
            PduType::C2HData => "C2HData",
            PduType::R2T => "R2T",
        }
    }
}

/// Common header flags.
pub mod flags {
    /// A header digest follows the header.
    pub const HDGSTF: u8 = 1 << 0;
    /// A data digest follows the data.
    pub const DDGSTF: u8 = 1 << 1;
    /// H2CData/C2HData: the last data PDU of the command (or of the R2T).
    pub const LAST_PDU: u8 = 1 << 2;
    /// C2HData: the command succeeded, and no response capsule follows. Only with
    /// LAST_PDU, and only where the host disabled SQ flow control.
    pub const SUCCESS: u8 = 1 << 3;
}

/// Offsets of the common header's fields: a termination request names the faulty one.
pub mod field {
    pub const PDU_TYPE: u32 = 0;
    pub const FLAGS: u32 = 1;
    pub const HLEN: u32 = 2;
    pub const PDO: u32 = 3;
    pub const PLEN: u32 = 4;
    /// ICReq/ICResp fields.
    pub const PFV: u32 = 8;
    pub const PDA: u32 = 10;
    pub const DGST: u32 = 11;
    pub const MAXR2T_OR_MAXH2CDATA: u32 = 12;
    /// Data PDU and R2T fields.
    pub const CCCID: u32 = 8;
    pub const TTAG: u32 = 10;
    pub const DATAO: u32 = 12;
    pub const DATAL: u32 = 16;
}

/// Fatal error status of a termination request (FES): why the sender ends the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Fes {
    /// A header field is invalid; FEI is its byte offset.
    InvalidHeaderField = 0x01,
    /// A PDU that is not allowed at this point of the conversation.
    PduSequenceError = 0x02,
    HeaderDigestError = 0x03,
    /// A data PDU's range lies outside its command's data.
    DataOutOfRange = 0x04,
    /// C2HTermReq: an H2CData PDU longer than MAXH2CDATA. H2CTermReq: more R2Ts than
    /// MAXR2T allows (the same code).
    DataLimitExceeded = 0x05,
    /// A parameter this end does not support; FEI is its byte offset.
    UnsupportedParameter = 0x06,
}

impl Fes {
    pub fn from_u16(v: u16) -> Option<Fes> {
        Some(match v {
            0x01 => Fes::InvalidHeaderField,
            0x02 => Fes::PduSequenceError,
            0x03 => Fes::HeaderDigestError,
            0x04 => Fes::DataOutOfRange,
            0x05 => Fes::DataLimitExceeded,
            0x06 => Fes::UnsupportedParameter,
            _ => return None,
        })
    }
}

/// The common header, as it travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommonHeader {
    pub pdu_type: u8,
    pub flags: u8,
    /// Header length, without its digest.
    pub hlen: u8,
    /// Data offset from the start of the PDU (0: no data).
    pub pdo: u8,
    /// The whole PDU's length: header, digest, padding, data, data digest.
    pub plen: u32,
}

impl CommonHeader {
    pub fn parse(b: &[u8]) -> CommonHeader {
        CommonHeader {
            pdu_type: b[0],
            flags: b[1],
            hlen: b[2],
            pdo: b[3],
            plen: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        }
    }

    pub fn to_bytes(self) -> [u8; COMMON_HEADER_BYTES] {
        let p = self.plen.to_le_bytes();
        [
            self.pdu_type,
            self.flags,
            self.hlen,
            self.pdo,
            p[0],
            p[1],
            p[2],
            p[3],
        ]
    }
}

/// Which digests a connection uses, as ICReq asks and ICResp grants.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

impl Digests {
    /// ICReq/ICResp DGST byte: bit 0 header digest, bit 1 data digest.
    pub fn to_byte(self) -> u8 {
        u8::from(self.header) | (u8::from(self.data) << 1)
    }

    /// The DGST byte's two known bits; reserved bits are the decoder's to refuse.
    pub fn from_byte(b: u8) -> Digests {
        Digests {
            header: b & 1 != 0,
            data: b & 2 != 0,
        }
    }
}

/// ICReq: the host opens the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcReq {
    pub pfv: u16,
    /// Host PDU data alignment (0's based dwords) for the data PDUs the host receives.
    pub hpda: u8,
    pub digests: Digests,
    /// Most R2Ts outstanding per command, 0's based.
    pub maxr2t: u32,
}

/// ICResp: the controller's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcResp {
    pub pfv: u16,
    /// Controller PDU data alignment for the data PDUs the controller receives.
    pub cpda: u8,
    pub digests: Digests,
    /// Most data bytes in one H2CData PDU.
    pub maxh2cdata: u32,
}

/// H2CTermReq or C2HTermReq: the sender is closing the connection, and says why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TermReq<'a> {
    /// The raw FES ([`Fes::from_u16`] names the known ones).
    pub fes: u16,
    /// Fatal error information: a field's offset for FES 1 and 6.
    pub fei: u32,
    /// The start of the PDU in error.
    pub error_data: &'a [u8],
}

/// H2CData or C2HData header fields (C2HData has no TTAG: 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataHeader {
    /// The command the data belongs to.
    pub cccid: u16,
    /// The R2T being answered (H2CData only).
    pub ttag: u16,
    /// Offset of this PDU's data in the command's data.
    pub datao: u32,
    pub datal: u32,
    pub last: bool,
    /// C2HData only: the command completed successfully, no response follows.
    pub success: bool,
}

/// R2T: the controller asks for `r2tl` bytes of a command's data from `r2to` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct R2t {
    pub cccid: u16,
    pub ttag: u16,
    pub r2to: u32,
    pub r2tl: u32,
}

/// A decoded PDU; data lies in the input (see [`Decoded::data`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pdu<'a> {
    IcReq(IcReq),
    IcResp(IcResp),
    H2CTermReq(TermReq<'a>),
    C2HTermReq(TermReq<'a>),
    CapsuleCmd(SubmissionEntry),
    CapsuleResp(CompletionEntry),
    H2CData(DataHeader),
    C2HData(DataHeader),
    R2T(R2t),
}

impl Pdu<'_> {
    pub fn pdu_type(&self) -> PduType {
        match self {
            Pdu::IcReq(_) => PduType::IcReq,
            Pdu::IcResp(_) => PduType::IcResp,
            Pdu::H2CTermReq(_) => PduType::H2CTermReq,
            Pdu::C2HTermReq(_) => PduType::C2HTermReq,
            Pdu::CapsuleCmd(_) => PduType::CapsuleCmd,
            Pdu::CapsuleResp(_) => PduType::CapsuleResp,
            Pdu::H2CData(_) => PduType::H2CData,
            Pdu::C2HData(_) => PduType::C2HData,
            Pdu::R2T(_) => PduType::R2T,
        }
    }
}

/// One whole PDU found at the front of the input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decoded<'a> {
    /// Bytes it spans (PLEN): consume these.
    pub len: usize,
    pub pdu: Pdu<'a>,
    /// Where its data (in-capsule or data PDU payload) lies in the input; empty for none.
    pub data: std::ops::Range<usize>,
    /// False when the data's digest did not match: the data must not be used, but the
    /// connection goes on (the command fails with a transient transport error).
    pub data_digest_ok: bool,
}
