//! One client connection's socket side: the input buffer the protocol parses from, the queue
//! of replies waiting for the socket (sent with writev, or through the connection's TLS
//! session once it has one), and the accounting of the memory the connection makes the
//! server hold, which bounds it (back-pressure: past the bound its requests wait unread in
//! the kernel's socket buffer).

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::Arc;

use hypoll_nvme::IoBuf;

use crate::bufcache::BufCache;
use crate::epoll::Interest;
use crate::protocol::Protocol;
use crate::stream::Stream;
use crate::tlsio::Tls;
use crate::REQUESTS_INFLIGHT_MAX;

/// What one queued reply costs beyond its bytes (its allocation and queue entry), counted
/// against the connection's byte bound so a flood of small refusals cannot hide behind
/// their few bytes.
pub const OUT_MSG_OVERHEAD_BYTES: usize = 128;
/// Bytes read from one socket per poll, so one busy client cannot starve the others.
pub const READ_BYTES_PER_POLL: usize = 1 << 20;
/// Input buffer a connection keeps between requests; a larger write grows it only while it
/// is being received.
pub(crate) const INBUF_KEEP_BYTES: usize = 1 << 20;
/// Bytes asked of the kernel per read.
pub(crate) const READ_CHUNK_BYTES: usize = 256 << 10;
/// Most buffers one writev hands the kernel.
const WRITEV_SLICES_MAX: usize = 64;
/// Longest reply header held inline in a queued reply (no allocation per request).
pub const HEAD_INLINE_BYTES_MAX: usize = 32;

const _: () = assert!(READ_CHUNK_BYTES <= READ_BYTES_PER_POLL);
const _: () = assert!(WRITEV_SLICES_MAX <= 1024, "IOV_MAX on Linux");
const _: () = assert!(HEAD_INLINE_BYTES_MAX <= u8::MAX as usize);

/// The first bytes of a queued message: a reply header, held inline, or handshake bytes.
enum Head {
    Inline {
        bytes: [u8; HEAD_INLINE_BYTES_MAX],
        len: u8,
    },
    Bytes(Vec<u8>),
}

impl std::ops::Deref for Head {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Head::Inline { bytes, len } => &bytes[..usize::from(*len)],
            Head::Bytes(b) => b,
        }
    }
}

/// A reply queued for the socket: its header, then a read's data.
struct OutMsg {
    head: Head,
    data: Vec<IoBuf>,
}

impl OutMsg {
    fn len(&self) -> usize {
        self.head.len() + self.data.iter().map(|b| b.len()).sum::<usize>()
    }
}

/// A client connection on a reactor: its socket, its buffers, and protocol `P`'s state.
pub struct Conn<P: Protocol> {
    pub(crate) stream: Stream,
    /// Who the client is, for log lines.
    pub peer: String,
    /// The protocol's state of this connection (its session, its requests in flight).
    pub proto: P::Conn,
    /// Received bytes not yet consumed: `inbuf[in_start..in_end]`.
    inbuf: Vec<u8>,
    pub(crate) in_start: usize,
    pub(crate) in_end: usize,
    out: VecDeque<OutMsg>,
    /// Bytes of the front message already sent.
    out_sent: usize,
    /// Queued replies' bytes not yet sent, plus [`OUT_MSG_OVERHEAD_BYTES`] per reply.
    out_bytes: usize,
    /// Data held for requests in flight: write payloads and read lengths. With `out_bytes`
    /// it is bounded by the service's `connection_bytes_max` (plus one request), so a client
    /// that pipelines large requests and never reads its socket cannot grow the server's
    /// memory.
    held_bytes: usize,
    pub(crate) write_blocked: bool,
    /// No more requests are read; the connection closes once its requests finish. Holds why.
    pub closing: Option<String>,
    /// The client shut down its side (a read returned end of stream): what it sent before
    /// is still parsed and answered, then the connection closes.
    pub(crate) eof: bool,
    /// The client is gone (end of stream or a socket error): replies are dropped.
    pub gone: bool,
    /// Closed for an error (logged and counted).
    pub failed: bool,
    pub(crate) interest: Interest,
    /// The socket is in the reactor's epoll set.
    pub(crate) registered: bool,
    pub(crate) dirty: bool,
    /// When the reactor adopted it: the handshake's clock starts here.
    pub(crate) adopted_ns: u64,
    /// The TLS session, once the protocol started one: every byte read or written after
    /// that goes through it.
    pub(crate) tls: Option<Box<Tls>>,
    /// Replies at the front of `out` queued before TLS started (the reply that accepts it,
    /// last): they go out in plaintext, and TLS takes the socket after them.
    plain_msgs: usize,
    /// Half-closed by the server, discarding input until the client ends its side or this
    /// time passes (see `linger.rs`).
    pub(crate) linger_until_ns: Option<u64>,
    /// Holds one of its reactor's slots for receiving a request larger than
    /// [`INBUF_KEEP_BYTES`] (see `intake.rs`).
    pub(crate) large_input: bool,
    /// Waits for such a slot, its socket unread meanwhile.
    pub(crate) awaiting_large_input: bool,
    /// When bytes last arrived (a stalled request is closed).
    pub(crate) last_input_ns: u64,
    /// When bytes last arrived or left (an idle connection is closed, if asked).
    pub(crate) last_active_ns: u64,
}

