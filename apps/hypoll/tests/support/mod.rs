//! What the tests of `hypoll serve` share: the server on a free port ([`serve`]), a raw NBD
//! client ([`nbd`]), certificate folders made with openssl ([`certs`]), and, here, client
//! tools run under a timeout and files of random bytes.
//!
//! Every test binary compiles all of this and uses a part of it, so what one binary leaves
//! unused is not dead code.
#![allow(dead_code)]

pub mod certs;
pub mod nbd;
pub mod serve;

use std::path::Path;
use std::process::{Command, Output};

/// How long any one client command may run.
const CLIENT_TIMEOUT_S: &str = "120";

/// Fails the test, naming the package, when `tool` is missing: `scripts/test` installs
/// every tool these tests use, so a missing one is a broken setup, never a pass.
pub fn require_tool(tool: &str) {
    let which = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .unwrap();
    assert!(
        which.status.success(),
        "{tool} is not installed: scripts/test installs it (apt: qemu-utils, libnbd-bin, fio, \
         openssl)"
    );
}

/// Runs a client tool under a timeout.
fn run(tool: &str, args: &[&str]) -> Output {
    require_tool(tool);
    Command::new("timeout")
        .arg(CLIENT_TIMEOUT_S)
        .arg(tool)
        .args(args)
        .output()
        .unwrap()
}

/// Runs a client tool; panics with its output unless it succeeds.
pub fn run_ok(tool: &str, args: &[&str]) -> Output {
    let out = run(tool, args);
    assert!(
        out.status.success(),
        "{tool} {args:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs a client tool that must fail; returns its stderr.
pub fn run_fails(tool: &str, args: &[&str]) -> String {
    let out = run(tool, args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "{tool} {args:?} succeeded but must not:\n{}\n{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_ne!(out.status.code(), Some(124), "{tool} {args:?} timed out");
    stderr
}

/// Writes `bytes` of xorshift output from `seed` to `path`: the same seed, the same file.
pub fn random_file(path: &Path, bytes: usize, seed: u64) {
    let mut x = seed | 1;
    let data: Vec<u8> = (0..bytes)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(path, data).unwrap();
}
