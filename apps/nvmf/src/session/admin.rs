//! The admin queue: Property Get/Set (CAP, VS, CC, CSTS), Identify, Get Log Page, Set/Get
//! Features, Keep Alive and Asynchronous Event Requests, and fabrics commands on any queue.
//!
//! The controller's own registers and timers (CC, CSTS, KATO, the keep-alive deadline, the
//! async event configuration, the held AERs) live here, in the admin queue's session alone:
//! the protocol sends every command that reads or writes them on the admin queue, and the
//! controller does not count I/O traffic as keep-alive (no TBKAS), so no I/O queue needs
//! them. What I/O queues do need (whether the controller lives, is ready, which queues it
//! has) is in the target's registry.

use hypoll_nvme::fabrics::*;
use hypoll_nvme::spec::{Status, SubmissionEntry};

use super::io::{Cmd, Kind};
use super::{Close, Session, Step};
use crate::config::PAGE_BYTES;
use crate::identify;

/// Controller Capabilities' timeout (CAP.TO, in 500 ms units): how long a host waits for
/// CSTS.RDY to follow CC.EN. The controller is ready at once; the host's wait is bounded.
const CAP_TO_500MS: u64 = 2;
/// CAP.CSS bit for the NVM command set.
const CAP_CSS_NVM: u64 = 1 << 37;
/// CAP.CQR: queues must be physically contiguous (always so over fabrics).
const CAP_CQR: u64 = 1 << 16;

/// The controller's state, held by its admin queue's session.
#[derive(Debug)]
pub(crate) struct AdminState {
    cc: u32,
    csts: u32,
    kato_ms: u32,
    pub(crate) keep_alive_deadline_ns: Option<u64>,
    aec: u32,
    /// I/O queues Set Features granted (a count), if it was sent.
    io_queues_granted: Option<u16>,
    /// Held Asynchronous Event Requests, oldest first.
    aers: Vec<u16>,
}

fn deadline(kato_ms: u32, now_ns: u64) -> Option<u64> {
    // The timer runs in KAS units: a KATO is rounded up to one.
    let unit_ms = u64::from(identify::KAS_100MS) * 100;
    let ms = u64::from(kato_ms).div_ceil(unit_ms) * unit_ms;
    (kato_ms != 0).then(|| now_ns.saturating_add(ms * 1_000_000))
}

impl AdminState {
    pub(crate) fn new(kato_ms: u32, now_ns: u64) -> AdminState {
        AdminState {
            cc: 0,
            csts: 0,
            kato_ms,
            keep_alive_deadline_ns: deadline(kato_ms, now_ns),
            aec: 0,
            io_queues_granted: None,
            aers: Vec::new(),
        }
    }

    fn enabled(&self) -> bool {
        self.cc & cc::EN != 0 && self.csts & csts::RDY != 0
    }
}

impl Session {
    fn admin_state(&mut self) -> &mut AdminState {
        self.admin.as_mut().expect("the admin queue's session")
    }

    /// A fabrics command on a connected queue.
    pub(super) fn fabrics(&mut self, sqe: &SubmissionEntry, out: &mut Vec<u8>) -> Step {
        let fctype = (sqe.nsid & 0xff) as u8;
        let admin = self.admin.is_some();
        let status = match fctype {
            fctype::PROPERTY_GET if admin => return self.property_get(sqe, out),
            fctype::PROPERTY_SET if admin => self.property_set(sqe, out),
            fctype::CONNECT => Status::COMMAND_SEQUENCE_ERROR,
            fctype::DISCONNECT if !admin => {
                self.respond(sqe.cid, Status::SUCCESS, 0, out);
                return Step::Close(self.close(Close::Disconnect));
            }
            _ => Status::INVALID_OPCODE,
        };
        self.respond(sqe.cid, status, 0, out);
        Step::Handled
    }

