//! `hypoll serve` driven by NBD clients nobody here wrote (qemu-io, qemu-img, nbdinfo,
//! nbdcopy, fio's nbd engine; `scripts/test` installs them): their data goes in and comes
//! back, a pipelining client is coalesced and one at queue depth 1 is not, write zeroes
//! keeps or punches holes as the client asks, and a client sees an export by its name and
//! never another request's bytes.

mod support;

use std::io::{Read, Write};
use std::process::Command;

use hypoll_nbd::client;
use hypoll_nbd::proto::*;
use support::nbd::{handshake, simple_reply};
use support::serve::{metric, two_cores, Serve};
use support::{random_file, run_ok};

#[test]
fn qemu_io_writes_patterns_and_reads_them_back() {
    let s = Serve::start(&["mem=emu:dram,size=64M"]);
    let out = run_ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0xa5 0 1M",
            "-c",
            "write -P 0x5a 1M 3M",
            "-c",
            "write -f -P 0x3c 8M 64k",
            "-c",
            "write -z 1M 512k",
            "-c",
            "discard 4M 1M",
            "-c",
            "flush",
            "-c",
            "read -P 0xa5 0 1M",
            "-c",
            "read -P 0 1M 512k",
            "-c",
            "read -P 0x5a 1536k 2560k",
            "-c",
            "read -P 0x3c 8M 64k",
            "-c",
            "read -P 0 4M 1M",
            "-c",
            "read -P 0 63M 1M",
            &s.uri("mem"),
        ],
    );
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!text.contains("failed"), "{text}");
    assert_eq!(text.matches("read ").count(), 6, "{text}");
    // Past the end: qemu-io refuses or the server answers with an error, never data.
    let past = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read 64M 4k", &s.uri("mem")])
        .output()
        .unwrap();
    let past =
        String::from_utf8_lossy(&past.stdout).to_string() + &String::from_utf8_lossy(&past.stderr);
    assert!(!past.contains("read 4096/4096"), "{past}");
}

#[test]
fn qemu_img_convert_and_compare_round_trip_an_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("in.img");
    let back = dir.path().join("back.img");
    random_file(&img, 16 << 20, 7);
    // An io_uring export on a file (through the page cache: the test's file system may not
    // take O_DIRECT).
    let disk = dir.path().join("disk.bin");
    random_file(&disk, 16 << 20, 3);
    let spec = format!("disk=uring:{},direct=0", disk.display());
    let s = Serve::start(&[&spec]);
    let img_s = img.to_str().unwrap();
    run_ok(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            img_s,
            &s.uri("disk"),
        ],
    );
    run_ok(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", img_s, &s.uri("disk")],
    );
    run_ok(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &s.uri("disk"),
            back.to_str().unwrap(),
        ],
    );
    assert!(std::fs::read(&img).unwrap() == std::fs::read(&back).unwrap());
    // A different image must not compare equal: compare really reads.
    random_file(&img, 16 << 20, 8);
    let differ = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw", img_s, &s.uri("disk")])
        .output()
        .unwrap();
    assert_eq!(differ.status.code(), Some(1), "{differ:?}");
}

