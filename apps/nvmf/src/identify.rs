//! The data structures admin commands return: Identify (controller, namespace, active
//! namespace list, namespace identification descriptors) and the log pages (error, SMART /
//! health, discovery). Offsets are the Base specification's (1.3/1.4 figures "Identify
//! Controller Data Structure", "Identify Namespace Data Structure", "Discovery Log Page").

use std::net::SocketAddr;

use hypoll_nvme::fabrics::{nqn_to_field, DISCOVERY_NQN, NQN_FIELD_BYTES};

use crate::config::{NamespaceConfig, TargetConfig, PAGE_BYTES};

/// Bytes of every Identify data structure.
pub const IDENTIFY_BYTES: usize = 4096;
/// The NVMe version the controller reports (VS and Identify's VER): 1.3.
pub const VERSION: u32 = 0x0001_0300;
/// Bytes of one error log entry, of the SMART / health log, of a discovery log record.
pub const ERROR_LOG_ENTRY_BYTES: usize = 64;
pub const SMART_LOG_BYTES: usize = 512;
pub const DISCOVERY_RECORD_BYTES: usize = 1024;
pub const FIRMWARE_LOG_BYTES: usize = 512;
/// Keep Alive Support granularity (KAS), in 100 ms units: the timer counts in these.
pub const KAS_100MS: u16 = 1;
/// The firmware revision Identify reports: the crate's version.
const FIRMWARE: &str = env!("CARGO_PKG_VERSION");

/// ONCS bits.
pub const ONCS_DSM: u16 = 1 << 2;
pub const ONCS_WRITE_ZEROES: u16 = 1 << 3;

/// Identify Controller's CNTRLTYPE.
const CNTRLTYPE_IO: u8 = 1;
const CNTRLTYPE_DISCOVERY: u8 = 2;

fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// An ASCII field padded with spaces, as Identify's strings are.
fn put_text(b: &mut [u8], at: usize, len: usize, text: &str) {
    let field = &mut b[at..at + len];
    field.fill(b' ');
    let n = text.len().min(len);
    field[..n].copy_from_slice(&text.as_bytes()[..n]);
}

/// The ONCS bits the namespaces' devices allow.
pub fn oncs(cfg: &TargetConfig) -> u16 {
    let mut oncs = 0;
    if cfg.namespaces.iter().any(|n| n.deallocate) {
        oncs |= ONCS_DSM;
    }
    if cfg.namespaces.iter().any(|n| n.write_zeroes) {
        oncs |= ONCS_WRITE_ZEROES;
    }
    oncs
}

/// MDTS: the largest transfer as a power of two of pages.
pub fn mdts(cfg: &TargetConfig) -> u8 {
    (cfg.limits.transfer_bytes_max / PAGE_BYTES).trailing_zeros() as u8
}

/// Identify Controller (CNS 01h) for controller `cntlid`, of the NVM subsystem or of the
/// discovery subsystem.
pub fn controller(cfg: &TargetConfig, cntlid: u16, discovery: bool) -> Vec<u8> {
    let l = &cfg.limits;
    let mut b = vec![0u8; IDENTIFY_BYTES];
    put_text(&mut b, 4, 20, &cfg.serial);
    put_text(&mut b, 24, 40, &cfg.model);
    put_text(&mut b, 64, 8, FIRMWARE);
    b[72] = 6; // RAB
    b[76] = 1 << 1; // CMIC: more than one controller may serve the subsystem
    b[77] = mdts(cfg);
    put_u16(&mut b, 78, cntlid);
    put_u32(&mut b, 80, VERSION);
    b[111] = if discovery {
        CNTRLTYPE_DISCOVERY
    } else {
        CNTRLTYPE_IO
    };
    b[260] = 1 << 1; // FRMW: one firmware slot
    b[258] = 3; // ACL (the Abort command is not served, but the field is 0's based)
    b[259] = l.aers_max - 1; // AERL
    b[261] = 1 << 2; // LPA: extended data for Get Log Page (offsets, 32-bit counts)
    b[262] = 0; // ELPE: one error log entry
    put_u16(&mut b, 320, KAS_100MS);
    b[512] = 0x66; // SQES: 64-byte entries
    b[513] = 0x44; // CQES: 16-byte entries
    put_u16(&mut b, 514, l.queue_entries_max); // MAXCMD
    if !discovery {
        put_u32(&mut b, 516, cfg.namespaces.len() as u32); // NN
        put_u16(&mut b, 520, oncs(cfg));
        b[525] = u8::from(cfg.namespaces.iter().any(|n| n.volatile_cache)); // VWC
    }
    // SGLS: SGLs supported (bits 1:0 = 01b), and the address of an in-capsule data block
    // is an offset (bit 20).
    put_u32(&mut b, 536, 1 | (1 << 20));
    let nqn = if discovery {
        DISCOVERY_NQN
    } else {
        &cfg.subsystem_nqn
    };
    nqn_to_field(nqn, &mut b[768..768 + NQN_FIELD_BYTES]);
    // Fabrics: capsule sizes in 16-byte units (IOCCSZ, IORCSZ), no in-capsule data offset
    // (ICDOFF), dynamic controllers (FCATT), one SGL data block per command (MSDBD).
    put_u32(&mut b, 1792, (64 + l.in_capsule_bytes_max) / 16);
    put_u32(&mut b, 1796, 1);
    put_u16(&mut b, 1800, 0);
    b[1802] = 0;
    b[1803] = 1;
    b
}

