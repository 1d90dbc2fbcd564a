//! Memory the application owns: regions it registers with an attached device (DMA-mapped on
//! vfio, fixed buffers on uring, used in place on emu and null), and vectored I/O whose
//! segments point into them. A region cannot be unregistered while an I/O into it is in
//! flight (the queue pair refuses), so a vectored I/O needs no buffer of its own in its slot:
//! its memory stays valid because its region stays registered.
//!
//! Vectored I/Os do not wait for a slot: their segment list is the caller's, read only
//! while the command is submitted, and a wait queue would have to copy it. A full queue
//! pair (or one with I/Os already waiting, which go first) refuses them as back-pressure.

use std::io::{IoSlice, IoSliceMut};

use hypoll_nvme::{Command, MemoryRegion, SubmitError, SEGMENTS_MAX};

use super::Reactor;
use crate::io::{
    DeviceId, IoDone, IoOp, IoRequest, RegionSlice, RegionUseError, RejectReason, Rejected,
};

impl<S> Reactor<S> {
    /// Registers `len_bytes` at `ptr` with `device`'s queue pair on this reactor, so that
    /// vectored I/Os ([`Reactor::readv`], [`Reactor::writev`]) may point into it. The
    /// device's own rules apply (alignment, size, how many regions: see
    /// [`hypoll_nvme::RegisterError`]).
    ///
    /// # Safety
    /// The memory must stay valid (allocated, not unmapped) until
    /// [`Reactor::unregister_memory`] returns `Ok` for it or the reactor is dropped. While a
    /// read into part of it is in flight, nobody else may read or write that part; while a
    /// write from part of it is in flight, nobody may write that part. (A reactor's state is
    /// dropped after the reactor, so memory the state owns outlives the registration.)
    pub unsafe fn register_memory(
        &mut self,
        device: DeviceId,
        ptr: *mut u8,
        len_bytes: usize,
    ) -> Result<MemoryRegion, RegionUseError> {
        let dev = self
            .devices
            .get_mut(device.0 as usize)
            .ok_or(RegionUseError::UnknownDevice)?;
        // SAFETY: our caller keeps the queue pair's contract (the same as ours).
        let region = unsafe { dev.qp.register_memory(ptr, len_bytes) }?;
        debug_assert!(dev.regions[region.index()].is_none(), "index taken twice");
        dev.regions[region.index()] = Some(region);
        Ok(region)
    }

    /// Unregisters `region` from `device`. Refused while an I/O into it is in flight: the
    /// region stays registered; try again once its completions have run.
    pub fn unregister_memory(
        &mut self,
        device: DeviceId,
        region: MemoryRegion,
    ) -> Result<(), RegionUseError> {
        let dev = self
            .devices
            .get_mut(device.0 as usize)
            .ok_or(RegionUseError::UnknownDevice)?;
        dev.qp.unregister_memory(region)?;
        if let Some(at) = dev.regions.get_mut(region.index()) {
            debug_assert_eq!(*at, Some(region), "the queue pair knew it, so did we");
            *at = None;
        }
        Ok(())
    }

    /// Reads `nlb` blocks from block `slba` into `segs`, filled in order, each a range of a
    /// region registered with `device`. At most [`SEGMENTS_MAX`] segments, together exactly
    /// `nlb` blocks; a segment outside its region, of a region not registered here, or
    /// against the device's alignment rules is refused. The completion's `buf` is `None`:
    /// the data is in the region.
    pub fn readv<F>(
        &mut self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
        segs: &[RegionSlice],
        callback: F,
    ) -> Result<(), Rejected<F>>
    where
        F: FnOnce(&mut Reactor<S>, &mut S, IoDone) + 'static,
    {
        let req = IoRequest::new(IoOp::Read, slba, nlb);
        self.submit_vectored(device, req, segs, callback)
    }

    /// Writes `nlb` blocks at block `slba` from `segs`, taken in order; the rules of
    /// [`Reactor::readv`] apply.
    pub fn writev<F>(
        &mut self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
        segs: &[RegionSlice],
        callback: F,
    ) -> Result<(), Rejected<F>>
    where
        F: FnOnce(&mut Reactor<S>, &mut S, IoDone) + 'static,
    {
        let req = IoRequest::new(IoOp::Write, slba, nlb);
        self.submit_vectored(device, req, segs, callback)
    }

