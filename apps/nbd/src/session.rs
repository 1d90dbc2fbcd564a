//! The NBD protocol as a pure state machine over byte buffers: the fixed newstyle handshake
//! and the transmission-request parser. No sockets, no clocks, no devices: the server feeds
//! it what it read and sends what it appends to `out`, and tests (and the fuzz targets) drive
//! it with any byte stream.
//!
//! [`Session::step`] looks at the unconsumed input and returns how many bytes it consumed and
//! what happened ([`Step`]). It consumes a message only once the whole of it is there
//! (a write's payload included), so a caller keeps unconsumed bytes and calls again after the
//! next read. Every reply the protocol itself decides (option replies, error replies to bad
//! requests) is appended to `out`; replies to valid requests are the caller's, once the
//! device has done the work.
//!
//! The handshake is here; the transmission phase's request parser is in `session/request.rs`.
//!
//! TLS is the caller's too: the session says when the client asked for it and was told yes
//! ([`Step::StartTls`]); under [`TlsMode::Require`] it answers nothing but that request and
//! an abort until then.

use std::ops::Range;
use std::sync::Arc;

pub use hypoll_frontend::TlsMode;

use crate::proto::*;

mod request;

/// What a client can see of one export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub description: String,
    pub size_bytes: u64,
    /// Transmission flags (`TFLAG_*`), `TFLAG_HAS_FLAGS` included.
    pub flags: u16,
    /// Requests must be aligned to this (offset and length): the device's block size.
    pub block_bytes: u32,
    /// Preferred request size.
    pub preferred_bytes: u32,
    /// Only clients the caller names may use it ([`Session::allow`]); it is hidden from
    /// the others.
    pub restricted: bool,
}

/// Limits a session enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest read or write payload (`--max-request-bytes`, 32 MiB by default like qemu).
    pub request_bytes_max: u32,
    /// Largest option payload; a longer one closes the connection.
    pub option_bytes_max: u32,
    /// Most options before a client must pick an export.
    pub options_max: u32,
}

/// Default largest read or write, as qemu's NBD server.
pub const REQUEST_BYTES_MAX_DEFAULT: u32 = 32 << 20;
/// Default largest option payload: a name and description of the longest allowed, and room.
pub const OPTION_BYTES_MAX_DEFAULT: u32 = 3 * STRING_BYTES_MAX as u32;
/// Default most options per handshake.
pub const OPTIONS_MAX_DEFAULT: u32 = 256;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            request_bytes_max: REQUEST_BYTES_MAX_DEFAULT,
            option_bytes_max: OPTION_BYTES_MAX_DEFAULT,
            options_max: OPTIONS_MAX_DEFAULT,
        }
    }
}

/// What a valid request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
    Trim,
    WriteZeroes,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Trim => "trim",
            Op::WriteZeroes => "write_zeroes",
        }
    }

    pub const ALL: [Op; 5] = [Op::Read, Op::Write, Op::Flush, Op::Trim, Op::WriteZeroes];
}

/// A request that passed every check: in range, aligned, within the limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
    pub fua: bool,
    /// Write Zeroes with `NO_HOLE`: the zeroed range must stay allocated.
    pub no_hole: bool,
    /// For a write: where its payload lies in the input given to `step`.
    pub payload: Range<usize>,
}

/// Why a session ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Close {
    /// The client sent `NBD_OPT_ABORT`.
    Abort,
    /// The client sent `NBD_CMD_DISC`: finish what is in flight, then close.
    Disconnect,
    /// The client broke the protocol; the reason is one log line.
    Protocol(String),
}

/// The outcome of one [`Session::step`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing to do until more input arrives.
    NeedMore,
    /// Handshake progress: replies (if any) were appended to `out`.
    Negotiating,
    /// The handshake ended: transmission on this export (an index into the exports).
    Ready { export: usize },
    /// A valid request, for the caller to run and answer.
    Request(Request),
    /// A request was refused: its error reply was appended to `out`; the reason is for logs.
    Refused {
        cookie: u64,
        error: u32,
        why: &'static str,
    },
    /// The client asked for TLS and the acceptance was appended to `out`: send it in
    /// plaintext, then speak TLS only. Input after the request must not be taken as if it
    /// came under TLS: the client sends nothing until it has the acceptance.
    StartTls,
    /// Close the connection (after the replies in `out`, and for a disconnect after the
    /// requests in flight).
    Close(Close),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    ClientFlags,
    Options,
    Transmission { export: usize },
    Closed,
}

