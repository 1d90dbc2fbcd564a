//! What the integration tests share: a target of one export on a free loopback port, and
//! the RAM device it exports.

use hypoll_frontend::ListenAddr;
use hypoll_nvmf::{NvmfConfig, NvmfExport, NvmfServer};
use hypoll_reactor::Device;

pub const BLOCK: u32 = 512;
/// Blocks of the test namespace (8 MiB).
pub const BLOCKS: u64 = 16384;

/// A target exporting `device` as the one namespace of subsystem `nqn`.
pub fn server(nqn: &str, device: &str) -> NvmfServer {
    let export = NvmfExport {
        name: "mem".into(),
        device: Device::open(device).unwrap(),
        read_only: false,
    };
    let mut cfg = NvmfConfig::new(vec![export], "127.0.0.1:0".parse().unwrap());
    cfg.subsystem_nqn = nqn.into();
    NvmfServer::start(cfg).unwrap()
}

/// The test namespace: zero-latency emulated RAM of [`BLOCKS`] blocks of [`BLOCK`] bytes.
pub fn mem() -> String {
    format!("emu:dram,size={},lba={BLOCK}", BLOCKS * u64::from(BLOCK))
}

/// The TCP port `s` listens on.
pub fn port(s: &NvmfServer) -> u16 {
    let ListenAddr::Tcp(addr) = s.local_addr() else {
        panic!("a TCP server")
    };
    addr.port()
}