    /// Submits a vectored read or write (`req.op`) over `segs`; `req`'s other fields (FUA,
    /// `user`) are kept. A refusal hands back the request and the callback; the segments
    /// are still the caller's.
    pub fn submit_vectored<F>(
        &mut self,
        device: DeviceId,
        req: IoRequest,
        segs: &[RegionSlice],
        callback: F,
    ) -> Result<(), Rejected<F>>
    where
        F: FnOnce(&mut Reactor<S>, &mut S, IoDone) + 'static,
    {
        let refuse = |reason, callback| {
            Err(Rejected {
                reason,
                device,
                req,
                buf: None,
                callback,
            })
        };
        if let Err(reason) = self.check_vectored(device, &req, segs) {
            return refuse(reason, callback);
        }
        let d = device.0 as usize;
        let dev = &mut self.devices[d];
        let key = self.slots.vacant_key();
        // One pass over the segments: each must be of a region registered here (a stale
        // handle, or another device's, is refused), and its bit goes into the mask the queue
        // pair is handed, so that it need not look the segments up again by address.
        // Each segment lies inside its region (`RegionSlice` is built so), whose memory the
        // registration's contract keeps valid until it is unregistered, which the queue pair
        // refuses while this command is outstanding. The slices live only for this call: the
        // queue pair reads the list during `submit_in_regions` and keeps its own copy, and
        // the list is emptied before it returns.
        let mut regions = 0u64;
        let mut unregistered = None;
        let submitted = match req.op {
            IoOp::Read => {
                let mut list = std::mem::take(&mut self.read_segments);
                for (index, s) in segs.iter().enumerate() {
                    if !registered(&dev.regions, s) {
                        unregistered = Some(index);
                        break;
                    }
                    regions |= 1 << s.region().index();
                    // SAFETY: see above; a read's region is the device's alone meanwhile
                    // (the registration's contract).
                    let bytes = unsafe { std::slice::from_raw_parts_mut(s.ptr(), s.len()) };
                    list.push(IoSliceMut::new(bytes));
                }
                let submitted = match unregistered {
                    Some(_) => Ok(()),
                    None => {
                        let cmd = Command::readv(req.slba, req.nlb, &mut list).with_fua(req.fua);
                        // SAFETY: the memory stays valid until the completion (see above),
                        // and `regions` holds the region of every segment and no other.
                        unsafe { dev.qp.submit_in_regions(&cmd, key as u64, regions) }
                    }
                };
                list.clear();
                self.read_segments = list;
                submitted
            }
            _ => {
                let mut list = std::mem::take(&mut self.write_segments);
                for (index, s) in segs.iter().enumerate() {
                    if !registered(&dev.regions, s) {
                        unregistered = Some(index);
                        break;
                    }
                    regions |= 1 << s.region().index();
                    // SAFETY: see above.
                    let bytes = unsafe { std::slice::from_raw_parts(s.ptr(), s.len()) };
                    list.push(IoSlice::new(bytes));
                }
                let submitted = match unregistered {
                    Some(_) => Ok(()),
                    None => {
                        let cmd = Command::writev(req.slba, req.nlb, &list).with_fua(req.fua);
                        // SAFETY: as for a read.
                        unsafe { dev.qp.submit_in_regions(&cmd, key as u64, regions) }
                    }
                };
                list.clear();
                self.write_segments = list;
                submitted
            }
        };
        if let Some(segment) = unregistered {
            return refuse(RejectReason::Unregistered { segment }, callback);
        }
        if let Err(e) = submitted {
            let reason = match e {
                SubmitError::QueueFull { depth } => self.full(d, depth),
                e => RejectReason::Submit(e),
            };
            return refuse(reason, callback);
        }
        self.record(d, req, None, Box::new(callback), self.now_ns, key);
        Ok(())
    }

    /// Why a vectored I/O cannot be submitted now, before its segments are looked at
    /// (`submit_vectored` checks each segment's region as it lists them).
    fn check_vectored(
        &self,
        device: DeviceId,
        req: &IoRequest,
        segs: &[RegionSlice],
    ) -> Result<(), RejectReason> {
        if self.stopping {
            return Err(RejectReason::ShuttingDown);
        }
        let dev = self
            .devices
            .get(device.0 as usize)
            .ok_or(RejectReason::UnknownDevice)?;
        if !matches!(req.op, IoOp::Read | IoOp::Write) {
            return Err(RejectReason::Buffer);
        }
        if segs.is_empty() || segs.len() > SEGMENTS_MAX {
            return Err(RejectReason::Segments {
                count: segs.len(),
                max: SEGMENTS_MAX,
            });
        }
        if !dev.waiting.is_empty() {
            // Those waiting go first; a vectored I/O does not wait behind them. (An
            // unregistered segment is refused first: only the list's pass finds it.)
            if let Some(segment) = segs.iter().position(|s| !registered(&dev.regions, s)) {
                return Err(RejectReason::Unregistered { segment });
            }
            return Err(self.full(device.0 as usize, dev.qp.depth()));
        }
        Ok(())
    }
}

/// Whether `s`'s region is registered with the queue pair whose regions, by table index,
/// are `regions`: the same handle (a stale one, or one of another queue pair that happens
/// to share its index, differs in identity or place).
#[inline]
fn registered(regions: &[Option<MemoryRegion>], s: &RegionSlice) -> bool {
    let region = s.region();
    regions.get(region.index()) == Some(&Some(region))
}

#[cfg(test)]
mod tests;