/// Why a connection could not start TLS.
#[derive(Debug, thiserror::Error)]
pub enum StartTlsError {
    /// Bytes arrived after the request to start TLS and before its handshake: a client
    /// waits for the reply before it starts the handshake, so these were sent in
    /// plaintext to be taken as if under TLS (the STARTTLS injection attack).
    #[error("{0} bytes arrived in plaintext after the request to start TLS")]
    Injected(usize),
    #[error("TLS is already started")]
    AlreadyStarted,
    #[error("TLS is not configured")]
    NotConfigured,
    #[error("starting the TLS session: {0}")]
    Session(rustls::Error),
}

impl<P: Protocol> Conn<P> {
    pub(crate) fn new(
        stream: Stream,
        peer: String,
        proto: P::Conn,
        interest: Interest,
        adopted_ns: u64,
    ) -> Conn<P> {
        Conn {
            stream,
            peer,
            proto,
            inbuf: Vec::new(),
            in_start: 0,
            in_end: 0,
            out: VecDeque::new(),
            out_sent: 0,
            out_bytes: 0,
            held_bytes: 0,
            write_blocked: false,
            closing: None,
            eof: false,
            gone: false,
            failed: false,
            interest,
            registered: true,
            dirty: false,
            adopted_ns,
            tls: None,
            plain_msgs: 0,
            linger_until_ns: None,
            large_input: false,
            awaiting_large_input: false,
            last_input_ns: adopted_ns,
            last_active_ns: adopted_ns,
        }
    }

    /// Starts TLS once the replies queued so far (the protocol's reply accepting TLS among
    /// them) are sent in plaintext. Refused if any input is left unconsumed: it was sent
    /// before the client could know TLS would start, and must not be read as if it came
    /// under TLS.
    pub(crate) fn start_tls(
        &mut self,
        config: Option<&Arc<rustls::ServerConfig>>,
    ) -> Result<(), StartTlsError> {
        if self.tls.is_some() {
            return Err(StartTlsError::AlreadyStarted);
        }
        let config = config.ok_or(StartTlsError::NotConfigured)?;
        if !self.input().is_empty() {
            return Err(StartTlsError::Injected(self.input().len()));
        }
        self.tls = Some(Box::new(
            Tls::new(config.clone()).map_err(StartTlsError::Session)?,
        ));
        self.plain_msgs = self.out.len();
        Ok(())
    }

    /// Whether the connection's TLS session holds decrypted input the socket will not
    /// announce again.
    pub(crate) fn tls_input_waiting(&mut self) -> bool {
        self.tls.as_mut().is_some_and(|t| t.has_input())
    }

