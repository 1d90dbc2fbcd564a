//! The log store's own poll policy, "spin 20 us, then wait for the interrupt", plugged into
//! every reactor through `ReactorConfig::custom_policy`.
//!
//! Why this rule for a log: a commit is a write, which on flash completes in tens of
//! microseconds, often within the spin, so the client's acknowledgement is not delayed by
//! a wake-up; a read of a cold record, or a device that is slow today, outlasts the spin,
//! and then the reactor gives its core back until the device interrupts, instead of
//! burning it for as long as the I/O takes.

use hypoll_reactor::{Decision, PolicyFactory, PollContext, PollPolicy};

/// How long after the oldest outstanding I/O's submission the reactor spins before it
/// waits for the interrupt.
pub const SPIN_NS: u64 = 20_000;

/// The policy's name, as the reactor reports it (`Reactor::policy_name`).
pub const POLICY_NAME: &str = "spin-20us-then-wait";

/// Spins until the oldest outstanding I/O has been out `spin_ns`, then waits for the
/// interrupt. It keeps no state: the submission time is in the context the reactor hands it.
pub struct SpinThenWait {
    spin_ns: u64,
}

impl PollPolicy for SpinThenWait {
    fn name(&self) -> &str {
        POLICY_NAME
    }

    fn decide(&mut self, ctx: &PollContext<'_>) -> Decision {
        // The reactor asks about its oldest I/O: once that one has had its spin, the ones
        // behind it are either done or about to be seen on the same interrupt.
        let out_ns = ctx.now_ns.saturating_sub(ctx.oldest.submit_ns);
        if out_ns < self.spin_ns {
            Decision::Spin
        } else {
            Decision::WaitInterrupt
        }
    }
}

/// Builds one `SpinThenWait` per reactor, on that reactor's thread.
pub fn spin_then_wait() -> PolicyFactory {
    PolicyFactory::new(|_reactor_index| Box::new(SpinThenWait { spin_ns: SPIN_NS }))
}
