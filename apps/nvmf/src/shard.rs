//! NVMe/TCP on a reactor's shard: what the protocol keeps per reactor (the target, the
//! namespaces' device queues) and per connection (its [`Session`], its commands in
//! flight), the parser loop that runs a connection's input through its session, and the
//! tick that ends sessions whose keep-alive ran out or whose controller ended on another
//! reactor. How a command becomes device commands and an answer is in `pipeline.rs`.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use hypoll_frontend::metrics::{IoMetrics, Metrics};
use hypoll_frontend::{HasShard, Protocol, Shard};
use hypoll_reactor::{AttachError, Device, DeviceId, Reactor};
use slab::Slab;

use crate::pipeline::{self, Kind, Pending};
use crate::session::{Close, Session, Step};
use crate::target::Target;

/// How often each reactor checks its sessions' timers (the keep-alive deadline of an admin
/// queue, the life of an I/O queue's controller) when no PDU arrives to check them: the
/// keep-alive timer's own unit (KAS), so a host that stops is disconnected within a unit
/// of its KATO.
pub const TICK_PERIOD: Duration = Duration::from_millis(100);

/// One namespace's device as a reactor sees it.
pub(crate) struct ShardExport {
    pub(crate) dev: DeviceId,
    pub(crate) lba_bytes: u32,
    /// Largest read or write per device command (the device's MDTS).
    pub(crate) rw_piece_bytes: u32,
    /// Most blocks per write zeroes or deallocate command.
    pub(crate) zero_piece_blocks: u32,
    /// Whether the device writes all of a read's buffer: if not, a recycled buffer is
    /// zeroed first, or the data would carry what another command left in it.
    pub(crate) reads_fill: bool,
    pub(crate) io: [IoMetrics; Kind::ALL.len()],
    /// Commands with pieces waiting for room in the queue pair: (connection, command).
    pub(crate) backlog: VecDeque<(usize, usize)>,
}

/// NVMe/TCP's state on one reactor.
pub struct Nvmf {
    target: Arc<Target>,
    pub(crate) exports: Vec<ShardExport>,
    pdu_bytes_max: usize,
    /// The session's output for one step, and a read's head and tail, reused.
    scratch: Vec<u8>,
    pub(crate) head: Vec<u8>,
    pub(crate) tail: Vec<u8>,
}

/// One NVMe/TCP connection's protocol state.
pub struct NvmfConn {
    pub(crate) session: Session,
    /// Commands at the device (or receiving their data), keyed as in their device
    /// commands' `user` word.
    pub(crate) inflight: Slab<Pending>,
    /// Solicited writes still receiving their data, by command identifier.
    pub(crate) by_cid: HashMap<u16, usize>,
}

impl Nvmf {
    /// NVMe/TCP's state on reactor `r`, whose namespaces' devices are attached already
    /// (`devices`, in namespace order: the device's ID on `r`, and whether it writes all of
    /// a read's buffer), with metric handles under `names`. A reactor shared with other
    /// front ends attaches each device once for all of them.
    pub fn new<S: HasShard<Nvmf>>(
        r: &mut Reactor<S>,
        target: Arc<Target>,
        devices: &[(DeviceId, bool)],
        names: &[String],
        metrics: &Metrics,
    ) -> Nvmf {
        assert_eq!(devices.len(), target.config().namespaces.len());
        assert_eq!(devices.len(), names.len());
        let exports = devices
            .iter()
            .zip(names)
            .map(|(&(dev, reads_fill), name)| {
                let ns = r.namespace(dev).expect("attached");
                ShardExport {
                    dev,
                    lba_bytes: ns.lba_size_bytes,
                    rw_piece_bytes: ns.transfer_bytes_max.max(ns.lba_size_bytes),
                    zero_piece_blocks: hypoll_nvme::spec::NLB_MAX,
                    reads_fill,
                    io: Kind::ALL.map(|k| metrics.io(r.index(), name, k.name())),
                    backlog: VecDeque::new(),
                }
            })
            .collect();
        let pdu_bytes_max = Session::new(target.clone()).pdu_bytes_max();
        r.every(TICK_PERIOD, |r, state: &mut S| tick(state.shard(), r));
        Nvmf {
            target,
            exports,
            pdu_bytes_max,
            scratch: Vec::new(),
            head: Vec::new(),
            tail: Vec::new(),
        }
    }

    /// Attaches every namespace's device to reactor `r` at `queue_depth`, then
    /// [`Nvmf::new`].
    pub fn attach<S: HasShard<Nvmf>>(
        r: &mut Reactor<S>,
        target: Arc<Target>,
        devices: &[Device],
        names: &[String],
        queue_depth: usize,
        metrics: &Metrics,
    ) -> Result<Nvmf, AttachError> {
        let mut attached = Vec::with_capacity(devices.len());
        for device in devices {
            let dev = r.attach(device, queue_depth)?;
            attached.push((dev, device.ctrl.reads_fill_buffer()));
        }
        Ok(Nvmf::new(r, target, &attached, names, metrics))
    }
}

