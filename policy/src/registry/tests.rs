//! Tests of the registry: every spec builds the policy it names, every bad one says why,
//! and every policy keeps the contracts of the trait.

use super::*;
use crate::policy::{Decision, InFlight, Observation, PollContext};
use crate::stats::{Bucket, BucketStats, OvershootStats, Snapshot, BUCKETS};
use proptest::prelude::*;

fn every_policy() -> Vec<Box<dyn PollPolicy>> {
    [
        "classic",
        "interrupt",
        "hybrid",
        "fixed:5",
        "hybrid-3/4",
        "hybrid-min:adjust=100",
    ]
    .into_iter()
    .chain(["hybrid-min", "uring-hybrid", "adaptive", "oracle"])
    .map(|spec| build(spec).unwrap())
    .collect()
}

fn any_stats() -> impl Strategy<Value = BucketStats> {
    (1u64..1000, 0u64..10_000_000, 0u64..10_000_000).prop_map(|(count, mean_ns, min_ns)| {
        BucketStats {
            count,
            mean_ns,
            min_ns: min_ns.min(mean_ns),
            max_ns: mean_ns * 2,
            p50_ns: mean_ns,
            p90_ns: mean_ns,
            p99_ns: mean_ns,
            window: 1,
        }
    })
}

proptest! {
    /// No policy sleeps twice for one I/O, whatever the statistics and history; and
    /// none sleeps before its bucket has samples.
    #[test]
    fn every_policy_sleeps_at_most_once_and_never_without_samples(
        stats in any_stats(),
        index in 0..BUCKETS,
        latencies_ns in prop::collection::vec(1u64..1_000_000, 0..5),
        now_ns in 0u64..1_000_000_000,
    ) {
        let bucket = Bucket::from_index(index);
        let overshoot = OvershootStats::new();
        let empty = Snapshot::EMPTY;
        let full = Snapshot::EMPTY.with_bucket(bucket.unwrap(), stats);
        let context = |stats, slept| PollContext {
            now_ns,
            outstanding: 1,
            oldest: InFlight { bucket, submit_ns: now_ns / 2, slept },
            stats,
            overshoot: &overshoot,
            interrupts: true,
            oracle_deadline_ns: None,
        };
        for mut policy in every_policy() {
            let fresh = policy.decide(&context(&empty, false));
            prop_assert!(
                !matches!(fresh, Decision::Sleep(_)),
                "{} slept without samples", policy.name()
            );
            for latency_ns in &latencies_ns {
                policy.on_completion(&Observation {
                    bucket,
                    submit_ns: 0,
                    latency_ns: *latency_ns,
                    slept: None,
                    idle_polls: 0,
                    censored: false,
                    after_interrupt: false,
                });
            }
            for stats in [&empty, &full] {
                let again = policy.decide(&context(stats, true));
                prop_assert!(
                    !matches!(again, Decision::Sleep(_)),
                    "{} slept twice: {:?}", policy.name(), again
                );
            }
        }
    }
}

#[test]
fn builds_every_spec_and_names_it() {
    for (spec, name) in [
        ("classic", "classic"),
        ("interrupt", "interrupt"),
        ("hybrid", "hybrid"),
        ("fixed:5", "fixed:5"),
        ("hybrid-3/4", "hybrid-3/4"),
        ("hybrid-min", "hybrid-min"),
        ("hybrid-min:adjust=2000", "hybrid-min:adjust=2000"),
        ("hybrid-min:adjust=0", "hybrid-min"),
        ("uring-hybrid", "uring-hybrid"),
        ("adaptive", "adaptive"),
        ("adaptive:sleep=timed", "adaptive"),
        (
            "adaptive:sleep=interruptible",
            "adaptive:sleep=interruptible",
        ),
        (
            "adaptive:sleep=interruptible,budget=1.5",
            "adaptive:budget=1.5,sleep=interruptible",
        ),
        (
            "adaptive:sleep=interruptible,load_budget=20,budget=1.5",
            "adaptive:budget=1.5,load_budget=20,sleep=interruptible",
        ),
        ("adaptive:load_budget=10", "adaptive"),
        ("  hybrid \n", "hybrid"),
    ] {
        let policy = build(spec).unwrap_or_else(|e| panic!("{spec}: {e}"));
        assert_eq!(policy.name(), name, "{spec}");
        // A policy's name is a spec that builds the same policy.
        assert_eq!(build(policy.name()).unwrap().name(), name);
    }
}

