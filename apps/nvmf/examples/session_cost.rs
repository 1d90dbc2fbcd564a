//! The protocol's own cost per I/O: drives one I/O queue's session through `count` 4 KiB
//! reads (command capsule in, C2HData and response framed out) and as many in-capsule
//! 4 KiB writes, with no socket and no device. Run it under an instruction counter with two
//! counts and divide the difference, so the setup cancels out:
//!
//! ```sh
//! cargo build --release -p hypoll-nvmf --example session_cost
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/session_cost 1000 [digests]
//! ```

use hypoll_nvme::fabrics::CNTLID_DYNAMIC;
use hypoll_nvme::spec::Status;
use hypoll_nvme::tcp::Digests;
use hypoll_nvmf::client::Host;
use hypoll_nvmf::{NamespaceConfig, Session, Step, Target, TargetConfig};

const NQN: &str = "nqn.2026-12.io.hypoll:cost";

fn run(s: &mut Session, input: &[u8], out: &mut Vec<u8>) -> Step {
    let (used, step) = s.step(input, 0, out);
    assert_eq!(used, input.len(), "{step:?}");
    step
}

fn main() {
    let mut args = std::env::args().skip(1);
    let count: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let digests = args.next().as_deref() == Some("digests");
    let mut cfg = TargetConfig::new(NQN);
    cfg.namespaces = vec![NamespaceConfig {
        block_bytes: 4096,
        blocks: 1 << 20,
        read_only: false,
        volatile_cache: false,
        write_zeroes: false,
        deallocate: false,
        uuid: NamespaceConfig::uuid_for("cost"),
    }];
    let t = Target::new(cfg).unwrap();
    let mut host = Host::new(Digests {
        header: digests,
        data: digests,
    });
    let mut out = Vec::new();
    let mut admin = Session::new(t.clone());
    run(&mut admin, &host.ic_req(0), &mut out);
    run(
        &mut admin,
        &host.connect(1, 0, 31, 0, CNTLID_DYNAMIC, NQN),
        &mut out,
    );
    run(&mut admin, &host.enable(2), &mut out);
    let mut q = Session::new(t);
    run(&mut q, &host.ic_req(0), &mut out);
    host.framing = q.framing();
    run(&mut q, &host.connect(1, 1, 127, 0, 1, NQN), &mut out);

    let data = vec![0x5au8; 4096];
    // One command of each kind, sent again once answered: the host's own cost stays out of
    // the difference between two counts.
    let read = host.read(7, 1, 8, 1, 4096);
    let write = host.write(9, 1, 8, &data, 4096);
    let (mut head, mut tail) = (Vec::with_capacity(256), Vec::with_capacity(256));
    let mut sent = 0usize;
    for _ in 0..count {
        out.clear();
        let Step::Io(cmd) = run(&mut q, &read, &mut out) else {
            panic!()
        };
        head.clear();
        tail.clear();
        q.complete_read_framed(cmd.cid, &[&data], &mut head, &mut tail)
            .unwrap();
        sent += head.len() + tail.len();
    }
    for _ in 0..count {
        out.clear();
        let Step::Io(cmd) = run(&mut q, &write, &mut out) else {
            panic!()
        };
        q.complete(cmd.cid, Status::SUCCESS, &mut out).unwrap();
        sent += out.len();
    }
    println!("{count} reads and {count} writes, {sent} bytes of headers and responses");
}
