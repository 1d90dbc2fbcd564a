//! The state all connections to one target share: its configuration, which namespaces are
//! ready, and the controller registry (controller IDs, who holds each, which I/O queues it
//! has). Only Connect and a connection's end take the registry's lock; a queue's I/O path
//! reads one atomic flag of its controller (whether it is still alive) and nothing else.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use hypoll_nvme::fabrics::{CONNECT_DATA_CNTLID_OFFSET, CONNECT_DATA_HOSTID_OFFSET};
use hypoll_nvme::fabrics::{CONNECT_DATA_HOSTNQN_OFFSET, CONNECT_QID_OFFSET};

use crate::config::{ConfigError, TargetConfig};

/// What one controller's queues share, without a lock: the admin queue's session writes it,
/// its I/O queues' sessions read it.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) cntlid: u16,
    /// Cleared when the controller ends (its admin queue closed, reset it or missed its
    /// keep-alive): its I/O queues then close.
    live: AtomicBool,
    /// CSTS.RDY: I/O queues may connect.
    ready: AtomicBool,
}

impl Link {
    fn new(cntlid: u16) -> Arc<Link> {
        Arc::new(Link {
            cntlid,
            live: AtomicBool::new(true),
            ready: AtomicBool::new(false),
        })
    }

    pub(crate) fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    pub(crate) fn end(&self) {
        self.live.store(false, Ordering::Release);
    }

    pub(crate) fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }
}

/// One controller in the registry.
struct Record {
    hostnqn: String,
    hostid: [u8; 16],
    discovery: bool,
    link: Arc<Link>,
    /// I/O queues Set Features (Number of Queues) granted; until then, all the limit allows.
    io_queues_granted: u16,
    /// Queue IDs of the I/O queues connected.
    io_queues: Vec<u16>,
}

/// Why a Connect is refused, for its status and DW0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No controller ID is free.
    Busy,
    /// A parameter at `offset` (in the command, or in its data).
    InvalidParameter { offset: u16, in_data: bool },
    /// The I/O queue names a controller that is not enabled yet.
    NotReady,
}

/// Why Set Features (Number of Queues) is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QueuesInUse;

/// A target: what every connection to it shares.
#[derive(Debug)]
pub struct Target {
    config: TargetConfig,
    /// The optional NVM commands the namespaces' devices allow (Identify's ONCS).
    oncs: u16,
    namespace_ready: Box<[AtomicBool]>,
    registry: Mutex<Registry>,
}

#[derive(Debug, Default)]
struct Registry {
    /// Slot `i` holds controller ID `i + 1`.
    slots: Vec<Option<RecordBox>>,
}

/// A record behind a box, so `Registry` stays `Debug` without printing host identities.
struct RecordBox(Box<Record>);

impl std::fmt::Debug for RecordBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "controller {}", self.0.link.cntlid)
    }
}

impl Target {
    pub fn new(config: TargetConfig) -> Result<Arc<Target>, ConfigError> {
        config.check()?;
        let namespace_ready = config
            .namespaces
            .iter()
            .map(|_| AtomicBool::new(true))
            .collect();
        Ok(Arc::new(Target {
            oncs: crate::identify::oncs(&config),
            config,
            namespace_ready,
            registry: Mutex::new(Registry::default()),
        }))
    }

    pub fn config(&self) -> &TargetConfig {
        &self.config
    }

    pub(crate) fn oncs(&self) -> u16 {
        self.oncs
    }

    pub fn subsystem_nqn(&self) -> &str {
        &self.config.subsystem_nqn
    }

    /// Marks a namespace (1-based ID) ready or not: I/O to one not ready is answered
    /// Namespace Not Ready (its device is gone or recovering).
    pub fn set_namespace_ready(&self, nsid: u32, ready: bool) {
        if let Some(r) = self.namespace_ready.get((nsid as usize).wrapping_sub(1)) {
            r.store(ready, Ordering::Release);
        }
    }

    pub(crate) fn namespace_ready(&self, index: usize) -> bool {
        self.namespace_ready[index].load(Ordering::Acquire)
    }

    /// Controllers alive now.
    pub fn controllers(&self) -> usize {
        self.lock().slots.iter().flatten().count()
    }

    /// I/O queues connected to controller `cntlid` now.
    pub fn io_queues(&self, cntlid: u16) -> usize {
        self.lock().find(cntlid).map_or(0, |r| r.io_queues.len())
    }

