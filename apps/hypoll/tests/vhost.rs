//! `hypoll serve --vhost-user-blk`: one export served over NBD and vhost-user-blk at once,
//! on the same reactors and the same device queue pairs (what an NBD client writes a
//! vhost-user-blk client, libblkio's driver, reads, and the other way round); served over
//! vhost-user-blk alone, with no NBD listener; bad sockets and settings refused.

mod support;

use std::io::Write;
use std::mem::MaybeUninit;
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use blkio::{Blkio, Completion, ReqFlags};
use hypoll_nbd::client;
use hypoll_nbd::proto::*;
use support::nbd::{handshake, read_ok, simple_reply};
use support::serve::{two_cores, Serve};

/// Runs one request on `q` and waits: its `ret`.
fn wait(q: &mut blkio::Blkioq) -> i32 {
    let mut done = [const { MaybeUninit::<Completion>::uninit() }; 1];
    let mut timeout = Duration::from_secs(10);
    assert_eq!(q.do_io(&mut done, 1, Some(&mut timeout), None).unwrap(), 1);
    // SAFETY: `do_io` filled one completion.
    unsafe { done[0].assume_init_read() }.ret
}

#[test]
fn one_export_over_nbd_and_vhost_user_blk_sees_one_disk() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("disk.sock");
    let vhost = format!("disk={}", socket.display());
    let serve = Serve::start_with(
        &["disk=emu:dram,size=16M"],
        &["--cores", &two_cores(), "--vhost-user-blk", &vhost],
    );
    // NBD writes a block and flushes.
    let mut nbd = handshake(serve.port, "disk");
    let mut w = client::request(CMD_WRITE, 0, 1, 1 << 20, 4096);
    w.extend([0x5a; 4096]);
    w.extend(client::request(CMD_FLUSH, 0, 2, 0, 0));
    nbd.write_all(&w).unwrap();
    assert_eq!(simple_reply(&mut nbd), (1, 0));
    assert_eq!(simple_reply(&mut nbd), (2, 0));

    // A guest's driver reads it, and writes another.
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", socket.to_str().unwrap()).unwrap();
    b.connect().unwrap();
    b.set_i32("num-queues", 2).unwrap();
    let mut started = b.start().unwrap();
    let region = b.alloc_mem_region(8192).unwrap();
    b.map_mem_region(&region).unwrap();
    let buf = region.addr as *mut u8;
    let q = &mut started.queues[1];
    q.read(1 << 20, buf, 4096, 0, ReqFlags::empty());
    assert_eq!(wait(q), 0);
    // SAFETY: the region is 8 KiB mapped by blkio; no request is in flight.
    let data = unsafe { std::slice::from_raw_parts_mut(buf, 8192) };
    assert!(
        data[..4096].iter().all(|&x| x == 0x5a),
        "NBD's write, read over vhost-user"
    );
    data[..4096].fill(0xa5);
    let q = &mut started.queues[0];
    q.write(2 << 20, buf, 4096, 0, ReqFlags::empty());
    assert_eq!(wait(q), 0);
    q.flush(0, ReqFlags::empty());
    assert_eq!(wait(q), 0);

    // NBD reads the guest's write.
    let back = read_ok(&mut nbd, 3, 2 << 20, 4096);
    assert!(
        back.iter().all(|&x| x == 0xa5),
        "the guest's write, read over NBD"
    );

    // Both clients attached and idle: the reactors park (the rings' notifications on, the
    // kick eventfds in their epoll sets) instead of spinning on the rings.
    serve.assert_idle_parks("attached");

    // The guest leaves, NBD closes; the server stops cleanly and takes its socket away.
    drop(started);
    drop(b);
    drop(nbd);
    let (status, stderr) = serve.signal_and_wait(libc::SIGTERM);
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("stopped cleanly"), "{stderr}");
    assert!(!socket.exists(), "the socket is removed");
}

/// A `hypoll serve` with `args` after `serve`, serving `sockets` vhost-user-blk sockets and
/// no NBD.
fn serve_vhost_only(args: &[&str], sockets: usize) -> Serve {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hypoll"));
    cmd.arg("serve").args(args);
    Serve::spawn_vhost_only(cmd, sockets)
}

