//! NVMe/TCP: the PDU codec both ends of an NVMe/TCP connection share (the target front end
//! in `apps/nvmf` and an initiator device), written from the NVMe/TCP Transport
//! Specification 1.0.
//!
//! - [`pdu`]: the PDU types and their header fields, flags and fatal error codes;
//! - [`decode`]: an incremental, bounded decoder whose errors name the termination request
//!   the specification prescribes;
//! - [`encode`]: the encoder, with the digests and data alignment a connection negotiated;
//! - [`digest`]: CRC32C header and data digests;
//! - [`sgl`]: the SGL descriptors a fabrics command's data pointer holds.
//!
//! ```
//! use hypoll_nvme::tcp::{decode::*, encode, pdu::*};
//!
//! let mut wire = Vec::new();
//! let req = IcReq { pfv: PFV_1_0, hpda: 0, digests: Digests::default(), maxr2t: 0 };
//! encode::ic_req(&mut wire, &req);
//! let d = Decoder::new(Role::Controller, 8192, 131072);
//! // Any prefix asks for more; the whole PDU decodes.
//! assert_eq!(d.decode(&wire[..5]), Ok(Decode::NeedMore(3)));
//! let Ok(Decode::Pdu(p)) = d.decode(&wire) else { panic!() };
//! assert_eq!((p.len, p.pdu), (128, Pdu::IcReq(req)));
//! ```

pub mod decode;
pub mod digest;
pub mod encode;
pub mod pdu;
pub mod sgl;

#[cfg(test)]
mod tests;

pub use decode::{Decode, Decoder, PduError, Role};
pub use encode::Framing;
pub use pdu::*;
pub use sgl::{SglDescriptor, SglKind};