    fn property_get(&mut self, sqe: &SubmissionEntry, out: &mut Vec<u8>) -> Step {
        let size8 = sqe.cdw10 & 0x7 == u32::from(PROPERTY_SIZE_8);
        let l = self.target.config().limits;
        let a = self.admin_state();
        let value = match (sqe.cdw11, size8) {
            (property::CAP, true) => Some(
                u64::from(l.queue_entries_max - 1) | CAP_CQR | (CAP_TO_500MS << 24) | CAP_CSS_NVM,
            ),
            (property::VS, false) => Some(u64::from(identify::VERSION)),
            (property::CC, false) => Some(u64::from(a.cc)),
            (property::CSTS, false) => Some(u64::from(a.csts)),
            _ => None,
        };
        let cid = sqe.cid;
        match value {
            Some(v) => {
                let (sq_head, sq_id) = self.queue.as_ref().map_or((0, 0), |q| (q.sq_head, q.qid));
                let cqe = hypoll_nvme::spec::CompletionEntry {
                    dw0: v as u32,
                    dw1: (v >> 32) as u32,
                    sq_head,
                    sq_id,
                    cid,
                    status_phase: 0,
                };
                hypoll_nvme::tcp::encode::capsule_resp(out, &self.framing, &cqe);
            }
            None => self.respond(cid, Status::INVALID_FIELD, 0, out),
        }
        Step::Handled
    }

    fn property_set(&mut self, sqe: &SubmissionEntry, out: &mut Vec<u8>) -> Status {
        let size8 = sqe.cdw10 & 0x7 == u32::from(PROPERTY_SIZE_8);
        if sqe.cdw11 != property::CC || size8 {
            return Status::INVALID_FIELD;
        }
        self.set_cc(sqe.cdw12, out);
        Status::SUCCESS
    }

    /// A write of CC: enabling makes the controller ready (or fatal, if the entry sizes
    /// are not the fabrics ones), disabling resets it, a shutdown completes at once.
    fn set_cc(&mut self, new: u32, out: &mut Vec<u8>) {
        let discovery = self.queue.as_ref().is_some_and(|q| q.discovery);
        let old = self.admin_state().cc;
        self.admin_state().cc = new;
        if new & cc::EN != 0 && old & cc::EN == 0 {
            let iosqes = (new >> cc::IOSQES_SHIFT) & 0xf;
            let iocqes = (new >> cc::IOCQES_SHIFT) & 0xf;
            let mps = (new >> 7) & 0xf;
            let css = (new >> 4) & 0x7;
            let fits = discovery || (iosqes == SQES_LOG2 && iocqes == CQES_LOG2);
            let ready = fits && mps == 0 && css == 0;
            let a = self.admin_state();
            a.csts = if ready { csts::RDY } else { csts::CFS };
            if let Some(q) = &self.queue {
                q.link.set_ready(ready);
            }
        } else if new & cc::EN == 0 && old & cc::EN != 0 {
            // A reset: the I/O queues end, held AERs are aborted, registers clear.
            if let Some(q) = self.queue.as_mut() {
                q.link = self.target.reset(&q.link);
            }
            let aers = std::mem::take(&mut self.admin_state().aers);
            for cid in aers {
                self.cmds.remove(&cid);
                self.respond(cid, Status::ABORTED_SQ_DELETION, 0, out);
            }
            let a = self.admin_state();
            a.csts = 0;
            a.io_queues_granted = None;
        }
        let a = self.admin_state();
        if new & cc::SHN_MASK != 0 {
            a.csts = (a.csts & !csts::SHST_MASK) | csts::SHST_COMPLETE;
        } else {
            a.csts &= !csts::SHST_MASK;
        }
    }

