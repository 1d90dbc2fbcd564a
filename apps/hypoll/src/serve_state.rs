//! What each of `hypoll serve`'s reactors holds: NBD's shard, the vhost-user-blk back
//! end's, and NVMe/TCP's shard with `--nvme-tcp`, side by side, so every front end shares
//! the reactors and their policy (see docs/lab/2026-12-front-end-composition.md). The
//! exports' devices are attached once per reactor, by NBD's start (export `i` is
//! `DeviceId` `i`); vhost-user-blk and NVMe/TCP serve the same queue pairs. Without NBD
//! (`serve_vhost.rs`) the reactors hold the vhost part alone.

use std::net::SocketAddr;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use hypoll_frontend::{AddedShards, HasShard, Shard};
use hypoll_nbd::proto::{TFLAG_READ_ONLY, TFLAG_SEND_TRIM, TFLAG_SEND_WRITE_ZEROES};
use hypoll_nbd::Nbd;
use hypoll_nvmf::{
    ConfigError, DiscoveryEntry, Limits, NamespaceConfig, Nvmf, Target, TargetConfig,
};
use hypoll_reactor::{DeviceId, InitError, Reactor};
use hypoll_vhost::{Geometry, ShardExport, VhostShard, VhostState};

/// One reactor's state in `hypoll serve`.
pub struct Serve {
    nbd: Shard<Nbd>,
    vhost: VhostShard<Serve>,
    nvmf: Option<Shard<Nvmf>>,
}

impl HasShard<Nbd> for Serve {
    fn shard(&mut self) -> &mut Shard<Nbd> {
        &mut self.nbd
    }
}

impl HasShard<Nvmf> for Serve {
    fn shard(&mut self) -> &mut Shard<Nvmf> {
        // Only NVMe/TCP's poller, timers, connections and I/O ask, and none of them exists
        // on a reactor without its shard.
        self.nvmf
            .as_mut()
            .expect("NVMe/TCP is served on this reactor")
    }
}

/// `--nvme-tcp`: every export a namespace of one subsystem, on an added listener.
#[derive(Clone)]
pub struct NvmeTcp {
    pub shards: AddedShards<Nvmf>,
    pub subsystem_nqn: String,
    /// What a host can make the target hold (`--nvme-*` flags), checked before start.
    pub limits: Limits,
    /// Where it listens (the discovery log's entry).
    pub addr: SocketAddr,
    /// The target, made by the first reactor to start from what it sees of the exports
    /// (every reactor sees the same), shared by all.
    pub target: Arc<OnceLock<Arc<Target>>>,
}

impl NvmeTcp {
    /// The target of the exports `nbd` serves on reactor `r`.
    fn target(&self, r: &Reactor<Serve>, nbd: &Nbd) -> Result<Arc<Target>, InitError> {
        if let Some(t) = self.target.get() {
            return Ok(t.clone());
        }
        let mut cfg = TargetConfig::new(&self.subsystem_nqn);
        cfg.limits = self.limits;
        for (i, info) in nbd.exports().iter().enumerate() {
            if info.restricted {
                // Refused before start (serve.rs): NVMe/TCP cannot tell clients apart.
                return Err(format!("--nvme-tcp: export {} is restricted", info.name).into());
            }
            let ns = r
                .namespace(DeviceId::from_index(i as u16))
                .ok_or_else(|| format!("export {} has no device on this reactor", info.name))?;
            let read_only = info.flags & TFLAG_READ_ONLY != 0;
            cfg.namespaces.push(NamespaceConfig {
                block_bytes: ns.lba_size_bytes,
                blocks: ns.capacity_lbas,
                read_only,
                // Every device takes a flush; one without a cache answers it at once.
                volatile_cache: true,
                write_zeroes: !read_only && info.flags & TFLAG_SEND_WRITE_ZEROES != 0,
                deallocate: !read_only && info.flags & TFLAG_SEND_TRIM != 0,
                uuid: NamespaceConfig::uuid_for(&info.name),
            });
        }
        cfg.discovery = vec![DiscoveryEntry {
            addr: self.addr,
            portid: 1,
        }];
        let made = Target::new(cfg).map_err(|e| format!("--nvme-tcp: {e}"))?;
        Ok(self.target.get_or_init(|| made).clone())
    }
}

/// `limits` for a target serving `nqn`, as the `--nvme-*` flags gave them: a value the
/// target cannot serve is an error naming its flag.
pub fn check_nvme_limits(nqn: &str, limits: Limits) -> Result<Limits, String> {
    let mut probe = TargetConfig::new(nqn);
    probe.limits = limits;
    match probe.check() {
        Ok(()) => Ok(limits),
        Err(ConfigError::Limit { field, why }) => {
            let flag = match field {
                "controllers_max" => "--nvme-max-controllers",
                "io_queues_max" => "--nvme-max-io-queues",
                "queue_entries_max" => "--nvme-queue-entries",
                "in_capsule_bytes_max" => "--nvme-in-capsule-bytes",
                "maxh2cdata_bytes" => "--nvme-maxh2cdata-bytes",
                other => other,
            };
            Err(format!("{flag}: {why}"))
        }
        Err(e) => Err(format!("--nvme-nqn: {e}")),
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
    nvme: Option<&NvmeTcp>,
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
    let nvmf = match nvme {
        None => None,
        Some(n) => {
            let target = n.target(r, &nbd.proto)?;
            let exports = nbd.proto.exports();
            let devices: Vec<(DeviceId, bool)> = (0..exports.len())
                .map(|i| (DeviceId::from_index(i as u16), nbd.proto.reads_fill(i)))
                .collect();
            let names: Vec<String> = exports.iter().map(|e| e.name.clone()).collect();
            let state = Nvmf::new(r, target, &devices, &names, n.shards.metrics());
            Some(n.shards.builder(r.index()).build(r, state)?)
        }
    };
    Ok(Serve { nbd, vhost, nvmf })
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
