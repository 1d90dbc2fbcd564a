//! A connection's buffers against a socket pair: what is queued reaches the client and its
//! bytes are given back; the test protocol `Sender` other modules' tests use.

use std::io::Read;
use std::os::unix::net::UnixStream;

use hypoll_reactor::Reactor;

use super::*;
use crate::protocol::HasShard;
use crate::shard::Shard;

/// A protocol that only sends: enough to drive a connection's output side.
pub(crate) struct Sender;

impl Protocol for Sender {
    type Conn = ();
    const NAME: &'static str = "test";
    fn connect(&mut self, _greeting: &mut Vec<u8>) {}
    fn negotiated(_conn: &()) -> bool {
        true
    }
    fn requests_inflight(_conn: &()) -> usize {
        0
    }
    fn request_bytes_max(&self) -> usize {
        4096
    }
    fn has_backlog(&self) -> bool {
        false
    }
    fn parse<S: HasShard<Self>>(
        _shard: &mut Shard<Self>,
        _r: &mut Reactor<S>,
        _key: usize,
    ) -> usize {
        0
    }
    fn retry_backlog<S: HasShard<Self>>(_shard: &mut Shard<Self>, _r: &mut Reactor<S>) -> usize {
        0
    }
    fn close_note(_conn: &()) -> String {
        String::new()
    }
}

fn connected() -> (Conn<Sender>, UnixStream) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    let interest = Interest {
        read: true,
        write: false,
    };
    let conn = Conn::new(Stream::Unix(ours), "peer".into(), (), interest, 0);
    (conn, theirs)
}

/// A protocol with nothing to greet with (NVMe/TCP waits for the host to speak first)
/// must not have its connection read as closed by the socket.
#[test]
fn an_empty_greeting_queues_nothing_and_writes_cleanly() {
    let (mut conn, _client) = connected();
    conn.push_bytes(Vec::new());
    assert!(!conn.has_output());
    let written = conn.write_out(&mut BufCache::default()).unwrap();
    assert_eq!(written, 0);
    assert_eq!(conn.out_bytes, 0);
}

#[test]
fn queued_bytes_reach_the_client_and_are_released() {
    let (mut conn, mut client) = connected();
    conn.push_bytes(b"hello".to_vec());
    conn.push_reply(&[1, 2, 3], Vec::new());
    assert_eq!(conn.out_bytes, 8 + 2 * OUT_MSG_OVERHEAD_BYTES);
    assert_eq!(conn.write_out(&mut BufCache::default()).unwrap(), 8);
    assert_eq!(conn.out_bytes, 0);
    assert!(!conn.has_output());
    let mut got = [0u8; 8];
    client.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"hello\x01\x02\x03");
}