#[test]
fn nbdinfo_lists_exports_and_sizes() {
    let s = Serve::start(&["a=emu:dram,size=64M", "b=null,size=1G,lba=4096"]);
    let out = run_ok("nbdinfo", &["--list", &s.uri("")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("export=\"a\""), "{text}");
    assert!(text.contains("export=\"b\""), "{text}");
    let size = |export: &str| {
        let out = run_ok("nbdinfo", &["--size", &s.uri(export)]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(size("a"), (64u64 << 20).to_string());
    assert_eq!(size("b"), (1u64 << 30).to_string());
    // The default export (empty name) is the first.
    assert_eq!(size(""), (64u64 << 20).to_string());
    let out = run_ok("nbdinfo", &[&s.uri("b")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("block_size_minimum: 4096"), "{text}");
    assert!(text.contains("can_multi_conn: true"), "{text}");
    let missing = Command::new("nbdinfo").arg(s.uri("nope")).output().unwrap();
    assert!(!missing.status.success());
}

/// What a client sees of an export names it and nothing of the server's machine: not the
/// device string, its backing file's path or its kind.
#[test]
fn clients_see_an_export_by_name_never_its_device_string() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("secret-disk.bin");
    let spec = format!("mem=emu:dram,backing=file:{},size=1M", disk.display());
    let s = Serve::start(&[&spec]);
    for args in [vec!["--list", "--json"], vec!["--json"]] {
        let uri = s.uri(if args.len() == 2 { "" } else { "mem" });
        let mut all = args.clone();
        all.push(&uri);
        let out = run_ok("nbdinfo", &all);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("\"export-name\": \"mem\""), "{text}");
        for leak in ["secret-disk", "backing", "emu:", "file:"] {
            assert!(!text.contains(leak), "{leak:?} in {text}");
        }
    }
}

#[test]
fn nbdcopy_copies_random_data_in_and_out() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let dst = dir.path().join("dst.img");
    random_file(&src, 32 << 20, 11);
    // Two reactors when the machine has two cores, and several connections: the copy
    // spreads over both.
    let cores = two_cores();
    let s = Serve::start_with(&["mem=emu:dram,size=32M"], &["--cores", &cores]);
    run_ok(
        "nbdcopy",
        &["--connections=4", src.to_str().unwrap(), &s.uri("mem")],
    );
    run_ok(
        "nbdcopy",
        &["--connections=4", &s.uri("mem"), dst.to_str().unwrap()],
    );
    run_ok("cmp", &[src.to_str().unwrap(), dst.to_str().unwrap()]);
}

/// fio's nbd engine writes `size` of 4 KiB random blocks to export `mem` at `iodepth`,
/// then reads them back and checks each one's crc32c; asserts it found no error.
fn fio_writes_and_verifies(s: &Serve, size: &str, iodepth: u32) {
    let out = run_ok(
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={}", s.uri("mem")),
            "--rw=randwrite",
            "--bs=4k",
            &format!("--size={size}"),
            &format!("--iodepth={iodepth}"),
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            // No verify state file left in the working directory.
            "--verify_state_save=0",
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("err= 0"), "{text}");
}

#[test]
fn fio_nbd_engine_verifies_crc32c() {
    let s = Serve::start(&["mem=emu:dram,size=64M"]);
    fio_writes_and_verifies(&s, "32M", 16);
    let m = s.metrics();
    // fio wrote 32 MiB and read it all back to verify.
    let written = metric(
        &m,
        "hypoll_nbd_bytes_total{reactor=\"0\",export=\"mem\",op=\"write\"}",
    );
    let read = metric(
        &m,
        "hypoll_nbd_bytes_total{reactor=\"0\",export=\"mem\",op=\"read\"}",
    );
    assert_eq!(written, (32u64 << 20) as f64);
    assert_eq!(read, (32u64 << 20) as f64);
}

/// Requests a reactor read at the end of coalescing windows, and the windows.
fn coalescing(s: &Serve) -> (f64, f64) {
    let m = s.metrics();
    (
        metric(&m, "hypoll_nbd_coalesced_requests_total{reactor=\"0\"}"),
        metric(&m, "hypoll_nbd_coalesce_windows_total{reactor=\"0\"}"),
    )
}

#[test]
fn a_pipelining_client_is_coalesced_and_its_data_verifies() {
    // A long window, so even a debug build finishes a batch well within it.
    let s = Serve::start_with(&["mem=emu:dram,size=64M"], &["--coalesce-us", "1000"]);
    fio_writes_and_verifies(&s, "16M", 32);
    let (gathered, windows) = coalescing(&s);
    // 4096 requests: the trial at 1024 gathers many, and coalescing stays on.
    assert!(windows >= 1.0, "no coalescing window at queue depth 32");
    assert!(
        gathered > 2.0 * windows,
        "{gathered} requests in {windows} windows: not pipelined"
    );
}

#[test]
fn a_client_at_queue_depth_one_is_not_coalesced() {
    let s = Serve::start_with(&["mem=emu:dram,size=64M"], &["--coalesce-us", "1000"]);
    run_ok(
        "fio",
        &[
            "--name=qd1",
            "--ioengine=nbd",
            &format!("--uri={}", s.uri("mem")),
            "--rw=randread",
            "--bs=4k",
            "--size=10M",
            "--iodepth=1",
        ],
    );
    let (gathered, windows) = coalescing(&s);
    // 2560 requests: one trial window per 1024, each gathering at most the one request
    // the client sends after its reply; coalescing never turns on.
    assert!(
        windows <= 2.0,
        "{windows} windows for 2560 requests at QD 1"
    );
    assert!(
        gathered <= windows,
        "{gathered} requests in {windows} windows"
    );
}

#[test]
fn write_zeroes_keeps_blocks_allocated_unless_the_client_allows_a_hole() {
    // tmpfs has no zero-range: the uring export zeroes by punching a hole, then allocates
    // the range again, unless the client allows a hole (qemu-io's `write -z -u` sends no
    // NO_HOLE flag; plain `write -z` does). Skipped where /dev/shm is absent.
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        return;
    };
    let path = dir.path().join("disk.img");
    random_file(&path, 16 << 20, 11);
    let s = Serve::start(&[&format!("shm=uring:{},direct=0", path.display())]);
    let allocated_bytes = || {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&path).unwrap().blocks() * 512
    };
    let full = allocated_bytes();
    let zero = |cmd: &str, at: &str| {
        let out = run_ok(
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                &format!("{cmd} {at} 1M"),
                "-c",
                &format!("read -P 0 {at} 1M"),
                &s.uri("shm"),
            ],
        );
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(!text.contains("failed"), "{text}");
    };
    zero("write -z", "1M");
    assert_eq!(allocated_bytes(), full, "NO_HOLE write zeroes left a hole");
    zero("write -z -u", "4M");
    assert!(
        allocated_bytes() <= full - (1 << 20),
        "write zeroes allowed to unmap punched no hole: {} of {full} bytes allocated",
        allocated_bytes()
    );
}

