//! What an NVMe/TCP host sends, byte for byte: for tests, the fuzz corpus and load tests.
//! Each builder returns one whole PDU framed as [`Host::framing`] says (set it to what the
//! target granted in its ICResp).

use hypoll_nvme::fabrics::*;
use hypoll_nvme::spec::{SubmissionEntry, CDW12_DEAC, DSM_ATTR_DEALLOCATE};
use hypoll_nvme::tcp::encode::{self, Framing};
use hypoll_nvme::tcp::{
    pda_bytes, DataHeader, Digests, Fes, IcReq, PduType, SglDescriptor, PFV_1_0,
};

use crate::session::BlockRange;

/// The host NQN and host ID the builders use unless told otherwise.
pub const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:6879706f-6c6c-0000-0000-000000000001";
pub const HOSTID: [u8; 16] = *b"hypoll-test-host";

/// A host's side of one connection.
#[derive(Clone, Debug)]
pub struct Host {
    /// How this host frames what it sends: after the IC exchange, the digests granted and
    /// the controller's alignment.
    pub framing: Framing,
    pub hostnqn: String,
    pub hostid: [u8; 16],
}

impl Default for Host {
    fn default() -> Self {
        Host::new(Digests::default())
    }
}

impl Host {
    /// A host that will use `digests` (once the target grants them).
    pub fn new(digests: Digests) -> Host {
        Host {
            framing: Framing {
                digests,
                pda_bytes: pda_bytes(0),
            },
            hostnqn: HOSTNQN.into(),
            hostid: HOSTID,
        }
    }

    /// ICReq asking for this host's digests, with the given host data alignment.
    pub fn ic_req(&self, hpda: u8) -> Vec<u8> {
        let mut w = Vec::new();
        let r = IcReq {
            pfv: PFV_1_0,
            hpda,
            digests: self.framing.digests,
            maxr2t: 0,
        };
        encode::ic_req(&mut w, &r);
        w
    }

    /// Any command, with in-capsule data if `data` is not empty.
    pub fn command(&self, sqe: &SubmissionEntry, data: &[u8]) -> Vec<u8> {
        let mut w = Vec::new();
        encode::capsule_cmd(&mut w, &self.framing, sqe, data);
        w
    }

    fn fabrics(cid: u16, fctype: u8) -> SubmissionEntry {
        SubmissionEntry {
            opcode: OPCODE_FABRICS,
            cid,
            nsid: u32::from(fctype),
            ..Default::default()
        }
    }

    /// A command whose data (`bytes`, 0 for none) travels in data PDUs.
    fn with_transport_data(mut sqe: SubmissionEntry, bytes: u32) -> SubmissionEntry {
        SglDescriptor::transport(bytes).store(&mut sqe);
        sqe
    }

    /// Connect queue `qid` (0: the admin queue, with `cntlid` [`CNTLID_DYNAMIC`]) of
    /// `sqsize + 1` entries to `subnqn`.
    pub fn connect(
        &self,
        cid: u16,
        qid: u16,
        sqsize: u16,
        kato_ms: u32,
        cntlid: u16,
        subnqn: &str,
    ) -> Vec<u8> {
        let data = ConnectData {
            hostid: self.hostid,
            cntlid,
            subnqn: subnqn.into(),
            hostnqn: self.hostnqn.clone(),
        }
        .to_bytes();
        let mut sqe = Host::fabrics(cid, fctype::CONNECT);
        sqe.cdw10 = u32::from(qid) << 16;
        sqe.cdw11 = u32::from(sqsize);
        sqe.cdw12 = kato_ms;
        SglDescriptor::in_capsule(data.len() as u32).store(&mut sqe);
        self.command(&sqe, &data)
    }

    pub fn property_get(&self, cid: u16, offset: u32, size8: bool) -> Vec<u8> {
        let mut sqe = Host::fabrics(cid, fctype::PROPERTY_GET);
        sqe.cdw10 = u32::from(if size8 {
            PROPERTY_SIZE_8
        } else {
            PROPERTY_SIZE_4
        });
        sqe.cdw11 = offset;
        self.command(&sqe, &[])
    }

