//! Physical Region Page entries (NVMe Base spec, "Physical Region Page Entry and List"):
//! how a command names the pages of its data buffer. PRP1 points at the first byte (any
//! dword-aligned offset in its page); PRP2 is the second page when the transfer touches
//! exactly two pages, otherwise the address of a PRP list holding every page after the
//! first. The driver never chains lists: a list lives inside one page. Pure arithmetic on IOVAs, so it is tested on the host.
//!
//! A vectored command's segments become one PRP list when they meet the PRP rules
//! ([`check_segments`]): every segment but the first starts on a page, every segment but the
//! last ends on one. [`segment_pages`] lists their pages for [`build`].

use crate::qpair::SegmentError;

/// The memory page size the driver programs into CC.MPS (4 KiB, MPS = 0).
pub const PAGE_BYTES: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrpError {
    #[error("the transfer spans {need} pages but only {have} were given")]
    TooFewPages { need: usize, have: usize },
    #[error("the transfer needs {need} PRP list entries, the list holds {have}")]
    ListTooShort { need: usize, have: usize },
    #[error("PRP offset {0} is not dword-aligned inside a page")]
    BadOffset(usize),
    #[error("page IOVA {0:#x} is not page-aligned")]
    UnalignedPage(u64),
    #[error(
        "a PRP list must not cross a page boundary (list at {list_iova:#x}, {entries} entries)"
    )]
    ListCrossesPage { list_iova: u64, entries: usize },
    #[error(transparent)]
    Segment(#[from] SegmentError),
}

/// Checks the PRP rules on a vectored command's segments, given as (address, length) in
/// order: every segment but the first starts on a page, every segment but the last ends on
/// one (a segment's dword alignment is checked with the command). The rules hold alike for
/// host addresses and IOVAs, which map pages to pages.
pub fn check_segments(
    segs: impl ExactSizeIterator<Item = (u64, usize)>,
) -> Result<(), SegmentError> {
    let last = segs.len().saturating_sub(1);
    for (index, (addr, len_bytes)) in segs.enumerate() {
        if index > 0 && !addr.is_multiple_of(PAGE_BYTES as u64) {
            return Err(SegmentError::StartsInsidePage {
                index,
                addr: addr as usize,
                page_bytes: PAGE_BYTES,
            });
        }
        let end = addr.saturating_add(len_bytes as u64);
        if index < last && !end.is_multiple_of(PAGE_BYTES as u64) {
            return Err(SegmentError::EndsInsidePage {
                index,
                end: end as usize,
                page_bytes: PAGE_BYTES,
            });
        }
    }
    Ok(())
}

/// Lists the pages of segments (IOVA, length) that meet the PRP rules into `pages`, in
/// order, for [`build`]: the page holding the first segment's first byte, then every page
/// of the data after it. Returns the first segment's offset in its page and the page count.
pub fn segment_pages(segs: &[(u64, usize)], pages: &mut [u64]) -> Result<(usize, usize), PrpError> {
    check_segments(segs.iter().copied())?;
    let page = PAGE_BYTES as u64;
    let first_offset = segs.first().map_or(0, |&(iova, _)| (iova % page) as usize);
    let mut count = 0;
    for &(iova, len_bytes) in segs {
        let start = iova - iova % page;
        let spanned = pages_spanned((iova - start) as usize, len_bytes);
        if count + spanned > pages.len() {
            return Err(PrpError::TooFewPages {
                need: count + spanned,
                have: pages.len(),
            });
        }
        for (i, p) in pages[count..count + spanned].iter_mut().enumerate() {
            *p = start + i as u64 * page;
        }
        count += spanned;
    }
    Ok((first_offset, count))
}

/// Pages a transfer of `len_bytes` starting `first_offset` bytes into its first page spans.
pub fn pages_spanned(first_offset: usize, len_bytes: usize) -> usize {
    (first_offset + len_bytes).div_ceil(PAGE_BYTES).max(1)
}

