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
//! ring's index. A SET_MEM_TABLE or REM_MEM_REG while rings run waits the same way, for
//! every running ring to have answered all it took (`Control::quiesce`); the message is
//! then handled, its answer sent, and the hold lifted. Sockets are blocking with a timeout
//! on each read and write: a message is read only once its header is there, and a front
//! end that stalls mid-message or does not read its answers costs the reactor at most the
//! timeout, then its connection. (The wait for the rings is not bounded by it: it lasts
//! as long as the device takes to answer what the rings took, off the reactor's path.)

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
/// How long a reactor that keeps turning waits before it looks again at a socket that had
/// nothing to read (a listening socket, a control connection between messages): a look is
/// a system call, every poller is polled on every turn, and once a guest runs its front
/// end sends control messages rarely. A reactor about to block arms the socket in epoll
/// instead, and looks at once when it wakes.
const IDLE_SOCKET_LOOK_NS: u64 = 1_000_000;
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
    /// What the next message waits for, if anything.
    waiting: Option<Wait>,
}

/// What a control connection's next message waits for.
#[derive(Clone, Copy, Debug)]
enum Wait {
    /// GET_VRING_BASE: this ring's stop.
    Stop(usize),
    /// A message that replaces or removes memory: every running ring to be quiet.
    Quiesce,
}

/// Whether a message of `code` replaces or removes guest memory (and so waits for the
/// rings to answer what they took under the old map before it is handled).
fn takes_memory(code: u32) -> bool {
    code == FrontendReq::SET_MEM_TABLE as u32 || code == FrontendReq::REM_MEM_REG as u32
}

impl<S: VhostState> ControlConn<S> {
    /// Takes the connection out of the reactor's epoll set until what its next message
    /// needs has happened (`resume_control` puts it back).
    fn wait(&mut self, r: &mut Reactor<S>, wait: Wait) {
        self.waiting = Some(wait);
        if let Some(id) = self.poller.take() {
            r.remove_poller(id);
        }
    }

    /// Whether the front end has closed the connection (what it sent before it closed,
    /// if anything, is moot: a front end that reconnects sets everything up again).
    fn ended(&self) -> bool {
        self.handler
            .try_clone_connection()
            .map_or(true, |sock| peer_closed(sock.as_fd()))
    }
}

/// When a poller next looks at its socket.
#[derive(Debug, Default)]
pub(crate) struct Pace {
    /// The reactor time of the next look; 0: the next poll.
    next_ns: u64,
}

impl Pace {
    /// Whether to look at the socket at `now_ns`.
    fn due(&self, now_ns: u64) -> bool {
        now_ns >= self.next_ns
    }

    /// A look at `now_ns` found nothing: the next waits [`IDLE_SOCKET_LOOK_NS`].
    fn found_nothing(&mut self, now_ns: u64) {
        self.next_ns = now_ns.saturating_add(IDLE_SOCKET_LOOK_NS);
        debug_assert!(!self.due(now_ns));
    }

    /// The reactor is about to block with the socket in its epoll set: whatever wakes it,
    /// the next poll looks.
    fn before_block(&mut self) {
        self.next_ns = 0;
    }
}

/// Watches one export's listening socket.
pub(crate) struct Listen {
    pub listener: UnixListener,
    pub export: usize,
    pub pace: Pace,
}

impl<S: VhostState> Poller<S> for Listen {
    fn poll(&mut self, r: &mut Reactor<S>, state: &mut S) -> usize {
        let now_ns = r.now_ns();
        if !self.pace.due(now_ns) {
            return 0;
        }
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
        if work == 0 {
            self.pace.found_nothing(now_ns);
        }
        work
    }

    fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.listener.as_fd())
    }

    fn before_block(&mut self) -> bool {
        self.pace.before_block();
        false
    }
}

/// Drives one control connection.
struct ConnPoller {
    key: usize,
    sock: UnixStream,
    pace: Pace,
}

impl<S: VhostState> Poller<S> for ConnPoller {
    fn poll(&mut self, r: &mut Reactor<S>, state: &mut S) -> usize {
        let now_ns = r.now_ns();
        if !self.pace.due(now_ns) {
            return 0;
        }
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
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                self.pace.found_nothing(now_ns);
                return 0;
            }
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
            self.pace.found_nothing(now_ns);
            return 0;
        }
        let code = u32::from_le_bytes(head[0..4].try_into().expect("4 bytes"));
        tracing::trace!(code, "a vhost-user message");
        if code == FrontendReq::GET_VRING_BASE as u32 {
            if n < VRING_STATE_MESSAGE_BYTES {
                self.pace.found_nothing(now_ns);
                return 0;
            }
            let index = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes"));
            let running = conn
                .backend
                .lock()
                .expect("never poisoned")
                .stop_ring(index as usize);
            if running {
                conn.wait(r, Wait::Stop(index as usize));
                return 1;
            }
        }
        let memory = takes_memory(code);
        if memory && conn.backend.lock().expect("never poisoned").quiesce() {
            conn.wait(r, Wait::Quiesce);
            return 1;
        }
        let handled = conn.handler.handle_request();
        if memory {
            // Handled (or refused): the rings take the new map, if any, and go on.
            conn.backend.lock().expect("never poisoned").release();
        }
        match handled {
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

    fn before_block(&mut self) -> bool {
        self.pace.before_block();
        false
    }
}

