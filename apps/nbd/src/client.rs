//! Client-side message builders, for tests, fuzz seeds and the load test: what a client
//! sends, byte for byte.

use crate::proto::*;

/// The client's flags after the greeting.
pub fn client_flags(flags: u32) -> Vec<u8> {
    flags.to_be_bytes().to_vec()
}

/// One option: IHAVEOPT, type, length, data.
pub fn option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(OPTION_HEADER_BYTES + data.len());
    m.extend_from_slice(&IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&option.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    m
}

/// `NBD_OPT_GO` or `NBD_OPT_INFO` for `name`, asking for the information types `infos`.
pub fn info_or_go(opt: u32, name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    option(opt, &d)
}

/// A transmission request header (a write's payload follows it).
pub fn request(kind: u16, flags: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut m = Vec::with_capacity(REQUEST_HEADER_BYTES);
    m.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    m.extend_from_slice(&cookie.to_be_bytes());
    m.extend_from_slice(&offset.to_be_bytes());
    m.extend_from_slice(&length.to_be_bytes());
    m
}

/// A whole handshake that ends in `NBD_OPT_GO` on `name` with block sizes asked for.
pub fn handshake_go(name: &str) -> Vec<u8> {
    let mut m = client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    m.extend(info_or_go(OPT_GO, name, &[INFO_BLOCK_SIZE]));
    m
}
