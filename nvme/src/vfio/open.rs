//! Bringing a controller up: the IOMMU group joins a type-1 container, the function's
//! memory decoding and bus mastering are turned on, BAR0 is mapped, MSI-X vectors are
//! routed to eventfds, and the controller is enabled and identified.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use parking_lot::Mutex;

use super::admin::{
    parse_identify_namespace, AdminQueue, ControllerIdentity, CNS_CONTROLLER, CNS_NAMESPACE,
};
use super::error::os;
use super::sysfs::{group_offenders, locate};
use super::{
    dma, regs, sys, Inner, VfioConfig, VfioController, VfioError, IO_QUEUES_MAX, TRANSFER_BYTES_MAX,
};
use crate::spec::NamespaceInfo;
use crate::sys::EventFd;

impl VfioController {
    /// Opens the PCI function `cfg.bdf` and brings the controller up.
    pub fn open(cfg: &VfioConfig) -> Result<VfioController, VfioError> {
        let group_id = locate(&cfg.bdf, &cfg.paths)?;
        let container_fd =
            sys::open_rw(&cfg.paths.dev.join("vfio/vfio")).map_err(os("opening /dev/vfio/vfio"))?;
        let version = sys::api_version(&container_fd).map_err(os("VFIO_GET_API_VERSION"))?;
        if version != sys::VFIO_API_VERSION {
            return Err(VfioError::Controller(format!(
                "speaks VFIO API version {version}, this driver knows {}",
                sys::VFIO_API_VERSION
            )));
        }
        let group_path = cfg.paths.dev.join(format!("vfio/{group_id}"));
        let group = sys::open_rw(&group_path).map_err(|e| match e.raw_os_error() {
            Some(libc::EBUSY) => VfioError::Controller(format!(
                "IOMMU group {group_id} is already open in another process ({group_path:?} is \
                 busy): VFIO lets one process own a group at a time"
            )),
            _ => VfioError::Os {
                what: "opening the IOMMU group",
                source: e,
            },
        })?;
        let flags = sys::group_flags(&group).map_err(os("VFIO_GROUP_GET_STATUS"))?;
        if flags & sys::VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(VfioError::GroupNotViable {
                bdf: cfg.bdf.clone(),
                group: group_id,
                others: group_offenders(group_id, &cfg.paths),
            });
        }
        sys::group_set_container(&group, &container_fd)
            .map_err(os("adding the group to the container"))?;
        let iommu = if sys::check_extension(&container_fd, sys::VFIO_TYPE1V2_IOMMU).unwrap_or(false)
        {
            sys::VFIO_TYPE1V2_IOMMU
        } else if sys::check_extension(&container_fd, sys::VFIO_TYPE1_IOMMU).unwrap_or(false) {
            sys::VFIO_TYPE1_IOMMU
        } else {
            return Err(VfioError::Controller(
                "has no type-1 IOMMU: load vfio_iommu_type1".into(),
            ));
        };
        sys::set_iommu(&container_fd, iommu).map_err(os("VFIO_SET_IOMMU"))?;
        let device =
            sys::group_device_fd(&group, &cfg.bdf).map_err(os("VFIO_GROUP_GET_DEVICE_FD"))?;
        let container = Arc::new(dma::Container::new(container_fd));

        // Memory decoding and bus mastering on: the controller may now DMA.
        let (config, _) = sys::region_info(&device, sys::VFIO_PCI_CONFIG_REGION_INDEX)
            .map_err(os("reading the config space region"))?;
        let command = sys::config_read_u16(&device, config.offset, sys::PCI_COMMAND)
            .map_err(os("reading the PCI command register"))?;
        sys::config_write_u16(
            &device,
            config.offset,
            sys::PCI_COMMAND,
            command | sys::PCI_COMMAND_MEMORY | sys::PCI_COMMAND_MASTER,
        )
        .map_err(os("enabling bus mastering"))?;

        let bar = map_bar0(&device)?;
        let cap = regs::Cap::parse(bar.read64(regs::CAP));
        let mut bar = bar;
        bar.set_doorbell_stride(cap.dstrd);
        if !cap.nvm_css {
            return Err(VfioError::Controller(
                "does not support the NVM command set".into(),
            ));
        }
        if cap.mpsmin_shift > 12 {
            return Err(VfioError::Controller(format!(
                "needs pages of at least {} bytes; this driver uses 4 KiB",
                1u64 << cap.mpsmin_shift
            )));
        }
        let irqs = setup_msix(&device)?;

