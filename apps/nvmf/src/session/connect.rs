//! Connect: the first command of every queue. On queue 0 it makes a controller (of the NVM
//! subsystem or of the discovery subsystem); on another queue it joins an I/O queue to an
//! existing controller of the same host.

use hypoll_nvme::fabrics::*;
use hypoll_nvme::spec::{Status, SubmissionEntry};
use hypoll_nvme::tcp::{SglDescriptor, SglKind};

use super::admin::AdminState;
use super::{CmdMap, Phase, Queue, Session, Step};
use crate::config::ADMIN_IN_CAPSULE_BYTES;
use crate::target::Refusal;

/// Connect's record format (CDW10 bits 15:0): only format 0 exists.
const RECFMT_0: u32 = 0;

impl Session {
    /// Serves the first command on a queue, which must be a Connect.
    pub(super) fn connect(
        &mut self,
        sqe: &SubmissionEntry,
        data: &[u8],
        now_ns: u64,
        out: &mut Vec<u8>,
    ) -> Step {
        let fctype = (sqe.nsid & 0xff) as u8;
        if sqe.opcode != OPCODE_FABRICS || fctype != fctype::CONNECT {
            self.respond(sqe.cid, Status::COMMAND_SEQUENCE_ERROR, 0, out);
            return Step::Handled;
        }
        match self.try_connect(sqe, data, now_ns) {
            Ok(cntlid) => self.respond(sqe.cid, Status::SUCCESS, u32::from(cntlid), out),
            Err((status, dw0)) => self.respond(sqe.cid, status, dw0, out),
        }
        Step::Handled
    }

    fn try_connect(
        &mut self,
        sqe: &SubmissionEntry,
        data: &[u8],
        now_ns: u64,
    ) -> Result<u16, (Status, u32)> {
        let invalid = |offset: u16, in_data: bool| {
            (
                Status::CONNECT_INVALID_PARAMETERS,
                connect_invalid_parameter_dw0(offset, in_data),
            )
        };
        if sqe.cdw10 & 0xffff != RECFMT_0 {
            return Err((Status::CONNECT_INCOMPATIBLE_FORMAT, 0));
        }
        let qid = (sqe.cdw10 >> 16) as u16;
        let sqsize = (sqe.cdw11 & 0xffff) as u16;
        let cattr = (sqe.cdw11 >> 16) as u8;
        let kato_ms = sqe.cdw12;
        let sgl = SglDescriptor::of(sqe);
        match sgl.kind() {
            SglKind::InCapsule => {}
            _ => return Err((Status::SGL_DESCRIPTOR_TYPE_INVALID, 0)),
        }
        if sgl.address != 0 {
            return Err((Status::SGL_OFFSET_INVALID, 0));
        }
        if sgl.length as usize != data.len() || data.len() != CONNECT_DATA_BYTES {
            return Err((Status::DATA_SGL_LENGTH_INVALID, 0));
        }
        let d = ConnectData::parse(data).map_err(|e| invalid(e.offset(), true))?;
        let target = self.target.clone();
        let cfg = target.config();
        let discovery = if d.subnqn == cfg.subsystem_nqn {
            false
        } else if d.subnqn == DISCOVERY_NQN {
            true
        } else {
            return Err(invalid(CONNECT_DATA_SUBNQN_OFFSET, true));
        };
        if sqsize == 0 || sqsize >= cfg.limits.queue_entries_max {
            return Err(invalid(CONNECT_SQSIZE_OFFSET, false));
        }
        let refused = |r: Refusal| match r {
            Refusal::Busy => (Status::CONNECT_CONTROLLER_BUSY, 0),
            Refusal::InvalidParameter { offset, in_data } => invalid(offset, in_data),
            Refusal::NotReady => (Status::COMMAND_SEQUENCE_ERROR, 0),
        };
        let link = if qid == 0 {
            if d.cntlid != CNTLID_DYNAMIC {
                return Err(invalid(CONNECT_DATA_CNTLID_OFFSET, true));
            }
            let link = target
                .connect_admin(&d.hostnqn, d.hostid, discovery)
                .map_err(refused)?;
            self.admin = Some(Box::new(AdminState::new(kato_ms, now_ns)));
            self.decoder.capsule_data_bytes_max = ADMIN_IN_CAPSULE_BYTES;
            link
        } else {
            if discovery {
                return Err(invalid(CONNECT_QID_OFFSET, false));
            }
            let link = target
                .connect_io(d.cntlid, qid, &d.hostnqn, d.hostid)
                .map_err(refused)?;
            self.decoder.capsule_data_bytes_max = cfg.limits.in_capsule_bytes_max;
            link
        };
        let cntlid = link.cntlid;
        let entries = sqsize + 1;
        self.queue = Some(Queue {
            qid,
            link,
            entries,
            // The Connect itself was the queue's first entry.
            sq_head: 1,
            flow_control: cattr & CATTR_DISABLE_SQ_FLOW_CONTROL == 0,
            discovery,
        });
        self.cmds = CmdMap::with_capacity_and_hasher(usize::from(entries), Default::default());
        self.phase = Phase::Connected;
        Ok(cntlid)
    }
}
