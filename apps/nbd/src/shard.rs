//! NBD on a reactor's shard: what the protocol keeps per reactor (its exports and their
//! device queues) and per connection (its [`Session`], its requests in flight), and the
//! parser loop that runs a connection's input through its session. How a parsed request
//! becomes device commands and a reply is in `pipeline.rs`.

use std::collections::VecDeque;
use std::sync::Arc;

use hypoll_frontend::{certificate_names, HasShard, Protocol, Shard};
use hypoll_reactor::{AttachError, Device, DeviceId, Reactor};
use prometheus_client::metrics::counter::Counter;
use slab::Slab;

use crate::metrics::{io_per_op, IoMetrics, Metrics};
use crate::pipeline::{self, Pending};
use crate::proto;
use crate::session::{Close, ExportInfo, Limits, Op, Session, Step, TlsMode};

/// Refused requests logged per connection; the rest are counted in the close line.
const REFUSALS_LOGGED_MAX: u32 = 4;

/// One export as a reactor sees it.
pub(crate) struct ShardExport {
    pub(crate) dev: DeviceId,
    pub(crate) lba_bytes: u32,
    /// Largest read or write per device command (the device's MDTS).
    pub(crate) rw_piece_bytes: u32,
    /// Most blocks per write zeroes or deallocate command.
    pub(crate) zero_piece_blocks: u32,
    /// Whether the device writes all of a read's buffer (`Controller::reads_fill_buffer`):
    /// if not, a recycled buffer is zeroed first, or the reply would carry what another
    /// request left in it.
    pub(crate) reads_fill: bool,
    pub(crate) io: [IoMetrics; Op::ALL.len()],
    /// Connections that chose this export.
    connections: Counter,
    /// Requests with pieces waiting for room in the queue pair: (connection, request).
    pub(crate) backlog: VecDeque<(usize, usize)>,
}

/// Who may use what: whether clients may or must start TLS, and the clients each export is
/// restricted to, if it is (by the names in their certificates).
#[derive(Clone)]
pub(crate) struct Access {
    pub(crate) tls: TlsMode,
    pub(crate) clients: Arc<[Option<Vec<String>>]>,
}

/// NBD's state on one reactor (the protocol part of its [`Shard`]): its exports there and
/// their device queues. A reactor state that serves NBD beside other front ends holds a
/// `Shard<Nbd>` and says where ([`HasShard`]); see [`Server::start_with`](crate::Server::start_with).
pub struct Nbd {
    pub(crate) exports: Vec<ShardExport>,
    infos: Arc<[ExportInfo]>,
    limits: Limits,
    access: Access,
    /// The session's output for one step, reused.
    scratch: Vec<u8>,
}

/// An NBD connection's protocol state.
pub struct NbdConn {
    session: Session,
    /// Requests in flight, keyed as in their device commands' `user` word.
    pub(crate) inflight: Slab<Pending>,
    refusals: u32,
    /// The session was told which restricted exports the client's certificate opens.
    access_checked: bool,
}

impl Nbd {
    /// What clients are told of each export, in export order (export `i`'s device is
    /// `DeviceId` `i` on every reactor).
    pub fn exports(&self) -> &[ExportInfo] {
        &self.infos
    }

    /// Whether export `export`'s device writes all of a read's buffer
    /// (`Controller::reads_fill_buffer`), for another front end on the same devices.
    pub fn reads_fill(&self, export: usize) -> bool {
        self.exports[export].reads_fill
    }

    /// Attaches every export's device to reactor `r` (at `queue_depth`) and takes the
    /// reactor's metric handles for them.
    pub(crate) fn attach<S>(
        r: &mut Reactor<S>,
        devices: &[Device],
        infos: &Arc<[ExportInfo]>,
        limits: Limits,
        access: Access,
        queue_depth: usize,
        metrics: &Metrics,
    ) -> Result<Nbd, AttachError> {
        assert_eq!(devices.len(), infos.len());
        let mut exports = Vec::new();
        for (device, info) in devices.iter().zip(infos.iter()) {
            let dev = r.attach(device, queue_depth)?;
            let ns = r.namespace(dev).expect("just attached");
            exports.push(ShardExport {
                dev,
                lba_bytes: ns.lba_size_bytes,
                rw_piece_bytes: ns.transfer_bytes_max.max(ns.lba_size_bytes),
                zero_piece_blocks: hypoll_nvme::spec::NLB_MAX,
                reads_fill: device.ctrl.reads_fill_buffer(),
                io: io_per_op(metrics, r.index(), &info.name),
                connections: metrics.export_connections(r.index(), &info.name),
                backlog: VecDeque::new(),
            });
        }
        Ok(Nbd {
            exports,
            infos: infos.clone(),
            limits,
            access,
            scratch: Vec::new(),
        })
    }
}