/// `hypoll serve` with `args`, expected to refuse them: its exit code and stderr.
fn refused(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hypoll"))
        .arg("serve")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A guest's driver on `socket` with `queues` queues, started, with an 8 KiB buffer
/// mapped: the buffer's address.
fn guest(socket: &Path, queues: i32) -> (Blkio, blkio::BlkioStartOutcome, *mut u8) {
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", socket.to_str().unwrap()).unwrap();
    b.connect().unwrap();
    b.set_i32("num-queues", queues).unwrap();
    let started = b.start().unwrap();
    let region = b.alloc_mem_region(8192).unwrap();
    b.map_mem_region(&region).unwrap();
    (b, started, region.addr as *mut u8)
}

#[test]
fn vhost_user_blk_alone_serves_guests_with_no_nbd_listener() {
    // NBD's port is taken (here, or by whoever holds it already): a server that listened
    // for NBD would not start.
    let _nbd_port = TcpListener::bind("127.0.0.1:10809");
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("disk.sock");
    let vhost = format!("disk={}", socket.display());
    let serve = serve_vhost_only(
        &[
            "--export",
            "disk=emu:dram,size=16M",
            "--vhost-user-blk",
            &vhost,
            "--cores",
            &two_cores(),
        ],
        1,
    );
    assert_eq!(serve.port, 0, "no NBD listener is announced");

    // Written on one queue, read back on the other (two reactors where there are two).
    let (b, mut started, buf) = guest(&socket, 2);
    // SAFETY: the region is 8 KiB mapped by blkio; no request is in flight.
    let data = unsafe { std::slice::from_raw_parts_mut(buf, 8192) };
    for (i, x) in data[..4096].iter_mut().enumerate() {
        *x = (i % 251) as u8;
    }
    let q = &mut started.queues[0];
    q.write(3 << 20, buf, 4096, 0, ReqFlags::empty());
    assert_eq!(wait(q), 0);
    let q = &mut started.queues[1];
    q.read(3 << 20, buf.wrapping_add(4096), 4096, 0, ReqFlags::empty());
    assert_eq!(wait(q), 0);
    // SAFETY: as above; the read is done.
    let data = unsafe { std::slice::from_raw_parts(buf, 8192) };
    assert_eq!(
        data[..4096],
        data[4096..],
        "the guest reads back what it wrote"
    );
    q.flush(0, ReqFlags::empty());
    assert_eq!(wait(q), 0);
    // Past the end: an error for that request, and the server goes on.
    q.read(16 << 20, buf, 4096, 0, ReqFlags::empty());
    assert_ne!(wait(q), 0);
    q.read(0, buf, 4096, 0, ReqFlags::empty());
    assert_eq!(wait(q), 0);

    drop(started);
    drop(b);
    let (status, stderr) = serve.signal_and_wait(libc::SIGTERM);
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("stopped cleanly"), "{stderr}");
    assert!(!socket.exists(), "the socket is removed");
}

#[test]
fn bad_sockets_exports_and_settings_are_refused_with_their_own_message() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("disk.sock");
    let vhost = format!("disk={}", socket.display());
    let export = "disk=emu:dram,size=16M";

    let (code, err) = refused(&["--export", export, "--vhost-user-blk", "nope=/tmp/x.sock"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("no --export named nope"), "{err}");

    // A file in the socket's place is refused and left as it was.
    let file = dir.path().join("disk.img");
    std::fs::write(&file, b"precious").unwrap();
    let on_file = format!("disk={}", file.display());
    let (code, err) = refused(&["--export", export, "--vhost-user-blk", &on_file]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"precious");

    // A folder that does not exist.
    let nowhere = format!("disk={}", dir.path().join("no/such/dir.sock").display());
    let (code, err) = refused(&["--export", export, "--vhost-user-blk", &nowhere]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--vhost-user-blk disk="), "{err}");

    // Without --listen: NBD's settings, and an export nothing serves.
    let (code, err) = refused(&[
        "--export",
        export,
        "--vhost-user-blk",
        &vhost,
        "--metrics",
        "127.0.0.1:0",
        "--max-connections",
        "4",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--metrics, --max-connections") && err.contains("--listen"),
        "{err}"
    );
    let (code, err) = refused(&[
        "--export",
        export,
        "--export",
        "other=null",
        "--vhost-user-blk",
        &vhost,
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--export other: served by nothing"), "{err}");
    let (code, err) = refused(&[
        "--export",
        export,
        "--vhost-user-blk",
        &vhost,
        "--vhost-user-blk",
        &vhost,
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("given twice"), "{err}");
    assert!(!socket.exists(), "nothing was left behind");

    // A socket a server listens on is not taken from it.
    let args = ["--export", export, "--vhost-user-blk", &vhost];
    let first = serve_vhost_only(&args, 1);
    let (code, err) = refused(&args);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("another server is listening"), "{err}");
    let (b, started, _) = guest(&socket, 1);
    drop(started);
    drop(b);
    // A server that died leaves its socket file: the next one replaces it.
    drop(first);
    assert!(socket.exists());
    let second = serve_vhost_only(&args, 1);
    let (b, mut started, buf) = guest(&socket, 1);
    let q = &mut started.queues[0];
    q.read(0, buf, 4096, 0, ReqFlags::empty());
    assert_eq!(wait(q), 0);
    drop(started);
    drop(b);
    let (status, stderr) = second.signal_and_wait(libc::SIGINT);
    assert!(status.success(), "{stderr}");
}
