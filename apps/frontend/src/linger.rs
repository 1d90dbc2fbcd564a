//! How a connection the server ends says goodbye: when the client has not ended its side,
//! closing the socket at once would make the kernel answer the client's unread requests
//! with a reset, and a client's kernel that takes a reset drops the replies it has not
//! handed to the client yet (a graceful stop under a pipelining client lost replies this
//! way). So the server half-closes instead: TLS's closing alert, then end of stream after
//! the last reply. It then reads and drops what the client still sends until the client
//! ends its side too, for at most [`LINGER_MS`], and only then closes.

use std::io;

use crate::conn::{Conn, READ_BYTES_PER_POLL};
use crate::protocol::Protocol;

/// Longest a half-closed connection waits for its client's end of stream before it closes.
/// Within the graceful stop's [`DRAIN_TIMEOUT`](crate::DRAIN_TIMEOUT), so a stop waits for
/// lingering connections rather than cutting them.
pub const LINGER_MS: u64 = 2_000;
/// Bytes read per `read` while discarding.
const DISCARD_CHUNK_BYTES: usize = 16 << 10;

const _: () = assert!(LINGER_MS < crate::DRAIN_TIMEOUT.as_millis() as u64);

impl<P: Protocol> Conn<P> {
    /// Whether ending this connection should half-close and linger: its client may still
    /// send (it has not ended its side) and the socket still works.
    pub(crate) fn should_linger(&self) -> bool {
        !self.gone && !self.eof && self.linger_until_ns.is_none()
    }

    /// Whether the connection is half-closed, waiting for its client's end of stream.
    pub(crate) fn lingering(&self) -> bool {
        self.linger_until_ns.is_some()
    }

    /// Ends the server's side: TLS's closing alert, then end of stream after the replies
    /// already written. The connection then lingers until `now_ns` + [`LINGER_MS`].
    pub(crate) fn half_close(&mut self, now_ns: u64) -> io::Result<()> {
        debug_assert!(self.should_linger() && !self.has_output());
        self.close_tls();
        self.stream.shutdown_write()?;
        self.linger_until_ns = Some(now_ns.saturating_add(LINGER_MS * 1_000_000));
        Ok(())
    }

    /// Reads and drops what the client still sends, at most [`READ_BYTES_PER_POLL`] a
    /// poll, so a client that keeps sending cannot hold the reactor. Returns whether the
    /// client is done (end of stream, or the socket failed) or its time is up at `now_ns`.
    pub(crate) fn discard_input(&mut self, now_ns: u64) -> bool {
        debug_assert!(self.lingering());
        let mut scratch = [0u8; DISCARD_CHUNK_BYTES];
        let mut total = 0;
        while total < READ_BYTES_PER_POLL {
            // Raw bytes: after the closing alert nothing the client sends is read as data.
            match self.stream.read(&mut scratch) {
                Ok(0) => return true,
                Ok(n) => total += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => return true,
            }
        }
        self.linger_until_ns.is_some_and(|until| now_ns >= until)
    }
}
