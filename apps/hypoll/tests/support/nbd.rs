//! A raw NBD client over TCP, for tests that speak the protocol byte by byte (and misbehave
//! on purpose): connect, negotiate, read replies, see the server close.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use hypoll_nbd::client;
use hypoll_nbd::proto::*;

/// A raw client connected and past the greeting; a read that waits 10 s fails.
pub fn connect(port: u16) -> TcpStream {
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; GREETING_BYTES];
    c.read_exact(&mut greeting).unwrap();
    c
}

/// Connects and negotiates `export` with NBD_OPT_GO; returns the socket in transmission.
pub fn handshake(port: u16, export: &str) -> TcpStream {
    let mut c = connect(port);
    c.write_all(&client::handshake_go(export)).unwrap();
    // Option replies until the ACK of GO.
    loop {
        let (_, reply, _) = option_reply(&mut c);
        assert!(reply & (1 << 31) == 0, "option error {reply:#x}");
        if reply == REP_ACK {
            return c;
        }
    }
}

/// Reads one option reply: (option, reply type, data).
pub fn option_reply(c: &mut impl Read) -> (u32, u32, Vec<u8>) {
    let mut h = [0u8; 20];
    c.read_exact(&mut h).unwrap();
    assert_eq!(
        u64::from_be_bytes(h[..8].try_into().unwrap()),
        OPT_REPLY_MAGIC
    );
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
    let mut data = vec![0u8; len];
    c.read_exact(&mut data).unwrap();
    (
        u32::from_be_bytes(h[8..12].try_into().unwrap()),
        u32::from_be_bytes(h[12..16].try_into().unwrap()),
        data,
    )
}

/// Reads one simple reply header: (cookie, error).
pub fn simple_reply(c: &mut impl Read) -> (u64, u32) {
    let mut h = [0u8; REPLY_HEADER_BYTES];
    c.read_exact(&mut h).unwrap();
    assert_eq!(
        u32::from_be_bytes(h[0..4].try_into().unwrap()),
        SIMPLE_REPLY_MAGIC
    );
    (
        u64::from_be_bytes(h[8..16].try_into().unwrap()),
        u32::from_be_bytes(h[4..8].try_into().unwrap()),
    )
}

/// Reads `len` bytes at `offset` (cookie `cookie`) on a connection in transmission, and
/// returns them; the read must succeed.
pub fn read_ok(c: &mut TcpStream, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
    c.write_all(&client::request(CMD_READ, 0, cookie, offset, len))
        .unwrap();
    assert_eq!(simple_reply(c), (cookie, 0));
    let mut data = vec![0u8; len as usize];
    c.read_exact(&mut data).unwrap();
    data
}

/// True once the server closed the connection (end of stream or reset).
pub fn closed(c: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(c.read(&mut b), Ok(0) | Err(_))
}

/// Everything the server sends until it closes (bounded by the read timeout).
pub fn read_to_close(c: &mut TcpStream) -> Vec<u8> {
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return all,
            Ok(n) => all.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return all,
            Err(e) => panic!("the server did not close the connection: {e}"),
        }
    }
}
