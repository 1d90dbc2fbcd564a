//! What each of `hypoll serve`'s reactors holds: NBD's shard and the vhost-user-blk back
//! end's, side by side, so both front ends share the reactors and their policy (see
//! docs/lab/2026-12-front-end-composition.md). The exports' devices are attached once per
//! reactor, by NBD's start (export `i` is `DeviceId` `i`); vhost-user-blk serves the same
//! queue pairs. Without NBD (`serve_vhost.rs`) the reactors hold the vhost part alone.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Mutex;

use hypoll_frontend::{HasShard, Shard};
use hypoll_nbd::proto::{TFLAG_READ_ONLY, TFLAG_SEND_TRIM, TFLAG_SEND_WRITE_ZEROES};
use hypoll_nbd::Nbd;
use hypoll_reactor::{DeviceId, InitError, Reactor};
use hypoll_vhost::{Geometry, ShardExport, VhostShard, VhostState};

/// One reactor's state in `hypoll serve`.
pub struct Serve {
    nbd: Shard<Nbd>,
    vhost: VhostShard<Serve>,
}

impl HasShard<Nbd> for Serve {
    fn shard(&mut self) -> &mut Shard<Nbd> {
        &mut self.nbd
    }
}

impl VhostState for Serve {
    fn vhost(&mut self) -> &mut VhostShard<Serve> {
        &mut self.vhost
    }
}

/// A `--vhost-user-blk NAME=PATH`: export `export` (its position among the exports) on the
/// socket at `socket`.
#[derive(Clone, Debug)]
pub struct VhostSocket {
    pub name: String,
    pub export: usize,
    pub socket: PathBuf,
}

/// The sockets' listeners, bound before the reactors start (so a bad path stops the
/// server with its own message), in `--vhost-user-blk` order; the first reactor takes
/// them.
pub type Listeners = Mutex<Vec<Option<UnixListener>>>;

/// What an export offers a guest beyond its device's namespace.
#[derive(Clone, Copy, Debug)]
pub struct ExportFacts {
    pub read_only: bool,
    pub discard: bool,
    pub write_zeroes: bool,
}

/// Makes a reactor's state from NBD's shard there: the vhost-user-blk exports on the
/// same devices, each guest offered a queue per reactor, and (on the first reactor) their
/// sockets listened to.
pub fn compose(
    r: &mut Reactor<Serve>,
    nbd: Shard<Nbd>,
    sockets: &[VhostSocket],
    listeners: &Listeners,
) -> Result<Serve, InitError> {
    let facts: Vec<ExportFacts> = nbd
        .proto
        .exports()
        .iter()
        .map(|info| ExportFacts {
            read_only: info.flags & TFLAG_READ_ONLY != 0,
            discard: info.flags & TFLAG_SEND_TRIM != 0,
            write_zeroes: info.flags & TFLAG_SEND_WRITE_ZEROES != 0,
        })
        .collect();
    let vhost = vhost_part(r, &facts, sockets, listeners)?;
    Ok(Serve { nbd, vhost })
}

/// The vhost-user-blk part of a reactor's state whose exports' devices are attached
/// already (export `i` as `DeviceId` `i`, described by `facts[i]`): one guest per socket,
/// offered a queue per reactor; the first reactor watches the sockets.
pub fn vhost_part<S: VhostState>(
    r: &mut Reactor<S>,
    facts: &[ExportFacts],
    sockets: &[VhostSocket],
    listeners: &Listeners,
) -> Result<VhostShard<S>, InitError> {
    let queues = u16::try_from(r.handles().len()).unwrap_or(u16::MAX);
    let mut exports = Vec::with_capacity(sockets.len());
    for s in sockets {
        let f = facts[s.export];
        let device = DeviceId::from_index(s.export as u16);
        let ns = r
            .namespace(device)
            .ok_or_else(|| format!("export {} has no device on this reactor", s.name))?;
        let geometry = Geometry::new(&ns, f.read_only, f.discard, f.write_zeroes, queues);
        exports.push(ShardExport {
            name: s.name.clone(),
            device,
            geometry,
        });
    }
    let mut vhost = VhostShard::with_devices(exports);
    if r.index() == 0 {
        let mut listeners = listeners.lock().expect("never poisoned");
        assert_eq!(listeners.len(), sockets.len(), "one listener per socket");
        for (i, (s, listener)) in sockets.iter().zip(listeners.iter_mut()).enumerate() {
            let listener = listener
                .take()
                .ok_or_else(|| format!("--vhost-user-blk {}: its socket is gone", s.name))?;
            vhost
                .listen_on(r, i, listener)
                .map_err(|e| format!("--vhost-user-blk {}: {}: {e}", s.name, s.socket.display()))?;
        }
    }
    Ok(vhost)
}
