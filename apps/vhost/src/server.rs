//! A vhost-user-blk server of its own: reactors whose state is the back end's shard and
//! nothing else, each export's socket listened to on the first reactor. (A server that
//! shares its reactors with other front ends holds a [`VhostShard`] in its own state and
//! calls [`VhostShard::new`] and [`VhostShard::listen`] from its reactors' `init`.)

use std::io;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use hypoll_frontend::remove_stale_socket;
use hypoll_reactor::{
    CoreList, Device, InitError, Opcode, Reactor, ReactorConfig, ReactorHandle, ReactorSet,
    ShutdownReport,
};

use crate::blk::Geometry;
use crate::conn::{Listen, Pace};
use crate::shard::{VhostShard, VhostState};
use crate::stop::{drain, VHOST_DRAIN_TIMEOUT};

/// Queue depth of each export's queue pair on each reactor, unless configured.
pub const QUEUE_DEPTH_DEFAULT: usize = 256;

/// One export: a device served on a vhost-user socket.
pub struct VhostExport {
    /// Its name (the guest reads it with GET_ID, its first 20 bytes).
    pub name: String,
    pub device: Device,
    pub read_only: bool,
    /// Where the socket is made (an old socket file there is replaced).
    pub socket: PathBuf,
}

impl VhostExport {
    /// What the guest is shown of this export, served on `num_queues` queues.
    pub fn geometry(&self, num_queues: u16) -> Geometry {
        let ctrl = &self.device.ctrl;
        Geometry::new(
            &ctrl.namespace(),
            self.read_only,
            ctrl.supports(Opcode::DatasetManagement),
            ctrl.supports(Opcode::WriteZeroes),
            num_queues,
        )
    }
}

/// How to run a server.
pub struct VhostConfig {
    pub exports: Vec<VhostExport>,
    pub cores: Option<CoreList>,
    pub policy: String,
    pub queue_depth: usize,
    /// Queues offered to each guest (`num_queues`); queue `i` runs on reactor
    /// `i % reactors`.
    pub num_queues: u16,
}

/// A reactor's state in a server of its own.
pub struct Standalone {
    pub vhost: VhostShard<Standalone>,
}

impl VhostState for Standalone {
    fn vhost(&mut self) -> &mut VhostShard<Standalone> {
        &mut self.vhost
    }
}

impl<S: VhostState> VhostShard<S> {
    /// Makes `socket` a listening socket for export `export` and watches it on `r`
    /// ([`bind_socket`], then [`VhostShard::listen_on`]).
    pub fn listen(
        &mut self,
        r: &mut Reactor<S>,
        export: usize,
        socket: &Path,
    ) -> std::io::Result<()> {
        let listener = bind_socket(socket)?;
        self.listen_on(r, export, listener)
    }

    /// Watches `listener` (from [`bind_socket`]) on `r` for front ends of export `export`.
    pub fn listen_on(
        &mut self,
        r: &mut Reactor<S>,
        export: usize,
        listener: UnixListener,
    ) -> std::io::Result<()> {
        listener.set_nonblocking(true)?;
        r.add_poller(Box::new(Listen {
            listener,
            export,
            pace: Pace::default(),
        }))?;
        Ok(())
    }
}

/// A listening socket at `path`, non-blocking. A socket file left there by a server that
/// died (nothing accepts on it) is replaced; a socket where a server still listens, or a
/// path that exists and is not a socket, is refused and left alone.
pub fn bind_socket(path: &Path) -> io::Result<UnixListener> {
    let listener = match UnixListener::bind(path) {
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            remove_stale_socket(path)?;
            UnixListener::bind(path)?
        }
        bound => bound?,
    };
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// A running server.
pub struct VhostServer {
    set: ReactorSet<Standalone>,
}

impl VhostServer {
    /// Starts the reactors, attaches every export's device on each, and listens on every
    /// export's socket (on the first reactor). Returns once front ends can connect.
    pub fn start(cfg: VhostConfig) -> Result<VhostServer, hypoll_reactor::StartError> {
        let exports: Vec<(String, Device, Geometry)> = cfg
            .exports
            .iter()
            .map(|e| (e.name.clone(), e.device.clone(), e.geometry(cfg.num_queues)))
            .collect();
        let sockets: Vec<PathBuf> = cfg.exports.iter().map(|e| e.socket.clone()).collect();
        let depth = cfg.queue_depth;
        let set = ReactorSet::start(
            ReactorConfig {
                cores: cfg.cores,
                policy: cfg.policy,
                ..ReactorConfig::default()
            },
            move |r: &mut Reactor<Standalone>| {
                let mut vhost = VhostShard::new(r, &exports, depth)?;
                if r.index() == 0 {
                    for (i, socket) in sockets.iter().enumerate() {
                        vhost.listen(r, i, socket).map_err(|e| {
                            InitError::from(format!("listening on {}: {e}", socket.display()))
                        })?;
                    }
                }
                Ok(Standalone { vhost })
            },
        )?;
        Ok(VhostServer { set })
    }

    pub fn handles(&self) -> &[ReactorHandle<Standalone>] {
        self.set.handles()
    }

    /// Stops gracefully: every ring stops taking the guest's requests and answers those it
    /// took (signalling the guest), waited for up to [`VHOST_DRAIN_TIMEOUT`]; then the
    /// reactors stop (what is still in flight then finishes or fails as a reactor's
    /// shutdown says).
    pub fn shutdown(self) -> ShutdownReport {
        drain(self.set.handles(), VHOST_DRAIN_TIMEOUT);
        self.set.shutdown()
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn a_path_that_is_not_a_socket_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("disk.img");
        std::fs::write(&file, b"precious").unwrap();
        let e = bind_socket(&file).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&file).unwrap(), b"precious");
        let sub = dir.path().join("a-folder");
        std::fs::create_dir(&sub).unwrap();
        bind_socket(&sub).unwrap_err();
        assert!(sub.is_dir());
    }

    #[test]
    fn a_live_socket_is_refused_and_a_stale_one_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.sock");
        let live = bind_socket(&path).unwrap();
        let e = bind_socket(&path).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
        // The first server still has its socket.
        UnixStream::connect(&path).unwrap();
        // A server that died leaves its socket file behind: the next one takes its place.
        drop(live);
        assert!(path.exists());
        let again = bind_socket(&path).unwrap();
        UnixStream::connect(&path).unwrap();
        assert!(again.accept().is_ok());
    }
}
