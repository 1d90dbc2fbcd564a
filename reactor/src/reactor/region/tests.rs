//! Vectored I/O into registered memory, on an emulated device stepped by hand: a round trip
//! through four segments, and every refusal the issue names (never a panic).

use std::sync::mpsc;
use std::sync::Arc;

use hypoll_nvme::{IoBuf, SubmitError, UnregisterError, VirtualClock, SEGMENTS_MAX};

use super::super::tests::{emu, reactor};
use crate::io::{Device, DeviceId, IoDone, IoFailure, RegionSlice, RegionUseError, RejectReason};
use crate::Reactor;

/// Steps `r` a millisecond of virtual time a turn until `rx` has an answer.
fn answer(
    r: &mut Reactor,
    clock: &VirtualClock,
    rx: &mpsc::Receiver<Result<(), IoFailure>>,
) -> Result<(), IoFailure> {
    for _ in 0..1_000 {
        if let Ok(result) = rx.try_recv() {
            return result;
        }
        clock.advance_by(1_000_000);
        r.sim_turn(&mut ());
    }
    panic!("no answer");
}

fn answering(
    tx: &mpsc::Sender<Result<(), IoFailure>>,
) -> impl FnOnce(&mut Reactor, &mut (), IoDone) + 'static {
    let tx = tx.clone();
    move |_, _, done| {
        assert!(done.buf.is_none(), "a vectored I/O's data is in its region");
        tx.send(done.result).unwrap()
    }
}

#[test]
fn a_vectored_write_and_read_go_through_registered_memory_in_place() {
    let clock = VirtualClock::new(1_000_000_000);
    let mut r = reactor(&clock, "classic");
    let device = Device::new(Arc::new(emu("emu:optane,size=1M,lba=512", &clock)));
    let dev = r.attach(&device, 4).unwrap();
    let mut memory = IoBuf::zeroed(64 << 10);
    // SAFETY: `memory` outlives the reactor (dropped at the end of the test, after `r`).
    let region = unsafe { r.register_memory(dev, memory.as_mut_ptr(), memory.len()) }.unwrap();
    for (i, byte) in memory[..4096].iter_mut().enumerate() {
        *byte = (i / 1024 + 1) as u8;
    }
    // Four 1 KiB records, scattered in the region, written as eight blocks in one command.
    let records: Vec<RegionSlice> = (0..4)
        .map(|i| RegionSlice::new(region, i * 1024, 1024).unwrap())
        .collect();
    let (tx, rx) = mpsc::channel();
    r.writev(dev, 16, 8, &records, answering(&tx)).unwrap();
    assert_eq!(
        r.unregister_memory(dev, region).unwrap_err().to_string(),
        RegionUseError::Unregister(UnregisterError::InUse { commands: 1 }).to_string(),
        "a region in use stays registered"
    );
    assert_eq!(answer(&mut r, &clock, &rx), Ok(()));
    // Read them back, in reverse order, into the region's second half.
    let back: Vec<RegionSlice> = (0..4)
        .map(|i| RegionSlice::new(region, 32768 + (3 - i) * 1024, 1024).unwrap())
        .collect();
    r.readv(dev, 16, 8, &back, answering(&tx)).unwrap();
    assert_eq!(answer(&mut r, &clock, &rx), Ok(()));
    for i in 0..4 {
        let got = &memory[32768 + (3 - i) * 1024..][..1024];
        assert!(got.iter().all(|&b| b == i as u8 + 1), "record {i}");
    }
    r.unregister_memory(dev, region).unwrap();
    assert!(matches!(
        r.unregister_memory(dev, region),
        Err(RegionUseError::Unregister(UnregisterError::Unknown))
    ));
    drop(r);
    drop(memory);
}

