//! Read-only exports, server-wide (`--read-only`, `-r`) and one at a time (`ro` in the
//! spec): clients (nbdinfo, qemu-io; `scripts/test` installs them) are told, writes, trims
//! and write zeroes are refused with EPERM and change nothing, and reads and flushes work.

mod support;

use std::io::Write;

use hypoll_nbd::client;
use hypoll_nbd::proto::*;
use support::nbd::{connect, option_reply, simple_reply};
use support::serve::Serve;
use support::{run_fails, run_ok};

/// GO on `export` over a raw connection; returns the transmission flags it was sent.
fn go(port: u16, export: &str) -> (std::net::TcpStream, u16) {
    let mut c = connect(port);
    c.write_all(&client::handshake_go(export)).unwrap();
    let mut flags = None;
    loop {
        let (_, reply, data) = option_reply(&mut c);
        assert_eq!(reply & (1 << 31), 0, "{reply:#x}");
        if reply == REP_INFO && u16::from_be_bytes([data[0], data[1]]) == INFO_EXPORT {
            flags = Some(u16::from_be_bytes([data[10], data[11]]));
        }
        if reply == REP_ACK {
            return (c, flags.expect("INFO_EXPORT before the ACK"));
        }
    }
}

/// Every request that writes is refused with EPERM, in order, and the data stays.
fn writes_are_refused_and_change_nothing(port: u16, export: &str) {
    let (mut c, flags) = go(port, export);
    assert_ne!(flags & TFLAG_READ_ONLY, 0, "{flags:#x}");
    let mut burst = client::request(CMD_WRITE, 0, 1, 0, 4096);
    burst.extend([0xee; 4096]);
    burst.extend(client::request(CMD_TRIM, 0, 2, 0, 4096));
    burst.extend(client::request(CMD_WRITE_ZEROES, 0, 3, 0, 4096));
    burst.extend(client::request(CMD_FLUSH, 0, 4, 0, 0));
    burst.extend(client::request(CMD_READ, 0, 5, 0, 4096));
    c.write_all(&burst).unwrap();
    let mut replies = [(0, 0); 5];
    for r in &mut replies {
        *r = simple_reply(&mut c);
        if r.0 == 5 {
            let mut data = vec![0u8; 4096];
            std::io::Read::read_exact(&mut c, &mut data).unwrap();
            assert!(data.iter().all(|&b| b == 0xab), "the refused write landed");
        }
    }
    replies.sort_unstable();
    assert_eq!(
        replies,
        [(1, EPERM), (2, EPERM), (3, EPERM), (4, 0), (5, 0)]
    );
}

/// qemu's image options for `export`, in plaintext.
fn image_opts(port: u16, export: &str) -> String {
    format!("driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={port},export={export}")
}

#[test]
fn read_only_server_refuses_every_write_with_eperm_and_serves_reads() {
    // A file-backed export, written first by a writable server, then served read-only.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    let spec = format!("disk=emu:dram,size=16M,backing=file:{}", path.display());
    {
        let s = Serve::start(&[&spec]);
        run_ok(
            "qemu-io",
            &[
                "--image-opts",
                &image_opts(s.port, "disk"),
                "-c",
                "write -P 0xab 0 1M",
                "-c",
                "flush",
            ],
        );
    }
    let s = Serve::start_with(&[&spec], &["-r"]);
    let info = run_ok("nbdinfo", &[&format!("nbd://127.0.0.1:{}/disk", s.port)]);
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(text.contains("is_read_only: true"), "{text}");
    assert!(
        text.contains("can_trim: false") && text.contains("can_zero: false"),
        "{text}"
    );
    writes_are_refused_and_change_nothing(s.port, "disk");
    // qemu will not open it for writing; read-only, it reads what is there.
    run_fails(
        "qemu-io",
        &[
            "--image-opts",
            &image_opts(s.port, "disk"),
            "-c",
            "write 0 4k",
        ],
    );
    let out = run_ok(
        "qemu-io",
        &[
            "-r",
            "--image-opts",
            &image_opts(s.port, "disk"),
            "-c",
            "read -P 0xab 0 1M",
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("Pattern verification failed"), "{text}");
}

#[test]
fn one_export_read_only_leaves_the_others_writable() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ro.img");
    let ro = format!("ro=emu:dram,size=16M,backing=file:{},ro", path.display());
    {
        let writable = ro.trim_end_matches(",ro");
        let s = Serve::start(&[writable]);
        run_ok(
            "qemu-io",
            &[
                "--image-opts",
                &image_opts(s.port, "ro"),
                "-c",
                "write -P 0xab 0 64k",
            ],
        );
    }
    let s = Serve::start(&["rw=emu:dram,size=16M", &ro]);
    writes_are_refused_and_change_nothing(s.port, "ro");
    let (_, flags) = go(s.port, "rw");
    assert_eq!(flags & TFLAG_READ_ONLY, 0, "{flags:#x}");
    run_ok(
        "qemu-io",
        &[
            "--image-opts",
            &image_opts(s.port, "rw"),
            "-c",
            "write -P 0xcd 0 1M",
            "-c",
            "read -P 0xcd 0 1M",
        ],
    );
}

/// The access mode (`O_RDONLY`, `O_WRONLY`, `O_RDWR`) of every descriptor process `pid`
/// holds on `path`.
fn access_modes(pid: u32, path: &std::path::Path) -> Vec<i32> {
    let mut modes = Vec::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let fd = fd.unwrap();
        if std::fs::read_link(fd.path()).ok().as_deref() != Some(path) {
            continue;
        }
        let info = std::fs::read_to_string(format!(
            "/proc/{pid}/fdinfo/{}",
            fd.file_name().to_string_lossy()
        ))
        .unwrap();
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .map(|v| i32::from_str_radix(v.trim(), 8).unwrap())
            .expect("fdinfo has flags");
        modes.push(flags & libc::O_ACCMODE);
    }
    modes
}

/// A read-only export of a file (`uring:`) opens it without write access, server-wide or
/// one export at a time, and still serves its data; a writable export of the same kind
/// opens its file for writing.
#[test]
fn a_read_only_file_export_is_opened_without_write_access() {
    let dir = tempfile::tempdir().unwrap();
    let ro = dir.path().join("ro.img");
    let rw = dir.path().join("rw.img");
    std::fs::write(&ro, vec![0xab_u8; 1 << 20]).unwrap();
    std::fs::write(&rw, vec![0_u8; 1 << 20]).unwrap();
    let ro_spec = format!("ro=uring:{},ro", ro.display());
    let rw_spec = format!("rw=uring:{}", rw.display());
    let s = Serve::start(&[&rw_spec, &ro_spec]);
    assert_eq!(access_modes(s.pid(), &ro), [libc::O_RDONLY]);
    assert_eq!(access_modes(s.pid(), &rw), [libc::O_RDWR]);
    writes_are_refused_and_change_nothing(s.port, "ro");
    drop(s);
    let s = Serve::start_with(&[&rw_spec], &["-r"]);
    assert_eq!(access_modes(s.pid(), &rw), [libc::O_RDONLY]);
}
