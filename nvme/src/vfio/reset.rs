//! Turning the controller off and on (CC.EN, waited for on CSTS.RDY): enabling it with a
//! fresh admin queue, disabling it, resetting it under I/O, and the normal shutdown when
//! the last user lets go.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::admin::{admin_op, AdminQueue, FEATURE_NUMBER_OF_QUEUES};
use super::{regs, sys, Inner, VfioError, ADMIN_QUEUE_ENTRIES, IO_QUEUES_MAX};
use crate::spec::SubmissionEntry;

/// Longest wait for CSTS.RDY to follow CC.EN when CAP.TO says less (or nothing).
const READY_TIMEOUT_MS_MIN: u64 = 2_000;

impl Inner {
    /// Resets and re-enables the controller. Every queue pair sees the new generation the
    /// next time it is touched, fails what the controller had not finished with "Command
    /// Aborted due to SQ Deletion" and creates its queues again.
    pub(super) fn reset(&self) -> Result<(), VfioError> {
        let mut admin = self.admin.lock();
        let result = self.enable(&mut admin);
        // The old queues are gone only if the controller stopped: it came back (the disable
        // before the enable took), or it reads as disabled (CSTS.RDY = 0). A controller that
        // never stopped (RDY stuck, or all ones) may still write the commands' buffers, so
        // the queue pairs must not make up their completions: no new generation, and the
        // caller keeps those buffers quarantined.
        let stopped = result.is_ok() || self.bar.read32(regs::CSTS) & regs::CSTS_RDY == 0;
        if stopped {
            self.generation.fetch_add(1, Ordering::SeqCst);
            // Queue pairs notice the reset when touched; wake the ones whose reactors block
            // on their interrupt, so the aborted commands complete now, not at a timeout.
            for irq in &self.irqs {
                let _ = irq.signal();
            }
        }
        result
    }

    fn wait_ready(&self, ready: bool) -> Result<(), VfioError> {
        let timeout_ms = self.cap.timeout_ms.max(READY_TIMEOUT_MS_MIN);
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        loop {
            let csts = self.bar.read32(regs::CSTS);
            if csts == u32::MAX {
                return Err(VfioError::Controller(
                    "reads as all ones: the function is gone or its BAR is not enabled".into(),
                ));
            }
            if ready && csts & regs::CSTS_CFS != 0 {
                return Err(VfioError::Controller(
                    "reports a fatal status (CSTS.CFS) while enabling".into(),
                ));
            }
            if (csts & regs::CSTS_RDY != 0) == ready {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(VfioError::Controller(format!(
                    "did not become {} within {timeout_ms} ms (CSTS {csts:#x})",
                    if ready { "ready" } else { "disabled" }
                )));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Tells the controller the host is done (CC.SHN, normal shutdown) so a real device
    /// flushes its volatile write cache, and waits for CSTS.SHST to say it has, up to CAP.TO.
    fn shut_down(&self) {
        let cc = self.bar.read32(regs::CC);
        if cc & regs::CC_EN == 0 {
            return;
        }
        self.bar
            .write32(regs::CC, (cc & !regs::CC_SHN_MASK) | regs::CC_SHN_NORMAL);
        let deadline =
            Instant::now() + Duration::from_millis(self.cap.timeout_ms.max(READY_TIMEOUT_MS_MIN));
        while self.bar.read32(regs::CSTS) & regs::CSTS_SHST_MASK != regs::CSTS_SHST_COMPLETE
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    pub(super) fn disable(&self) -> Result<(), VfioError> {
        let cc = self.bar.read32(regs::CC);
        if cc & regs::CC_EN != 0 {
            self.bar.write32(regs::CC, cc & !regs::CC_EN);
        }
        self.wait_ready(false)
    }

    /// Disables the controller, installs a fresh admin queue and enables it again (Base spec,
    /// "Initialization"). Every I/O queue is gone afterwards.
    pub(super) fn enable(&self, admin: &mut AdminQueue) -> Result<(), VfioError> {
        self.disable()?;
        admin.clear();
        let n = u32::from(ADMIN_QUEUE_ENTRIES) - 1;
        self.bar.write32(regs::AQA, n | (n << 16));
        self.bar.write64(regs::ASQ, admin.sq.iova());
        self.bar.write64(regs::ACQ, admin.cq.iova());
        // NVM command set (CSS 0), 4 KiB pages (MPS 0), round robin (AMS 0).
        self.bar.write32(
            regs::CC,
            regs::CC_IOSQES_64 | regs::CC_IOCQES_16 | regs::CC_EN,
        );
        self.wait_ready(true)?;
        let want = u32::from(IO_QUEUES_MAX) - 1;
        let cmd = SubmissionEntry {
            opcode: admin_op::SET_FEATURES,
            cdw10: FEATURE_NUMBER_OF_QUEUES,
            cdw11: want | (want << 16),
            ..Default::default()
        };
        admin.run(&self.bar, "Set Features (Number of Queues)", cmd)?;
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Every queue pair is gone (each holds an Arc). Shut the controller down and stop it
        // so it touches no memory once the admin queue is unmapped; if it will not stop, keep
        // that memory.
        self.shut_down();
        if self.disable().is_err() {
            let admin = self.admin.get_mut();
            admin.sq.leak();
            admin.cq.leak();
            admin.data.leak();
        }
        if !self.irqs.is_empty() {
            let _ = sys::disable_msix(&self.device);
        }
    }
}