        let admin = AdminQueue::new(&container)?;
        let pool = dma::PoolWindow::map(&container);
        let mut inner = Inner {
            cfg: cfg.clone(),
            bar,
            cap,
            admin: Mutex::new(admin),
            qids: Mutex::new(Vec::new()),
            generation: AtomicU64::new(0),
            ns: NamespaceInfo {
                nsid: 1,
                lba_size_bytes: 512,
                capacity_lbas: 0,
                transfer_bytes_max: TRANSFER_BYTES_MAX,
            },
            identity: ControllerIdentity {
                model: String::new(),
                serial: String::new(),
                firmware: String::new(),
                mdts_bytes: None,
                namespaces: 0,
                oncs: 0,
            },
            irqs,
            pool,
            container,
            device,
            _group: group,
        };
        let (identity, ns) = {
            let mut admin = inner.admin.lock();
            inner.enable(&mut admin)?;
            let ctrl = admin.identify(&inner.bar, CNS_CONTROLLER, 0)?;
            let identity = ControllerIdentity::parse(&ctrl, 1 << cap.mpsmin_shift);
            if identity.namespaces == 0 {
                return Err(VfioError::Controller("has no namespaces".into()));
            }
            let nsdata = admin.identify(&inner.bar, CNS_NAMESPACE, 1)?;
            let (capacity_lbas, lba_size_bytes) = parse_identify_namespace(&nsdata)
                .map_err(|e| VfioError::Controller(format!("namespace 1: {e}")))?;
            let transfer_bytes_max = identity.mdts_bytes.map_or(TRANSFER_BYTES_MAX, |m| {
                m.min(u64::from(TRANSFER_BYTES_MAX)) as u32
            });
            let ns = NamespaceInfo {
                nsid: 1,
                lba_size_bytes,
                capacity_lbas,
                transfer_bytes_max,
            };
            (identity, ns)
        };
        inner.identity = identity;
        inner.ns = ns;
        let mut queues = usize::from(IO_QUEUES_MAX).min(inner.bar.queues_mapped() - 1);
        if !inner.irqs.is_empty() {
            queues = queues.min(inner.irqs.len() - 1);
        }
        inner.qids = Mutex::new(vec![false; queues]);
        Ok(VfioController {
            inner: Arc::new(inner),
        })
    }
}

/// Maps BAR0: whole if the kernel allows it, else its first mmap-able area (the registers
/// and doorbells; the MSI-X table that shares the BAR stays with the kernel).
fn map_bar0(device: &OwnedFd) -> Result<regs::Bar, VfioError> {
    let (info, sparse) = sys::region_info(device, sys::VFIO_PCI_BAR0_REGION_INDEX)
        .map_err(os("reading BAR0's region info"))?;
    if info.flags & sys::VFIO_REGION_INFO_FLAG_MMAP == 0 {
        return Err(VfioError::Controller(
            "BAR0 cannot be mmapped (vfio-pci built without VFIO_PCI_MMAP?)".into(),
        ));
    }
    let whole = sys::Mapping::device(device, info.offset, info.size as usize);
    let map = match (whole, sparse) {
        (Ok(m), _) => m,
        (Err(_), Some((0, size))) if size as usize > regs::DOORBELL_BASE => {
            sys::Mapping::device(device, info.offset, size as usize).map_err(os("mmap of BAR0"))?
        }
        (Err(e), _) => return Err(os("mmap of BAR0")(e)),
    };
    if map.len_bytes() < regs::DOORBELL_BASE + 16 {
        return Err(VfioError::Controller(format!(
            "BAR0 maps only {} bytes: too small for NVMe registers and doorbells",
            map.len_bytes()
        )));
    }
    Ok(regs::Bar::new(map))
}

/// Routes every MSI-X vector (up to 1 + IO_QUEUES_MAX) to its own eventfd; none if the
/// function has no MSI-X.
fn setup_msix(device: &OwnedFd) -> Result<Vec<EventFd>, VfioError> {
    let info = sys::irq_info(device, sys::VFIO_PCI_MSIX_IRQ_INDEX)
        .map_err(os("reading the MSI-X interrupt info"))?;
    let count = (info.count as usize)
        .min(usize::from(IO_QUEUES_MAX) + 1)
        .min(sys::IRQ_VECTORS_MAX);
    if count < 2 {
        return Ok(Vec::new());
    }
    let fds: Vec<EventFd> = (0..count)
        .map(|_| EventFd::new())
        .collect::<Result<_, _>>()
        .map_err(os("creating interrupt eventfds"))?;
    let raw: Vec<i32> = fds.iter().map(|f| f.as_fd().as_raw_fd()).collect();
    sys::set_msix_eventfds(device, &raw).map_err(os("routing MSI-X to eventfds"))?;
    Ok(fds)
}
