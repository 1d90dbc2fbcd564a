//! The leaf every device's configuration parser builds on: the error a device string can
//! give, and byte counts as people write them (`4k`, `512M`, `8G`). It imports nothing of
//! this crate, so the backends and the device-string parser in `device.rs` both depend on
//! it without depending on each other.

/// Device kinds a device string may name.
pub const DEVICE_KINDS: &[&str] = &[
    "emu:<profile>",
    "null",
    "uring:/path",
    "vfio:<pci address>",
    "nvme-tcp:HOST:PORT/SUBNQN",
    "vhost-user:/path.sock",
];

/// Why a device string (or one of its keys) was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("empty device string: expected one of {}", DEVICE_KINDS.join(", "))]
    Empty,
    #[error("unknown device {name:?}: expected one of {}", DEVICE_KINDS.join(", "))]
    UnknownDevice { name: String },
    #[error("unknown emulated profile {name:?}: accepted profiles are {accepted}")]
    UnknownProfile { name: String, accepted: String },
    #[error("unknown key {key:?} for device {device}: accepted keys are {accepted}")]
    UnknownKey {
        device: String,
        key: String,
        accepted: String,
    },
    #[error("bad value {value:?} for {key}: expected {expected}")]
    BadValue {
        key: String,
        value: String,
        expected: String,
    },
    #[error("{item:?} is not key=value")]
    NotKeyValue { item: String },
}

/// Writes a byte count as [`parse_size_bytes`] reads it, with the largest binary suffix that
/// divides it exactly: `64G`, `128K`, `1000`.
pub fn size_text(bytes: u64) -> String {
    for (shift, suffix) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes != 0 && bytes.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// Parses a byte count with an optional binary suffix: `4096`, `4k`, `512M`, `8G`, `1T`,
/// `8GiB`. Suffixes are powers of 1024, as storage tools (fio, qemu-img) read them.
pub fn parse_size_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(digits_end);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 4096, 4k, 512M, 8G)"))?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("{text:?} has an unknown size suffix {suffix:?}")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_print_as_they_parse() {
        for bytes in [
            0,
            1,
            512,
            1000,
            4096,
            3 << 20,
            (5 << 30) + 512,
            1 << 40,
            u64::MAX,
        ] {
            let text = size_text(bytes);
            assert_eq!(parse_size_bytes(&text), Ok(bytes), "{text}");
        }
        assert_eq!(size_text(64 << 30), "64G");
        assert_eq!(size_text(128 << 10), "128K");
    }

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size_bytes("4096"), Ok(4096));
        assert_eq!(parse_size_bytes("4k"), Ok(4096));
        assert_eq!(parse_size_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_size_bytes("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size_bytes("1T"), Ok(1 << 40));
        assert!(parse_size_bytes("8X").is_err());
        assert!(parse_size_bytes("G").is_err());
        assert!(parse_size_bytes("99999999999T").is_err());
    }
}
