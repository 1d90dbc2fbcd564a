//! hypoll-nvme: NVMe command and completion types, the [`QueuePair`] trait that every hypoll
//! device implements, the emulated NVMe controller (the project's default device) and the
//! zero-latency `null` device.
//!
//! Open a device from a device string and drive it one command at a time:
//!
//! ```
//! use std::time::Duration;
//! use hypoll_nvme::{DeviceConfig, SyncIo};
//!
//! let ctrl = "emu:optane,size=64M".parse::<DeviceConfig>()?.open()?;
//! let mut qp = ctrl.create_queue_pair(32)?;
//! let mut io = SyncIo::new(&mut *qp, Duration::from_secs(1));
//! io.write(8, &[0xab; 4096])?;
//! assert_eq!(&io.read(8, 8)?[..], &[0xab; 4096][..]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A reactor drives a queue pair with [`QueuePair::submit`] and
//! [`QueuePair::process_completions`] instead, many commands in flight.

pub mod buf;
pub mod clock;
pub mod command;
pub mod config;
pub mod device;
pub mod emu;
pub mod fabrics;
pub mod null;
pub mod nvmetcp;
mod pool;
pub mod qpair;
pub mod region;
pub mod spec;
pub mod sync;
pub mod sys;
pub mod tcp;
pub mod uring;
pub mod vfio;
pub mod vhost_user;

pub use buf::IoBuf;
pub use clock::{Clock, VirtualClock};
pub use config::{parse_size_bytes, ConfigError};
pub use device::DeviceConfig;
pub use emu::{EmuConfig, EmuController, EmuQueuePair};
pub use null::{NullConfig, NullController, NullQueuePair};
pub use nvmetcp::{NvmeTcpConfig, NvmeTcpController, NvmeTcpQueuePair};
pub use qpair::{
    Command, Completion, Controller, QueuePair, QueuePairError, RecoveryError, Segment,
    SegmentError, SubmitError, QUEUE_DEPTH_MAX, SEGMENTS_MAX,
};
pub use region::{
    MemoryRegion, RegionError, RegisterError, UnregisterError, REGIONS_MAX, REGION_ALIGN_BYTES,
    REGION_BYTES_MAX,
};
pub use spec::{NamespaceInfo, Opcode, Status};
pub use sync::{IoError, SyncIo};
pub use sys::{monotonic_ns, wait_readable};
pub use uring::{
    io_uring_threads_cpu_ns, CompletionMode, IopollMode, TaskRun, UringConfig, UringController,
    UringQueuePair,
};
pub use vfio::{VfioConfig, VfioController, VfioQueuePair};
