//! NVMe over Fabrics and admin-command facts both ends of a fabrics connection need: the
//! fabrics command types, the properties a host reads and writes (CAP, VS, CC, CSTS), the
//! Connect command's data, and the admin opcodes a fabrics host sends.
//!
//! Layouts follow the NVM Express over Fabrics specification (1.1: "Fabrics Command",
//! "Connect Command", "Property Definitions") and the Base specification's admin command
//! set. The transport that carries them (NVMe/TCP) is in [`crate::tcp`].

use thiserror::Error;

/// The opcode every fabrics command carries; its type is in byte 4 (FCTYPE).
pub const OPCODE_FABRICS: u8 = 0x7f;

/// Fabrics command types (byte 4 of a fabrics command).
pub mod fctype {
    pub const PROPERTY_SET: u8 = 0x00;
    pub const CONNECT: u8 = 0x01;
    pub const PROPERTY_GET: u8 = 0x04;
    pub const AUTHENTICATION_SEND: u8 = 0x05;
    pub const AUTHENTICATION_RECEIVE: u8 = 0x06;
    pub const DISCONNECT: u8 = 0x08;
}

/// Admin command opcodes a fabrics controller serves (Base spec, "Opcodes for Admin
/// Commands").
pub mod admin {
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const IDENTIFY: u8 = 0x06;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0a;
    pub const ASYNC_EVENT_REQUEST: u8 = 0x0c;
    pub const KEEP_ALIVE: u8 = 0x18;
}

/// Identify CNS values (CDW10 bits 7:0).
pub mod cns {
    pub const NAMESPACE: u8 = 0x00;
    pub const CONTROLLER: u8 = 0x01;
    pub const ACTIVE_NAMESPACES: u8 = 0x02;
    pub const NAMESPACE_DESCRIPTORS: u8 = 0x03;
}

/// Log page identifiers (Get Log Page CDW10 bits 7:0).
pub mod log_page {
    pub const ERROR: u8 = 0x01;
    pub const SMART: u8 = 0x02;
    pub const FIRMWARE_SLOT: u8 = 0x03;
    pub const DISCOVERY: u8 = 0x70;
}

/// Feature identifiers (Set/Get Features CDW10 bits 7:0).
pub mod feature {
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0b;
    pub const KEEP_ALIVE_TIMER: u8 = 0x0f;
}

/// Property offsets (Fabrics spec, "Property Definitions"); Property Get/Set name one.
pub mod property {
    /// Controller Capabilities, 8 bytes.
    pub const CAP: u32 = 0x00;
    /// Version, 4 bytes.
    pub const VS: u32 = 0x08;
    /// Controller Configuration, 4 bytes.
    pub const CC: u32 = 0x14;
    /// Controller Status, 4 bytes.
    pub const CSTS: u32 = 0x1c;
    /// NVM Subsystem Reset, 4 bytes.
    pub const NSSR: u32 = 0x20;
}

/// Property Get/Set attribute (byte 40, bits 2:0): the property's size.
pub const PROPERTY_SIZE_4: u8 = 0;
pub const PROPERTY_SIZE_8: u8 = 1;

/// CC fields.
pub mod cc {
    pub const EN: u32 = 1 << 0;
    pub const SHN_SHIFT: u32 = 14;
    pub const SHN_MASK: u32 = 0b11 << SHN_SHIFT;
    pub const IOSQES_SHIFT: u32 = 16;
    pub const IOCQES_SHIFT: u32 = 20;
}

/// CSTS fields.
pub mod csts {
    pub const RDY: u32 = 1 << 0;
    pub const CFS: u32 = 1 << 1;
    pub const SHST_SHIFT: u32 = 2;
    pub const SHST_MASK: u32 = 0b11 << SHST_SHIFT;
    /// Shutdown processing complete.
    pub const SHST_COMPLETE: u32 = 0b10 << SHST_SHIFT;
}

/// Log2 of the submission and completion queue entry sizes a fabrics controller uses
/// (64 and 16 bytes): CC.IOSQES and CC.IOCQES must say these.
pub const SQES_LOG2: u32 = 6;
pub const CQES_LOG2: u32 = 4;

/// The well-known name of the discovery subsystem.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// Bytes an NQN field occupies in Connect data and in Identify Controller.
pub const NQN_FIELD_BYTES: usize = 256;
/// Longest NQN the specification allows, in bytes (the field keeps room for a NUL).
pub const NQN_BYTES_MAX: usize = 223;

/// Connect's controller ID that asks for any controller (the dynamic controller model).
pub const CNTLID_DYNAMIC: u16 = 0xffff;
/// Connect's CATTR bit 2: the host disables submission queue flow control.
pub const CATTR_DISABLE_SQ_FLOW_CONTROL: u8 = 1 << 2;

/// Bytes of the Connect command's data.
pub const CONNECT_DATA_BYTES: usize = 1024;
/// Offsets in Connect data, for Connect's Invalid Parameters answer (IPO).
pub const CONNECT_DATA_HOSTID_OFFSET: u16 = 0;
pub const CONNECT_DATA_CNTLID_OFFSET: u16 = 16;
pub const CONNECT_DATA_SUBNQN_OFFSET: u16 = 256;
pub const CONNECT_DATA_HOSTNQN_OFFSET: u16 = 512;
/// Offsets in the Connect command, for IPO.
pub const CONNECT_QID_OFFSET: u16 = 42;
pub const CONNECT_SQSIZE_OFFSET: u16 = 44;