impl<S: VhostState> VhostShard<S> {
    /// Takes a connection that came in on export `export`'s socket.
    fn adopt(&mut self, r: &mut Reactor<S>, export: usize, stream: UnixStream) {
        if self.draining {
            tracing::info!(
                export = %self.exports[export].name,
                "a vhost-user front end connected while the server stops: closed"
            );
            return;
        }
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
        let added = conn.handler.try_clone_connection().and_then(|sock| {
            r.add_poller(Box::new(ConnPoller {
                key,
                sock,
                pace: Pace::default(),
            }))
        });
        match added {
            Ok(id) => conn.poller = Some(id),
            Err(e) => {
                tracing::warn!("watching a vhost-user connection failed: {e}");
                self.close(r, key);
            }
        }
    }

    /// A ring of connection `key` has stopped, or has answered all it took under a hold:
    /// if what the connection's next message waits for has happened, read its messages
    /// again.
    pub(crate) fn resume_control(&mut self, r: &mut Reactor<S>, key: usize) {
        let Some(conn) = self.controls.get_mut(key) else {
            return;
        };
        let Some(wait) = conn.waiting else {
            return;
        };
        let mut backend = conn.backend.lock().expect("never poisoned");
        let still = match wait {
            Wait::Stop(index) => backend.stop_ring(index),
            Wait::Quiesce => backend.quiesce(),
        };
        drop(backend);
        if still {
            // Another ring's news, or a stale message: what it waits for has not happened.
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
        let mut backend = conn.backend.lock().expect("never poisoned");
        backend.release();
        backend.stop_all();
        drop(backend);
        tracing::info!(export = %self.exports[conn.export].name, "a vhost-user front end left");
    }

    /// The graceful stop on this reactor: no new front end is served, and every ring of the
    /// connections here stops taking the guest's requests, answers those it took (and
    /// signals the guest) and ends; no ring starts again. The connections stay open, so
    /// that the front end keeps listening for the rings' signals until the reactors stop.
    pub fn drain(&mut self) {
        self.draining = true;
        for (_, conn) in self.controls.iter_mut() {
            conn.backend.lock().expect("never poisoned").drain();
        }
    }

    /// Control connections open on this reactor.
    pub fn connections(&self) -> usize {
        self.controls.len()
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;
    use std::time::{Duration, Instant};

    use hypoll_reactor::{Device, Reactor, ReactorTuning, StandaloneConfig};

    use super::*;
    use crate::blk::Geometry;
    use crate::server::{bind_socket, Standalone};

    #[test]
    fn a_socket_that_had_nothing_is_looked_at_again_after_the_pace_or_a_block() {
        let mut pace = Pace::default();
        assert!(pace.due(0), "a new poller looks at once");
        pace.found_nothing(5_000);
        assert!(!pace.due(5_000) && !pace.due(5_000 + IDLE_SOCKET_LOOK_NS - 1));
        assert!(pace.due(5_000 + IDLE_SOCKET_LOOK_NS));
        pace.before_block();
        assert!(pace.due(5_001), "after a block the next poll looks");
        pace.found_nothing(u64::MAX - 1);
        assert!(!pace.due(u64::MAX - 1));
    }

    /// A reactor that keeps turning looks at an empty listening socket once per
    /// [`IDLE_SOCKET_LOOK_NS`] of its own time, not once per turn (each look is a system
    /// call); a reactor that blocked looks as soon as it wakes.
    #[test]
    fn a_turning_reactor_accepts_at_its_pace_and_a_woken_one_at_once() {
        let (mut r, _handle) = Reactor::<Standalone>::standalone(StandaloneConfig {
            tuning: ReactorTuning {
                idle_spin_ns: 0,
                ..ReactorTuning::default()
            },
            ..StandaloneConfig::default()
        })
        .unwrap();
        let device = Device::open("null,size=1M").unwrap();
        let geometry = Geometry::new(&device.ctrl.namespace(), false, false, false, 1);
        let vhost = VhostShard::new(&mut r, &[("d".into(), device, geometry)], 8).unwrap();
        let mut state = Standalone { vhost };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        let listener = bind_socket(&path).unwrap();
        state.vhost.listen_on(&mut r, 0, listener).unwrap();

        // An empty look, then a front end connects: turns before the pace has passed do
        // not look; the first after it accepts.
        r.poll(&mut state);
        let looked_ns = r.now_ns();
        let _first = UnixStream::connect(&path).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            r.poll(&mut state);
            let accepted = state.vhost.connections() == 1;
            if r.now_ns() < looked_ns + IDLE_SOCKET_LOOK_NS {
                assert!(!accepted, "looked again before the pace");
            } else {
                assert!(accepted, "the first turn after the pace accepts");
                break;
            }
            assert!(Instant::now() < deadline);
        }

        // Its control connection has nothing to read either: the reactor blocks (both
        // sockets armed), a second front end's connection wakes it, and the next turn
        // takes it (and closes it: one front end per export at a time) without waiting
        // for the pace.
        r.poll(&mut state);
        r.poll(&mut state);
        let before = UnixStream::connect(&path).unwrap();
        let woke = Instant::now();
        r.idle();
        let looked = r.poll(&mut state);
        assert!(looked > 0, "the woken reactor looked at once");
        assert!(woke.elapsed() < Duration::from_secs(2));
        drop(before);
    }
}