#[test]
fn lists_every_policy_once_and_builds_each_by_its_name() {
    let names: Vec<_> = list().iter().map(|info| info.name).collect();
    assert_eq!(
        names,
        [
            "classic",
            "interrupt",
            "hybrid",
            "fixed",
            "hybrid-3/4",
            "hybrid-min",
            "uring-hybrid",
            "adaptive",
            "oracle"
        ]
    );
    for info in list() {
        assert!(!info.description.is_empty() && !info.description.contains('\n'));
        assert!(info.syntax.starts_with(info.name));
        if info.name != "fixed" {
            assert_eq!(build(info.name).unwrap().name(), info.name);
        }
    }
}

fn error(spec: &str) -> (PolicySpecError, String) {
    let error = build(spec).map(|p| p.name().to_owned()).unwrap_err();
    let message = error.to_string();
    (error, message)
}

#[test]
fn unknown_names_list_the_known_ones() {
    let (e, message) = error("hybird");
    assert_eq!(
        e,
        PolicySpecError::UnknownPolicy {
            name: "hybird".into()
        }
    );
    assert!(message.contains("`hybird`"), "{message}");
    for info in list() {
        assert!(message.contains(info.syntax), "{message}");
    }
    assert_eq!(error("").0, PolicySpecError::Empty);
    assert!(error("  ").1.contains("hybrid-min[:adjust=<ns>]"));
    assert!(matches!(
        error("Classic").0,
        PolicySpecError::UnknownPolicy { .. }
    ));
}

#[test]
fn bad_parameters_name_the_key_and_the_accepted_ones() {
    let (e, message) = error("hybrid-min:adjst=2000");
    assert!(matches!(e, PolicySpecError::UnknownParameter { .. }));
    assert_eq!(
        message,
        "policy `hybrid-min` has no parameter `adjst`; accepted: adjust"
    );
    let (e, message) = error("hybrid-min:adjust=2us");
    assert!(matches!(e, PolicySpecError::InvalidValue { .. }));
    assert!(
        message.contains("`2us`") && message.contains("nanoseconds"),
        "{message}"
    );
    assert!(matches!(
        error("hybrid-min:adjust").0,
        PolicySpecError::InvalidValue { .. }
    ));
    assert!(matches!(
        error("hybrid-min:adjust=-1").0,
        PolicySpecError::InvalidValue { .. }
    ));
    let (e, _) = error("hybrid-min:adjust=1,adjust=2");
    assert!(matches!(
        e,
        PolicySpecError::DuplicateParameter { key: "adjust", .. }
    ));
    assert!(matches!(
        error("hybrid-min:").0,
        PolicySpecError::UnknownParameter { .. }
    ));
    // A policy with two parameters.
    let (e, message) = error("adaptive:sleep=never");
    assert!(matches!(
        e,
        PolicySpecError::InvalidValue { key: "sleep", .. }
    ));
    assert!(message.contains("timed"), "{message}");
    assert_eq!(
        error("adaptive:budget=2,wake=1").1,
        "policy `adaptive` has no parameter `wake`; accepted: budget, load_budget, sleep"
    );
    assert!(matches!(
        error("adaptive:load_budget=0").0,
        PolicySpecError::InvalidValue {
            key: "load_budget",
            ..
        }
    ));
    assert!(matches!(
        error("adaptive:sleep=timed,budget=1,sleep=timed").0,
        PolicySpecError::DuplicateParameter { key: "sleep", .. }
    ));
}

#[test]
fn policies_without_parameters_refuse_them() {
    for name in [
        "classic",
        "interrupt",
        "hybrid",
        "hybrid-3/4",
        "uring-hybrid",
    ] {
        let (e, message) = error(&format!("{name}:x=1"));
        assert!(
            matches!(e, PolicySpecError::UnexpectedArguments { .. }),
            "{name}"
        );
        assert!(message.contains("takes no arguments"), "{message}");
    }
}

#[test]
fn fixed_needs_whole_microseconds_in_range() {
    let (e, message) = error("fixed");
    assert!(matches!(e, PolicySpecError::MissingValue { .. }));
    assert!(message.contains("fixed:<us>"), "{message}");
    for bad in [
        "fixed:0",
        "fixed:5us",
        "fixed:1.5",
        "fixed:-3",
        "fixed:1000001",
        "fixed:",
    ] {
        let (e, message) = error(bad);
        assert!(matches!(e, PolicySpecError::InvalidValue { .. }), "{bad}");
        assert!(message.contains("microseconds"), "{message}");
    }
    assert_eq!(build("fixed:1000000").unwrap().name(), "fixed:1000000");
}
