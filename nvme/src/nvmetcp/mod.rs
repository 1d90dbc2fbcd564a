//! The `nvme-tcp:HOST:PORT/SUBNQN` device: an NVMe/TCP initiator, so `hypoll bench` (and
//! any reactor) drives an NVMe/TCP target's namespace as it drives a local device, under
//! every policy.
//!
//! Opening it makes a controller at the target: an admin queue (ICReq/ICResp, fabrics
//! Connect, CC.EN, Identify Controller and Namespace, Number of Queues), kept open by a
//! thread of its own that sends Keep Alives. Each queue pair is an I/O queue on a TCP
//! connection of its own (`queue.rs`), polled without blocking; its interrupt fd is an
//! epoll set holding the socket (`sys.rs`), so a reactor that waits for interrupts wakes
//! when the target answers. The codec is the one the target side uses (`crate::tcp`,
//! in [`Role::Host`](crate::tcp::Role::Host)).
//!
//! - `config.rs`: the device string; `wire.rs`: a connection during set-up, blocking;
//!   `memory.rs`: a command's data in the caller's memory (the only `unsafe` copies).

mod config;
mod memory;
mod queue;
mod sys;
mod wire;

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use config::{NvmeTcpConfig, KATO_MS_DEFAULT, KATO_MS_MAX, NVME_TCP_KEYS};
pub use queue::{NvmeTcpQueuePair, CONNECTION_LOST};

use crate::fabrics::{self, cc, csts, ConnectData, CNTLID_DYNAMIC};
use crate::qpair::{Controller, QueuePair, QueuePairError, QUEUE_DEPTH_MAX};
use crate::spec::{NamespaceInfo, Opcode};
use wire::{protocol_error, Wire};

/// Entries of the admin queue asked for.
const ADMIN_SQSIZE: u16 = 31;
/// I/O queues asked for with Set Features (Number of Queues): one per reactor.
const IO_QUEUES_WANTED: u16 = 64;
/// The transfer size assumed when the target sets no limit (MDTS 0).
const TRANSFER_BYTES_UNLIMITED: u32 = 1 << 20;
/// How often CSTS is read while the controller gets ready.
const READY_POLL: Duration = Duration::from_millis(10);
/// ONCS bits.
const ONCS_DSM: u16 = 1 << 2;
const ONCS_WRITE_ZEROES: u16 = 1 << 3;

/// The I/O queue IDs a controller was granted, and which are in use.
pub(crate) struct QueueIds {
    used: Mutex<Vec<bool>>,
}

impl QueueIds {
    fn take(&self) -> Option<u16> {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        let i = used.iter().position(|u| !u)?;
        used[i] = true;
        Some(i as u16 + 1)
    }

    pub(crate) fn release(&self, qid: u16) {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(u) = used.get_mut(usize::from(qid).wrapping_sub(1)) {
            *u = false;
        }
    }
}

/// A controller at an NVMe/TCP target, with one namespace in use.
pub struct NvmeTcpController {
    cfg: NvmeTcpConfig,
    addr: SocketAddr,
    /// Who this host is and which controller its I/O queues join.
    connect: ConnectData,
    ns: NamespaceInfo,
    oncs: u16,
    /// Most write data a command capsule carries.
    in_capsule_bytes: u32,
    /// The largest SQSIZE an I/O queue may ask for (CAP.MQES, within MAXCMD).
    sqsize_max: u16,
    queues: Arc<QueueIds>,
    keep_alive: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
}

/// A host ID made once per controller: two hashes seeded at random by the standard
/// library, so two hosts (or two runs) do not collide.
fn host_id() -> [u8; 16] {
    use std::hash::{BuildHasher, Hasher};
    let mut id = [0u8; 16];
    for (i, half) in id.chunks_mut(8).enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(i as u64 ^ u64::from(std::process::id()));
        let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        h.write_u128(since_epoch.map_or(0, |d| d.as_nanos()));
        half.copy_from_slice(&h.finish().to_le_bytes());
    }
    // A version 4 UUID's layout.
    id[6] = (id[6] & 0x0f) | 0x40;
    id[8] = (id[8] & 0x3f) | 0x80;
    id
}

