//! Physical Region Page entries (NVMe Base spec, "Physical Region Page Entry and List"):
//! how a command names the pages of its data buffer. PRP1 points at the first byte (any
//! dword-aligned offset in its page); PRP2 is the second page when the transfer touches
//! exactly two pages, otherwise the address of a PRP list holding every page after the
//! first. The driver never chains lists: a list lives inside one page. Pure arithmetic on IOVAs, so it is tested on the host.

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
