//! Core lists as users write them (`0,1`, `0-3`, `0,2-3`), checked against the cores the
//! process may use.

use std::fmt;

/// Highest core number accepted in a list.
pub const CORE_MAX: usize = 4095;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    #[error("bad core list {list:?}: {why} (expected e.g. 0,1 or 0-3 or 0,2-3)")]
    BadList { list: String, why: String },
    #[error(
        "core {core} is not in this process's allowed set {allowed} (cgroup cpuset or taskset)"
    )]
    NotAllowed { core: usize, allowed: CoreList },
    #[error("reading the process's allowed cores: {0}")]
    Os(String),
}

/// An ordered list of distinct cores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoreList(Vec<usize>);

impl CoreList {
    pub fn new(mut cores: Vec<usize>) -> CoreList {
        cores.sort_unstable();
        cores.dedup();
        CoreList(cores)
    }

    /// Parses `0,1`, `0-3`, `0,2-3`.
    pub fn parse(list: &str) -> Result<CoreList, CoreError> {
        let bad = |why: String| CoreError::BadList {
            list: list.to_string(),
            why,
        };
        let number = |s: &str| -> Result<usize, CoreError> {
            let n: usize = s
                .trim()
                .parse()
                .map_err(|_| bad(format!("{s:?} is not a core number")))?;
            if n > CORE_MAX {
                return Err(bad(format!("core {n} is above {CORE_MAX}")));
            }
            Ok(n)
        };
        let mut cores = Vec::new();
        for part in list.split(',') {
            match part.split_once('-') {
                Some((lo, hi)) => {
                    let (lo, hi) = (number(lo)?, number(hi)?);
                    if lo > hi {
                        return Err(bad(format!("range {lo}-{hi} runs backwards")));
                    }
                    cores.extend(lo..=hi);
                }
                None => cores.push(number(part)?),
            }
        }
        Ok(CoreList::new(cores))
    }

    /// Every core the process may use.
    pub fn allowed() -> Result<CoreList, CoreError> {
        crate::sys::allowed_cores()
            .map(CoreList::new)
            .map_err(|e| CoreError::Os(e.to_string()))
    }

    /// Fails with the first core of `self` outside `allowed`.
    pub fn check_within(&self, allowed: &CoreList) -> Result<(), CoreError> {
        match self.0.iter().find(|c| !allowed.0.contains(c)) {
            Some(&core) => Err(CoreError::NotAllowed {
                core,
                allowed: allowed.clone(),
            }),
            None => Ok(()),
        }
    }

    pub fn as_slice(&self) -> &[usize] {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Prints in the compact form the parser reads: `0-3,6`.
impl fmt::Display for CoreList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut i = 0;
        let mut first = true;
        while i < self.0.len() {
            let start = self.0[i];
            let mut end = start;
            while i + 1 < self.0.len() && self.0[i + 1] == end + 1 {
                i += 1;
                end += 1;
            }
            if !first {
                write!(f, ",")?;
            }
            first = false;
            if start == end {
                write!(f, "{start}")?;
            } else {
                write!(f, "{start}-{end}")?;
            }
            i += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_and_ranges_parse_and_print_back() {
        assert_eq!(CoreList::parse("0,1").unwrap().as_slice(), &[0, 1]);
        assert_eq!(CoreList::parse("0-3").unwrap().as_slice(), &[0, 1, 2, 3]);
        assert_eq!(
            CoreList::parse("5, 0,2-3,2").unwrap().as_slice(),
            &[0, 2, 3, 5]
        );
        assert_eq!(CoreList::parse("0,2-3,5").unwrap().to_string(), "0,2-3,5");
        assert_eq!(CoreList::new(vec![0, 1, 2, 3, 6]).to_string(), "0-3,6");
    }

    #[test]
    fn bad_lists_say_what_is_wrong() {
        for (list, says) in [
            ("", "not a core number"),
            ("a", "not a core number"),
            ("3-1", "backwards"),
            ("0-", "not a core number"),
            ("99999", "above"),
        ] {
            let e = CoreList::parse(list).unwrap_err().to_string();
            assert!(e.contains(says), "{list:?}: {e}");
        }
    }

    #[test]
    fn a_core_outside_the_allowed_set_names_both() {
        let allowed = CoreList::parse("0-1").unwrap();
        let e = CoreList::parse("1,7")
            .unwrap()
            .check_within(&allowed)
            .unwrap_err();
        assert_eq!(
            e,
            CoreError::NotAllowed {
                core: 7,
                allowed: allowed.clone()
            }
        );
        let text = e.to_string();
        assert!(text.contains("core 7") && text.contains("0-1"), "{text}");
        CoreList::parse("0")
            .unwrap()
            .check_within(&allowed)
            .unwrap();
    }
}
