//! A reactor's share of the vhost-user back end: the exports' devices attached on it, the
//! guests' memory registered with them ([`Space`]), an inbox per ring it owns (completions
//! land there: an I/O callback is handed the state, not the ring's poller), and the control
//! connections it serves. The state type of a reactor that serves vhost-user-blk holds a
//! [`VhostShard`] and says where ([`VhostState`]), so the back end can share reactors with
//! other front ends.

use std::sync::Arc;

use hypoll_reactor::{Device, DeviceId, InitError, IoDone, PollerId, Reactor};
use slab::Slab;

use crate::blk::Geometry;
use crate::conn::ControlConn;
use crate::memory::Space;
use crate::ring::{RingStart, Vring};

/// A reactor's state that holds a [`VhostShard`].
pub trait VhostState: Sized + 'static {
    fn vhost(&mut self) -> &mut VhostShard<Self>;
}

/// One export as a reactor sees it: its device there, what the guest is shown.
#[derive(Clone, Debug)]
pub struct ShardExport {
    pub name: String,
    pub device: DeviceId,
    pub geometry: Geometry,
}

/// What one ring owned by this reactor is told from outside its poller.
pub(crate) struct Inbox {
    /// Completed requests: (slot, succeeded). At most the queue's size: one per request in
    /// flight.
    pub done: Vec<(u16, bool)>,
    pub poller: Option<PollerId>,
}

/// A reactor's share of the back end.
pub struct VhostShard<S: VhostState> {
    pub(crate) exports: Vec<ShardExport>,
    pub(crate) inboxes: Slab<Inbox>,
    pub(crate) spaces: Slab<Space>,
    /// Spaces whose rings are gone, waiting for their I/O to let go of the registrations.
    pub(crate) leaving: Vec<Space>,
    pub(crate) controls: Slab<ControlConn<S>>,
    /// The server is stopping (`drain`): no new front end is served.
    pub(crate) draining: bool,
}

impl<S: VhostState> VhostShard<S> {
    /// Attaches each export's device on `r` with a queue pair of `depth`: `exports` are
    /// (name, device, geometry), the same on every reactor.
    pub fn new(
        r: &mut Reactor<S>,
        exports: &[(String, Device, Geometry)],
        depth: usize,
    ) -> Result<VhostShard<S>, InitError> {
        let mut attached = Vec::with_capacity(exports.len());
        for (name, device, geometry) in exports {
            let id = r.attach(device, depth)?;
            attached.push(ShardExport {
                name: name.clone(),
                device: id,
                geometry: *geometry,
            });
        }
        Ok(VhostShard::with_devices(attached))
    }

    /// A shard for exports whose devices are attached on this reactor already (by the
    /// server that shares the reactor with other front ends: one queue pair per device
    /// per reactor, whoever's requests it carries).
    pub fn with_devices(exports: Vec<ShardExport>) -> VhostShard<S> {
        VhostShard {
            exports,
            inboxes: Slab::new(),
            spaces: Slab::new(),
            leaving: Vec::new(),
            controls: Slab::new(),
            draining: false,
        }
    }

    /// Rings this reactor owns now.
    pub fn rings(&self) -> usize {
        self.inboxes.len()
    }

    /// Starts a ring on this reactor (a control connection's message).
    pub(crate) fn start_ring(&mut self, r: &mut Reactor<S>, start: RingStart) {
        let Some(export) = self.exports.get(start.export).cloned() else {
            tracing::error!(
                export = start.export,
                "a ring for an export this reactor lacks"
            );
            start.shared.fail();
            return;
        };
        let space = match self
            .spaces
            .iter()
            .find(|(_, s)| Arc::ptr_eq(&s.conn, &start.conn) && s.device == export.device)
        {
            Some((key, _)) => key,
            None => self
                .spaces
                .insert(Space::new(start.conn.clone(), export.device)),
        };
        self.spaces[space].rings += 1;
        let inbox = self.inboxes.insert(Inbox {
            done: Vec::with_capacity(usize::from(start.queue_size)),
            poller: None,
        });
        let ring = Vring::<S>::new(start, inbox, space, export);
        match r.add_poller(Box::new(ring)) {
            Ok(id) => self.inboxes[inbox].poller = Some(id),
            Err(e) => {
                tracing::error!("watching a ring's kick eventfd failed: {e}");
                self.inboxes.remove(inbox);
                self.drop_ring_space(r, space);
            }
        }
    }

    /// A ring that stopped lets go of its inbox and its share of the space.
    pub(crate) fn end_ring(&mut self, r: &mut Reactor<S>, inbox: usize, space: usize) {
        if let Some(Inbox {
            poller: Some(id), ..
        }) = self.inboxes.try_remove(inbox)
        {
            r.remove_poller(id);
        }
        self.drop_ring_space(r, space);
    }

    fn drop_ring_space(&mut self, r: &mut Reactor<S>, space: usize) {
        let Some(s) = self.spaces.get_mut(space) else {
            return;
        };
        s.rings -= 1;
        if s.rings == 0 {
            let mut s = self.spaces.remove(space);
            if !s.release(r) {
                self.leaving.push(s);
            }
        }
        self.leaving.retain_mut(|s| !s.release(r));
    }

    /// The inbox of ring `inbox` and the space `space`, for a ring's poll.
    pub(crate) fn ring_parts(&mut self, inbox: usize, space: usize) -> (&mut Inbox, &mut Space) {
        (&mut self.inboxes[inbox], &mut self.spaces[space])
    }
}

/// Packs a ring's inbox key and a request's slot into an I/O's `user` number.
pub(crate) fn user(inbox: usize, slot: u16) -> u64 {
    (inbox as u64) << 16 | u64::from(slot)
}

/// An I/O of a ring completed: its slot goes to the ring's inbox; the ring's poller writes
/// the status and pushes the used ring on its next poll (the same turn's completions
/// together: one used-index update and at most one notification for the batch).
pub(crate) fn completed<S: VhostState>(_r: &mut Reactor<S>, state: &mut S, done: IoDone) {
    let inbox = (done.user >> 16) as usize;
    let slot = done.user as u16;
    if let Some(inbox) = state.vhost().inboxes.get_mut(inbox) {
        // Bounded: one entry per request in flight, at most the queue's size, reserved.
        debug_assert!(inbox.done.len() < inbox.done.capacity());
        inbox.done.push((slot, done.result.is_ok()));
    }
}
