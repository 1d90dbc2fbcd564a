//! What a VFIO queue pair does with memory beyond its pinned pool: vectored commands' PRP
//! lists (straight to the segments, or through bounce pages piece by piece) and regions the
//! application registered, each mapped for the device at an IOVA range of its own.

use super::*;

impl VfioQueuePair {
    /// PRP1 and PRP2 of a vectored Read or Write, whose segments meet the PRP rules (checked
    /// by `submit`), with the slot's list written where more than two pages need it: straight
    /// to the segments when every one lies in the pinned pool, else through bounce pages
    /// (a write's data copied in now, a read's segments kept for the copy out).
    pub(super) fn vectored_prps(
        &mut self,
        cid: u16,
        slot: &mut Slot,
        opcode: Opcode,
        segs: &[Segment],
        data_bytes: usize,
    ) -> Result<(u64, u64), SubmitError> {
        // One page more than a transfer's: the first segment may start inside a page.
        let mut iovas = [0u64; PAGES_PER_COMMAND_MAX + 1];
        let mut direct = [(0u64, 0usize); SEGMENTS_MAX];
        let window = self.ctrl.pool.as_ref().ok();
        let all_pinned = segs.iter().zip(direct.iter_mut()).all(|(s, d)| {
            let iova = window
                .and_then(|w| w.iova_of_bytes(s.ptr(), s.len_bytes()))
                .or_else(|| self.region_iova(s.ptr(), s.len_bytes(), false));
            *d = (iova.unwrap_or(0), s.len_bytes());
            iova.is_some()
        });
        let (first_offset, npages) = if all_pinned {
            let pages = prp::segment_pages(&direct[..segs.len()], &mut iovas)
                .expect("segments that meet the PRP rules within MDTS fit a command's pages");
            self.zero_copy_ios += 1;
            pages
        } else {
            let npages = prp::pages_spanned(0, data_bytes);
            if !self.pool.take(&mut slot.pages[..npages]) {
                return Err(SubmitError::QueueFull { depth: self.depth });
            }
            slot.npages = npages as u8;
            for (i, &p) in slot.pages[..npages].iter().enumerate() {
                iovas[i] = self.bounce.iova() + (p as usize * PAGE_BYTES) as u64;
            }
            if opcode == Opcode::Write {
                let bounce = &mut self.bounce;
                for_each_bounce_piece(&slot.pages[..npages], segs, |offset, seg_ptr, n| {
                    // SAFETY: submit's contract keeps the write's segments valid; the pieces
                    // stay inside their segment.
                    let src = unsafe { std::slice::from_raw_parts(seg_ptr.cast_const(), n) };
                    bounce.write_bytes(offset, src);
                });
            } else {
                self.seg_lists[usize::from(cid) * SEGMENTS_MAX..][..segs.len()]
                    .copy_from_slice(segs);
                slot.read_segs = segs.len() as u16;
            }
            (0, npages)
        };
        debug_assert_eq!(npages, prp::pages_spanned(first_offset, data_bytes));
        let list_off = usize::from(cid) * LIST_BYTES_PER_SLOT;
        let mut list = [0u64; PAGES_PER_COMMAND_MAX];
        let prps = prp::build(
            &iovas[..npages],
            first_offset,
            data_bytes,
            &mut list,
            self.lists.iova() + list_off as u64,
        )
        .expect("pages of segments that meet the PRP rules make valid PRPs");
        if npages > 2 {
            for (i, &entry) in list[..npages - 1].iter().enumerate() {
                self.lists.write_volatile(list_off + 8 * i, entry);
            }
        }
        Ok(prps)
    }

    /// The IOVA of `len_bytes` at `ptr` in a registered region's mapping (with
    /// `page_start`, only where they start on a page).
    pub(super) fn region_iova(
        &self,
        ptr: *const u8,
        len_bytes: usize,
        page_start: bool,
    ) -> Option<u64> {
        if self.regions.is_empty() {
            return None;
        }
        let index = self.regions.find(ptr, len_bytes).ok().flatten()?;
        let window = self.windows[index].as_ref()?;
        if page_start {
            window.iova_of(ptr, len_bytes)
        } else {
            window.iova_of_bytes(ptr, len_bytes)
        }
    }

