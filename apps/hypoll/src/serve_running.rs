//! A running `hypoll serve`: NBD's server with NVMe/TCP's listener and the vhost-user-blk
//! part beside it, or vhost-user-blk alone; how it says where clients connect, and how it
//! stops.

use std::io::Write;

use hypoll_frontend::AddedListener;
use hypoll_nbd::proto::TFLAG_READ_ONLY;
use hypoll_nbd::{Server, StopReport};

use crate::serve_state::{NvmeTcp, Serve, VhostSocket};
use crate::serve_vhost::VhostOnly;

/// A running server: NBD with any vhost-user-blk sockets beside it, or those alone.
pub(crate) enum Running {
    Nbd(Box<NbdRunning>),
    Vhost(VhostOnly),
}

/// NBD's server, with NVMe/TCP's listener and what it serves when `--nvme-tcp` asked for
/// them.
pub(crate) struct NbdRunning {
    pub(crate) server: Server<Serve>,
    pub(crate) nvme: Option<(AddedListener<Serve>, NvmeTcp)>,
}

impl Running {
    /// Tells the operator where clients connect and what each export is.
    pub(crate) fn announce(&self, sockets: &[VhostSocket]) {
        let mut out = std::io::stdout().lock();
        match self {
            Running::Nbd(nbd) => {
                let server = &nbd.server;
                let _ = writeln!(out, "listening on {}", server.local_addr());
                if let Some((_, n)) = &nbd.nvme {
                    let nqn = n
                        .target
                        .get()
                        .map_or(n.subsystem_nqn.as_str(), |t| t.subsystem_nqn());
                    let _ = writeln!(out, "nvme-tcp listening on {}, subsystem {nqn}", n.addr);
                }
                if let Some(m) = server.metrics_addr() {
                    let _ = writeln!(out, "metrics on http://{m}/metrics");
                }
                for (e, device) in server.exports().iter().zip(server.export_devices()) {
                    let ro = e.flags & TFLAG_READ_ONLY != 0;
                    let _ = writeln!(
                        out,
                        "export {} = {device} ({} bytes, {}-byte blocks{})",
                        e.name,
                        e.size_bytes,
                        e.block_bytes,
                        if ro { ", read-only" } else { "" }
                    );
                }
            }
            Running::Vhost(server) => {
                for e in server.exports() {
                    let _ = writeln!(
                        out,
                        "export {} = {} ({} bytes, {}-byte blocks{})",
                        e.name,
                        e.device,
                        e.size_bytes,
                        e.block_bytes,
                        if e.read_only { ", read-only" } else { "" }
                    );
                }
            }
        }
        for s in sockets {
            let _ = writeln!(out, "vhost-user-blk {} on {}", s.name, s.socket.display());
        }
        let _ = out.flush();
    }

    /// Stops it: the guests' rings first (each answers what it took: `hypoll_vhost::drain`,
    /// when vhost-user-blk is served), then NVMe/TCP's listener and connections, then
    /// NBD's (or the vhost part alone). Drains that time out run one after the other: a stop
    /// with both vhost-user-blk and NBD may take both bounds.
    pub(crate) fn stop(self, vhost: bool) -> Stopped {
        let (report, nvme_left, vhost_left) = match self {
            Running::Nbd(nbd) => {
                let NbdRunning { server, nvme } = *nbd;
                let vhost_left = match server.handles() {
                    Some(handles) if vhost => {
                        hypoll_vhost::drain(handles, hypoll_vhost::VHOST_DRAIN_TIMEOUT)
                    }
                    _ => 0,
                };
                let nvme_left = nvme.map_or(0, |(listener, _)| listener.stop());
                (server.stop(), nvme_left, vhost_left)
            }
            Running::Vhost(server) => {
                let (report, vhost_left) = server.stop();
                (report, 0, vhost_left)
            }
        };
        Stopped {
            report,
            nvme_left,
            vhost_left,
        }
    }
}

/// What a stop left undone: the report of NBD's (or the vhost part's) stop, the NVMe/TCP
/// connections cut, and the vhost-user rings whose drain timed out.
pub(crate) struct Stopped {
    report: StopReport,
    nvme_left: usize,
    vhost_left: usize,
}

impl Stopped {
    /// Says on stderr what the stop left undone; returns whether it stopped cleanly.
    pub(crate) fn tell(&self) -> bool {
        let r = &self.report;
        let mut problems = Vec::new();
        if self.vhost_left > 0 {
            problems.push(format!(
                "{} vhost-user rings still had guests' requests in flight when the drain \
                 timed out",
                self.vhost_left
            ));
        }
        if self.nvme_left > 0 {
            problems.push(format!(
                "{} NVMe/TCP connections did not finish in time and were cut",
                self.nvme_left
            ));
        }
        if r.connections_left > 0 {
            problems.push(format!(
                "{} connections did not finish in time and were cut",
                r.connections_left
            ));
        }
        problems.extend(r.flush_failures.iter().map(|f| format!("final flush: {f}")));
        problems.extend(r.panics.iter().map(ToString::to_string));
        if r.failed_ios > 0 {
            problems.push(format!("{} I/Os were failed at shutdown", r.failed_ios));
        }
        for p in &problems {
            eprintln!("hypoll serve: {p}");
        }
        problems.is_empty()
    }
}
