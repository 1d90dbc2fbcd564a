//! What each of `hypoll serve`'s reactors holds: NBD's shard and the vhost-user-blk back
//! end's, side by side, so both front ends share the reactors and their policy (see
//! docs/lab/2026-12-front-end-composition.md). The exports' devices are attached once per
//! reactor, by NBD's start (export `i` is `DeviceId` `i`); vhost-user-blk serves the same
//! queue pairs.

use std::path::PathBuf;

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

/// Makes a reactor's state from NBD's shard there: the vhost-user-blk exports on the
/// same devices, each guest offered a queue per reactor, and (on the first reactor) their
/// sockets listened to.
pub fn compose(
    r: &mut Reactor<Serve>,
    nbd: Shard<Nbd>,
    sockets: &[VhostSocket],
) -> Result<Serve, InitError> {
    let queues = u16::try_from(r.handles().len()).unwrap_or(u16::MAX);
    let mut exports = Vec::with_capacity(sockets.len());
    for s in sockets {
        let info = &nbd.proto.exports()[s.export];
        let device = DeviceId::from_index(s.export as u16);
        let ns = r
            .namespace(device)
            .ok_or_else(|| format!("export {} has no device on this reactor", s.name))?;
        let geometry = Geometry::new(
            &ns,
            info.flags & TFLAG_READ_ONLY != 0,
            info.flags & TFLAG_SEND_TRIM != 0,
            info.flags & TFLAG_SEND_WRITE_ZEROES != 0,
            queues,
        );
        exports.push(ShardExport {
            name: s.name.clone(),
            device,
            geometry,
        });
    }
    let mut vhost = VhostShard::with_devices(exports);
    if r.index() == 0 {
        for (i, s) in sockets.iter().enumerate() {
            vhost
                .listen(r, i, &s.socket)
                .map_err(|e| format!("--vhost-user-blk {}: {}: {e}", s.name, s.socket.display()))?;
        }
    }
    Ok(Serve { nbd, vhost })
}