    pub fn property_set(&self, cid: u16, offset: u32, value: u32) -> Vec<u8> {
        let mut sqe = Host::fabrics(cid, fctype::PROPERTY_SET);
        sqe.cdw10 = u32::from(PROPERTY_SIZE_4);
        sqe.cdw11 = offset;
        sqe.cdw12 = value;
        self.command(&sqe, &[])
    }

    /// CC with EN and the fabrics entry sizes, as a Linux host enables a controller.
    pub fn enable(&self, cid: u16) -> Vec<u8> {
        let v = cc::EN | (SQES_LOG2 << cc::IOSQES_SHIFT) | (CQES_LOG2 << cc::IOCQES_SHIFT);
        self.property_set(cid, property::CC, v)
    }

    /// Identify `cns` for `nsid`: 4096 bytes come back.
    pub fn identify(&self, cid: u16, cns: u8, nsid: u32) -> Vec<u8> {
        let mut sqe = SubmissionEntry {
            opcode: admin::IDENTIFY,
            cid,
            nsid,
            cdw10: u32::from(cns),
            ..Default::default()
        };
        sqe = Host::with_transport_data(sqe, 4096);
        self.command(&sqe, &[])
    }

    /// Get Log Page `lid`: `len` bytes (a multiple of 4) from `offset`.
    pub fn get_log_page(&self, cid: u16, lid: u8, len: u32, offset: u64) -> Vec<u8> {
        let numd = len / 4 - 1;
        let sqe = SubmissionEntry {
            opcode: admin::GET_LOG_PAGE,
            cid,
            nsid: 0xffff_ffff,
            cdw10: u32::from(lid) | (numd << 16),
            cdw11: numd >> 16,
            cdw12: offset as u32,
            cdw13: (offset >> 32) as u32,
            ..Default::default()
        };
        self.command(&Host::with_transport_data(sqe, len), &[])
    }

    pub fn set_features(&self, cid: u16, fid: u8, cdw11: u32) -> Vec<u8> {
        let sqe = SubmissionEntry {
            opcode: admin::SET_FEATURES,
            cid,
            cdw10: u32::from(fid),
            cdw11,
            ..Default::default()
        };
        self.command(&Host::with_transport_data(sqe, 0), &[])
    }

    pub fn get_features(&self, cid: u16, fid: u8, select: u8) -> Vec<u8> {
        let sqe = SubmissionEntry {
            opcode: admin::GET_FEATURES,
            cid,
            cdw10: u32::from(fid) | (u32::from(select) << 8),
            ..Default::default()
        };
        self.command(&Host::with_transport_data(sqe, 0), &[])
    }

    fn admin_no_data(&self, cid: u16, opcode: u8) -> Vec<u8> {
        let sqe = SubmissionEntry {
            opcode,
            cid,
            ..Default::default()
        };
        self.command(&Host::with_transport_data(sqe, 0), &[])
    }

    pub fn keep_alive(&self, cid: u16) -> Vec<u8> {
        self.admin_no_data(cid, admin::KEEP_ALIVE)
    }

    pub fn async_event_request(&self, cid: u16) -> Vec<u8> {
        self.admin_no_data(cid, admin::ASYNC_EVENT_REQUEST)
    }

    fn rw(opcode: u8, cid: u16, nsid: u32, slba: u64, blocks: u32) -> SubmissionEntry {
        let mut sqe = SubmissionEntry {
            opcode,
            cid,
            nsid,
            cdw12: blocks - 1,
            ..Default::default()
        };
        sqe.set_slba(slba);
        sqe
    }

    /// Read `blocks` of `block_bytes` from `slba`.
    pub fn read(&self, cid: u16, nsid: u32, slba: u64, blocks: u32, block_bytes: u32) -> Vec<u8> {
        let sqe = Host::rw(0x02, cid, nsid, slba, blocks);
        self.command(&Host::with_transport_data(sqe, blocks * block_bytes), &[])
    }