/// Identify Namespace (CNS 00h).
pub fn namespace(ns: &NamespaceConfig) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_BYTES];
    put_u64(&mut b, 0, ns.blocks); // NSZE
    put_u64(&mut b, 8, ns.blocks); // NCAP
    put_u64(&mut b, 16, ns.blocks); // NUSE
    b[25] = 0; // NLBAF: one format
    b[26] = 0; // FLBAS: format 0
    b[30] = 1; // NMIC: may be shared by controllers
    b[99] = u8::from(ns.read_only); // NSATTR: write protected
    b[104..120].copy_from_slice(&ns.uuid); // NGUID
                                           // LBA format 0: no metadata, LBADS = log2(block size), best performance.
    b[128 + 2] = ns.block_bytes.trailing_zeros() as u8;
    b
}

/// Active Namespace ID list (CNS 02h): the IDs above `after`, ascending.
pub fn active_namespaces(cfg: &TargetConfig, after: u32) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_BYTES];
    let ids = (after.saturating_add(1)..=cfg.namespaces.len() as u32).take(IDENTIFY_BYTES / 4);
    for (i, nsid) in ids.enumerate() {
        put_u32(&mut b, 4 * i, nsid);
    }
    b
}

/// Namespace Identification Descriptor list (CNS 03h): NGUID, UUID and command set (NVM).
pub fn namespace_descriptors(ns: &NamespaceConfig) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_BYTES];
    let mut at = 0;
    for (nidt, nid) in [(2u8, &ns.uuid[..]), (3, &ns.uuid[..]), (4, &[0u8][..])] {
        b[at] = nidt;
        b[at + 1] = nid.len() as u8;
        b[at + 4..at + 4 + nid.len()].copy_from_slice(nid);
        at += 4 + nid.len();
    }
    b
}

/// Error Information log (01h): one entry, empty (no error is recorded).
pub fn error_log() -> Vec<u8> {
    vec![0u8; ERROR_LOG_ENTRY_BYTES]
}

/// Firmware Slot Information log (03h): slot 1 active, holding this firmware.
pub fn firmware_log() -> Vec<u8> {
    let mut b = vec![0u8; FIRMWARE_LOG_BYTES];
    b[0] = 1; // AFI: slot 1 is active
    put_text(&mut b, 8, 8, FIRMWARE);
    b
}

/// SMART / Health Information log (02h): no warning, spare at its full, nothing counted
/// (the target does not keep the counters; temperature is not reported).
pub fn smart_log() -> Vec<u8> {
    let mut b = vec![0u8; SMART_LOG_BYTES];
    b[3] = 100; // available spare, percent
    b[4] = 10; // available spare threshold, percent
    b
}

/// Discovery log page (70h): the header and one record per place the subsystem is served.
pub fn discovery_log(cfg: &TargetConfig, queue_entries: u16) -> Vec<u8> {
    let n = cfg.discovery.len();
    let mut b = vec![0u8; DISCOVERY_RECORD_BYTES * (1 + n)];
    put_u64(&mut b, 0, 1); // GENCTR: the log never changes while the target runs
    put_u64(&mut b, 8, n as u64); // NUMREC
    for (i, e) in cfg.discovery.iter().enumerate() {
        let r = &mut b[DISCOVERY_RECORD_BYTES * (1 + i)..][..DISCOVERY_RECORD_BYTES];
        r[0] = 3; // TRTYPE: TCP
        r[1] = match e.addr {
            SocketAddr::V4(_) => 1,
            SocketAddr::V6(_) => 2,
        };
        r[2] = 2; // SUBTYPE: an NVM subsystem
                  // TREQ: secure channel not specified; SQ flow control may be disabled (bit 2).
        r[3] = 1 << 2;
        put_u16(r, 4, e.portid);
        put_u16(r, 6, hypoll_nvme::fabrics::CNTLID_DYNAMIC);
        put_u16(r, 8, queue_entries); // ASQSZ
        put_text(r, 32, 32, &e.addr.port().to_string());
        nqn_to_field(&cfg.subsystem_nqn, &mut r[256..256 + NQN_FIELD_BYTES]);
        put_text(r, 512, 256, &e.addr.ip().to_string());
        // TSAS: security type none (byte 768 left 0).
    }
    b
}
