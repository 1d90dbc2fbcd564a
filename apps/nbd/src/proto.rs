//! NBD wire constants, from the protocol document (fixed newstyle negotiation, simple
//! replies). All integers on the wire are big-endian.

/// `NBDMAGIC`: the first eight bytes a server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: follows the first magic, and starts every option a client sends.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Starts every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Starts every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Starts every simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Handshake flags the server sends.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Option types.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;

/// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR | 1;
pub const REP_ERR_POLICY: u32 = REP_ERR | 2;
pub const REP_ERR_INVALID: u32 = REP_ERR | 3;
pub const REP_ERR_TLS_REQD: u32 = REP_ERR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR | 6;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR | 9;

/// Information types of `NBD_REP_INFO`.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// Command types.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// Error values of replies (the protocol fixes them to these Linux errno numbers).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Bytes of the server's greeting: NBDMAGIC, IHAVEOPT, handshake flags.
pub const GREETING_BYTES: usize = 18;
/// Bytes of an option header: IHAVEOPT, option, length.
pub const OPTION_HEADER_BYTES: usize = 16;
/// Bytes of a request header: magic, flags, type, cookie, offset, length.
pub const REQUEST_HEADER_BYTES: usize = 28;
/// Bytes of a simple reply header: magic, error, cookie.
pub const REPLY_HEADER_BYTES: usize = 16;
/// Zero bytes after an `NBD_OPT_EXPORT_NAME` reply unless the client asked for none.
pub const EXPORT_NAME_PAD_BYTES: usize = 124;
/// Longest export name or description the protocol allows.
pub const STRING_BYTES_MAX: usize = 4096;

/// A simple reply's header.
pub fn simple_reply(cookie: u64, error: u32) -> [u8; REPLY_HEADER_BYTES] {
    let mut h = [0u8; REPLY_HEADER_BYTES];
    h[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    h[4..8].copy_from_slice(&error.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h
}

/// A name for an option type, for log lines.
pub fn option_name(option: u32) -> &'static str {
    match option {
        OPT_EXPORT_NAME => "EXPORT_NAME",
        OPT_ABORT => "ABORT",
        OPT_LIST => "LIST",
        OPT_STARTTLS => "STARTTLS",
        OPT_INFO => "INFO",
        OPT_GO => "GO",
        OPT_STRUCTURED_REPLY => "STRUCTURED_REPLY",
        9 => "LIST_META_CONTEXT",
        10 => "SET_META_CONTEXT",
        11 => "EXTENDED_HEADERS",
        _ => "unknown",
    }
}
