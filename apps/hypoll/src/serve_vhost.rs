//! `hypoll serve` without NBD: `--vhost-user-blk` with no `--listen` serves the exports to
//! virtual machines only. The reactors hold the vhost-user-blk part alone (no NBD listener,
//! poller or timer); each export's device is attached once per reactor, as with NBD, and
//! the stop drains the guests' rings, then flushes every export as NBD's does.

use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use hypoll_frontend::{StopReport, FLUSH_TIMEOUT};
use hypoll_nbd::server::ExportSpec;
use hypoll_reactor::{
    CoreList, Device, DeviceId, IoDone, Opcode, Reactor, ReactorConfig, ReactorSet, ReactorTuning,
};
use hypoll_vhost::{Standalone, VhostShard};

use crate::serve_state::{vhost_part, ExportFacts, Listeners, VhostSocket};

/// How the reactors of a server without NBD run.
pub struct VhostOnlyConfig {
    /// (name, spec) as `--export` gives them.
    pub exports: Vec<(String, String)>,
    pub read_only: bool,
    pub cores: CoreList,
    pub policy: String,
    pub queue_depth: usize,
    /// How long a reactor with nothing in flight polls its rings before it parks.
    pub idle_spin_ns: u64,
}

/// An export as the operator is told about it.
pub struct ExportLine {
    pub name: String,
    pub device: String,
    pub size_bytes: u64,
    pub block_bytes: u32,
    pub read_only: bool,
}

/// A running server without NBD.
pub struct VhostOnly {
    set: ReactorSet<Standalone>,
    names: Vec<String>,
    lines: Vec<ExportLine>,
}

/// The exports opened, each in `--export` order.
struct Opened {
    devices: Vec<Device>,
    /// What a guest is shown of each.
    facts: Vec<ExportFacts>,
    lines: Vec<ExportLine>,
}

/// Opens each export's device, refusing duplicate names and NBD's own items.
fn open_exports(exports: &[(String, String)], read_only: bool) -> Result<Opened, String> {
    let mut devices = Vec::with_capacity(exports.len());
    let mut facts = Vec::with_capacity(exports.len());
    let mut lines: Vec<ExportLine> = Vec::with_capacity(exports.len());
    for (name, spec) in exports {
        if lines.iter().any(|l| &l.name == name) {
            return Err(format!("--export {name}: named twice"));
        }
        let spec = ExportSpec::parse(spec);
        if spec.clients.is_some() {
            return Err(format!(
                "--export {name}: clients= names NBD clients by their TLS certificates, \
                 and without --listen there is no NBD"
            ));
        }
        let device = spec
            .open_device(read_only)
            .map_err(|e| format!("export {name}: {e}"))?;
        let ns = device.ctrl.namespace();
        let read_only = read_only || spec.read_only;
        facts.push(ExportFacts {
            read_only,
            discard: device.ctrl.supports(Opcode::DatasetManagement),
            write_zeroes: device.ctrl.supports(Opcode::WriteZeroes),
        });
        lines.push(ExportLine {
            name: name.clone(),
            device: device.ctrl.describe(),
            size_bytes: ns.capacity_bytes(),
            block_bytes: ns.lba_size_bytes,
            read_only,
        });
        devices.push(device);
    }
    Ok(Opened {
        devices,
        facts,
        lines,
    })
}

impl VhostOnly {
    /// Opens the exports, starts the reactors (each attaching every export's device) and
    /// watches the sockets' `listeners` on the first. Returns once guests can connect.
    pub fn start(
        cfg: VhostOnlyConfig,
        sockets: Vec<VhostSocket>,
        listeners: Arc<Listeners>,
    ) -> Result<VhostOnly, String> {
        let Opened {
            devices,
            facts,
            lines,
        } = open_exports(&cfg.exports, cfg.read_only)?;
        let names = cfg.exports.iter().map(|(n, _)| n.clone()).collect();
        let depth = cfg.queue_depth;
        let set = ReactorSet::start(
            ReactorConfig {
                cores: Some(cfg.cores),
                policy: cfg.policy,
                tuning: ReactorTuning {
                    idle_spin_ns: cfg.idle_spin_ns,
                    ..ReactorTuning::default()
                },
                ..ReactorConfig::default()
            },
            move |r: &mut Reactor<Standalone>| {
                for (i, d) in devices.iter().enumerate() {
                    let id = r.attach(d, depth)?;
                    debug_assert_eq!(id, DeviceId::from_index(i as u16));
                }
                let vhost: VhostShard<Standalone> = vhost_part(r, &facts, &sockets, &listeners)?;
                Ok(Standalone { vhost })
            },
        )
        .map_err(|e| e.to_string())?;
        Ok(VhostOnly { set, names, lines })
    }

