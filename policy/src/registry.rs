//! Building a policy from its spec string, and the list of policies.
//!
//! A spec is a name, optionally followed by `:` and the policy's arguments:
//! `classic`, `fixed:5`, `hybrid-min:adjust=2000`. Adding a policy is adding one entry to
//! [`POLICIES`].

use std::fmt;

use crate::adaptive::{Adaptive, ADAPTIVE_BUDGET_PCT, ADAPTIVE_LOAD_BUDGET_PCT};
use crate::classic::Classic;
use crate::fixed::{Fixed, FIXED_SLEEP_US_MAX};
use crate::hybrid::Hybrid;
use crate::hybrid_min::HybridMin;
use crate::hybrid_three_quarters::HybridThreeQuarters;
use crate::interrupt::Interrupt;
use crate::oracle::Oracle;
use crate::policy::PollPolicy;
use crate::uring_hybrid::UringHybrid;

/// A policy's name, spec syntax and one-line description, for `hypoll policies`.
#[derive(Clone, Copy)]
pub struct PolicyInfo {
    /// Name, the part of the spec before `:`.
    pub name: &'static str,
    /// Spec syntax: `[...]` is optional, `<...>` a value.
    pub syntax: &'static str,
    /// What it does and where it comes from, in one line.
    pub description: &'static str,
    build: Builder,
}

/// Builds a policy from the arguments after the `:`, if any.
type Builder = fn(Option<&str>) -> Result<Box<dyn PollPolicy>, PolicySpecError>;

impl fmt::Debug for PolicyInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyInfo")
            .field("name", &self.name)
            .field("syntax", &self.syntax)
            .field("description", &self.description)
            .finish()
    }
}

const ADJUST: &str = "adjust";
const BUDGET: &str = "budget";
const LOAD_BUDGET: &str = "load_budget";
const SLEEP: &str = "sleep";

static POLICIES: [PolicyInfo; 9] = [
    PolicyInfo {
        name: Classic::NAME,
        syntax: "classic",
        description: "always spin on the completion queue (Linux io_poll_delay = -1)",
        build: |args| {
            no_arguments(Classic::NAME, args)?;
            Ok(Box::new(Classic))
        },
    },
    PolicyInfo {
        name: Interrupt::NAME,
        syntax: "interrupt",
        description: "always block on the device's interrupt fd (IRQ-driven completion); \
                      without one, sleep to the bucket's mean once, then spin",
        build: |args| {
            no_arguments(Interrupt::NAME, args)?;
            Ok(Box::new(Interrupt))
        },
    },
    PolicyInfo {
        name: Hybrid::NAME,
        syntax: "hybrid",
        description: "sleep (mean + 1) / 2 of the I/O's bucket once, then spin \
                      (Linux io_poll_delay = 0, 2016)",
        build: |args| {
            no_arguments(Hybrid::NAME, args)?;
            Ok(Box::new(Hybrid))
        },
    },
    PolicyInfo {
        name: Fixed::NAME,
        syntax: "fixed:<us>",
        description: "sleep <us> microseconds once per I/O, then spin (Linux io_poll_delay > 0)",
        build: build_fixed,
    },
    PolicyInfo {
        name: HybridThreeQuarters::NAME,
        syntax: "hybrid-3/4",
        description: "sleep (mean + 1) * 3 / 4 of the I/O's bucket once, then spin \
                      (blk-mq proposal, 2020)",
        build: |args| {
            no_arguments(HybridThreeQuarters::NAME, args)?;
            Ok(Box::new(HybridThreeQuarters))
        },
    },
    PolicyInfo {
        name: HybridMin::NAME,
        syntax: "hybrid-min[:adjust=<ns>]",
        description: "sleep max((mean + 1) / 2, bucket min) minus adjust once, no sleep if \
                      adjust is at least that (blk-mq proposal, 2017)",
        build: build_hybrid_min,
    },
    PolicyInfo {
        name: UringHybrid::NAME,
        syntax: "uring-hybrid",
        description: "sleep half the shortest runtime seen once, then spin \
                      (io_uring IORING_SETUP_HYBRID_IOPOLL, 2024)",
        build: |args| {
            no_arguments(UringHybrid::NAME, args)?;
            Ok(Box::new(UringHybrid::new()))
        },
    },
    PolicyInfo {
        name: Adaptive::NAME,
        syntax: "adaptive[:budget=<pct>,load_budget=<pct>,sleep=interruptible]",
        description: "ours: calibrates wake-up overshoot and sleep cost online, sleeps to a \
                      latency budget on the learnt distribution, batches under load, \
                      interrupts for long waits",
        build: build_adaptive,
    },
    PolicyInfo {
        name: Oracle::NAME,
        syntax: "oracle",
        description: "benchmark only, emulated devices: sleep until the device's true \
                      deadline minus the measured wake-up overshoot (the limit of sleeping)",
        build: |args| {
            no_arguments(Oracle::NAME, args)?;
            Ok(Box::new(Oracle::new()))
        },
    },
];

