//! One NVMe/TCP connection during set-up, blocking: the ICReq/ICResp exchange, then admin
//! and fabrics commands one at a time (Connect, properties, Identify, features, Keep
//! Alive), each waiting for its answer within a timeout. A queue pair's connection then
//! turns non-blocking (`queue.rs`); the admin connection stays here for its keep-alives.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::fabrics::{self, ConnectData};
use crate::spec::{CompletionEntry, SubmissionEntry};
use crate::tcp::decode::{Decode, Decoder, Role};
use crate::tcp::encode::{self, Framing};
use crate::tcp::{pda_bytes, Digests, IcReq, Pdu, SglDescriptor, PFV_1_0};

/// How long a set-up step (connecting, one command's answer) may take.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest data an admin command here reads (Identify's 4 KiB).
const ADMIN_DATA_BYTES_MAX: u32 = 4096;

/// An error of the conversation, as an `io::Error` (what `Controller` opening returns).
pub(crate) fn protocol_error(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// A connection past its ICReq/ICResp exchange.
pub(crate) struct Wire {
    pub(crate) stream: TcpStream,
    /// How this end frames what it sends: the digests granted, the controller's alignment.
    pub(crate) framing: Framing,
    pub(crate) decoder: Decoder,
    /// Most data the controller takes in one H2CData PDU.
    pub(crate) maxh2cdata: u32,
    /// Received bytes not yet decoded.
    input: Vec<u8>,
}

/// What a command was answered with: its completion and the data that came before it.
pub(crate) struct Answer {
    pub(crate) cqe: CompletionEntry,
    pub(crate) data: Vec<u8>,
}

impl Answer {
    /// The completion's status as a result.
    pub(crate) fn ok(self, what: &str) -> io::Result<Answer> {
        let status = self.cqe.status();
        if status.is_success() {
            Ok(self)
        } else {
            Err(io::Error::other(format!(
                "{what}: the target answered {status}"
            )))
        }
    }
}

impl Wire {
    /// Connects to `addr` and exchanges ICReq/ICResp asking for `digests`; the decoder
    /// takes data PDUs of up to `data_pdu_bytes_max`.
    pub(crate) fn connect(
        addr: SocketAddr,
        digests: Digests,
        data_pdu_bytes_max: u32,
    ) -> io::Result<Wire> {
        let stream = TcpStream::connect_timeout(&addr, SETUP_TIMEOUT)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(SETUP_TIMEOUT))?;
        stream.set_write_timeout(Some(SETUP_TIMEOUT))?;
        let mut w = Wire {
            stream,
            framing: Framing {
                digests: Digests::default(),
                pda_bytes: pda_bytes(0),
            },
            decoder: Decoder::new(Role::Host, 0, data_pdu_bytes_max.max(ADMIN_DATA_BYTES_MAX)),
            maxh2cdata: 0,
            input: Vec::new(),
        };
        let mut req = Vec::new();
        encode::ic_req(
            &mut req,
            &IcReq {
                pfv: PFV_1_0,
                hpda: 0,
                digests,
                maxr2t: 0,
            },
        );
        w.stream.write_all(&req)?;
        let resp = match w.recv(|p, _| {
            Some(match p {
                Pdu::IcResp(r) => Ok(r),
                other => Err(other.pdu_type()),
            })
        })? {
            Ok(r) => r,
            Err(other) => {
                return Err(protocol_error(format!(
                    "expected ICResp, the target sent {other:?}"
                )))
            }
        };
        if resp.pfv != PFV_1_0
            || (resp.digests.header && !digests.header)
            || (resp.digests.data && !digests.data)
        {
            return Err(protocol_error(format!(
                "ICResp grants what was not asked for: {resp:?}"
            )));
        }
        w.framing = Framing {
            digests: resp.digests,
            pda_bytes: pda_bytes(resp.cpda),
        };
        w.decoder.digests = resp.digests;
        w.maxh2cdata = resp.maxh2cdata;
        Ok(w)
    }

    /// Decodes the next PDU, reading as needed; `keep` turns it into the caller's value
    /// (given its data), or `None` to read on.
    fn recv<T>(&mut self, mut keep: impl FnMut(Pdu<'_>, &[u8]) -> Option<T>) -> io::Result<T> {
        loop {
            match self.decoder.decode(&self.input) {
                Ok(Decode::Pdu(p)) => {
                    if !p.data_digest_ok {
                        return Err(protocol_error("a data digest did not match"));
                    }
                    let kept = keep(p.pdu, &self.input[p.data.clone()]);
                    self.input.drain(..p.len);
                    if let Some(v) = kept {
                        return Ok(v);
                    }
                    continue;
                }
                Ok(Decode::NeedMore(_)) => {}
                Err(e) => return Err(protocol_error(format!("the target sent a bad PDU: {e}"))),
            }
            let mut chunk = [0u8; 8192];
            let n = self.stream.read(&mut chunk)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the target closed the connection",
                ));
            }
            self.input.extend_from_slice(&chunk[..n]);
        }
    }

    /// Sends `sqe` (with `data` in the capsule if not empty) and waits for its answer; a
    /// termination request or any PDU but its data and completion is an error.
    pub(crate) fn command(&mut self, sqe: &SubmissionEntry, data: &[u8]) -> io::Result<Answer> {
        let mut out = Vec::new();
        encode::capsule_cmd(&mut out, &self.framing, sqe, data);
        self.stream.write_all(&out)?;
        let mut got = Vec::new();
        let cid = sqe.cid;
        let mut bad = None;
        let cqe = self.recv(|p, d| match p {
            Pdu::C2HData(h) if h.cccid == cid && h.datao as usize == got.len() => {
                got.extend_from_slice(d);
                h.success.then(|| CompletionEntry {
                    cid,
                    ..Default::default()
                })
            }
            Pdu::CapsuleResp(c) if c.cid == cid => Some(c),
            other => {
                bad = Some(format!("{:?}", other.pdu_type()));
                Some(CompletionEntry::default())
            }
        })?;
        if let Some(what) = bad {
            return Err(protocol_error(format!(
                "command {:#04x}: the target sent {what}",
                sqe.opcode
            )));
        }
        Ok(Answer { cqe, data: got })
    }

    /// Connect of queue `qid` (0: the admin queue, which makes a controller) of `sqsize + 1`
    /// entries; returns the controller ID. An I/O queue asks for SQ flow control off: this
    /// host never has more commands in flight than the queue holds, and the target may then
    /// let a read's last data PDU stand for its response (one PDU less per read).
    pub(crate) fn connect_queue(
        &mut self,
        qid: u16,
        sqsize: u16,
        kato_ms: u32,
        data: &ConnectData,
    ) -> io::Result<u16> {
        let bytes = data.to_bytes();
        let mut sqe = fabrics_sqe(qid, fabrics::fctype::CONNECT);
        sqe.cdw10 = u32::from(qid) << 16;
        sqe.cdw11 = u32::from(sqsize);
        if qid != 0 {
            sqe.cdw11 |= u32::from(fabrics::CATTR_DISABLE_SQ_FLOW_CONTROL) << 16;
        }
        sqe.cdw12 = kato_ms;
        SglDescriptor::in_capsule(bytes.len() as u32).store(&mut sqe);
        let a = self.command(&sqe, &bytes)?;
        let status = a.cqe.status();
        if !status.is_success() {
            return Err(io::Error::other(format!(
                "Connect of queue {qid}: the target answered {status} (DW0 {:#x})",
                a.cqe.dw0
            )));
        }
        Ok(a.cqe.dw0 as u16)
    }

    pub(crate) fn property_get(&mut self, cid: u16, offset: u32, size8: bool) -> io::Result<u64> {
        let mut sqe = fabrics_sqe(cid, fabrics::fctype::PROPERTY_GET);
        sqe.cdw10 = u32::from(if size8 {
            fabrics::PROPERTY_SIZE_8
        } else {
            fabrics::PROPERTY_SIZE_4
        });
        sqe.cdw11 = offset;
        let a = self.command(&sqe, &[])?.ok("Property Get")?;
        Ok(u64::from(a.cqe.dw0) | u64::from(a.cqe.dw1) << 32)
    }

    pub(crate) fn property_set(&mut self, cid: u16, offset: u32, value: u32) -> io::Result<()> {
        let mut sqe = fabrics_sqe(cid, fabrics::fctype::PROPERTY_SET);
        sqe.cdw10 = u32::from(fabrics::PROPERTY_SIZE_4);
        sqe.cdw11 = offset;
        sqe.cdw12 = value;
        self.command(&sqe, &[])?.ok("Property Set")?;
        Ok(())
    }

    /// An admin command that reads `data_bytes` (0: none).
    pub(crate) fn admin(
        &mut self,
        mut sqe: SubmissionEntry,
        data_bytes: u32,
        what: &str,
    ) -> io::Result<Answer> {
        SglDescriptor::transport(data_bytes).store(&mut sqe);
        let a = self.command(&sqe, &[])?.ok(what)?;
        if a.data.len() != data_bytes as usize {
            return Err(protocol_error(format!(
                "{what}: {} bytes of data, {data_bytes} expected",
                a.data.len()
            )));
        }
        Ok(a)
    }

    /// Identify `cns` of `nsid`: its 4 KiB.
    pub(crate) fn identify(&mut self, cid: u16, cns: u8, nsid: u32) -> io::Result<Vec<u8>> {
        let sqe = SubmissionEntry {
            opcode: fabrics::admin::IDENTIFY,
            cid,
            nsid,
            cdw10: u32::from(cns),
            ..Default::default()
        };
        Ok(self.admin(sqe, ADMIN_DATA_BYTES_MAX, "Identify")?.data)
    }

    pub(crate) fn set_features(&mut self, cid: u16, fid: u8, cdw11: u32) -> io::Result<u32> {
        let sqe = SubmissionEntry {
            opcode: fabrics::admin::SET_FEATURES,
            cid,
            cdw10: u32::from(fid),
            cdw11,
            ..Default::default()
        };
        Ok(self.admin(sqe, 0, "Set Features")?.cqe.dw0)
    }

    pub(crate) fn keep_alive(&mut self, cid: u16) -> io::Result<()> {
        let sqe = SubmissionEntry {
            opcode: fabrics::admin::KEEP_ALIVE,
            cid,
            ..Default::default()
        };
        self.admin(sqe, 0, "Keep Alive")?;
        Ok(())
    }

    /// Received bytes not yet decoded (a queue pair takes them over).
    pub(crate) fn take_input(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.input)
    }
}

fn fabrics_sqe(cid: u16, fctype: u8) -> SubmissionEntry {
    SubmissionEntry {
        opcode: fabrics::OPCODE_FABRICS,
        cid,
        nsid: u32::from(fctype),
        ..Default::default()
    }
}