/// Computes (PRP1, PRP2) for a transfer of `len_bytes` over `pages` (page-aligned IOVAs),
/// starting `first_offset` bytes into the first page. When the transfer spans more than
/// two pages, the entries for pages 2.. are written to `list` (which the device reads at
/// `list_iova`) and PRP2 points at it.
pub fn build(
    pages: &[u64],
    first_offset: usize,
    len_bytes: usize,
    list: &mut [u64],
    list_iova: u64,
) -> Result<(u64, u64), PrpError> {
    if first_offset >= PAGE_BYTES || !first_offset.is_multiple_of(4) {
        return Err(PrpError::BadOffset(first_offset));
    }
    let need = pages_spanned(first_offset, len_bytes);
    if pages.len() < need {
        return Err(PrpError::TooFewPages {
            need,
            have: pages.len(),
        });
    }
    if let Some(&bad) = pages[..need].iter().find(|p| *p % PAGE_BYTES as u64 != 0) {
        return Err(PrpError::UnalignedPage(bad));
    }
    let prp1 = pages[0] + first_offset as u64;
    match need {
        1 => Ok((prp1, 0)),
        2 => Ok((prp1, pages[1])),
        _ => {
            let entries = need - 1;
            if list.len() < entries {
                return Err(PrpError::ListTooShort {
                    need: entries,
                    have: list.len(),
                });
            }
            let list_offset = (list_iova % PAGE_BYTES as u64) as usize;
            if list_offset + entries * 8 > PAGE_BYTES || !list_iova.is_multiple_of(8) {
                return Err(PrpError::ListCrossesPage { list_iova, entries });
            }
            list[..entries].copy_from_slice(&pages[1..need]);
            Ok((prp1, list_iova))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = PAGE_BYTES as u64;

    #[test]
    fn one_page_uses_prp1_only() {
        let mut list = [0u64; 4];
        assert_eq!(build(&[5 * P], 0, 4096, &mut list, 0), Ok((5 * P, 0)));
        assert_eq!(
            build(&[5 * P], 512, 512, &mut list, 0),
            Ok((5 * P + 512, 0))
        );
        assert_eq!(list, [0; 4], "no list for one page");
    }

    #[test]
    fn two_pages_put_the_second_in_prp2() {
        let mut list = [0u64; 4];
        assert_eq!(
            build(&[9 * P, 3 * P], 0, 8192, &mut list, 0),
            Ok((9 * P, 3 * P))
        );
        // 4 KiB starting half way into a page spans two pages.
        assert_eq!(
            build(&[9 * P, 3 * P], 2048, 4096, &mut list, 0),
            Ok((9 * P + 2048, 3 * P))
        );
        assert_eq!(list, [0; 4]);
    }

    #[test]
    fn more_pages_go_through_a_list_in_order() {
        let pages = [7 * P, 2 * P, 11 * P, 4 * P];
        let mut list = [0u64; 8];
        let list_iova = 100 * P + 256;
        assert_eq!(
            build(&pages, 0, 4 * PAGE_BYTES, &mut list, list_iova),
            Ok((7 * P, list_iova))
        );
        assert_eq!(&list[..3], &[2 * P, 11 * P, 4 * P]);
        assert_eq!(
            list[3], 0,
            "only the entries the transfer needs are written"
        );
        // 12 KiB from an offset spans four pages too.
        let mut list = [0u64; 8];
        assert_eq!(
            build(&pages, 8, 3 * PAGE_BYTES, &mut list, list_iova),
            Ok((7 * P + 8, list_iova))
        );
        assert_eq!(&list[..3], &[2 * P, 11 * P, 4 * P]);
    }

    #[test]
    fn bad_inputs_are_errors_not_wrong_prps() {
        let mut list = [0u64; 2];
        assert_eq!(
            build(&[P, 2 * P], 0, 3 * PAGE_BYTES, &mut list, 0),
            Err(PrpError::TooFewPages { need: 3, have: 2 })
        );
        assert_eq!(
            build(&[P, 2 * P, 3 * P, 4 * P], 0, 4 * PAGE_BYTES, &mut list, 0),
            Err(PrpError::ListTooShort { need: 3, have: 2 })
        );
        assert_eq!(build(&[P], 3, 8, &mut list, 0), Err(PrpError::BadOffset(3)));
        assert_eq!(
            build(&[P + 8], 0, 8, &mut list, 0),
            Err(PrpError::UnalignedPage(P + 8))
        );
        let mut big = [0u64; 8];
        assert_eq!(
            build(&[P, 2 * P, 3 * P], 0, 3 * PAGE_BYTES, &mut big, 2 * P - 8),
            Err(PrpError::ListCrossesPage {
                list_iova: 2 * P - 8,
                entries: 2
            })
        );
    }

    /// Builds the PRPs of segments (IOVA, length) as the driver does: the pages, then PRP1,
    /// PRP2 and the list.
    fn prps_of(segs: &[(u64, usize)], list: &mut [u64]) -> Result<(u64, u64), PrpError> {
        let mut pages = [0u64; 40];
        let (offset, n) = segment_pages(segs, &mut pages)?;
        let total = segs.iter().map(|s| s.1).sum();
        build(&pages[..n], offset, total, list, 100 * P)
    }

    #[test]
    fn segments_that_meet_the_prp_rules_make_one_list_in_order() {
        let mut list = [0u64; 32];
        // One segment is a plain buffer.
        assert_eq!(
            prps_of(&[(5 * P + 512, 1024)], &mut list),
            Ok((5 * P + 512, 0))
        );
        // The tail of one page, then a whole page elsewhere: two pages, PRP2 the second.
        assert_eq!(
            prps_of(&[(5 * P + 3072, 1024), (9 * P, 4096)], &mut list),
            Ok((5 * P + 3072, 9 * P))
        );
        // A head inside a page, whole pages, and a short tail: a list of every page after
        // the first, in segment order, each page-aligned.
        let segs = [(7 * P + 2048, 2048), (2 * P, 8192), (11 * P, 512)];
        assert_eq!(prps_of(&segs, &mut list), Ok((7 * P + 2048, 100 * P)));
        assert_eq!(&list[..3], &[2 * P, 3 * P, 11 * P]);
        assert_eq!(list[3], 0, "no more entries than pages");
        // A 4 x 1 KiB write that splits a page is refused, naming the segment.
        let quarters = [
            (P, 1024),
            (P + 1024, 1024),
            (P + 2048, 1024),
            (P + 3072, 1024),
        ];
        assert_eq!(
            prps_of(&quarters, &mut list),
            Err(PrpError::Segment(SegmentError::EndsInsidePage {
                index: 0,
                end: (P + 1024) as usize,
                page_bytes: PAGE_BYTES
            }))
        );
    }

    #[test]
    fn segments_that_break_the_prp_rules_are_refused() {
        // Every segment but the first must start on a page.
        assert_eq!(
            check_segments([(P, 4096), (2 * P + 8, 504)].into_iter()),
            Err(SegmentError::StartsInsidePage {
                index: 1,
                addr: (2 * P + 8) as usize,
                page_bytes: PAGE_BYTES
            })
        );
        // Every segment but the last must end on one, the first included.
        assert_eq!(
            check_segments([(P + 512, 1024), (3 * P, 4096)].into_iter()),
            Err(SegmentError::EndsInsidePage {
                index: 0,
                end: (P + 1536) as usize,
                page_bytes: PAGE_BYTES
            })
        );
        assert_eq!(
            check_segments([(P, 4096), (3 * P, 100), (5 * P, 4096)].into_iter()),
            Err(SegmentError::EndsInsidePage {
                index: 1,
                end: (3 * P + 100) as usize,
                page_bytes: PAGE_BYTES
            })
        );
        // The first may start, and the last end, anywhere.
        assert_eq!(
            check_segments([(P + 4000, 96), (3 * P, 4096), (5 * P, 12)].into_iter()),
            Ok(())
        );
        // Too few pages for the segments is an error, not an overrun.
        let mut pages = [0u64; 2];
        assert_eq!(
            segment_pages(&[(P + 2048, 2048), (4 * P, 8192)], &mut pages),
            Err(PrpError::TooFewPages { need: 3, have: 2 })
        );
    }

    #[test]
    fn pages_spanned_counts_partial_pages() {
        assert_eq!(pages_spanned(0, 1), 1);
        assert_eq!(pages_spanned(0, 4096), 1);
        assert_eq!(pages_spanned(0, 4097), 2);
        assert_eq!(pages_spanned(4092, 8), 2);
        assert_eq!(pages_spanned(0, 128 << 10), 32);
        assert_eq!(pages_spanned(0, 0), 1);
    }
}