    /// An admin command (not fabrics) on the admin queue.
    pub(super) fn admin_command(
        &mut self,
        sqe: &SubmissionEntry,
        data: &[u8],
        now_ns: u64,
        out: &mut Vec<u8>,
    ) -> Step {
        if !self.admin_state().enabled() {
            self.respond(sqe.cid, Status::COMMAND_SEQUENCE_ERROR, 0, out);
            return Step::Handled;
        }
        let reply = match sqe.opcode {
            admin::IDENTIFY => self.identify(sqe),
            admin::GET_LOG_PAGE => self.get_log_page(sqe),
            admin::SET_FEATURES => self.set_features(sqe, now_ns).map(Reply::Dw0),
            admin::GET_FEATURES => self.get_features(sqe).map(Reply::Dw0),
            admin::KEEP_ALIVE => {
                let a = self.admin_state();
                a.keep_alive_deadline_ns = deadline(a.kato_ms, now_ns);
                Ok(Reply::Dw0(0))
            }
            admin::ASYNC_EVENT_REQUEST => {
                let max = usize::from(self.target.config().limits.aers_max);
                let a = self.admin_state();
                if a.aers.len() >= max {
                    Err(Status::AER_LIMIT_EXCEEDED)
                } else {
                    a.aers.push(sqe.cid);
                    self.cmds.insert(sqe.cid, Cmd::new(Kind::Aer, 0));
                    return Step::Handled;
                }
            }
            _ => Err(Status::INVALID_OPCODE),
        };
        match reply {
            Ok(Reply::Dw0(dw0)) => self.respond(sqe.cid, Status::SUCCESS, dw0, out),
            Ok(Reply::Data(bytes)) => match Self::data_out_check(sqe, bytes.len() as u32, data) {
                Ok(()) => self.data_reply(sqe.cid, &[&bytes], out),
                Err(status) => self.respond(sqe.cid, status, 0, out),
            },
            Err(status) => self.respond(sqe.cid, status, 0, out),
        }
        Step::Handled
    }

    /// The namespace index of an active namespace ID.
    pub(crate) fn namespace_index(&self, nsid: u32) -> Option<usize> {
        let n = self.target.config().namespaces.len();
        (1..=n as u64)
            .contains(&u64::from(nsid))
            .then(|| nsid as usize - 1)
    }

    fn identify(&mut self, sqe: &SubmissionEntry) -> Result<Reply, Status> {
        let cfg = self.target.config();
        let (cntlid, discovery) = self
            .queue
            .as_ref()
            .map_or((0, false), |q| (q.link.cntlid, q.discovery));
        let cns = (sqe.cdw10 & 0xff) as u8;
        if discovery && cns != cns::CONTROLLER {
            return Err(Status::INVALID_FIELD);
        }
        let ns = self.namespace_index(sqe.nsid).map(|i| &cfg.namespaces[i]);
        Ok(Reply::Data(match cns {
            cns::CONTROLLER => identify::controller(cfg, cntlid, discovery),
            cns::NAMESPACE => identify::namespace(ns.ok_or(Status::INVALID_NAMESPACE)?),
            cns::ACTIVE_NAMESPACES if sqe.nsid < 0xffff_fffe => {
                identify::active_namespaces(cfg, sqe.nsid)
            }
            cns::ACTIVE_NAMESPACES => return Err(Status::INVALID_NAMESPACE),
            cns::NAMESPACE_DESCRIPTORS => {
                identify::namespace_descriptors(ns.ok_or(Status::INVALID_NAMESPACE)?)
            }
            _ => return Err(Status::INVALID_FIELD),
        }))
    }

    fn get_log_page(&mut self, sqe: &SubmissionEntry) -> Result<Reply, Status> {
        let cfg = self.target.config();
        let discovery = self.queue.as_ref().is_some_and(|q| q.discovery);
        let lid = (sqe.cdw10 & 0xff) as u8;
        let numd = (u64::from(sqe.cdw11 & 0xffff) << 16 | u64::from(sqe.cdw10 >> 16)) + 1;
        let len = numd * 4;
        let offset = u64::from(sqe.cdw12) | u64::from(sqe.cdw13) << 32;
        if len > u64::from(cfg.limits.transfer_bytes_max) || !offset.is_multiple_of(4) {
            return Err(Status::INVALID_FIELD);
        }
        let log = match (lid, discovery) {
            (log_page::DISCOVERY, true) => {
                identify::discovery_log(cfg, cfg.limits.queue_entries_max)
            }
            (log_page::ERROR, false) => identify::error_log(),
            (log_page::SMART, false) => identify::smart_log(),
            (log_page::FIRMWARE_SLOT, false) => identify::firmware_log(),
            _ => return Err(Status::INVALID_LOG_PAGE),
        };
        if offset > log.len() as u64 {
            return Err(Status::INVALID_FIELD);
        }
        let mut page = vec![0u8; len as usize];
        let from = &log[offset as usize..];
        let n = from.len().min(page.len());
        page[..n].copy_from_slice(&from[..n]);
        Ok(Reply::Data(page))
    }

