//! `vhost-user:PATH`, hypoll-nvme's client device for vhost-user-blk back ends (libblkio
//! underneath), against this crate's back end: two queue pairs on one connection, each
//! request type, data written through one queue pair and read back through the other, a
//! read past the end failing, a third queue pair refused.

use std::time::Duration;

use hypoll_reactor::nvme::{QueuePairError, Status, SyncIo};
use hypoll_reactor::{CoreList, Device, IoBuf, Opcode};
use hypoll_vhost::{VhostConfig, VhostExport, VhostServer};

fn server(socket: &std::path::Path) -> VhostServer {
    let cores = hypoll_reactor::allowed_cores().unwrap();
    let list: Vec<String> = cores.iter().take(2).map(ToString::to_string).collect();
    VhostServer::start(VhostConfig {
        exports: vec![VhostExport {
            name: "d".into(),
            device: Device::open("emu:dram,size=8M").unwrap(),
            read_only: false,
            socket: socket.to_path_buf(),
        }],
        cores: Some(CoreList::parse(&list.join(",")).unwrap()),
        policy: "adaptive".into(),
        queue_depth: 32,
        num_queues: 2,
    })
    .unwrap()
}

#[test]
fn the_client_device_reads_back_what_it_wrote_on_another_queue() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vhost.sock");
    let server = server(&socket);

    let spec = format!("vhost-user:{},queues=2,depth=32", socket.display());
    let device = Device::open(&spec).unwrap();
    assert_eq!(device.ctrl.describe(), spec);
    let ns = device.ctrl.namespace();
    assert_eq!(ns.capacity_bytes(), 8 << 20);
    assert!(device.ctrl.supports(Opcode::WriteZeroes));
    let mut q0 = device.ctrl.create_queue_pair(32).unwrap();
    let mut q1 = device.ctrl.create_queue_pair(16).unwrap();
    assert!(matches!(
        device.ctrl.create_queue_pair(8).err().unwrap(),
        QueuePairError::NoQueuesLeft { max: 2 }
    ));

    let lba = ns.lba_size_bytes as usize;
    let data: Vec<u8> = (0..8192).map(|i| (i * 7 + 3) as u8).collect();
    let timeout = Duration::from_secs(5);
    let blocks = (data.len() / lba) as u32;
    {
        let mut io = SyncIo::new(&mut *q0, timeout);
        io.write(64, &data).unwrap();
        io.flush().unwrap();
    }
    {
        let mut io = SyncIo::new(&mut *q1, timeout);
        let read: IoBuf = io.read(64, blocks).unwrap();
        assert_eq!(
            &read[..data.len()],
            &data[..],
            "read back on the other queue"
        );
        io.write_zeroes(64, 1).unwrap();
        let read = io.read(64, blocks).unwrap();
        assert!(read[..lba].iter().all(|&b| b == 0), "zeroed");
        assert_eq!(&read[lba..data.len()], &data[lba..]);
        io.deallocate(128, 8).unwrap();
        // The last block and one past it: the back end refuses the request.
        let last = ns.capacity_lbas - 1;
        assert!(
            matches!(io.read(last, 2), Err(hypoll_reactor::nvme::IoError::Status(s)) if s != Status::SUCCESS)
        );
        io.read(last, 1).unwrap();
    }
    drop((q0, q1));
    drop(device);
    assert!(server.shutdown().panics.is_empty());
}

#[test]
fn a_reactor_waiting_on_the_client_device_interrupt_is_woken_by_each_completion() {
    use std::cell::Cell;
    use std::rc::Rc;

    use hypoll_reactor::{Reactor, StandaloneConfig};

    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vhost.sock");
    let server = server(&socket);
    let device = Device::open(&format!("vhost-user:{}", socket.display())).unwrap();
    // The `interrupt` policy waits on the queue pair's interrupt line for every I/O.
    let (mut r, _handle) = Reactor::<()>::standalone(StandaloneConfig {
        policy: "interrupt".into(),
        ..StandaloneConfig::default()
    })
    .unwrap();
    let dev = r.attach(&device, 8).unwrap();
    let done = Rc::new(Cell::new(0u32));
    let start = std::time::Instant::now();
    for i in 0..50u64 {
        let d = done.clone();
        r.read(dev, i * 8, 8, IoBuf::zeroed(4096), move |_, _, io| {
            assert!(io.result.is_ok(), "{:?}", io.result);
            d.set(d.get() + 1);
        })
        .unwrap();
        while done.get() as u64 <= i {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "read {i} completed"
            );
            if r.poll(&mut ()) == 0 {
                r.idle();
            }
        }
    }
    assert!(
        r.counters().interrupt_waits > 0,
        "the reactor waited on the interrupt"
    );
    r.shut_down(&mut ());
    drop(r);
    drop(device);
    assert!(server.shutdown().panics.is_empty());
}