    /// Whether the connection speaks TLS (or will, once its plaintext replies are out).
    pub fn uses_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The certificate the client showed, once the TLS handshake is over (verified against
    /// the CA: a client whose certificate fails never gets this far).
    pub fn peer_certificate(&self) -> Option<&rustls::pki_types::CertificateDer<'static>> {
        let tls = self.tls.as_ref()?;
        tls.peer_certificate()
    }

    /// Queues TLS's closing alert, for the last write before the socket closes.
    pub(crate) fn close_tls(&mut self) {
        if let Some(tls) = self.tls.as_mut() {
            if self.plain_msgs == 0 && !tls.is_handshaking() {
                tls.close_notify();
                let _ = tls.flush(&mut self.stream);
            }
        }
    }

    /// Whether the connection may take more requests: it is open, the service is not
    /// stopping, and it is within its bounds of requests and bytes.
    pub(crate) fn can_parse(&self, draining: bool, bytes_max: usize) -> bool {
        self.closing.is_none()
            && !self.gone
            && !draining
            && P::requests_inflight(&self.proto) < REQUESTS_INFLIGHT_MAX
            && self.out_bytes + self.held_bytes < bytes_max
    }

    /// Received bytes the protocol has not consumed yet.
    pub fn input(&self) -> &[u8] {
        &self.inbuf[self.in_start..self.in_end]
    }

    /// The unconsumed input and the protocol's state, to parse the one with the other.
    pub fn input_and_state(&mut self) -> (&[u8], &mut P::Conn) {
        (&self.inbuf[self.in_start..self.in_end], &mut self.proto)
    }

    /// Marks the first `n` bytes of [`Conn::input`] consumed.
    pub fn consume(&mut self, n: usize) {
        assert!(n <= self.in_end - self.in_start);
        self.in_start += n;
        if self.in_start == self.in_end && self.inbuf.len() > INBUF_KEEP_BYTES {
            // A large request passed: give its room back now, not at the next read, so its
            // reactor's slot for large requests frees at once.
            self.in_start = 0;
            self.in_end = 0;
            self.inbuf.truncate(INBUF_KEEP_BYTES);
            self.inbuf.shrink_to(INBUF_KEEP_BYTES);
        }
    }

    /// Gives back the room a large request took, once what is left of the input fits the
    /// standing buffer.
    pub(crate) fn shrink_input(&mut self) {
        if self.inbuf.len() > INBUF_KEEP_BYTES && self.input_len() <= INBUF_KEEP_BYTES {
            self.inbuf.copy_within(self.in_start..self.in_end, 0);
            self.in_end -= self.in_start;
            self.in_start = 0;
            self.inbuf.truncate(INBUF_KEEP_BYTES);
            self.inbuf.shrink_to(INBUF_KEEP_BYTES);
        }
        debug_assert!(self.in_end <= self.inbuf.len());
    }

    /// Unconsumed input bytes: what is left of a request not yet whole.
    pub(crate) fn input_len(&self) -> usize {
        self.in_end - self.in_start
    }

    /// Counts `bytes` of data a request in flight holds against the connection's bound.
    pub fn hold(&mut self, bytes: usize) {
        self.held_bytes += bytes;
    }

    /// Gives back what [`Conn::hold`] counted, once the request is done.
    pub fn release(&mut self, bytes: usize) {
        assert!(bytes <= self.held_bytes, "releasing more than is held");
        self.held_bytes -= bytes;
    }

    /// Queues a reply: a short header (at most [`HEAD_INLINE_BYTES_MAX`] bytes, held without
    /// an allocation) and a read's data.
    pub fn push_reply(&mut self, header: &[u8], data: Vec<IoBuf>) {
        assert!(header.len() <= HEAD_INLINE_BYTES_MAX);
        // An empty message would make the next `writev` write nothing, read as a closed
        // socket; no protocol sends a reply of no bytes.
        debug_assert!(!header.is_empty() || data.iter().any(|b| !b.is_empty()));
        let mut bytes = [0u8; HEAD_INLINE_BYTES_MAX];
        bytes[..header.len()].copy_from_slice(header);
        self.push_out(OutMsg {
            head: Head::Inline {
                bytes,
                len: header.len() as u8,
            },
            data,
        });
    }

