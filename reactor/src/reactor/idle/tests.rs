//! How the idle path carries out a policy's decision on a device that cannot interrupt: the
//! emulator on a virtual clock has no interrupt line, as an IOPOLL ring has none.

use std::sync::Arc;

use hypoll_nvme::{IoBuf, VirtualClock};
use hypoll_policy::{Decision, PollContext, PollPolicy};

use super::super::tests::{emu, reactor};
use super::super::{mailbox, Reactor, ReactorTuning};
use crate::io::Device;

/// A policy that asks to wait for the interrupt whatever it is told.
struct AlwaysWait;

impl PollPolicy for AlwaysWait {
    fn name(&self) -> &str {
        "always-wait"
    }

    fn decide(&mut self, _ctx: &PollContext<'_>) -> Decision {
        Decision::WaitInterrupt
    }
}

/// A read outstanding on an emulated device on `clock`, then one idle step of `r`.
fn one_idle_step_with_a_read_outstanding(r: &mut Reactor, clock: &VirtualClock) {
    let device = Device::new(Arc::new(emu("emu:nand,size=1M", clock)));
    let dev = r.attach(&device, 4).unwrap();
    r.read(dev, 0, 8, IoBuf::zeroed(4096), |_, _, _| {})
        .unwrap();
    assert_eq!(
        r.sim_turn(&mut ()),
        0,
        "nothing completes before the clock moves"
    );
    r.when_idle();
}

#[test]
fn a_wait_for_an_interrupt_that_cannot_come_is_counted_as_spun() {
    let clock = VirtualClock::new(1_000_000_000);
    let (handle, rx) = mailbox(0, 0, 16).unwrap();
    let mut r = Reactor::new(
        0,
        rx,
        Arc::new([handle]),
        Box::new(AlwaysWait),
        ReactorTuning::default(),
    )
    .unwrap();
    r.set_clock(hypoll_nvme::Clock::Virtual(clock.clone()));
    one_idle_step_with_a_read_outstanding(&mut r, &clock);
    assert_eq!(r.counters.interrupt_waits, 0);
    assert_eq!(r.counters.interrupt_waits_spun, 1);
}

#[test]
fn the_interrupt_policy_is_told_there_is_no_interrupt_and_does_not_ask_to_wait() {
    let clock = VirtualClock::new(1_000_000_000);
    let mut r = reactor(&clock, "interrupt");
    one_idle_step_with_a_read_outstanding(&mut r, &clock);
    assert_eq!(r.counters.interrupt_waits_spun, 0);
}
