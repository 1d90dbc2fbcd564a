//! The shadow model's own tests: block encoding, and the rule of what a read may see.

use super::model::{decode_block, fill_block, Model, WriteRec};
use super::LBA_BYTES;

#[test]
fn blocks_decode_to_the_value_written_and_catch_misdirection() {
    let mut block = [0u8; LBA_BYTES];
    assert_eq!(decode_block(5, &block), Ok(0));
    fill_block(42, 5, &mut block);
    assert_eq!(decode_block(5, &block), Ok(42));
    assert!(decode_block(6, &block).is_err(), "written for block 5");
    block[300] ^= 1;
    assert!(decode_block(5, &block).is_err(), "one flipped bit");
}

#[test]
fn the_model_allows_overlapping_writes_either_way_and_nothing_older() {
    let mut m = Model {
        history: vec![Vec::new(); 1],
        ..Model::default()
    };
    let write = |m: &mut Model, value, start, end, ok| {
        m.writes.push(WriteRec {
            value,
            start,
            end,
            ok,
        });
        let id = m.writes.len() - 1;
        m.history[0].push(id);
    };
    // Write 1 done at 2; writes 2 and 3 overlap (3..6, 4..5); write 4 failed (7..8).
    write(&mut m, 1, 1, 2, true);
    write(&mut m, 2, 3, 6, true);
    write(&mut m, 3, 4, 5, true);
    write(&mut m, 4, 7, 8, false);
    // A read after everything: 2 or 3 (either order), or 4 (failed: maybe); not 1 or 0.
    let after = |m: &Model, v| m.allows(0, v, 9, 9);
    assert!(after(&m, 2) && after(&m, 3) && after(&m, 4));
    assert!(!after(&m, 1) && !after(&m, 0));
    // A read concurrent with writes 2 and 3 may also see 1, but not the initial zeroes.
    assert!(m.allows(0, 1, 3, 4) && m.allows(0, 2, 3, 4));
    assert!(!m.allows(0, 0, 3, 4));
    // Nor a value written after the read ended.
    assert!(!m.allows(0, 4, 3, 4));
}