impl Protocol for Nvmf {
    type Conn = NvmfConn;
    const NAME: &'static str = "NVMe/TCP";

    fn connect(&mut self, _greeting: &mut Vec<u8>) -> NvmfConn {
        // The host speaks first (ICReq).
        NvmfConn {
            session: Session::new(self.target.clone()),
            inflight: Slab::new(),
            by_cid: HashMap::new(),
        }
    }

    fn negotiated(conn: &NvmfConn) -> bool {
        conn.session.connected()
    }

    /// Commands at the device: a held Asynchronous Event Request is not one (it is the
    /// session's, answered or dropped with it), or an admin queue could never close.
    fn requests_inflight(conn: &NvmfConn) -> usize {
        conn.inflight.len()
    }

    fn request_bytes_max(&self) -> usize {
        self.pdu_bytes_max
    }

    fn has_backlog(&self) -> bool {
        self.exports.iter().any(|e| !e.backlog.is_empty())
    }

    fn parse<S: HasShard<Nvmf>>(shard: &mut Shard<Nvmf>, r: &mut Reactor<S>, key: usize) -> usize {
        parse(shard, r, key)
    }

    fn retry_backlog<S: HasShard<Nvmf>>(shard: &mut Shard<Nvmf>, r: &mut Reactor<S>) -> usize {
        let mut work = 0;
        for e in 0..shard.proto.exports.len() {
            work += pipeline::retry_backlog(shard, r, e);
        }
        work
    }

    fn close_note(_conn: &NvmfConn) -> String {
        String::new()
    }
}

/// Why a session's end closes its connection, and whether that is a failure (logged and
/// counted).
fn closing(close: &Close) -> (String, bool) {
    match close {
        Close::HostTerminated { fes } => (
            format!("the host ended the connection (termination request, FES {fes:#x})"),
            true,
        ),
        Close::Fatal { fes, why } => (
            format!("transport error, termination request sent ({fes:?}): {why}"),
            true,
        ),
        Close::Protocol(why) => (format!("protocol error: {why}"), true),
        Close::KeepAliveExpired => ("the host's keep-alive timer ran out".into(), true),
        Close::ControllerGone => ("the queue's controller ended".into(), false),
        Close::Disconnect => ("the host disconnected the queue".into(), false),
    }
}

/// Runs the session over the buffered input while the connection may take commands.
fn parse<S: HasShard<Nvmf>>(shard: &mut Shard<Nvmf>, r: &mut Reactor<S>, key: usize) -> usize {
    let mut work = 0;
    let mut out = std::mem::take(&mut shard.proto.scratch);
    loop {
        if !shard.can_parse(key) || shard.conns[key].input().is_empty() {
            break;
        }
        out.clear();
        let now_ns = r.now_ns();
        let conn = &mut shard.conns[key];
        let (input, state) = conn.input_and_state();
        let (used, step) = state.session.step(input, now_ns, &mut out);
        if !out.is_empty() {
            conn.push_bytes(out.clone());
        }
        match step {
            Step::NeedMore(_) => break,
            Step::Handled => {}
            Step::Io(cmd) => {
                shard.count_request();
                // An in-capsule write's data is still at the front of the input.
                pipeline::start(shard, r, key, cmd);
            }
            Step::WriteData {
                cid,
                offset,
                data,
                last,
            } => {
                // Still at the front of the input: `receive` copies it from there.
                pipeline::receive(shard, r, key, cid, offset, data, last);
            }
            Step::WriteAborted { cid } => pipeline::abort(shard, key, cid),
            Step::Close(close) => {
                let (why, failed) = closing(&close);
                let conn = &mut shard.conns[key];
                conn.failed |= failed;
                conn.closing = Some(why);
            }
        }
        shard.conns[key].consume(used);
        work += 1;
    }
    shard.proto.scratch = out;
    work
}

/// Ends the sessions that time or another queue ended: an admin queue past its keep-alive
/// deadline, an I/O queue whose controller is gone.
fn tick<S: HasShard<Nvmf>>(shard: &mut Shard<Nvmf>, r: &mut Reactor<S>) {
    let now_ns = r.now_ns();
    let mut ended = Vec::new();
    for (key, conn) in shard.conns.iter_mut() {
        if conn.closing.is_some() {
            continue;
        }
        if let Some(close) = conn.proto.session.poll(now_ns) {
            let (why, failed) = closing(&close);
            conn.failed |= failed;
            conn.closing = Some(why);
            ended.push(key);
        }
    }
    for key in ended {
        shard.mark_dirty(key);
    }
}