    fn lock(&self) -> MutexGuard<'_, Registry> {
        // A panic elsewhere while holding the lock leaves the registry consistent: every
        // change to it is one assignment.
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An admin queue's Connect: a new controller with the lowest free ID.
    pub(crate) fn connect_admin(
        &self,
        hostnqn: &str,
        hostid: [u8; 16],
        discovery: bool,
    ) -> Result<Arc<Link>, Refusal> {
        let mut reg = self.lock();
        let max = usize::from(self.config.limits.controllers_max);
        let slot = match reg.slots.iter().position(Option::is_none) {
            Some(i) => i,
            None if reg.slots.len() < max => {
                reg.slots.push(None);
                reg.slots.len() - 1
            }
            None => return Err(Refusal::Busy),
        };
        let link = Link::new(slot as u16 + 1);
        reg.slots[slot] = Some(RecordBox(Box::new(Record {
            hostnqn: hostnqn.into(),
            hostid,
            discovery,
            link: link.clone(),
            io_queues_granted: self.config.limits.io_queues_max,
            io_queues: Vec::new(),
        })));
        debug_assert!(reg.slots.len() <= max);
        Ok(link)
    }

    /// An I/O queue's Connect to controller `cntlid` as queue `qid`.
    pub(crate) fn connect_io(
        &self,
        cntlid: u16,
        qid: u16,
        hostnqn: &str,
        hostid: [u8; 16],
    ) -> Result<Arc<Link>, Refusal> {
        let mut reg = self.lock();
        let bad_cntlid = Refusal::InvalidParameter {
            offset: CONNECT_DATA_CNTLID_OFFSET,
            in_data: true,
        };
        let Some(r) = reg.find_mut(cntlid) else {
            return Err(bad_cntlid);
        };
        if !r.link.is_live() || r.discovery {
            return Err(bad_cntlid);
        }
        if r.hostnqn != hostnqn {
            return Err(Refusal::InvalidParameter {
                offset: CONNECT_DATA_HOSTNQN_OFFSET,
                in_data: true,
            });
        }
        if r.hostid != hostid {
            return Err(Refusal::InvalidParameter {
                offset: CONNECT_DATA_HOSTID_OFFSET,
                in_data: true,
            });
        }
        if !r.link.ready.load(Ordering::Acquire) {
            return Err(Refusal::NotReady);
        }
        if qid > r.io_queues_granted || r.io_queues.contains(&qid) {
            return Err(Refusal::InvalidParameter {
                offset: CONNECT_QID_OFFSET,
                in_data: false,
            });
        }
        r.io_queues.push(qid);
        debug_assert!(r.io_queues.len() <= usize::from(r.io_queues_granted));
        Ok(r.link.clone())
    }

    /// Set Features (Number of Queues): grants `count` I/O queues, unless some are
    /// connected already.
    pub(crate) fn grant_io_queues(&self, link: &Link, count: u16) -> Result<(), QueuesInUse> {
        let mut reg = self.lock();
        let Some(r) = reg.find_mut(link.cntlid) else {
            return Err(QueuesInUse);
        };
        if !r.io_queues.is_empty() {
            return Err(QueuesInUse);
        }
        r.io_queues_granted = count.min(self.config.limits.io_queues_max);
        Ok(())
    }

    /// A controller reset (CC.EN cleared): its I/O queues end, and the admin queue goes on
    /// with a fresh link for the queues that connect after it is enabled again.
    pub(crate) fn reset(&self, link: &Arc<Link>) -> Arc<Link> {
        let mut reg = self.lock();
        link.end();
        let fresh = Link::new(link.cntlid);
        if let Some(r) = reg.find_mut(link.cntlid) {
            if Arc::ptr_eq(&r.link, link) {
                r.link = fresh.clone();
                r.io_queues.clear();
                r.io_queues_granted = self.config.limits.io_queues_max;
            }
        }
        fresh
    }

    /// The admin queue's connection ended: so does its controller.
    pub(crate) fn release_admin(&self, link: &Arc<Link>) {
        let mut reg = self.lock();
        link.end();
        let slot = usize::from(link.cntlid) - 1;
        if let Some(Some(r)) = reg.slots.get(slot) {
            if Arc::ptr_eq(&r.0.link, link) {
                reg.slots[slot] = None;
            }
        }
    }

    /// An I/O queue's connection ended.
    pub(crate) fn release_io(&self, link: &Arc<Link>, qid: u16) {
        let mut reg = self.lock();
        if let Some(r) = reg.find_mut(link.cntlid) {
            if Arc::ptr_eq(&r.link, link) {
                r.io_queues.retain(|&q| q != qid);
            }
        }
    }
}

impl Registry {
    fn find(&self, cntlid: u16) -> Option<&Record> {
        let slot = usize::from(cntlid).checked_sub(1)?;
        self.slots.get(slot)?.as_ref().map(|b| &*b.0)
    }

    fn find_mut(&mut self, cntlid: u16) -> Option<&mut Record> {
        let slot = usize::from(cntlid).checked_sub(1)?;
        self.slots.get_mut(slot)?.as_mut().map(|b| &mut *b.0)
    }
}