    pub fn exports(&self) -> &[ExportLine] {
        &self.lines
    }

    /// Stops: every ring stops taking the guest's requests and answers those it took
    /// (`hypoll_vhost::drain`, up to its timeout), then every export is flushed (from the
    /// first reactor: a flush covers the whole device), then the reactors stop; what a
    /// ring still had in flight past the drain's timeout completes or fails as the
    /// reactors stop. Returns the report and the rings whose drain timed out.
    pub fn stop(self) -> (StopReport, usize) {
        let vhost_left = hypoll_vhost::drain(self.set.handles(), hypoll_vhost::VHOST_DRAIN_TIMEOUT);
        let flush_failures = self.flush_exports();
        let shutdown = self.set.shutdown();
        let report = StopReport {
            flush_failures,
            failed_ios: shutdown.exits.iter().map(|e| e.failed_ios).sum(),
            panics: shutdown.panics.iter().map(|p| p.to_string()).collect(),
            ..StopReport::default()
        };
        (report, vhost_left)
    }

    /// Flushes every export and waits for the answers up to [`FLUSH_TIMEOUT`]; returns
    /// what failed.
    fn flush_exports(&self) -> Vec<String> {
        let mut failures = Vec::new();
        let (tx, rx) = mpsc::channel();
        let mut asked = 0;
        for (i, name) in self.names.iter().enumerate() {
            let tx = tx.clone();
            let name = name.clone();
            let sent = self.set.handles()[0].send(move |r, _| {
                let done_tx = tx.clone();
                let done_name = name.clone();
                let submitted = r.flush(DeviceId::from_index(i as u16), move |_, _, d: IoDone| {
                    let _ = done_tx.send(d.result.map_err(|e| format!("{done_name}: flush: {e}")));
                });
                if let Err(e) = submitted {
                    let _ = tx.send(Err(format!("{name}: flush refused: {e}")));
                }
            });
            match sent {
                Ok(()) => asked += 1,
                Err(e) => {
                    failures.push(format!("{}: could not ask for a flush: {e}", self.names[i]))
                }
            }
        }
        drop(tx);
        let deadline = Instant::now() + FLUSH_TIMEOUT;
        for _ in 0..asked {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => failures.push(e),
                Err(_) => {
                    failures.push("the final flush did not finish in time".into());
                    break;
                }
            }
        }
        failures
    }
}

/// Each `--vhost-user-blk NAME=PATH` with its export's position; refuses a name no
/// `--export` has and a socket path given twice. Without NBD (`nbd` false) every export
/// must be served by a socket.
pub fn vhost_sockets(
    exports: &[(String, String)],
    vhost: &[(String, PathBuf)],
    nbd: bool,
) -> Result<Vec<VhostSocket>, String> {
    let mut sockets: Vec<VhostSocket> = Vec::with_capacity(vhost.len());
    for (name, socket) in vhost {
        let Some(export) = exports.iter().position(|(n, _)| n == name) else {
            return Err(format!(
                "--vhost-user-blk {name}={}: no --export named {name}",
                socket.display()
            ));
        };
        if sockets.iter().any(|s| s.socket == *socket) {
            return Err(format!(
                "--vhost-user-blk {name}={}: that socket is given twice",
                socket.display()
            ));
        }
        sockets.push(VhostSocket {
            name: name.clone(),
            export,
            socket: socket.clone(),
        });
    }
    if !nbd {
        if let Some((name, _)) = exports
            .iter()
            .find(|(n, _)| !sockets.iter().any(|s| s.name == *n))
        {
            return Err(format!(
                "--export {name}: served by nothing: no --vhost-user-blk names it, and \
                 without --listen NBD is not served"
            ));
        }
    }
    Ok(sockets)
}

/// The socket files this server made, removed when it ends, however it ends.
#[derive(Default)]
pub struct SocketFiles(Vec<PathBuf>);

impl Drop for SocketFiles {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Binds every vhost-user-blk socket before anything starts, so a bad path stops the
/// server with its own message.
pub fn bind_sockets(sockets: &[VhostSocket]) -> Result<(SocketFiles, Arc<Listeners>), String> {
    let mut files = SocketFiles::default();
    let mut listeners = Vec::with_capacity(sockets.len());
    for s in sockets {
        let listener = hypoll_vhost::bind_socket(&s.socket)
            .map_err(|e| format!("--vhost-user-blk {}={}: {e}", s.name, s.socket.display()))?;
        files.0.push(s.socket.clone());
        listeners.push(Some(listener));
    }
    Ok((files, Arc::new(Mutex::new(listeners))))
}