impl Protocol for Nbd {
    type Conn = NbdConn;
    const NAME: &'static str = "NBD";

    fn connect(&mut self, greeting: &mut Vec<u8>) -> NbdConn {
        NbdConn {
            session: Session::with_tls(self.infos.clone(), self.limits, self.access.tls, greeting),
            inflight: Slab::new(),
            refusals: 0,
            access_checked: false,
        }
    }

    fn negotiated(conn: &NbdConn) -> bool {
        conn.session.export().is_some()
    }

    fn requests_inflight(conn: &NbdConn) -> usize {
        conn.inflight.len()
    }

    fn request_bytes_max(&self) -> usize {
        proto::REQUEST_HEADER_BYTES + self.limits.request_bytes_max as usize
    }

    fn has_backlog(&self) -> bool {
        self.exports.iter().any(|e| !e.backlog.is_empty())
    }

    fn parse<S: HasShard<Nbd>>(shard: &mut Shard<Nbd>, r: &mut Reactor<S>, key: usize) -> usize {
        parse(shard, r, key)
    }

    fn retry_backlog<S: HasShard<Nbd>>(shard: &mut Shard<Nbd>, r: &mut Reactor<S>) -> usize {
        let mut work = 0;
        for e in 0..shard.proto.exports.len() {
            work += pipeline::retry_backlog(shard, r, e);
        }
        work
    }

    fn close_note(conn: &NbdConn) -> String {
        if conn.refusals > REFUSALS_LOGGED_MAX {
            format!(
                " ({} requests refused, {} not logged)",
                conn.refusals,
                conn.refusals - REFUSALS_LOGGED_MAX
            )
        } else {
            String::new()
        }
    }
}

impl NbdConn {
    /// The export the handshake chose, once it is over.
    pub(crate) fn export(&self) -> Option<usize> {
        self.session.export()
    }
}

/// Runs the session over the buffered input while the connection may take requests.
fn parse<S: HasShard<Nbd>>(shard: &mut Shard<Nbd>, r: &mut Reactor<S>, key: usize) -> usize {
    let mut work = 0;
    let mut out = std::mem::take(&mut shard.proto.scratch);
    loop {
        if !shard.can_parse(key) || shard.conns[key].input().is_empty() {
            break;
        }
        out.clear();
        let conn = &mut shard.conns[key];
        if !conn.proto.access_checked {
            if let Some(cert) = conn.peer_certificate() {
                // After TLS, before any option under it: the client's certificate is
                // known, and verified.
                let named: Vec<bool> = (shard.proto.access.clients.iter())
                    .map(|names| {
                        names
                            .iter()
                            .flatten()
                            .any(|name| certificate_names(cert, name))
                    })
                    .collect();
                conn.proto.session.allow(|i| named[i]);
                conn.proto.access_checked = true;
            }
        }
        let (input, state) = conn.input_and_state();
        let (used, step) = state.session.step(input, &mut out);
        if !out.is_empty() {
            conn.push_bytes(out.clone());
        }
        match step {
            Step::NeedMore => break,
            Step::Negotiating => {}
            Step::Ready { export } => {
                shard.proto.exports[export].connections.inc();
            }
            Step::StartTls => {
                // What follows the request is checked by `start_tls`: none may be left.
                conn.consume(used);
                if let Err(e) = shard.start_tls(key) {
                    let conn = &mut shard.conns[key];
                    conn.failed = true;
                    conn.closing = Some(format!("STARTTLS: {e}"));
                }
                work += 1;
                continue;
            }
            Step::Request(req) => {
                shard.count_request();
                let export = shard.conns[key]
                    .proto
                    .export()
                    .expect("requests follow the handshake");
                // The request's payload is still at the front of the input.
                pipeline::start(shard, r, key, export, req);
            }
            Step::Refused { why, error, .. } => {
                conn.proto.refusals += 1;
                let refusals = conn.proto.refusals;
                let peer = conn.peer.clone();
                shard.metrics.refused.inc();
                if refusals <= REFUSALS_LOGGED_MAX {
                    shard.log(&peer, &format!("request refused with error {error}: {why}"));
                }
            }
            Step::Close(close) => {
                let why = match close {
                    Close::Abort => "the client aborted the handshake".to_string(),
                    Close::Disconnect => "the client disconnected".to_string(),
                    Close::Protocol(why) => {
                        conn.failed = true;
                        format!("protocol error: {why}")
                    }
                };
                conn.closing = Some(why);
            }
        }
        shard.conns[key].consume(used);
        work += 1;
    }
    shard.proto.scratch = out;
    work
}