#[test]
fn bad_vectored_input_is_refused_clearly_and_never_panics() {
    let clock = VirtualClock::new(1_000_000_000);
    let mut r = reactor(&clock, "classic");
    let device = Device::new(Arc::new(emu("emu:optane,size=1M,lba=512", &clock)));
    let dev = r.attach(&device, 4).unwrap();
    let mut memory = IoBuf::zeroed(1 << 20);
    let mut other = IoBuf::zeroed(4096);
    // SAFETY: both outlive the reactor (dropped after it).
    let region = unsafe { r.register_memory(dev, memory.as_mut_ptr(), memory.len()) }.unwrap();
    let (tx, _rx) = mpsc::channel();
    let reason = |res: Result<(), crate::Rejected<_>>| res.unwrap_err().reason;
    let one = [RegionSlice::new(region, 0, 4096).unwrap()];

    // No segments, and more than a command carries.
    assert_eq!(
        reason(r.writev(dev, 0, 8, &[], answering(&tx))),
        RejectReason::Segments {
            count: 0,
            max: SEGMENTS_MAX
        }
    );
    let many: Vec<RegionSlice> = (0..=SEGMENTS_MAX)
        .map(|i| RegionSlice::new(region, i * 512, 512).unwrap())
        .collect();
    assert_eq!(
        reason(r.writev(dev, 0, many.len() as u32, &many, answering(&tx))),
        RejectReason::Segments {
            count: SEGMENTS_MAX + 1,
            max: SEGMENTS_MAX
        }
    );
    // A slice cannot leave its region, nor be empty.
    assert!(RegionSlice::new(region, (1 << 20) - 512, 1024).is_none());
    assert!(RegionSlice::new(region, 0, 0).is_none());
    assert!(RegionSlice::new(region, usize::MAX, 2).is_none());
    // A region registered with another device (or since unregistered) is refused by its
    // segment's position.
    let device2 = Device::new(Arc::new(emu("emu:optane,size=1M,lba=512", &clock)));
    let dev2 = r.attach(&device2, 4).unwrap();
    // SAFETY: as above.
    let elsewhere = unsafe { r.register_memory(dev2, other.as_mut_ptr(), other.len()) }.unwrap();
    let mixed = [one[0], RegionSlice::new(elsewhere, 0, 512).unwrap()];
    assert_eq!(
        reason(r.writev(dev, 0, 9, &mixed, answering(&tx))),
        RejectReason::Unregistered { segment: 1 }
    );
    // Zero blocks: refused before the device sees it.
    assert!(matches!(
        reason(r.readv(dev, 0, 0, &one, answering(&tx))),
        RejectReason::Submit(SubmitError::InvalidField(_))
    ));
    // Segments that do not add up to the blocks asked for.
    assert!(matches!(
        reason(r.readv(dev, 0, 16, &one, answering(&tx))),
        RejectReason::Submit(_)
    ));
    // An unknown device.
    assert_eq!(
        reason(r.readv(DeviceId::from_index(9), 0, 8, &one, answering(&tx))),
        RejectReason::UnknownDevice
    );
    assert!(matches!(
        r.unregister_memory(DeviceId::from_index(9), region),
        Err(RegionUseError::UnknownDevice)
    ));
    // A region the device cannot take: misaligned.
    // SAFETY: as above; refused, so never used.
    let misaligned = unsafe { r.register_memory(dev, memory.as_mut_ptr().add(100), 4096) };
    assert!(
        matches!(misaligned, Err(RegionUseError::Register(_))),
        "{misaligned:?}"
    );
    assert_eq!(r.outstanding(), 0, "nothing was accepted");
    // Past the namespace: the device answers as NVMe does, with a status.
    r.readv(dev, (1 << 20) / 512 - 4, 8, &one, answering(&tx))
        .unwrap();
    assert!(matches!(
        answer(&mut r, &clock, &_rx),
        Err(IoFailure::Device(status)) if !status.is_success()
    ));
    drop(r);
    drop((memory, other));
}

#[test]
fn a_stale_handle_is_refused_even_where_a_new_region_took_its_place() {
    let clock = VirtualClock::new(1_000_000_000);
    let mut r = reactor(&clock, "classic");
    let device = Device::new(Arc::new(emu("emu:optane,size=1M,lba=512", &clock)));
    let dev = r.attach(&device, 4).unwrap();
    let mut memory = IoBuf::zeroed(64 << 10);
    // SAFETY: `memory` outlives the reactor (dropped after it).
    let old = unsafe { r.register_memory(dev, memory.as_mut_ptr(), memory.len()) }.unwrap();
    r.unregister_memory(dev, old).unwrap();
    // The same memory again: the same table index, place and length, a new identity.
    // SAFETY: as above.
    let new = unsafe { r.register_memory(dev, memory.as_mut_ptr(), memory.len()) }.unwrap();
    assert_eq!(new.index(), old.index());
    let (tx, rx) = mpsc::channel();
    let stale = [RegionSlice::new(old, 0, 4096).unwrap()];
    let refused = r.readv(dev, 0, 8, &stale, answering(&tx)).unwrap_err();
    assert_eq!(refused.reason, RejectReason::Unregistered { segment: 0 });
    let fresh = [RegionSlice::new(new, 0, 4096).unwrap()];
    r.readv(dev, 0, 8, &fresh, answering(&tx)).unwrap();
    assert_eq!(answer(&mut r, &clock, &rx), Ok(()));
    drop(r);
    drop(memory);
}

/// The null device takes a vectored I/O's regions from the reactor instead of looking
/// them up: the region must still count as in use until the completion.
#[test]
fn on_null_a_region_in_use_stays_registered_until_the_completion() {
    let clock = VirtualClock::new(1_000_000_000);
    let mut r = reactor(&clock, "classic");
    let device = Device::open("null,size=1M").unwrap();
    let dev = r.attach(&device, 4).unwrap();
    let mut memory = IoBuf::zeroed(64 << 10);
    let mut second = IoBuf::zeroed(8 << 10);
    // SAFETY: both outlive the reactor (dropped after it).
    let region = unsafe { r.register_memory(dev, memory.as_mut_ptr(), memory.len()) }.unwrap();
    // SAFETY: as above.
    let other = unsafe { r.register_memory(dev, second.as_mut_ptr(), second.len()) }.unwrap();
    let (tx, rx) = mpsc::channel();
    let segs = [
        RegionSlice::new(other, 4096, 2048).unwrap(),
        RegionSlice::new(region, 0, 2048).unwrap(),
    ];
    r.writev(dev, 0, 8, &segs, answering(&tx)).unwrap();
    for (name, handle) in [("first", region), ("second", other)] {
        assert!(
            matches!(
                r.unregister_memory(dev, handle),
                Err(RegionUseError::Unregister(UnregisterError::InUse {
                    commands: 1
                }))
            ),
            "the {name} region is in use"
        );
    }
    assert_eq!(answer(&mut r, &clock, &rx), Ok(()));
    r.unregister_memory(dev, region).unwrap();
    r.unregister_memory(dev, other).unwrap();
    drop(r);
    drop((memory, second));
}
