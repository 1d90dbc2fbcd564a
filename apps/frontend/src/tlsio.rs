//! One connection's TLS session, driven without blocking from the reactor's turn: ciphertext
//! is read from the non-blocking socket into rustls and plaintext read out of it; plaintext
//! replies go in and ciphertext is written out as the socket takes it. Nothing here waits:
//! a socket that would block returns `WouldBlock` to the connection, whose epoll interest
//! brings it back.
//!
//! What a session holds beyond the connection's own buffers is bounded by
//! [`TLS_BUFFER_BYTES_MAX`] (rustls's own limits and the send limit set here), so it is
//! documented beside `--max-connection-bytes` rather than counted in it: the smallest byte
//! bound would not hold it.

use std::io::{self, IoSlice, Read, Write};
use std::sync::Arc;

use crate::stream::Stream;

/// Ciphertext queued for the socket that rustls holds before it takes no more plaintext:
/// the socket's turn empties it, so a larger one saves no system calls.
pub const TLS_SEND_BYTES_MAX: usize = 64 << 10;
/// Received plaintext rustls holds (its fixed limit: it reads no more ciphertext past it).
const TLS_RECEIVED_PLAINTEXT_BYTES_MAX: usize = 16 << 10;
/// Ciphertext rustls holds while it joins one handshake message (its fixed limit; a record
/// outside a handshake needs far less).
const TLS_DEFRAME_BYTES_MAX: usize = 64 << 10;
/// Most bytes one connection's TLS session holds in its buffers, beyond
/// `--max-connection-bytes`.
pub const TLS_BUFFER_BYTES_MAX: usize =
    TLS_SEND_BYTES_MAX + TLS_RECEIVED_PLAINTEXT_BYTES_MAX + TLS_DEFRAME_BYTES_MAX;
/// Ciphertext one read takes from the socket before it hands control back, when what it
/// decrypts yields no plaintext (handshake records, empty records), so a client cannot
/// keep a reactor in one connection's read.
const CIPHERTEXT_BYTES_PER_READ_MAX: usize = 1 << 20;

/// A connection's TLS session.
pub(crate) struct Tls {
    session: rustls::ServerConnection,
}

impl Tls {
    pub(crate) fn new(config: Arc<rustls::ServerConfig>) -> Result<Tls, rustls::Error> {
        let mut session = rustls::ServerConnection::new(config)?;
        session.set_buffer_limit(Some(TLS_SEND_BYTES_MAX));
        Ok(Tls { session })
    }

    /// Reads plaintext into `buf`, decrypting what the socket has until some is ready.
    /// `Ok(0)` is the end of the stream (the client's close_notify, or a socket closed
    /// without one: requests are framed, so a cut one is seen as such by the protocol);
    /// `WouldBlock` when the socket has nothing more; a TLS failure is `InvalidData`, after
    /// its alert was offered to the socket.
    pub(crate) fn read(&mut self, sock: &mut Stream, buf: &mut [u8]) -> io::Result<usize> {
        let mut ciphertext_bytes = 0;
        loop {
            match self.session.reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                Err(e) => return Err(e),
            }
            if ciphertext_bytes >= CIPHERTEXT_BYTES_PER_READ_MAX {
                // Level-triggered epoll brings the connection back for the rest.
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = match self.session.read_tls(sock) {
                Ok(0) => return Ok(0),
                Ok(n) => n,
                Err(e) => return Err(e),
            };
            ciphertext_bytes += n;
            if let Err(e) = self.session.process_new_packets() {
                // rustls queued an alert saying why: one attempt to send it, so the client
                // reports the cause (a certificate refused) rather than a reset.
                let _ = self.session.write_tls(sock);
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        }
    }

    /// Whether decrypted plaintext waits in the session: the socket may be empty, so no
    /// readiness event would come for it.
    pub(crate) fn has_plaintext(&mut self) -> bool {
        self.session
            .process_new_packets()
            .is_ok_and(|state| state.plaintext_bytes_to_read() > 0)
    }

    /// Whether ciphertext (handshake messages, records, alerts) waits for the socket.
    pub(crate) fn wants_write(&self) -> bool {
        self.session.wants_write()
    }

    /// Writes waiting ciphertext until none is left or the socket is full (then
    /// [`Tls::wants_write`] still says so). Returns the bytes written.
    pub(crate) fn flush(&mut self, sock: &mut Stream) -> io::Result<usize> {
        let mut written = 0;
        while self.session.wants_write() {
            match self.session.write_tls(sock) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(written)
    }

    /// Encrypts what of `bufs` fits under [`TLS_SEND_BYTES_MAX`]; returns the plaintext
    /// bytes taken (0 while the handshake runs: nothing is sent before it is over).
    pub(crate) fn encrypt(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        if self.session.is_handshaking() {
            return Ok(0);
        }
        self.session.writer().write_vectored(bufs)
    }

    /// Queues the close_notify alert (sent by the next [`Tls::flush`]).
    pub(crate) fn close_notify(&mut self) {
        self.session.send_close_notify();
    }

    pub(crate) fn is_handshaking(&self) -> bool {
        self.session.is_handshaking()
    }
}
