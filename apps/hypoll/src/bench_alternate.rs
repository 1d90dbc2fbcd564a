//! `hypoll bench --alternate`: one run of two policies taking turns (see `alternate`),
//! reported as two runs, one per policy, and their comparison segment by segment.

use std::time::Duration;

use hypoll_reactor::PolicyFactory;

use crate::alternate::{self, Alternating, Paired};
use crate::bench::{run, RunResult, Workload};

/// Two policies' run under `--alternate`: each side as a run of its own, and the two
/// compared segment by segment.
pub struct Alternated {
    pub sides: [RunResult; 2],
    pub paired: Option<Paired>,
}

/// Runs `work` with `specs` taking turns every `segment` on each reactor, on a fresh device
/// and reactor set.
pub fn run_alternating(
    work: &Workload,
    specs: &[String; 2],
    segment: Duration,
) -> Result<Alternated, String> {
    let built = specs.clone();
    let factory = PolicyFactory::new(move |_| {
        let build = |spec: &str| {
            hypoll_policy::build(spec).expect("--policy specs are checked when parsed")
        };
        Box::new(Alternating::new(
            [build(&built[0]), build(&built[1])],
            segment,
        ))
    });
    let work = Workload {
        alternate: Some(segment),
        ..work.clone()
    };
    let label = format!("{}|{}", specs[0], specs[1]);
    let (total, tallies) = run(&work, &label, Some(factory))?;
    let reactors = tallies.len();
    let segment_ns = u64::try_from(segment.as_nanos()).unwrap_or(u64::MAX);
    let mut names = specs.clone();
    if names[0] == names[1] {
        names[1] = format!("{} (twin)", names[1]);
    }
    let mut segments = Vec::new();
    let mut sides = names.map(|policy| RunResult::empty(policy, total.cores));
    for tally in tallies {
        for (side, got) in sides.iter_mut().zip(&tally.sides) {
            // A side's turns interleave with the other's on every reactor: its wall time is
            // the reactors' mean.
            side.add_counts(got);
            side.wall_ns += got.wall_ns / reactors as u64;
        }
        segments.extend(tally.segments);
    }
    // A verify pass's mismatches are the device's, not a side's: the first carries them,
    // so that a sum over the rows counts each once.
    sides[0].mismatches = total.mismatches;
    let segments = alternate::merge(segments);
    Ok(Alternated {
        sides,
        paired: alternate::paired(&segments, segment_ns, reactors),
    })
}
