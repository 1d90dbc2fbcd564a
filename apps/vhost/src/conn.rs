//! The sockets of the back end on a reactor: each export's listening socket, and the one
//! control connection it serves at a time, both pollers whose fd is their wake fd. No
//! thread of their own: the `vhost` crate's request handler reads one message when the
//! socket has one, on the reactor.
//!
//! The handler answers each message before it returns, but GET_VRING_BASE must wait for
//! the ring to stop, and the ring runs on another reactor (or on this one, in a later
//! turn). So the connection peeks at each message before the handler reads it: a
//! GET_VRING_BASE for a running ring asks the ring to stop and takes the connection out of
//! the reactor's epoll set; the ring, once its requests in flight are answered, sends a
//! message back that puts it in again, and the handler then answers with the stopped
//! ring's index. Sockets are blocking with a timeout on each read and write: a message is
//! read only once its header is there, and a front end that stalls mid-message or does not
//! read its answers costs the reactor at most the timeout, then its connection.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hypoll_reactor::{Poller, PollerId, Reactor};
use vhost::vhost_user::message::FrontendReq;
use vhost::vhost_user::{BackendReqHandler, Error};

use crate::control::{Control, Handler};
use crate::shard::{VhostShard, VhostState};
use crate::sys::{peek, peer_closed};

/// How long one read or write of a control message may block the reactor.
pub const CONTROL_IO_TIMEOUT: Duration = Duration::from_millis(200);
/// Bytes of a vhost-user message header, and of a header with a `VhostUserVringState`.
const HEADER_BYTES: usize = 12;
const VRING_STATE_MESSAGE_BYTES: usize = HEADER_BYTES + 8;

/// One control connection, as its reactor holds it.
pub(crate) struct ControlConn<S: VhostState> {
    handler: Handler<S>,
    backend: Arc<Mutex<Control<S>>>,
    /// The export whose socket it came in on (one connection per export at a time).
    export: usize,
    poller: Option<PollerId>,
    /// The ring whose stop a GET_VRING_BASE waits for.
    waiting: Option<usize>,
}

impl<S: VhostState> ControlConn<S> {
    /// Whether the front end has closed the connection (what it sent before it closed,
    /// if anything, is moot: a front end that reconnects sets everything up again).
    fn ended(&self) -> bool {
        self.handler
            .try_clone_connection()
            .map_or(true, |sock| peer_closed(sock.as_fd()))
    }
}

/// Watches one export's listening socket.
pub(crate) struct Listen {
    pub listener: UnixListener,
    pub export: usize,
}

impl<S: VhostState> Poller<S> for Listen {
    fn poll(&mut self, r: &mut Reactor<S>, state: &mut S) -> usize {
        let mut work = 0;
        loop {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::warn!("accepting a vhost-user connection: {e}");
                    break;
                }
            };
            work += 1;
            state.vhost().adopt(r, self.export, stream);
        }
        work
    }

    fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.listener.as_fd())
    }
}

/// Drives one control connection.
struct ConnPoller {
    key: usize,
    sock: UnixStream,
}

impl<S: VhostState> Poller<S> for ConnPoller {
    fn poll(&mut self, r: &mut Reactor<S>, state: &mut S) -> usize {
        let shard = state.vhost();
        let Some(conn) = shard.controls.get_mut(self.key) else {
            return 0;
        };
        if conn.waiting.is_some() {
            return 0;
        }
        let mut head = [0u8; VRING_STATE_MESSAGE_BYTES];
        let n = match peek(self.sock.as_fd(), &mut head) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return 0,
            Err(e) => {
                tracing::info!("a vhost-user connection failed: {e}");
                shard.close(r, self.key);
                return 1;
            }
        };
        if n == 0 {
            shard.close(r, self.key);
            return 1;
        }
        if n < HEADER_BYTES {
            // The rest of the header is on its way.
            return 0;
        }
        let code = u32::from_le_bytes(head[0..4].try_into().expect("4 bytes"));
        tracing::trace!(code, "a vhost-user message");
        if code == FrontendReq::GET_VRING_BASE as u32 {
            if n < VRING_STATE_MESSAGE_BYTES {
                return 0;
            }
            let index = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes"));
            let running = conn
                .backend
                .lock()
                .expect("never poisoned")
                .stop_ring(index as usize);
            if running {
                conn.waiting = Some(index as usize);
                if let Some(id) = conn.poller.take() {
                    r.remove_poller(id);
                }
                return 1;
            }
        }
        match conn.handler.handle_request() {
            Ok(()) => {}
            Err(Error::Disconnected | Error::PartialMessage) => shard.close(r, self.key),
            Err(e) => {
                tracing::warn!(
                    "a vhost-user front end's message failed ({e}): closing its connection"
                );
                shard.close(r, self.key);
            }
        }
        1
    }

    fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.sock.as_fd())
    }
}