    fn set_features(&mut self, sqe: &SubmissionEntry, now_ns: u64) -> Result<u32, Status> {
        let fid = (sqe.cdw10 & 0xff) as u8;
        if sqe.cdw10 & (1 << 31) != 0 {
            return Err(Status::FEATURE_NOT_SAVEABLE);
        }
        let discovery = self.queue.as_ref().is_some_and(|q| q.discovery);
        match fid {
            feature::NUMBER_OF_QUEUES if !discovery => {
                let (nsqr, ncqr) = (sqe.cdw11 & 0xffff, sqe.cdw11 >> 16);
                if nsqr == 0xffff || ncqr == 0xffff {
                    return Err(Status::INVALID_FIELD);
                }
                let max = self.target.config().limits.io_queues_max;
                let granted = (nsqr.min(ncqr) as u16 + 1).min(max);
                let link = self.queue.as_ref().expect("connected").link.clone();
                self.target
                    .grant_io_queues(&link, granted)
                    .map_err(|_| Status::COMMAND_SEQUENCE_ERROR)?;
                self.admin_state().io_queues_granted = Some(granted);
                Ok(queues_dw0(granted))
            }
            feature::ASYNC_EVENT_CONFIG => {
                // Only SMART warnings can be asked for: the controller announces no
                // notices (OAES is 0).
                self.admin_state().aec = sqe.cdw11 & 0xff;
                Ok(0)
            }
            feature::KEEP_ALIVE_TIMER => {
                let a = self.admin_state();
                a.kato_ms = sqe.cdw11;
                a.keep_alive_deadline_ns = deadline(a.kato_ms, now_ns);
                Ok(0)
            }
            _ => Err(Status::INVALID_FIELD),
        }
    }

    fn get_features(&mut self, sqe: &SubmissionEntry) -> Result<u32, Status> {
        let fid = (sqe.cdw10 & 0xff) as u8;
        let select = (sqe.cdw10 >> 8) & 0x7;
        let discovery = self.queue.as_ref().is_some_and(|q| q.discovery);
        let max = self.target.config().limits.io_queues_max;
        let a = self.admin_state();
        // Saved values (select 2) are the defaults: nothing is saveable.
        let current = select == 0;
        let value = match fid {
            feature::NUMBER_OF_QUEUES if !discovery => {
                queues_dw0(a.io_queues_granted.filter(|_| current).unwrap_or(max))
            }
            feature::ASYNC_EVENT_CONFIG => {
                if current {
                    a.aec
                } else {
                    0
                }
            }
            feature::KEEP_ALIVE_TIMER => {
                if current {
                    a.kato_ms
                } else {
                    0
                }
            }
            _ => return Err(Status::INVALID_FIELD),
        };
        match select {
            0..=2 => Ok(value),
            // Capabilities: changeable, not saveable, not per namespace.
            3 => Ok(1 << 2),
            _ => Err(Status::INVALID_FIELD),
        }
    }
}

/// Number of Queues' answer: `count` submission and completion queues, 0's based.
fn queues_dw0(count: u16) -> u32 {
    let n = u32::from(count.max(1) - 1);
    n | (n << 16)
}

/// What an admin command answers with.
enum Reply {
    Dw0(u32),
    Data(Vec<u8>),
}

const _: () = assert!(identify::IDENTIFY_BYTES as u32 == PAGE_BYTES);