    /// Maps the region into the controller's IOMMU container at an IOVA range of its own
    /// (the kernel pins its pages), so PRPs point straight at it: a read or write whose
    /// buffer starts on a page inside it, or whose segments all lie in mapped memory, moves
    /// no bounce copy. Refused with [`RegisterError::Device`] when the kernel will not pin
    /// it (RLIMIT_MEMLOCK) or the IOVA space is used up.
    ///
    /// # Safety
    ///
    /// As [`crate::QueuePair::register_memory`]: the memory stays mapped at these addresses
    /// until it is unregistered or the queue pair is dropped.
    pub(super) unsafe fn register_region(
        &mut self,
        ptr: *mut u8,
        len_bytes: usize,
    ) -> Result<MemoryRegion, RegisterError> {
        let region = self.regions.add(ptr, len_bytes)?;
        // SAFETY: the caller keeps the memory mapped until it is unregistered (which unmaps
        // the window first) or the queue pair is dropped (whose fields, the windows among
        // them, drop after its queues are deleted).
        match unsafe { PoolWindow::map_memory(&self.ctrl.container, ptr, len_bytes, true) } {
            Ok(window) => {
                self.windows[region.index()] = Some(window);
                Ok(region)
            }
            Err(e) => {
                self.regions.undo(&region);
                Err(RegisterError::Device(e.to_string()))
            }
        }
    }

    pub(super) fn unregister_region(
        &mut self,
        region: MemoryRegion,
    ) -> Result<(), UnregisterError> {
        self.regions.check_remove(&region)?;
        if let Some(window) = self.windows[region.index()].take() {
            if let Err((window, _)) = window.unmap() {
                self.windows[region.index()] = Some(window);
                return Err(UnregisterError::Device("VFIO_IOMMU_UNMAP_DMA failed"));
            }
        }
        self.regions.remove(&region);
        Ok(())
    }
}

/// Calls `f(offset in the bounce region, address in a segment, length)` for each piece of
/// `segs` laid end to end over the bounce `pages`: a piece ends at a page's or a segment's
/// end, whichever comes first.
pub(super) fn for_each_bounce_piece(
    pages: &[u32],
    segs: &[Segment],
    mut f: impl FnMut(usize, *mut u8, usize),
) {
    let mut at = 0usize;
    for seg in segs {
        let mut done = 0;
        while done < seg.len_bytes() {
            let (page, in_page) = (at / PAGE_BYTES, at % PAGE_BYTES);
            let n = (PAGE_BYTES - in_page).min(seg.len_bytes() - done);
            // `wrapping_add` keeps the address arithmetic safe; `f` is handed addresses
            // inside the segment only.
            f(
                pages[page] as usize * PAGE_BYTES + in_page,
                seg.ptr().wrapping_add(done),
                n,
            );
            done += n;
            at += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Segments laid end to end over bounce pages: each piece stays inside one page and one
    /// segment, and together they cover every byte once, in order.
    #[test]
    fn bounce_pieces_follow_both_page_and_segment_boundaries() {
        let mut a = [0u8; 100];
        let mut b = [0u8; 4000];
        let mut c = [0u8; 2000];
        let segs = [
            Segment::from_raw(a.as_mut_ptr(), a.len()),
            Segment::from_raw(b.as_mut_ptr(), b.len()),
            Segment::from_raw(c.as_mut_ptr(), c.len()),
        ];
        let mut pieces = Vec::new();
        for_each_bounce_piece(&[5, 2], &segs, |offset, ptr, n| {
            pieces.push((offset, ptr, n))
        });
        let p = PAGE_BYTES;
        assert_eq!(
            pieces,
            [
                (5 * p, a.as_mut_ptr(), 100),
                (5 * p + 100, b.as_mut_ptr(), 3996),
                (2 * p, b.as_mut_ptr().wrapping_add(3996), 4),
                (2 * p + 4, c.as_mut_ptr(), 2000),
            ]
        );
    }
}