/// Every policy [`build`] knows, with its syntax and a one-line description.
pub fn list() -> &'static [PolicyInfo] {
    &POLICIES
}

/// Builds the policy that `spec` names, e.g. `hybrid`, `fixed:5`, `hybrid-min:adjust=2000`.
/// Surrounding whitespace is ignored; names and keys are case-sensitive.
pub fn build(spec: &str) -> Result<Box<dyn PollPolicy>, PolicySpecError> {
    let spec = spec.trim();
    if spec.is_empty() {
        return Err(PolicySpecError::Empty);
    }
    let (name, args) = match spec.split_once(':') {
        Some((name, args)) => (name, Some(args)),
        None => (spec, None),
    };
    let info = POLICIES
        .iter()
        .find(|info| info.name == name)
        .ok_or_else(|| PolicySpecError::UnknownPolicy {
            name: name.to_owned(),
        })?;
    (info.build)(args)
}

fn no_arguments(policy: &'static str, args: Option<&str>) -> Result<(), PolicySpecError> {
    match args {
        None => Ok(()),
        Some(args) => Err(PolicySpecError::UnexpectedArguments {
            policy,
            arguments: args.to_owned(),
        }),
    }
}

fn build_fixed(args: Option<&str>) -> Result<Box<dyn PollPolicy>, PolicySpecError> {
    let value = args.ok_or(PolicySpecError::MissingValue {
        policy: Fixed::NAME,
        syntax: "fixed:<us>, e.g. fixed:5",
    })?;
    let sleep_us = value
        .parse::<u64>()
        .ok()
        .filter(|us| (1..=FIXED_SLEEP_US_MAX).contains(us))
        .ok_or_else(|| PolicySpecError::InvalidValue {
            policy: Fixed::NAME,
            key: "<us>",
            value: value.to_owned(),
            expected: "whole microseconds from 1 to 1000000 (0 is `hybrid` in Linux)",
        })?;
    Ok(Box::new(Fixed::from_us(sleep_us)))
}

fn build_hybrid_min(args: Option<&str>) -> Result<Box<dyn PollPolicy>, PolicySpecError> {
    const ACCEPTED: &[&str] = &[ADJUST];
    let adjust_ns = parameter(
        HybridMin::NAME,
        ADJUST,
        ACCEPTED,
        args,
        "whole nanoseconds, e.g. adjust=2000",
        |v| v.parse::<u64>().ok(),
    )?;
    Ok(Box::new(HybridMin::new(adjust_ns.unwrap_or(0))))
}

fn build_adaptive(args: Option<&str>) -> Result<Box<dyn PollPolicy>, PolicySpecError> {
    const ACCEPTED: &[&str] = &[BUDGET, LOAD_BUDGET, SLEEP];
    let budget_pct = parameter(
        Adaptive::NAME,
        BUDGET,
        ACCEPTED,
        args,
        "a latency budget in percent of the mean, above 0 and at most 100, e.g. budget=1.5",
        |v| v.parse::<f64>().ok().filter(|p| *p > 0.0 && *p <= 100.0),
    )?;
    let load_budget_pct = parameter(
        Adaptive::NAME,
        LOAD_BUDGET,
        ACCEPTED,
        args,
        "how much later than spinning waiting on the interrupt under load may be, in percent \
         of the mean, above 0 and at most 100, e.g. load_budget=10",
        |v| v.parse::<f64>().ok().filter(|p| *p > 0.0 && *p <= 100.0),
    )?;
    let interruptible = parameter(
        Adaptive::NAME,
        SLEEP,
        ACCEPTED,
        args,
        "timed (a sleep always lasts; the default) or interruptible (a completion ends a sleep)",
        |v| match v {
            "interruptible" => Some(true),
            "timed" => Some(false),
            _ => None,
        },
    )?;
    Ok(Box::new(
        Adaptive::with(
            budget_pct.unwrap_or(ADAPTIVE_BUDGET_PCT),
            interruptible.unwrap_or(false),
        )
        .with_load_budget(load_budget_pct.unwrap_or(ADAPTIVE_LOAD_BUDGET_PCT)),
    ))
}

