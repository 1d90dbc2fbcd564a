//! NVMe/TCP header and data digests: CRC32C (the Castagnoli polynomial, as iSCSI uses it),
//! sent as a little-endian dword after the header or the data it covers.

/// The digest of one contiguous run of bytes.
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// The digest of data held in pieces, as if they were one run (a read's data in several
/// device buffers).
pub fn crc32c_pieces<'a>(pieces: impl IntoIterator<Item = &'a [u8]>) -> u32 {
    pieces.into_iter().fold(0, crc32c::crc32c_append)
}

/// Whether the little-endian digest in `stored` matches `bytes`.
pub fn matches(bytes: &[u8], stored: &[u8]) -> bool {
    debug_assert_eq!(stored.len(), super::DIGEST_BYTES);
    crc32c(bytes).to_le_bytes() == stored
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_is_the_castagnoli_crc_of_the_iscsi_test_vectors() {
        // RFC 3720, B.4: 32 bytes of zeroes, of ones, and an incrementing pattern.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        let inc: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&inc), 0x46dd_794e);
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn pieces_digest_as_one_run() {
        let data: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        let whole = crc32c(&data);
        let (a, rest) = data.split_at(4096);
        let (b, c) = rest.split_at(17);
        assert_eq!(crc32c_pieces([a, b, c]), whole);
        assert_eq!(crc32c_pieces([]), crc32c(&[]));
        assert!(matches(&data, &whole.to_le_bytes()));
        assert!(!matches(&data, &(whole ^ 1).to_le_bytes()));
    }
}
