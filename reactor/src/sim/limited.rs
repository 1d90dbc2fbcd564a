//! Devices that cannot abort, or abort and reset: the emulated controller with those
//! answers taken away, as `QueuePair`'s defaults give them.

use std::sync::Arc;

use hypoll_nvme::{
    Command, Completion, Controller, EmuController, EmuQueuePair, NamespaceInfo, QueuePair,
    QueuePairError, RecoveryError, SubmitError,
};

use crate::io::Device;

/// An emulated controller whose queue pairs lack abort, or abort and reset: how a reactor
/// copes with devices that cannot do either (as `QueuePair`'s defaults say).
pub struct LimitedController {
    inner: EmuController,
    abort: bool,
    reset: bool,
}

impl LimitedController {
    pub fn new(inner: EmuController, abort: bool, reset: bool) -> LimitedController {
        LimitedController {
            inner,
            abort,
            reset,
        }
    }
}

impl Controller for LimitedController {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.inner.namespace()
    }

    fn create_queue_pair(&self, depth: usize) -> Result<Box<dyn QueuePair>, QueuePairError> {
        Ok(Box::new(LimitedQp {
            inner: self.inner.queue_pair(depth)?,
            abort: self.abort,
            reset: self.reset,
        }))
    }
}

struct LimitedQp {
    inner: EmuQueuePair,
    abort: bool,
    reset: bool,
}

impl QueuePair for LimitedQp {
    unsafe fn submit(&mut self, cmd: &Command<'_>, tag: u64) -> Result<(), SubmitError> {
        // SAFETY: forwarded unchanged: our caller keeps the submit contract for us.
        unsafe { self.inner.submit(cmd, tag) }
    }

    fn process_completions(&mut self, max: usize, out: &mut dyn FnMut(Completion)) -> usize {
        self.inner.process_completions(max, out)
    }

    fn interrupt_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.inner.interrupt_fd()
    }

    fn arm_interrupt(&mut self) {
        self.inner.arm_interrupt()
    }

    fn disarm_interrupt(&mut self) {
        self.inner.disarm_interrupt()
    }

    fn outstanding(&self) -> usize {
        self.inner.outstanding()
    }

    fn depth(&self) -> usize {
        self.inner.depth()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.inner.namespace()
    }

    fn abort(&mut self, tag: u64) -> Result<(), RecoveryError> {
        if self.abort {
            QueuePair::abort(&mut self.inner, tag)
        } else {
            Err(RecoveryError::Unsupported)
        }
    }

    fn reset(&mut self) -> Result<(), RecoveryError> {
        if self.reset {
            QueuePair::reset(&mut self.inner)
        } else {
            Err(RecoveryError::Unsupported)
        }
    }

    unsafe fn register_memory(
        &mut self,
        ptr: *mut u8,
        len_bytes: usize,
    ) -> Result<hypoll_nvme::MemoryRegion, hypoll_nvme::RegisterError> {
        // SAFETY: forwarded unchanged: our caller keeps the contract for us.
        unsafe { self.inner.register_memory(ptr, len_bytes) }
    }

    fn unregister_memory(
        &mut self,
        region: hypoll_nvme::MemoryRegion,
    ) -> Result<(), hypoll_nvme::UnregisterError> {
        self.inner.unregister_memory(region)
    }
}

/// The emulated queue pair inside `qp`, if `qp` is a limited one.
pub(super) fn inner<'q>(qp: &'q (dyn QueuePair + 'static)) -> Option<&'q EmuQueuePair> {
    (qp as &dyn std::any::Any)
        .downcast_ref::<LimitedQp>()
        .map(|l| &l.inner)
}

/// The controller as a device that can abort and reset as asked.
pub(super) fn device_for(ctrl: &EmuController, abort: bool, reset: bool) -> Device {
    if abort && reset {
        Device::new(Arc::new(ctrl.clone()))
    } else {
        Device::new(Arc::new(LimitedController::new(ctrl.clone(), abort, reset)))
    }
}