fn uuid_text(id: &[u8; 16]) -> String {
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

impl NvmeTcpController {
    /// Connects to the target and makes a controller there (see the module docs).
    pub fn open(cfg: &NvmeTcpConfig) -> io::Result<NvmeTcpController> {
        let addr = cfg.address.to_socket_addrs()?.next().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{}: no address", cfg.address),
            )
        })?;
        let mut admin = Wire::connect(addr, cfg.digests, 0)?;
        let hostid = host_id();
        let mut connect = ConnectData {
            hostid,
            cntlid: CNTLID_DYNAMIC,
            subnqn: cfg.subnqn.clone(),
            hostnqn: format!("nqn.2014-08.org.nvmexpress:uuid:{}", uuid_text(&hostid)),
        };
        connect.cntlid = admin.connect_queue(0, ADMIN_SQSIZE, cfg.kato_ms, &connect)?;
        let cap = admin.property_get(2, fabrics::property::CAP, true)?;
        let mqes = (cap & 0xffff) as u16;
        let ready_within = Duration::from_millis(((cap >> 24) & 0xff).max(2) * 500);
        let enable = cc::EN
            | (fabrics::SQES_LOG2 << cc::IOSQES_SHIFT)
            | (fabrics::CQES_LOG2 << cc::IOCQES_SHIFT);
        admin.property_set(3, fabrics::property::CC, enable)?;
        let started = Instant::now();
        loop {
            let status = admin.property_get(4, fabrics::property::CSTS, false)? as u32;
            if status & csts::CFS != 0 {
                return Err(io::Error::other("the controller reports a fatal status"));
            }
            if status & csts::RDY != 0 {
                break;
            }
            if started.elapsed() > ready_within {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the controller did not become ready",
                ));
            }
            std::thread::sleep(READY_POLL);
        }
        let ctrl = admin.identify(5, fabrics::cns::CONTROLLER, 0)?;
        let mdts = ctrl[77];
        let transfer_bytes_max = if mdts == 0 {
            TRANSFER_BYTES_UNLIMITED
        } else {
            4096u32
                .checked_shl(u32::from(mdts))
                .unwrap_or(TRANSFER_BYTES_UNLIMITED)
                .min(TRANSFER_BYTES_UNLIMITED)
        };
        let maxcmd = u16_at(&ctrl, 514);
        let oncs = u16_at(&ctrl, 520);
        let in_capsule_bytes = (u32_at(&ctrl, 1792) * 16).saturating_sub(64);
        let n = u32::from(IO_QUEUES_WANTED - 1);
        let dw0 = admin.set_features(6, fabrics::feature::NUMBER_OF_QUEUES, n | n << 16)?;
        let granted = (dw0 & 0xffff).min(dw0 >> 16) + 1;
        let ns = admin.identify(7, fabrics::cns::NAMESPACE, cfg.nsid)?;
        let blocks = u64::from_le_bytes(ns[..8].try_into().expect("8 bytes"));
        let format = usize::from(ns[26] & 0xf);
        let lbads = ns[128 + 4 * format + 2];
        if blocks == 0 || !(9..=12).contains(&lbads) {
            return Err(protocol_error(format!(
                "namespace {} is not active, or its block size (2^{lbads}) is not 512 to 4096 \
                 bytes",
                cfg.nsid
            )));
        }
        let lba_size_bytes = 1u32 << lbads;
        let mut sqsize_max = mqes;
        if maxcmd > 1 {
            sqsize_max = sqsize_max.min(maxcmd - 1);
        }
        let period = (cfg.kato_ms > 0).then(|| Duration::from_millis(u64::from(cfg.kato_ms) / 3));
        let keep_alive = Some(keep_alive(admin, period)?);
        Ok(NvmeTcpController {
            cfg: cfg.clone(),
            addr,
            connect,
            ns: NamespaceInfo {
                nsid: cfg.nsid,
                lba_size_bytes,
                capacity_lbas: blocks,
                transfer_bytes_max: transfer_bytes_max.max(lba_size_bytes),
            },
            oncs,
            in_capsule_bytes,
            sqsize_max: sqsize_max.max(1),
            queues: Arc::new(QueueIds {
                used: Mutex::new(vec![false; granted as usize]),
            }),
            keep_alive,
        })
    }

    /// The queue pair itself (not boxed), for tests that look at it.
    pub fn queue_pair(&self, depth: usize) -> Result<NvmeTcpQueuePair, QueuePairError> {
        if depth == 0 || depth > QUEUE_DEPTH_MAX {
            return Err(QueuePairError::BadDepth {
                depth,
                max: QUEUE_DEPTH_MAX,
            });
        }
        let max = self.queues.used.lock().map_or(0, |u| u.len());
        let qid = self
            .queues
            .take()
            .ok_or(QueuePairError::NoQueuesLeft { max })?;
        // The queue holds one entry more than the commands it may have in flight.
        let depth = depth.min(usize::from(self.sqsize_max));
        let opened = Wire::connect(self.addr, self.cfg.digests, self.ns.transfer_bytes_max)
            .and_then(|mut wire| {
                wire.connect_queue(qid, depth as u16, 0, &self.connect)?;
                NvmeTcpQueuePair::new(
                    wire,
                    depth,
                    self.ns,
                    self.in_capsule_bytes,
                    qid,
                    self.queues.clone(),
                )
            });
        opened.map_err(|e| {
            self.queues.release(qid);
            QueuePairError::Os(e)
        })
    }
}

/// Starts the thread that holds the admin queue open, sending a Keep Alive on it every
/// `period` (if any), until told to stop (or its sender drops); then it closes the admin
/// queue, which ends the controller at the target.
fn keep_alive(
    mut admin: Wire,
    period: Option<Duration>,
) -> io::Result<(mpsc::Sender<()>, JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("nvme-tcp-keepalive".into())
        .spawn(move || {
            let Some(period) = period else {
                let _ = rx.recv();
                return;
            };
            let mut cid = 100u16;
            while let Err(RecvTimeoutError::Timeout) = rx.recv_timeout(period) {
                cid = cid.wrapping_add(1);
                if let Err(e) = admin.keep_alive(cid) {
                    tracing::warn!("nvme-tcp: keep-alive failed, the controller will end: {e}");
                    break;
                }
            }
        })?;
    Ok((tx, thread))
}

impl Drop for NvmeTcpController {
    fn drop(&mut self) {
        if let Some((tx, thread)) = self.keep_alive.take() {
            drop(tx);
            let _ = thread.join();
        }
    }
}

impl Controller for NvmeTcpController {
    fn describe(&self) -> String {
        self.cfg.to_string()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.ns
    }

    fn create_queue_pair(&self, depth: usize) -> Result<Box<dyn QueuePair>, QueuePairError> {
        Ok(Box::new(self.queue_pair(depth)?))
    }

    fn supports(&self, opcode: Opcode) -> bool {
        match opcode {
            Opcode::DatasetManagement => self.oncs & ONCS_DSM != 0,
            Opcode::WriteZeroes => self.oncs & ONCS_WRITE_ZEROES != 0,
            Opcode::Read | Opcode::Write | Opcode::Flush => true,
        }
    }
}
