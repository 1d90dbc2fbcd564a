//! The NBD server's instructions per request on its reactor thread: a server on a `null`
//! export, and a client thread sending 4 KiB reads over loopback TCP in batches of `depth`
//! (one write each, each batch answered before the next) until `count` are answered. Socket-watching and request gathering are off, so the
//! reactor does no timed spinning and the count follows the code, not the machine. Run
//! under callgrind with one file per thread, at two counts, and divide the difference of
//! the reactor thread's totals (`scripts/serve-cost` does it):
//!
//! ```sh
//! cargo build --release -p hypoll-nbd --example serve_cost
//! valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file=/tmp/cg.%p \
//!     target/release/examples/serve_cost 2000 32
//! ```

use std::io::{Read, Write};
use std::net::TcpStream;

use hypoll_nbd::proto::*;
use hypoll_nbd::{client, ListenAddr, Server, ServerConfig};

fn option_reply(c: &mut TcpStream) -> u32 {
    let mut h = [0u8; 20];
    c.read_exact(&mut h).unwrap();
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
    let mut data = vec![0u8; len];
    c.read_exact(&mut data).unwrap();
    u32::from_be_bytes(h[12..16].try_into().unwrap())
}

fn main() {
    let mut args = std::env::args().skip(1);
    let count: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(2000);
    let depth: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(32);
    let mut cfg = ServerConfig::new(
        vec![("null".into(), "null,size=1G".into())],
        "127.0.0.1:0".parse().unwrap(),
    );
    cfg.service.idle_spin_ns = 0;
    cfg.service.coalesce_ns = 0;
    let server = Server::start(cfg).unwrap();
    let ListenAddr::Tcp(addr) = server.local_addr().clone() else {
        unreachable!("a TCP listener")
    };
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_nodelay(true).unwrap();
    let mut greeting = [0u8; GREETING_BYTES];
    c.read_exact(&mut greeting).unwrap();
    c.write_all(&client::handshake_go("null")).unwrap();
    while option_reply(&mut c) != REP_ACK {}
    let request = |cookie: u64| client::request(CMD_READ, 0, cookie, (cookie % 4096) * 4096, 4096);
    // Batches of `depth` requests in one write, each batch answered before the next: the
    // server sees the same arrivals whatever the scheduler does.
    let mut reply = vec![0u8; REPLY_HEADER_BYTES + 4096];
    let mut sent = 0;
    while sent < count {
        let n = depth.min(count - sent);
        let batch: Vec<u8> = (sent..sent + n).flat_map(request).collect();
        c.write_all(&batch).unwrap();
        for _ in 0..n {
            c.read_exact(&mut reply).unwrap();
            assert_eq!(u32::from_be_bytes(reply[4..8].try_into().unwrap()), 0);
        }
        sent += n;
    }
    drop(c);
    let report = server.stop();
    assert_eq!(report.connections_left, 0);
    println!("{count} reads at depth {depth}");
}