/// One connection's protocol state.
#[derive(Clone, Debug)]
pub struct Session {
    exports: Arc<[ExportInfo]>,
    limits: Limits,
    phase: Phase,
    no_zeroes: bool,
    options_seen: u32,
    tls: TlsMode,
    /// The client's request for TLS was accepted: everything since came under it.
    tls_started: bool,
    /// Which exports this client may use, by index: the unrestricted ones until the caller
    /// says otherwise.
    allowed: Vec<bool>,
}

fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

fn option_reply(out: &mut Vec<u8>, option: u32, reply: u32, data: &[u8]) {
    out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

impl Session {
    /// A session for a new connection, without TLS; appends the server's greeting to
    /// `out`.
    pub fn new(exports: Arc<[ExportInfo]>, limits: Limits, out: &mut Vec<u8>) -> Session {
        Session::with_tls(exports, limits, TlsMode::Off, out)
    }

    /// A session for a new connection that may (`On`) or must (`Require`) start TLS;
    /// appends the server's greeting to `out`.
    pub fn with_tls(
        exports: Arc<[ExportInfo]>,
        limits: Limits,
        tls: TlsMode,
        out: &mut Vec<u8>,
    ) -> Session {
        out.extend_from_slice(&NBD_MAGIC.to_be_bytes());
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        let allowed = exports.iter().map(|e| !e.restricted).collect();
        Session {
            exports,
            limits,
            phase: Phase::ClientFlags,
            no_zeroes: false,
            options_seen: 0,
            tls,
            tls_started: false,
            allowed,
        }
    }

    /// Lets this client use the restricted exports whose index `allow` says yes to (once
    /// the caller knows who the client is: its certificate, after TLS). An unrestricted
    /// export stays open whatever `allow` says.
    pub fn allow(&mut self, allow: impl Fn(usize) -> bool) {
        for (i, e) in self.exports.iter().enumerate() {
            self.allowed[i] = !e.restricted || allow(i);
        }
    }

    /// Whether the client's request for TLS was accepted.
    pub fn tls_started(&self) -> bool {
        self.tls_started
    }

    /// The export being served, once the handshake has ended.
    pub fn export(&self) -> Option<usize> {
        match self.phase {
            Phase::Transmission { export } => Some(export),
            _ => None,
        }
    }

    pub fn is_closed(&self) -> bool {
        self.phase == Phase::Closed
    }

    /// Consumes at most one message from the front of `input`; returns the bytes consumed
    /// and what happened. After `Step::Close` every later call returns `(0, Close)` again.
    pub fn step(&mut self, input: &[u8], out: &mut Vec<u8>) -> (usize, Step) {
        match self.phase {
            Phase::ClientFlags => self.client_flags(input),
            Phase::Options => self.option(input, out),
            Phase::Transmission { export } => self.request(export, input, out),
            Phase::Closed => (
                0,
                Step::Close(Close::Protocol("the session is closed".into())),
            ),
        }
    }

    fn close(&mut self, consumed: usize, why: Close) -> (usize, Step) {
        self.phase = Phase::Closed;
        (consumed, Step::Close(why))
    }

    fn protocol_error(&mut self, consumed: usize, why: String) -> (usize, Step) {
        self.close(consumed, Close::Protocol(why))
    }

    fn client_flags(&mut self, input: &[u8]) -> (usize, Step) {
        if input.len() < 4 {
            return (0, Step::NeedMore);
        }
        let flags = be_u32(input);
        let known = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;
        if flags & !known != 0 {
            return self.protocol_error(4, format!("unknown client flags {flags:#x}"));
        }
        if flags & FLAG_C_FIXED_NEWSTYLE == 0 {
            return self.protocol_error(
                4,
                "the client does not speak fixed newstyle negotiation".into(),
            );
        }
        self.no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
        self.phase = Phase::Options;
        (4, Step::Negotiating)
    }

    /// The export `name` names, if this client may use it; `Err(())` when it exists but
    /// is restricted to other clients.
    fn find_allowed(&self, name: &[u8]) -> Result<Option<usize>, ()> {
        match self.find_export(name) {
            Some(i) if !self.allowed[i] => Err(()),
            found => Ok(found),
        }
    }

    fn find_export(&self, name: &[u8]) -> Option<usize> {
        if name.is_empty() {
            // The default export: the first one.
            return (!self.exports.is_empty()).then_some(0);
        }
        self.exports.iter().position(|e| e.name.as_bytes() == name)
    }

    fn option(&mut self, input: &[u8], out: &mut Vec<u8>) -> (usize, Step) {
        if input.len() < OPTION_HEADER_BYTES {
            return (0, Step::NeedMore);
        }
        let magic = be_u64(input);
        if magic != IHAVEOPT {
            return self.protocol_error(
                OPTION_HEADER_BYTES,
                format!("option magic {magic:#x}, expected IHAVEOPT"),
            );
        }
        let option = be_u32(&input[8..]);
        let len = be_u32(&input[12..]);
        if len > self.limits.option_bytes_max {
            return self.protocol_error(
                OPTION_HEADER_BYTES,
                format!(
                    "option {} carries {len} bytes, more than the {} allowed",
                    option_name(option),
                    self.limits.option_bytes_max
                ),
            );
        }
        let total = OPTION_HEADER_BYTES + len as usize;
        if input.len() < total {
            return (0, Step::NeedMore);
        }
        self.options_seen += 1;
        if self.options_seen > self.limits.options_max {
            return self.protocol_error(
                total,
                format!(
                    "more than {} options without choosing an export",
                    self.limits.options_max
                ),
            );
        }
        let data = &input[OPTION_HEADER_BYTES..total];
        if self.tls == TlsMode::Require
            && !self.tls_started
            && !matches!(option, OPT_STARTTLS | OPT_ABORT)
        {
            if option == OPT_EXPORT_NAME {
                // This option has no error reply: closing is the only answer.
                return self
                    .protocol_error(total, "EXPORT_NAME before TLS, which is required".into());
            }
            // Nothing is answered before TLS, not even which exports exist.
            let msg = format!("TLS is required before option {}", option_name(option));
            option_reply(out, option, REP_ERR_TLS_REQD, msg.as_bytes());
            return (total, Step::Negotiating);
        }
        match option {
            OPT_EXPORT_NAME => {
                let Ok(Some(export)) = self.find_allowed(data) else {
                    // This option has no error reply: closing is the only answer.
                    return self.protocol_error(
                        total,
                        format!(
                            "EXPORT_NAME for unknown export {:?}",
                            String::from_utf8_lossy(data)
                        ),
                    );
                };
                let e = &self.exports[export];
                out.extend_from_slice(&e.size_bytes.to_be_bytes());
                out.extend_from_slice(&e.flags.to_be_bytes());
                if !self.no_zeroes {
                    out.extend_from_slice(&[0u8; EXPORT_NAME_PAD_BYTES]);
                }
                self.phase = Phase::Transmission { export };
                (total, Step::Ready { export })
            }
            OPT_ABORT => {
                option_reply(out, option, REP_ACK, &[]);
                self.close(total, Close::Abort)
            }
            OPT_LIST => {
                if !data.is_empty() {
                    option_reply(out, option, REP_ERR_INVALID, b"LIST takes no data");
                    return (total, Step::Negotiating);
                }
                // Exports restricted to other clients are not listed.
                let listed = self.exports.iter().zip(&self.allowed);
                for (e, _) in listed.filter(|(_, allowed)| **allowed) {
                    let mut d = Vec::with_capacity(4 + e.name.len() + e.description.len());
                    d.extend_from_slice(&(e.name.len() as u32).to_be_bytes());
                    d.extend_from_slice(e.name.as_bytes());
                    d.extend_from_slice(e.description.as_bytes());
                    option_reply(out, option, REP_SERVER, &d);
                }
                option_reply(out, option, REP_ACK, &[]);
                (total, Step::Negotiating)
            }
            OPT_INFO | OPT_GO => self.info_or_go(option, data, total, out),
            OPT_STARTTLS if self.tls != TlsMode::Off => {
                let refusal = if !data.is_empty() {
                    Some("STARTTLS takes no data")
                } else if self.tls_started {
                    Some("TLS is already started")
                } else {
                    None
                };
                if let Some(msg) = refusal {
                    option_reply(out, option, REP_ERR_INVALID, msg.as_bytes());
                    return (total, Step::Negotiating);
                }
                // Nothing negotiated before this point carries over: the session keeps no
                // per-export state from options, so there is nothing to forget.
                option_reply(out, option, REP_ACK, &[]);
                self.tls_started = true;
                (total, Step::StartTls)
            }
            _ => {
                // STARTTLS with TLS off, STRUCTURED_REPLY, meta contexts, extended headers
                // and anything unknown: simple replies are all this server speaks.
                let msg = format!("option {} is not supported", option_name(option));
                option_reply(out, option, REP_ERR_UNSUP, msg.as_bytes());
                (total, Step::Negotiating)
            }
        }
    }

    fn info_or_go(
        &mut self,
        option: u32,
        data: &[u8],
        total: usize,
        out: &mut Vec<u8>,
    ) -> (usize, Step) {
        let invalid = |out: &mut Vec<u8>, msg: &str| {
            option_reply(out, option, REP_ERR_INVALID, msg.as_bytes());
            (total, Step::Negotiating)
        };
        if data.len() < 4 {
            return invalid(out, "the option is too short for a name length");
        }
        let name_len = be_u32(data) as usize;
        if name_len > STRING_BYTES_MAX || data.len() < 4 + name_len + 2 {
            return invalid(out, "the name length does not fit the option");
        }
        let name = &data[4..4 + name_len];
        let rest = &data[4 + name_len..];
        let requests = be_u16(rest) as usize;
        if rest.len() != 2 + 2 * requests {
            return invalid(out, "the information request count does not fit the option");
        }
        let export = match self.find_allowed(name) {
            Ok(Some(export)) => export,
            Ok(None) => {
                let msg = format!("no export named {:?}", String::from_utf8_lossy(name));
                option_reply(out, option, REP_ERR_UNKNOWN, msg.as_bytes());
                return (total, Step::Negotiating);
            }
            Err(()) => {
                let msg = format!(
                    "export {:?} is not open to this client",
                    String::from_utf8_lossy(name)
                );
                option_reply(out, option, REP_ERR_POLICY, msg.as_bytes());
                return (total, Step::Negotiating);
            }
        };
        let e = &self.exports[export];
        let mut sent = [false; 4];
        for i in 0..requests {
            let kind = be_u16(&rest[2 + 2 * i..]);
            if (kind as usize) < sent.len() && std::mem::replace(&mut sent[kind as usize], true) {
                continue;
            }
            let mut d = Vec::new();
            d.extend_from_slice(&kind.to_be_bytes());
            match kind {
                INFO_NAME => d.extend_from_slice(e.name.as_bytes()),
                INFO_DESCRIPTION => d.extend_from_slice(e.description.as_bytes()),
                INFO_BLOCK_SIZE => {
                    d.extend_from_slice(&e.block_bytes.to_be_bytes());
                    d.extend_from_slice(&e.preferred_bytes.to_be_bytes());
                    d.extend_from_slice(&self.limits.request_bytes_max.to_be_bytes());
                }
                // INFO_EXPORT goes last, always; unknown kinds are ignored, as the
                // protocol asks.
                _ => continue,
            }
            option_reply(out, option, REP_INFO, &d);
        }
        let mut d = Vec::with_capacity(12);
        d.extend_from_slice(&INFO_EXPORT.to_be_bytes());
        d.extend_from_slice(&e.size_bytes.to_be_bytes());
        d.extend_from_slice(&e.flags.to_be_bytes());
        option_reply(out, option, REP_INFO, &d);
        option_reply(out, option, REP_ACK, &[]);
        if option == OPT_GO {
            self.phase = Phase::Transmission { export };
            (total, Step::Ready { export })
        } else {
            (total, Step::Negotiating)
        }
    }
}

#[cfg(test)]
mod tests;
