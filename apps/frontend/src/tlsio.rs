//! One connection's TLS session, driven without blocking from the reactor's turn: ciphertext
//! is read from the non-blocking socket into rustls and plaintext read out of it; plaintext
//! replies go in and ciphertext is written out as the socket takes it. Nothing here waits:
//! a socket that would block returns `WouldBlock` to the connection, whose epoll interest
//! brings it back.
//!
//! Ciphertext is read from the socket in large reads into a staging buffer and handed to
//! rustls from there (rustls itself reads 4 KiB at a time), and a short read tells that the
//! socket is empty, so a turn costs no read that only says EAGAIN.
//!
//! What a session holds beyond the connection's own buffers is bounded by
//! [`TLS_BUFFER_BYTES_MAX`] (rustls's own limits, the send limit set here and the staging
//! buffer), so it is documented beside `--max-connection-bytes` rather than counted in it:
//! the smallest byte bound would not hold it.

use std::io::{self, IoSlice, Read, Write};
use std::sync::Arc;

use crate::stream::Stream;

/// Ciphertext queued for the socket that rustls holds before it takes no more plaintext:
/// room for a batch of replies (32 reads of 4 KiB and their headers), so one `writev`
/// carries the batch; at a quarter of this, a batch took two or three.
pub const TLS_SEND_BYTES_MAX: usize = 256 << 10;
/// Received plaintext rustls holds (its fixed limit: it reads no more ciphertext past it).
const TLS_RECEIVED_PLAINTEXT_BYTES_MAX: usize = 16 << 10;
/// Ciphertext rustls holds while it joins one handshake message (its fixed limit; a record
/// outside a handshake needs far less).
const TLS_DEFRAME_BYTES_MAX: usize = 64 << 10;
/// Ciphertext taken from the socket per read, before rustls takes it: two full records.
const TLS_STAGE_BYTES: usize = 32 << 10;
/// Most bytes one connection's TLS session holds in its buffers, beyond
/// `--max-connection-bytes`.
pub const TLS_BUFFER_BYTES_MAX: usize =
    TLS_SEND_BYTES_MAX + TLS_RECEIVED_PLAINTEXT_BYTES_MAX + TLS_DEFRAME_BYTES_MAX + TLS_STAGE_BYTES;
/// Ciphertext one read takes from the socket before it hands control back, when what it
/// decrypts yields no plaintext (handshake records, empty records), so a client cannot
/// keep a reactor in one connection's read.
const CIPHERTEXT_BYTES_PER_READ_MAX: usize = 1 << 20;

/// A connection's TLS session.
pub(crate) struct Tls {
    session: rustls::ServerConnection,
    /// Ciphertext read from the socket: `stage[stage_start..stage_end]` is not yet rustls's.
    stage: Box<[u8]>,
    stage_start: usize,
    stage_end: usize,
    /// The last socket read came back short: the socket is empty until epoll says
    /// otherwise, so the next read that finds nothing staged returns `WouldBlock` at once.
    socket_drained: bool,
}