/// Parses parameter `key` from a policy's comma-separated `key=value` arguments, whose
/// parameters are `accepted`: `None` when absent, an error naming the culprit for an unknown
/// or repeated key or a bad value.
fn parameter<T>(
    policy: &'static str,
    key: &'static str,
    accepted: &'static [&'static str],
    args: Option<&str>,
    expected: &'static str,
    parse: impl Fn(&str) -> Option<T>,
) -> Result<Option<T>, PolicySpecError> {
    let mut found = None;
    for pair in args.into_iter().flat_map(|args| args.split(',')) {
        let (given, value) = pair.split_once('=').unwrap_or((pair, ""));
        if given != key {
            if accepted.contains(&given) {
                continue;
            }
            return Err(PolicySpecError::UnknownParameter {
                policy,
                key: given.to_owned(),
                accepted,
            });
        }
        if found.is_some() {
            return Err(PolicySpecError::DuplicateParameter { policy, key });
        }
        found = Some(parse(value).ok_or_else(|| PolicySpecError::InvalidValue {
            policy,
            key,
            value: value.to_owned(),
            expected,
        })?);
    }
    Ok(found)
}

/// Why a spec names no policy. The message names the culprit and what would be accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PolicySpecError {
    /// The spec is empty.
    Empty,
    /// No policy has this name.
    UnknownPolicy {
        /// The name given.
        name: String,
    },
    /// The policy takes no arguments, but some were given.
    UnexpectedArguments {
        /// The policy.
        policy: &'static str,
        /// What followed the `:`.
        arguments: String,
    },
    /// The policy has no parameter of this name.
    UnknownParameter {
        /// The policy.
        policy: &'static str,
        /// The key given.
        key: String,
        /// The keys the policy accepts.
        accepted: &'static [&'static str],
    },
    /// A parameter was given twice.
    DuplicateParameter {
        /// The policy.
        policy: &'static str,
        /// The key given twice.
        key: &'static str,
    },
    /// The policy needs a value that was not given.
    MissingValue {
        /// The policy.
        policy: &'static str,
        /// The syntax it expects.
        syntax: &'static str,
    },
    /// A value does not parse or is out of range.
    InvalidValue {
        /// The policy.
        policy: &'static str,
        /// The parameter (`<us>` for a positional one).
        key: &'static str,
        /// The value given.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
}

impl fmt::Display for PolicySpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => write!(f, "empty policy spec; known policies: ")?,
            Self::UnknownPolicy { name } => {
                write!(f, "unknown policy `{name}`; known policies: ")?;
            }
            Self::UnexpectedArguments { policy, arguments } => {
                return write!(
                    f,
                    "policy `{policy}` takes no arguments, got `{policy}:{arguments}`"
                );
            }
            Self::UnknownParameter {
                policy,
                key,
                accepted,
            } => {
                return write!(
                    f,
                    "policy `{policy}` has no parameter `{key}`; accepted: {}",
                    accepted.join(", ")
                );
            }
            Self::DuplicateParameter { policy, key } => {
                return write!(f, "parameter `{key}` of policy `{policy}` is given twice");
            }
            Self::MissingValue { policy, syntax } => {
                return write!(f, "policy `{policy}` needs a value: {syntax}");
            }
            Self::InvalidValue {
                policy,
                key,
                value,
                expected,
            } => {
                return write!(
                    f,
                    "invalid value `{value}` for `{key}` of policy `{policy}`: expected {expected}"
                );
            }
        }
        let syntaxes: Vec<&str> = POLICIES.iter().map(|info| info.syntax).collect();
        f.write_str(&syntaxes.join(", "))
    }
}

impl std::error::Error for PolicySpecError {}

#[cfg(test)]
mod tests;