#[test]
fn a_read_from_a_device_that_moves_no_data_never_returns_another_requests_bytes() {
    // One reactor serves both exports and recycles I/O buffers between them. The `null`
    // device completes a read without writing its buffer: the server must zero it, or the
    // reply would carry what a request on the other export left there.
    let s = Serve::start(&["disk=emu:dram,size=1M", "nul=null,size=1M"]);
    let secret = vec![0x5au8; 4096];
    let mut c = handshake(s.port, "disk");
    for cookie in 0..8u64 {
        let mut m = client::request(CMD_WRITE, 0, cookie, 0, 4096);
        m.extend_from_slice(&secret);
        c.write_all(&m).unwrap();
        assert_eq!(simple_reply(&mut c), (cookie, 0));
        c.write_all(&client::request(CMD_READ, 0, 100 + cookie, 0, 4096))
            .unwrap();
        assert_eq!(simple_reply(&mut c), (100 + cookie, 0));
        let mut data = vec![0u8; 4096];
        c.read_exact(&mut data).unwrap();
        assert_eq!(data, secret);
    }
    let mut n = handshake(s.port, "nul");
    for cookie in 0..8u64 {
        n.write_all(&client::request(CMD_READ, 0, cookie, 0, 4096))
            .unwrap();
        assert_eq!(simple_reply(&mut n), (cookie, 0));
        let mut data = vec![0xffu8; 4096];
        n.read_exact(&mut data).unwrap();
        assert!(
            data.iter().all(|&b| b == 0),
            "read {cookie} carried old bytes"
        );
    }
}