impl Tls {
    pub(crate) fn new(config: Arc<rustls::ServerConfig>) -> Result<Tls, rustls::Error> {
        let mut session = rustls::ServerConnection::new(config)?;
        session.set_buffer_limit(Some(TLS_SEND_BYTES_MAX));
        Ok(Tls {
            session,
            stage: vec![0u8; TLS_STAGE_BYTES].into_boxed_slice(),
            stage_start: 0,
            stage_end: 0,
            socket_drained: false,
        })
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
            if self.stage_start == self.stage_end {
                if std::mem::take(&mut self.socket_drained)
                    || ciphertext_bytes >= CIPHERTEXT_BYTES_PER_READ_MAX
                {
                    // Level-triggered epoll brings the connection back for the rest.
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                let n = match sock.read(&mut self.stage) {
                    Ok(0) => return Ok(0),
                    Ok(n) => n,
                    Err(e) => return Err(e),
                };
                self.socket_drained = n < self.stage.len();
                (self.stage_start, self.stage_end) = (0, n);
                ciphertext_bytes += n;
            }
            let mut staged = &self.stage[self.stage_start..self.stage_end];
            let taken = self.session.read_tls(&mut staged)?;
            if taken == 0 {
                // rustls takes every record it is given unless it has failed: stop, never
                // spin on input it will not take.
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "the TLS session takes no more input",
                ));
            }
            self.stage_start += taken;
            if let Err(e) = self.session.process_new_packets() {
                // rustls queued an alert saying why: one attempt to send it, so the client
                // reports the cause (a certificate refused) rather than a reset.
                let _ = self.session.write_tls(sock);
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        }
    }

    /// Whether input waits in the session, decrypted or staged: the socket may be empty,
    /// so no readiness event would come for it.
    pub(crate) fn has_input(&mut self) -> bool {
        self.stage_start < self.stage_end
            || self
                .session
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

    /// The client's own certificate, once the handshake is over.
    pub(crate) fn peer_certificate(&self) -> Option<&rustls::pki_types::CertificateDer<'static>> {
        if self.session.is_handshaking() {
            return None;
        }
        self.session.peer_certificates()?.first()
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::path::Path;
    use std::process::Command;

    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    use crate::bufcache::BufCache;
    use crate::conn::tests::Sender;
    use crate::conn::Conn;
    use crate::epoll::Interest;
    use crate::stream::Stream;

    fn openssl(dir: &Path, args: &[&str]) {
        let out = Command::new("openssl")
            .current_dir(dir)
            .args(args)
            .output()
            .expect("openssl runs (scripts/test installs it)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A CA (`ca.pem`) and a certificate it signed for `localhost`, made with openssl.
    fn server_config(dir: &Path) -> std::sync::Arc<rustls::ServerConfig> {
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=ca",
                "-keyout",
                "ca-key.pem",
                "-out",
                "ca.pem",
            ],
        );
        openssl(
            dir,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                "/CN=localhost",
                "-keyout",
                "key.pem",
                "-out",
                "req.pem",
            ],
        );
        std::fs::write(dir.join("ext"), "subjectAltName=DNS:localhost\n").unwrap();
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-days",
                "2",
                "-in",
                "req.pem",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca-key.pem",
                "-CAcreateserial",
                "-out",
                "cert.pem",
                "-extfile",
                "ext",
            ],
        );
        let certs = CertificateDer::pem_file_iter(dir.join("cert.pem"))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let key = PrivateKeyDer::from_pem_file(dir.join("key.pem")).unwrap();
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        std::sync::Arc::new(config)
    }

    fn client_config(dir: &Path) -> std::sync::Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(dir.join("ca.pem")).unwrap() {
            roots.add(cert.unwrap()).unwrap();
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        std::sync::Arc::new(config)
    }

    fn socket_readable(s: std::os::fd::BorrowedFd<'_>) -> bool {
        let mut fd = libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd on a descriptor the caller's socket keeps open; no wait.
        unsafe { libc::poll(&mut fd, 1, 0) == 1 }
    }

    /// When a read stops at the input buffer's bound, decrypted input can stay in the TLS
    /// session with the socket empty: no readiness event would ever announce it, so the
    /// connection must say it waits (the shard reads it on its next turn).
    #[test]
    fn decrypted_input_left_behind_a_full_buffer_is_reported_and_read_later() {
        let dir = std::env::temp_dir().join(format!("hypoll-tlsio-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let interest = Interest {
            read: true,
            write: false,
        };
        let mut conn: Conn<Sender> = Conn::new(Stream::Unix(ours), "peer".into(), (), interest, 0);
        conn.start_tls(Some(&server_config(&dir))).unwrap();
        let name = "localhost".try_into().unwrap();
        let client = rustls::ClientConnection::new(client_config(&dir), name).unwrap();
        let mut client = rustls::StreamOwned::new(client, theirs);
        let mut bufs = BufCache::default();
        // The handshake, both sides turned by hand.
        client.sock.set_nonblocking(true).unwrap();
        for _ in 0..100 {
            let _ = client.conn.complete_io(&mut client.sock);
            conn.read_in(8 << 10);
            conn.write_out(&mut bufs).unwrap();
            if !client.conn.is_handshaking() && !conn.tls.as_ref().unwrap().is_handshaking() {
                break;
            }
        }
        assert!(!client.conn.is_handshaking(), "handshake done");
        client.sock.set_nonblocking(false).unwrap();

        // One record of 12 KiB; the connection's buffer holds 8 KiB of it.
        let sent: Vec<u8> = (0..12 << 10).map(|i| (i % 251) as u8).collect();
        client.write_all(&sent).unwrap();
        client.flush().unwrap();
        assert_eq!(conn.read_in(8 << 10), 8 << 10);
        assert!(
            !socket_readable(conn.stream.fd()),
            "all its ciphertext was read"
        );
        assert!(conn.tls_input_waiting(), "4 KiB wait in the session");
        let mut got = conn.input().to_vec();
        conn.consume(got.len());
        conn.read_in(8 << 10);
        got.extend_from_slice(conn.input());
        assert_eq!(got, sent);
        assert!(!conn.tls_input_waiting());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
