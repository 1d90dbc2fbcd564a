//! Checks that opening fails with the error a user can act on: a function not bound to
//! vfio-pci, a group that is not viable, memory that cannot be pinned. They unbind the
//! function or open it in a child process, so they run after the I/O checks.

use hypoll_nvme::vfio::VfioError;
use hypoll_nvme::{Controller, VfioConfig, VfioController};

use crate::{ensure, open, Check};

fn expect_open_error(cfg: &VfioConfig, what: &str, matches: impl Fn(&VfioError) -> bool) -> Check {
    match VfioController::open(cfg) {
        Ok(_) => Err(format!("opened; expected {what}")),
        Err(e) => {
            println!("   error as the user sees it: {e}");
            ensure(matches(&e), || format!("expected {what}, got {e:?}"))
        }
    }
}

pub fn not_bound(cfg: &VfioConfig) -> Check {
    let unbind = "/sys/bus/pci/drivers/vfio-pci/unbind";
    std::fs::write(unbind, &cfg.bdf).map_err(|e| format!("{unbind}: {e}"))?;
    let result = expect_open_error(cfg, "NotBoundToVfio", |e| {
        matches!(e, VfioError::NotBoundToVfio { driver: None, .. })
            && e.to_string().contains("vfio-pci/bind")
    });
    let bind = "/sys/bus/pci/drivers/vfio-pci/bind";
    std::fs::write(bind, &cfg.bdf).map_err(|e| format!("{bind}: {e}"))?;
    result?;
    // Bound again: it opens.
    open(cfg).map(drop)
}

pub fn nonviable(bdf: &str) -> Check {
    let cfg = VfioConfig::parse(bdf)?;
    expect_open_error(
        &cfg,
        "GroupNotViable",
        |e| matches!(e, VfioError::GroupNotViable { others, .. } if !others.is_empty()),
    )
}

/// Runs in a child process: gives up CAP_IPC_LOCK, limits locked memory to 64 KiB, and
/// opens the controller, which must fail to pin its queues.
pub fn pin_child(cfg: &VfioConfig) -> Check {
    drop_cap_ipc_lock()?;
    let lim = libc::rlimit {
        rlim_cur: 64 << 10,
        rlim_max: 64 << 10,
    };
    // SAFETY: setrlimit reads one live rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) } != 0 {
        return Err(format!("setrlimit: {}", std::io::Error::last_os_error()));
    }
    let opened = VfioController::open(cfg);
    let ctrl = match opened {
        // The admin queue is 3 pages: it may fit; the queue pair's memory cannot.
        Ok(ctrl) => ctrl,
        Err(e) => {
            println!("   error as the user sees it: {e}");
            return ensure(matches!(e, VfioError::PinFailed { .. }), || {
                format!("{e:?}")
            });
        }
    };
    match ctrl.create_queue_pair(64) {
        Ok(_) => Err("a 64-deep queue pair pinned over 8 MiB under a 64 KiB limit".into()),
        Err(e) => {
            println!("   error as the user sees it: {e}");
            ensure(
                e.to_string().contains("cannot pin") && e.to_string().contains("65536 bytes"),
                || format!("{e}"),
            )
        }
    }
}

/// Clears CAP_IPC_LOCK from the effective and permitted sets (capset(2), version 3).
fn drop_cap_ipc_lock() -> Check {
    const CAP_V3: u32 = 0x2008_0522;
    const CAP_IPC_LOCK: u32 = 14;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: CAP_V3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget writes two Data structures for a version-3 header.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } != 0 {
        return Err(format!("capget: {}", std::io::Error::last_os_error()));
    }
    data[0].effective &= !(1 << CAP_IPC_LOCK);
    data[0].permitted &= !(1 << CAP_IPC_LOCK);
    // SAFETY: capset reads the header and two Data structures.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) } != 0 {
        return Err(format!("capset: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

pub fn pin_failure(cfg: &VfioConfig) -> Check {
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = std::process::Command::new(me)
        .arg(&cfg.bdf)
        .arg("--pin-child")
        .output()
        .map_err(|e| e.to_string())?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    ensure(out.status.success(), || {
        format!("child: {}", String::from_utf8_lossy(&out.stderr))
    })
}
