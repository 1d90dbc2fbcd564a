//! The shadow model of the blocks: every write's window, and which values a read may see
//! (the rule is in the module docs of `sim`).

use std::sync::Arc;

use crate::io::IoOp;

use super::LBA_BYTES;

/// One write's effect as the model sees it (write zeroes and deallocate write value 0).
#[derive(Clone, Copy, Debug)]
pub(super) struct WriteRec {
    pub(super) value: u64,
    pub(super) start: u64,
    /// `u64::MAX` while in flight, and forever for an abandoned write.
    pub(super) end: u64,
    pub(super) ok: bool,
}

/// An accepted I/O.
#[derive(Clone, Debug)]
pub(super) struct OpRec {
    pub(super) op: IoOp,
    pub(super) reactor: usize,
    pub(super) slba: u64,
    pub(super) nlb: u32,
    pub(super) start: u64,
    pub(super) start_ns: u64,
    /// Indices into `Model::writes` for its blocks (write-like ops).
    pub(super) write_ids: Vec<usize>,
    pub(super) callbacks: u32,
    /// The reactor accepted it (recorded before submitting, so it can be refused).
    pub(super) accepted: bool,
}

/// The model, shared by every reactor's callbacks.
pub(super) type Shared = Arc<parking_lot::Mutex<Model>>;

#[derive(Default)]
pub(super) struct Model {
    /// The event counter: bumped before each submission and at each callback.
    pub(super) tick: u64,
    pub(super) ops: Vec<OpRec>,
    pub(super) writes: Vec<WriteRec>,
    /// Per block, the writes to it (indices into `writes`), in submission order.
    pub(super) history: Vec<Vec<usize>>,
    pub(super) errors: Vec<String>,
    pub(super) reads_checked: u64,
    pub(super) latency_ns_max: u64,
    pub(super) latency_ns_bound: u64,
}

/// The bytes of value `value` on block `lba`: zeroes for value 0, else a header naming the
/// value and the block (a misdirected write shows) and a pattern derived from both.
pub(super) fn fill_block(value: u64, lba: u64, block: &mut [u8]) {
    if value == 0 {
        block.fill(0);
        return;
    }
    block[..8].copy_from_slice(&value.to_le_bytes());
    block[8..16].copy_from_slice(&lba.to_le_bytes());
    let mut x = value.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ lba;
    for byte in &mut block[16..] {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *byte = x as u8;
    }
}

/// Names a block value for messages: zeroes, or the data of the write with that I/O number.
pub(super) fn value_name(value: u64) -> String {
    if value == 0 {
        "zeroes".to_string()
    } else {
        format!("the data of I/O {}", value - 1)
    }
}

/// The value a block holds, or why it holds none.
pub(super) fn decode_block(lba: u64, block: &[u8]) -> Result<u64, String> {
    if block.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    let value = u64::from_le_bytes(block[..8].try_into().expect("8 bytes"));
    let mut expected = [0u8; LBA_BYTES];
    fill_block(value, lba, &mut expected);
    if value == 0 || block != &expected[..] {
        let claimed = u64::from_le_bytes(block[8..16].try_into().expect("8 bytes"));
        return Err(format!(
            "block {lba} holds bytes no write produced (header: value {value}, block \
             {claimed})"
        ));
    }
    Ok(value)
}

impl Model {
    pub(super) fn bump(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Whether block `lba` may hold `value` for a read with window `[start, end]`.
    pub(super) fn allows(&self, lba: u64, value: u64, start: u64, end: u64) -> bool {
        let hist = &self.history[lba as usize];
        let initial = WriteRec {
            value: 0,
            start: 0,
            end: 0,
            ok: true,
        };
        let recs = std::iter::once(initial).chain(hist.iter().map(|&i| self.writes[i]));
        for w in recs {
            if w.value != value || w.start > end {
                continue;
            }
            let overwritten = hist
                .iter()
                .map(|&i| self.writes[i])
                .any(|later| later.ok && later.start > w.end && later.end < start);
            if !overwritten {
                return true;
            }
        }
        false
    }

    /// What the model allows on block `lba` now, for a failure message.
    pub(super) fn allowed_now(&self, lba: u64, start: u64, end: u64) -> Vec<u64> {
        let mut values: Vec<u64> = std::iter::once(0)
            .chain(
                self.history[lba as usize]
                    .iter()
                    .map(|&i| self.writes[i].value),
            )
            .filter(|&v| self.allows(lba, v, start, end))
            .collect();
        values.sort_unstable();
        values.dedup();
        values
    }

    /// Checks a successful read's data against the model.
    pub(super) fn check_read(&mut self, slba: u64, data: &[u8], start: u64, end: u64, what: &str) {
        for (i, block) in data.chunks(LBA_BYTES).enumerate() {
            let lba = slba + i as u64;
            match decode_block(lba, block) {
                Err(e) => self.errors.push(format!("{what}: {e}")),
                Ok(value) => {
                    if !self.allows(lba, value, start, end) {
                        let allowed: Vec<String> = self
                            .allowed_now(lba, start, end)
                            .into_iter()
                            .map(value_name)
                            .collect();
                        self.errors.push(format!(
                            "{what}: block {lba} holds {}, but the model allows only {} \
                             (read window {start}..={end})",
                            value_name(value),
                            allowed.join(", ")
                        ));
                    }
                }
            }
        }
        self.reads_checked += 1;
    }
}