    /// Write `data` (whole blocks) at `slba`, in the capsule.
    pub fn write(&self, cid: u16, nsid: u32, slba: u64, data: &[u8], block_bytes: u32) -> Vec<u8> {
        let mut sqe = Host::rw(0x01, cid, nsid, slba, data.len() as u32 / block_bytes);
        SglDescriptor::in_capsule(data.len() as u32).store(&mut sqe);
        self.command(&sqe, data)
    }

    /// A write of `blocks` whose data waits for the target's R2T.
    pub fn write_solicited(
        &self,
        cid: u16,
        nsid: u32,
        slba: u64,
        blocks: u32,
        block_bytes: u32,
    ) -> Vec<u8> {
        let sqe = Host::rw(0x01, cid, nsid, slba, blocks);
        self.command(&Host::with_transport_data(sqe, blocks * block_bytes), &[])
    }

    /// Data answering R2T `ttag` of command `cid`.
    pub fn h2c_data(&self, cid: u16, ttag: u16, offset: u32, data: &[u8], last: bool) -> Vec<u8> {
        let mut w = Vec::new();
        let h = DataHeader {
            cccid: cid,
            ttag,
            datao: offset,
            datal: data.len() as u32,
            last,
            success: false,
        };
        encode::data_pdu(&mut w, &self.framing, PduType::H2CData, &h, data);
        w
    }

    pub fn flush(&self, cid: u16, nsid: u32) -> Vec<u8> {
        let sqe = SubmissionEntry {
            opcode: 0x00,
            cid,
            nsid,
            ..Default::default()
        };
        self.command(&Host::with_transport_data(sqe, 0), &[])
    }

    pub fn write_zeroes(
        &self,
        cid: u16,
        nsid: u32,
        slba: u64,
        blocks: u32,
        deallocate: bool,
    ) -> Vec<u8> {
        let mut sqe = Host::rw(0x08, cid, nsid, slba, blocks);
        if deallocate {
            sqe.cdw12 |= CDW12_DEAC;
        }
        self.command(&Host::with_transport_data(sqe, 0), &[])
    }

    /// Dataset Management deallocating `ranges`, in the capsule or (if not) solicited.
    pub fn deallocate(
        &self,
        cid: u16,
        nsid: u32,
        ranges: &[BlockRange],
        in_capsule: bool,
    ) -> Vec<u8> {
        let mut data = Vec::with_capacity(16 * ranges.len());
        for r in ranges {
            data.extend_from_slice(&0u32.to_le_bytes());
            data.extend_from_slice(&r.blocks.to_le_bytes());
            data.extend_from_slice(&r.slba.to_le_bytes());
        }
        let mut sqe = SubmissionEntry {
            opcode: 0x09,
            cid,
            nsid,
            cdw10: ranges.len() as u32 - 1,
            cdw11: DSM_ATTR_DEALLOCATE,
            ..Default::default()
        };
        if in_capsule {
            SglDescriptor::in_capsule(data.len() as u32).store(&mut sqe);
            self.command(&sqe, &data)
        } else {
            self.command(&Host::with_transport_data(sqe, data.len() as u32), &[])
        }
    }

    /// The ranges of [`Host::deallocate`] as the H2CData that answers its R2T.
    pub fn deallocate_data(&self, cid: u16, ttag: u16, ranges: &[BlockRange]) -> Vec<u8> {
        let mut data = Vec::new();
        for r in ranges {
            data.extend_from_slice(&0u32.to_le_bytes());
            data.extend_from_slice(&r.blocks.to_le_bytes());
            data.extend_from_slice(&r.slba.to_le_bytes());
        }
        self.h2c_data(cid, ttag, 0, &data, true)
    }

    /// Fabrics Disconnect (of an I/O queue).
    pub fn disconnect(&self, cid: u16) -> Vec<u8> {
        self.command(&Host::fabrics(cid, fctype::DISCONNECT), &[])
    }

    pub fn term_req(&self, fes: Fes) -> Vec<u8> {
        let mut w = Vec::new();
        encode::term_req(&mut w, PduType::H2CTermReq, fes, 0, &[]);
        w
    }
}