    /// Queues bytes to send as they are (a handshake's replies). Nothing is queued for no
    /// bytes: an empty message would make the next `writev` write nothing, which reads as
    /// a closed socket.
    pub fn push_bytes(&mut self, bytes: Vec<u8>) {
        if bytes.is_empty() {
            return;
        }
        self.push_out(OutMsg {
            head: Head::Bytes(bytes),
            data: Vec::new(),
        });
    }

    fn push_out(&mut self, msg: OutMsg) {
        self.out_bytes += msg.len() + OUT_MSG_OVERHEAD_BYTES;
        self.out.push_back(msg);
        self.debug_assert_out_accounted();
    }

    pub(crate) fn has_output(&self) -> bool {
        !self.out.is_empty() || self.tls.as_ref().is_some_and(|t| t.wants_write())
    }

    /// Checks that every byte the connection is charged for is accounted for: queued
    /// bytes not yet sent, plus the fixed cost of each queued reply. Costs a walk over the
    /// queue, so in debug builds only, and only while the queue is short: a client that
    /// never reads may queue hundreds of thousands of replies, and a walk per push would
    /// make a debug server quadratic in them.
    fn debug_assert_out_accounted(&self) {
        const CHECKED_MSGS_MAX: usize = 1024;
        if cfg!(debug_assertions) && self.out.len() <= CHECKED_MSGS_MAX {
            let queued: usize = self
                .out
                .iter()
                .map(|m| m.len() + OUT_MSG_OVERHEAD_BYTES)
                .sum();
            assert!(self.out_sent <= self.out.front().map_or(0, OutMsg::len));
            assert_eq!(self.out_bytes + self.out_sent, queued);
        }
    }

    /// Checks, as the connection closes, that every request gave back what it held.
    pub(crate) fn assert_closed_clean(&self) {
        assert_eq!(P::requests_inflight(&self.proto), 0);
        assert_eq!(self.held_bytes, 0, "requests done, bytes still held");
        assert!(self.gone || self.out_bytes == 0);
    }