/// The data of a Connect command: who the host is and what it connects to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectData {
    pub hostid: [u8; 16],
    /// [`CNTLID_DYNAMIC`] for an admin queue; the controller's ID for an I/O queue.
    pub cntlid: u16,
    pub subnqn: String,
    pub hostnqn: String,
}

/// Why Connect data does not parse; `offset()` is the field's offset for the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum ConnectDataError {
    #[error("connect data of {0} bytes, expected {CONNECT_DATA_BYTES}")]
    Length(usize),
    #[error("the subsystem NQN is empty, unterminated, too long or not UTF-8")]
    SubNqn,
    #[error("the host NQN is empty, unterminated, too long or not UTF-8")]
    HostNqn,
}

impl ConnectDataError {
    /// The offset of the faulty field in the Connect data (IPO, with IATTR 1).
    pub fn offset(self) -> u16 {
        match self {
            ConnectDataError::Length(_) => CONNECT_DATA_HOSTID_OFFSET,
            ConnectDataError::SubNqn => CONNECT_DATA_SUBNQN_OFFSET,
            ConnectDataError::HostNqn => CONNECT_DATA_HOSTNQN_OFFSET,
        }
    }
}

/// An NQN field: NUL-terminated UTF-8 of 1..=[`NQN_BYTES_MAX`] bytes.
fn nqn_from_field(field: &[u8]) -> Option<String> {
    let end = field.iter().position(|&b| b == 0)?;
    if end == 0 || end > NQN_BYTES_MAX {
        return None;
    }
    std::str::from_utf8(&field[..end]).ok().map(str::to_owned)
}

/// Writes `nqn` into an NQN field, NUL-padded; an NQN longer than the field allows is cut
/// (a host that sends one is refused by the controller anyway).
pub fn nqn_to_field(nqn: &str, field: &mut [u8]) {
    field.fill(0);
    let n = nqn.len().min(field.len() - 1);
    field[..n].copy_from_slice(&nqn.as_bytes()[..n]);
}

impl ConnectData {
    pub fn parse(data: &[u8]) -> Result<ConnectData, ConnectDataError> {
        if data.len() != CONNECT_DATA_BYTES {
            return Err(ConnectDataError::Length(data.len()));
        }
        let field = |at: u16| &data[at as usize..at as usize + NQN_FIELD_BYTES];
        let subnqn =
            nqn_from_field(field(CONNECT_DATA_SUBNQN_OFFSET)).ok_or(ConnectDataError::SubNqn)?;
        let hostnqn =
            nqn_from_field(field(CONNECT_DATA_HOSTNQN_OFFSET)).ok_or(ConnectDataError::HostNqn)?;
        let mut hostid = [0u8; 16];
        hostid.copy_from_slice(&data[..16]);
        Ok(ConnectData {
            hostid,
            cntlid: u16::from_le_bytes([data[16], data[17]]),
            subnqn,
            hostnqn,
        })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut d = vec![0u8; CONNECT_DATA_BYTES];
        d[..16].copy_from_slice(&self.hostid);
        d[16..18].copy_from_slice(&self.cntlid.to_le_bytes());
        let sub = CONNECT_DATA_SUBNQN_OFFSET as usize;
        nqn_to_field(&self.subnqn, &mut d[sub..sub + NQN_FIELD_BYTES]);
        let host = CONNECT_DATA_HOSTNQN_OFFSET as usize;
        nqn_to_field(&self.hostnqn, &mut d[host..host + NQN_FIELD_BYTES]);
        d
    }
}

/// Connect's Invalid Parameters answer carries the faulty field's place in CQE DW0: its
/// offset (IPO, bits 15:0) and whether it lies in the data (IATTR bit 0, bit 16).
pub fn connect_invalid_parameter_dw0(offset: u16, in_data: bool) -> u32 {
    u32::from(offset) | (u32::from(in_data) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_data_round_trips_and_sits_where_the_spec_puts_it() {
        let d = ConnectData {
            hostid: [7; 16],
            cntlid: CNTLID_DYNAMIC,
            subnqn: "nqn.2026-12.io.hypoll:test".into(),
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:1".into(),
        };
        let b = d.to_bytes();
        assert_eq!(b.len(), CONNECT_DATA_BYTES);
        assert_eq!(&b[16..18], &[0xff, 0xff]);
        assert_eq!(&b[256..260], b"nqn.");
        assert_eq!(&b[512..516], b"nqn.");
        assert_eq!(ConnectData::parse(&b), Ok(d));
    }

    #[test]
    fn bad_connect_data_names_its_field() {
        let mut b = ConnectData {
            hostid: [0; 16],
            cntlid: 1,
            subnqn: "nqn.a".into(),
            hostnqn: "nqn.b".into(),
        }
        .to_bytes();
        assert_eq!(
            ConnectData::parse(&b[..1000]),
            Err(ConnectDataError::Length(1000))
        );
        // A host NQN with no terminating NUL.
        b[512..768].fill(b'x');
        let e = ConnectData::parse(&b).unwrap_err();
        assert_eq!((e, e.offset()), (ConnectDataError::HostNqn, 512));
        // An empty subsystem NQN.
        b[256] = 0;
        let e = ConnectData::parse(&b).unwrap_err();
        assert_eq!((e, e.offset()), (ConnectDataError::SubNqn, 256));
        assert_eq!(connect_invalid_parameter_dw0(256, true), 0x1_0100);
    }
}
