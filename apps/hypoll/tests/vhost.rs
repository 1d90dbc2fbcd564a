//! `hypoll serve --vhost-user-blk`: one export served over NBD and vhost-user-blk at once,
//! on the same reactors and the same device queue pairs. What an NBD client writes a
//! vhost-user-blk client (libblkio's driver) reads, and the other way round.

mod support;

use std::io::{Read, Write};
use std::mem::MaybeUninit;
use std::time::Duration;

use blkio::{Blkio, Completion, ReqFlags};
use hypoll_nbd::client;
use hypoll_nbd::proto::*;
use support::nbd::{handshake, simple_reply};
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
    nbd.write_all(&client::request(CMD_READ, 0, 3, 2 << 20, 4096))
        .unwrap();
    assert_eq!(simple_reply(&mut nbd), (3, 0));
    let mut back = vec![0u8; 4096];
    nbd.read_exact(&mut back).unwrap();
    assert!(
        back.iter().all(|&x| x == 0xa5),
        "the guest's write, read over NBD"
    );

    // Both clients attached and idle: the reactors park (the rings' notifications on, the
    // kick eventfds in their epoll sets) instead of spinning on the rings.
    let before = cpu_ns(serve.pid());
    let idle = Duration::from_secs(2);
    std::thread::sleep(idle);
    let used = cpu_ns(serve.pid()) - before;
    eprintln!("idle, attached: {used} ns of CPU in {idle:?}");
    assert!(
        used < idle.as_nanos() as u64 / 20,
        "an idle server used {used} ns of CPU in {idle:?}"
    );

    // The guest leaves, NBD closes; the server stops cleanly and takes its socket away.
    drop(started);
    drop(b);
    drop(nbd);
    let (status, stderr) = serve.signal_and_wait(libc::SIGTERM);
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("stopped cleanly"), "{stderr}");
    assert!(!socket.exists(), "the socket is removed");
}

/// CPU time (user + system) the process `pid` has used, from /proc.
fn cpu_ns(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) start after its ')'.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf takes no pointers.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    ticks * 1_000_000_000 / hz
}
