//! The transmission phase: one request header (and a write's payload) parsed and checked
//! against the export, its limits and its access, or answered with the protocol's error.

use super::*;

impl Session {
    pub(super) fn request(
        &mut self,
        export: usize,
        input: &[u8],
        out: &mut Vec<u8>,
    ) -> (usize, Step) {
        if input.len() < REQUEST_HEADER_BYTES {
            return (0, Step::NeedMore);
        }
        let magic = be_u32(input);
        if magic != REQUEST_MAGIC {
            return self.protocol_error(
                REQUEST_HEADER_BYTES,
                format!("request magic {magic:#x}, expected {REQUEST_MAGIC:#x}"),
            );
        }
        let flags = be_u16(&input[4..]);
        let kind = be_u16(&input[6..]);
        let cookie = be_u64(&input[8..]);
        let offset = be_u64(&input[16..]);
        let length = be_u32(&input[24..]);
        let mut consumed = REQUEST_HEADER_BYTES;
        if kind == CMD_WRITE {
            if length > self.limits.request_bytes_max {
                // Its payload cannot be buffered: the stream cannot be followed any more.
                return self.protocol_error(
                    REQUEST_HEADER_BYTES,
                    format!(
                        "write of {length} bytes, more than the {} allowed",
                        self.limits.request_bytes_max
                    ),
                );
            }
            consumed += length as usize;
            if input.len() < consumed {
                return (0, Step::NeedMore);
            }
        }
        let refuse = |out: &mut Vec<u8>, error: u32, why: &'static str| {
            out.extend_from_slice(&simple_reply(cookie, error));
            (consumed, Step::Refused { cookie, error, why })
        };
        let e = &self.exports[export];
        let op = match kind {
            CMD_READ => Op::Read,
            CMD_WRITE => Op::Write,
            CMD_FLUSH => Op::Flush,
            CMD_TRIM => Op::Trim,
            CMD_WRITE_ZEROES => Op::WriteZeroes,
            CMD_DISC => return self.close(consumed, Close::Disconnect),
            _ => return refuse(out, EINVAL, "unsupported command"),
        };
        if e.flags & TFLAG_READ_ONLY != 0 && matches!(op, Op::Write | Op::Trim | Op::WriteZeroes) {
            // Before any other check: whatever else is wrong with it, it may not write.
            return refuse(out, EPERM, "write to a read-only export");
        }
        // FUA is accepted on every command once advertised: the protocol says the server
        // MUST accept it (even by ignoring it), and clients are known to set it on a flush.
        // On a read or a flush there is no write of the command's own to make durable.
        let allowed_flags = match op {
            Op::Read | Op::Flush | Op::Write | Op::Trim => CMD_FLAG_FUA,
            Op::WriteZeroes => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
        };
        if flags & !allowed_flags != 0 {
            return refuse(out, EINVAL, "command flags not allowed for this command");
        }
        let advertised = match op {
            Op::Read | Op::Write => true,
            Op::Flush => e.flags & TFLAG_SEND_FLUSH != 0,
            Op::Trim => e.flags & TFLAG_SEND_TRIM != 0,
            Op::WriteZeroes => e.flags & TFLAG_SEND_WRITE_ZEROES != 0,
        };
        if !advertised {
            return refuse(out, EINVAL, "command not advertised for this export");
        }
        if flags & CMD_FLAG_FUA != 0 && e.flags & TFLAG_SEND_FUA == 0 {
            return refuse(out, EINVAL, "FUA not advertised for this export");
        }
        if op != Op::Flush {
            if length == 0 {
                return refuse(out, EINVAL, "zero-length request");
            }
            if op == Op::Read && length > self.limits.request_bytes_max {
                return refuse(out, EINVAL, "read longer than the request limit");
            }
            let end = offset.checked_add(u64::from(length));
            if end.is_none_or(|end| end > e.size_bytes) {
                let error = if op == Op::Read { EINVAL } else { ENOSPC };
                return refuse(out, error, "request past the end of the export");
            }
            let block = u64::from(e.block_bytes.max(1));
            if !offset.is_multiple_of(block) || !u64::from(length).is_multiple_of(block) {
                return refuse(
                    out,
                    EINVAL,
                    "request not aligned to the export's block size",
                );
            }
        }
        let payload = if op == Op::Write {
            REQUEST_HEADER_BYTES..consumed
        } else {
            0..0
        };
        (
            consumed,
            Step::Request(Request {
                op,
                cookie,
                offset: if op == Op::Flush { 0 } else { offset },
                length: if op == Op::Flush { 0 } else { length },
                fua: flags & CMD_FLAG_FUA != 0 && !matches!(op, Op::Read | Op::Flush),
                no_hole: flags & CMD_FLAG_NO_HOLE != 0,
                payload,
            }),
        )
    }
}