impl<S: VhostState> VhostShard<S> {
    /// Takes a connection that came in on export `export`'s socket.
    fn adopt(&mut self, r: &mut Reactor<S>, export: usize, stream: UnixStream) {
        // A front end that reconnects has closed its old connection, which this reactor
        // may not have seen yet: an old connection at its end goes first.
        let ended: Vec<usize> = self
            .controls
            .iter()
            .filter(|(_, c)| c.export == export && c.ended())
            .map(|(key, _)| key)
            .collect();
        for key in ended {
            self.close(r, key);
        }
        if self.controls.iter().any(|(_, c)| c.export == export) {
            tracing::warn!(
                export = %self.exports[export].name,
                "a second vhost-user front end for an export already served: closed"
            );
            return;
        }
        let timeouts = stream
            .set_read_timeout(Some(CONTROL_IO_TIMEOUT))
            .and_then(|()| stream.set_write_timeout(Some(CONTROL_IO_TIMEOUT)))
            .and_then(|()| stream.set_nonblocking(false));
        if let Err(e) = timeouts {
            tracing::warn!("setting up a vhost-user connection: {e}");
            return;
        }
        let key = self.controls.vacant_key();
        let control = Control::new(
            export,
            self.exports[export].geometry,
            r.handles().clone(),
            (r.index(), key),
        );
        let backend = Arc::new(Mutex::new(control));
        let handler = BackendReqHandler::from_stream(stream, backend.clone());
        let inserted = self.controls.insert(ControlConn {
            handler,
            backend,
            export,
            poller: None,
            waiting: None,
        });
        debug_assert_eq!(inserted, key);
        tracing::info!(export = %self.exports[export].name, "a vhost-user front end connected");
        self.watch(r, key);
    }

    /// Puts connection `key`'s socket in the reactor's epoll set (again).
    fn watch(&mut self, r: &mut Reactor<S>, key: usize) {
        let conn = &mut self.controls[key];
        let added = conn
            .handler
            .try_clone_connection()
            .and_then(|sock| r.add_poller(Box::new(ConnPoller { key, sock })));
        match added {
            Ok(id) => conn.poller = Some(id),
            Err(e) => {
                tracing::warn!("watching a vhost-user connection failed: {e}");
                self.close(r, key);
            }
        }
    }

    /// A ring that connection `key` waited for has stopped: read its messages again.
    pub(crate) fn resume_control(&mut self, r: &mut Reactor<S>, key: usize) {
        let Some(conn) = self.controls.get_mut(key) else {
            return;
        };
        let Some(index) = conn.waiting else {
            return;
        };
        if conn
            .backend
            .lock()
            .expect("never poisoned")
            .stop_ring(index)
        {
            // Another ring's stop, or a stale message: this one still runs.
            return;
        }
        conn.waiting = None;
        self.watch(r, key);
    }

    /// Closes connection `key`: its rings stop (each finishes what it has in flight).
    fn close(&mut self, r: &mut Reactor<S>, key: usize) {
        let Some(mut conn) = self.controls.try_remove(key) else {
            return;
        };
        if let Some(id) = conn.poller.take() {
            r.remove_poller(id);
        }
        conn.backend.lock().expect("never poisoned").stop_all();
        tracing::info!(export = %self.exports[conn.export].name, "a vhost-user front end left");
    }

    /// Control connections open on this reactor.
    pub fn connections(&self) -> usize {
        self.controls.len()
    }
}