    /// Writes queued replies until done or the socket is full; sent data buffers go back to
    /// `bufs`. Returns the bytes written (to the socket, or into the TLS session).
    pub(crate) fn write_out(&mut self, bufs: &mut BufCache) -> io::Result<usize> {
        self.debug_assert_out_accounted();
        let mut written = 0;
        self.write_blocked = false;
        loop {
            let plaintext = self.tls.is_none() || self.plain_msgs > 0;
            if plaintext && self.out.is_empty() {
                break;
            }
            if !plaintext {
                let tls = self.tls.as_mut().expect("not plaintext");
                written += tls.flush(&mut self.stream)?;
                if tls.wants_write() {
                    self.write_blocked = true;
                    break;
                }
                if self.out.is_empty() || tls.is_handshaking() {
                    break;
                }
            }
            let mut slices = [IoSlice::new(&[]); WRITEV_SLICES_MAX];
            let msgs_max = if plaintext && self.tls.is_some() {
                self.plain_msgs
            } else {
                usize::MAX
            };
            let count = fill_slices(&self.out, self.out_sent, &mut slices, msgs_max);
            let result = match (plaintext, self.tls.as_mut()) {
                (false, Some(tls)) => tls.encrypt(&slices[..count]),
                _ => self.stream.write_vectored(&slices[..count]),
            };
            let n = match result {
                Ok(0) if plaintext => return Err(io::ErrorKind::WriteZero.into()),
                // Cannot be: the session's buffer was just emptied and the handshake is
                // over. Stop rather than spin.
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.write_blocked = true;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            written += n;
            self.advance_out(n, plaintext, bufs);
        }
        self.debug_assert_out_accounted();
        Ok(written)
    }

    /// Marks `n` more queued bytes sent: finished messages leave the queue, their data
    /// buffers go back to `bufs`.
    fn advance_out(&mut self, n: usize, plaintext: bool, bufs: &mut BufCache) {
        self.out_bytes -= n;
        let mut left = self.out_sent + n;
        while let Some(front) = self.out.front() {
            let len = front.len();
            if left < len {
                break;
            }
            left -= len;
            if let Some(msg) = self.out.pop_front() {
                msg.data.into_iter().for_each(|b| bufs.give(b));
            }
            self.out_bytes -= OUT_MSG_OVERHEAD_BYTES;
            if plaintext && self.plain_msgs > 0 {
                self.plain_msgs -= 1;
            }
        }
        self.out_sent = left;
    }

    /// Reads what the socket has, up to the per-poll budget, into an input buffer of at
    /// most `limit_bytes`. Returns bytes read; an end of stream or an error marks the client
    /// gone.
    pub(crate) fn read_in(&mut self, limit_bytes: usize) -> usize {
        assert!(self.in_start <= self.in_end && self.in_end <= self.inbuf.len());
        assert!(self.inbuf.len() <= limit_bytes);
        let mut total = 0;
        while total < READ_BYTES_PER_POLL {
            if self.in_start == self.in_end {
                self.in_start = 0;
                self.in_end = 0;
                if self.inbuf.len() > INBUF_KEEP_BYTES {
                    // A large write passed: give its room back.
                    self.inbuf.truncate(INBUF_KEEP_BYTES);
                    self.inbuf.shrink_to(INBUF_KEEP_BYTES);
                }
            } else if self.in_start > 0 && self.inbuf.len() - self.in_end < READ_CHUNK_BYTES {
                self.inbuf.copy_within(self.in_start..self.in_end, 0);
                self.in_end -= self.in_start;
                self.in_start = 0;
            }
            if self.inbuf.len() - self.in_end < READ_CHUNK_BYTES && self.inbuf.len() < limit_bytes {
                let grown = (self.in_end + READ_CHUNK_BYTES).min(limit_bytes);
                self.inbuf.resize(grown, 0);
            }
            if self.in_end == self.inbuf.len() {
                // Full: the parser must consume first.
                break;
            }
            let read = match self.tls.as_mut() {
                Some(tls) => tls.read(&mut self.stream, &mut self.inbuf[self.in_end..]),
                None => self.stream.read(&mut self.inbuf[self.in_end..]),
            };
            match read {
                Ok(0) => {
                    // The client sent all it will: what it sent is still served and its
                    // replies go out (see `Shard::progress`).
                    self.eof = true;
                    break;
                }
                Ok(n) => {
                    let asked = self.inbuf.len() - self.in_end;
                    self.in_end += n;
                    total += n;
                    if n < asked && self.tls.is_none() {
                        // The socket is drained: another read would only say EAGAIN. (A
                        // TLS read stops at a record's end instead, whatever the socket
                        // holds.)
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.gone = true;
                    self.failed = true;
                    self.closing = Some(format!("reading the socket: {e}"));
                    break;
                }
            }
        }
        assert!(self.in_start <= self.in_end && self.in_end <= self.inbuf.len());
        assert!(self.inbuf.len() <= limit_bytes);
        total
    }
}

/// Points `slices` at the unsent bytes of the first `msgs_max` messages of `out`, whose
/// front has `out_sent` bytes sent, as many as fit; returns how many slices it filled.
fn fill_slices<'a>(
    out: &'a VecDeque<OutMsg>,
    out_sent: usize,
    slices: &mut [IoSlice<'a>; WRITEV_SLICES_MAX],
    msgs_max: usize,
) -> usize {
    let mut count = 0;
    let mut skip = out_sent;
    for msg in out.iter().take(msgs_max) {
        for part in std::iter::once(&msg.head[..]).chain(msg.data.iter().map(|b| &b[..])) {
            if skip >= part.len() {
                skip -= part.len();
                continue;
            }
            slices[count] = IoSlice::new(&part[skip..]);
            count += 1;
            skip = 0;
            if count == WRITEV_SLICES_MAX {
                return count;
            }
        }
    }
    count
}

#[cfg(test)]
pub(crate) mod tests;
