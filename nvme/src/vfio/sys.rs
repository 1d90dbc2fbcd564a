//! The VFIO kernel interface: the ioctls on the container, group and device descriptors,
//! BAR and DMA mappings, and MSI-X eventfds. This is the only file of the driver that calls
//! into the kernel; it speaks `linux/vfio.h` (UAPI, stable since Linux 3.6) through `libc`.
//!
//! Why raw ioctls rather than the rust-vmm `vfio-ioctls` crate: that crate is written for
//! VMMs and pulls in `kvm-ioctls`, `kvm-bindings` and `vmm-sys-util`; a storage driver
//! needs fourteen ioctls and six structures, written out below from the UAPI header with
//! the header's names, each call checked.
//!
//! Every `unsafe` block here is one of: an ioctl whose argument is a live, correctly sized
//! `#[repr(C)]` value owned by the caller; an `mmap`/`munmap` of a range this module owns;
//! or a read/write of a plain integer through such a mapping.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

/// `VFIO_TYPE` and `VFIO_BASE`: VFIO ioctls are `_IO(';', 100 + n)`, with no size encoded.
const fn vfio_io(nr: u64) -> u64 {
    ((b';' as u64) << 8) | (100 + nr)
}

pub const VFIO_GET_API_VERSION: u64 = vfio_io(0);
pub const VFIO_CHECK_EXTENSION: u64 = vfio_io(1);
pub const VFIO_SET_IOMMU: u64 = vfio_io(2);
pub const VFIO_GROUP_GET_STATUS: u64 = vfio_io(3);
pub const VFIO_GROUP_SET_CONTAINER: u64 = vfio_io(4);
pub const VFIO_GROUP_GET_DEVICE_FD: u64 = vfio_io(6);
pub const VFIO_DEVICE_GET_REGION_INFO: u64 = vfio_io(8);
pub const VFIO_DEVICE_GET_IRQ_INFO: u64 = vfio_io(9);
pub const VFIO_DEVICE_SET_IRQS: u64 = vfio_io(10);
pub const VFIO_IOMMU_MAP_DMA: u64 = vfio_io(13);
pub const VFIO_IOMMU_UNMAP_DMA: u64 = vfio_io(14);

pub const VFIO_API_VERSION: i32 = 0;
pub const VFIO_TYPE1_IOMMU: u64 = 1;
pub const VFIO_TYPE1V2_IOMMU: u64 = 3;

pub const VFIO_GROUP_FLAGS_VIABLE: u32 = 1 << 0;

pub const VFIO_REGION_INFO_FLAG_MMAP: u32 = 1 << 2;
pub const VFIO_REGION_INFO_FLAG_CAPS: u32 = 1 << 3;
pub const VFIO_REGION_INFO_CAP_SPARSE_MMAP: u16 = 1;

pub const VFIO_PCI_BAR0_REGION_INDEX: u32 = 0;
pub const VFIO_PCI_CONFIG_REGION_INDEX: u32 = 7;
pub const VFIO_PCI_MSIX_IRQ_INDEX: u32 = 2;

pub const VFIO_IRQ_SET_DATA_NONE: u32 = 1 << 0;
pub const VFIO_IRQ_SET_DATA_EVENTFD: u32 = 1 << 2;
pub const VFIO_IRQ_SET_ACTION_TRIGGER: u32 = 1 << 5;

pub const VFIO_DMA_MAP_FLAG_READ: u32 = 1 << 0;
pub const VFIO_DMA_MAP_FLAG_WRITE: u32 = 1 << 1;

/// PCI configuration space: the Command register and its enable bits.
pub const PCI_COMMAND: u64 = 0x04;
pub const PCI_COMMAND_MEMORY: u16 = 1 << 1;
pub const PCI_COMMAND_MASTER: u16 = 1 << 2;

#[repr(C)]
#[derive(Default)]
struct GroupStatus {
    argsz: u32,
    flags: u32,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
pub struct RegionInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub cap_offset: u32,
    pub size: u64,
    pub offset: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
pub struct IrqInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub count: u32,
}

#[repr(C)]
struct DmaMap {
    argsz: u32,
    flags: u32,
    vaddr: u64,
    iova: u64,
    size: u64,
}

#[repr(C)]
struct DmaUnmap {
    argsz: u32,
    flags: u32,
    iova: u64,
    size: u64,
}

/// Most MSI-X vectors one `VFIO_DEVICE_SET_IRQS` call hands eventfds for.
pub const IRQ_VECTORS_MAX: usize = 64;

#[repr(C)]
struct IrqSet {
    argsz: u32,
    flags: u32,
    index: u32,
    start: u32,
    count: u32,
    fds: [i32; IRQ_VECTORS_MAX],
}

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Opens `path` read-write, close-on-exec.
pub fn open_rw(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))?;
    // SAFETY: `c` is a NUL-terminated path that lives for the call.
    let fd = cvt(unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) })?;
    // SAFETY: `fd` was just returned by open and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// An ioctl that takes an integer argument (or none).
fn ioctl_val(fd: RawFd, request: u64, arg: u64) -> io::Result<libc::c_int> {
    // SAFETY: these requests take their argument by value; no memory is passed.
    cvt(unsafe { libc::ioctl(fd, request as _, arg) })
}

/// An ioctl that reads and/or writes the `#[repr(C)]` value `arg`.
///
/// # Safety
/// `request` must be an ioctl whose argument is a `T` (the VFIO structure it names), with
/// `argsz` set so the kernel touches no byte outside `*arg`.
unsafe fn ioctl_ptr<T>(fd: RawFd, request: u64, arg: *mut T) -> io::Result<libc::c_int> {
    // SAFETY: the caller promises `arg` is the structure `request` expects.
    cvt(unsafe { libc::ioctl(fd, request as _, arg) })
}

pub fn api_version(container: &OwnedFd) -> io::Result<i32> {
    ioctl_val(container.as_raw_fd(), VFIO_GET_API_VERSION, 0)
}

pub fn check_extension(container: &OwnedFd, ext: u64) -> io::Result<bool> {
    Ok(ioctl_val(container.as_raw_fd(), VFIO_CHECK_EXTENSION, ext)? > 0)
}

pub fn set_iommu(container: &OwnedFd, kind: u64) -> io::Result<()> {
    ioctl_val(container.as_raw_fd(), VFIO_SET_IOMMU, kind).map(drop)
}

/// The group's flags (`VFIO_GROUP_FLAGS_*`).
pub fn group_flags(group: &OwnedFd) -> io::Result<u32> {
    let mut status = GroupStatus {
        argsz: std::mem::size_of::<GroupStatus>() as u32,
        flags: 0,
    };
    // SAFETY: VFIO_GROUP_GET_STATUS takes a vfio_group_status, which `status` is.
    unsafe { ioctl_ptr(group.as_raw_fd(), VFIO_GROUP_GET_STATUS, &mut status) }?;
    Ok(status.flags)
}

pub fn group_set_container(group: &OwnedFd, container: &OwnedFd) -> io::Result<()> {
    let mut fd: i32 = container.as_raw_fd();
    // SAFETY: VFIO_GROUP_SET_CONTAINER reads one int, the container descriptor.
    unsafe { ioctl_ptr(group.as_raw_fd(), VFIO_GROUP_SET_CONTAINER, &mut fd) }.map(drop)
}

pub fn group_device_fd(group: &OwnedFd, bdf: &str) -> io::Result<OwnedFd> {
    let name = CString::new(bdf)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "address holds a NUL"))?;
    // SAFETY: VFIO_GROUP_GET_DEVICE_FD reads a NUL-terminated device name.
    let fd = unsafe {
        ioctl_ptr(
            group.as_raw_fd(),
            VFIO_GROUP_GET_DEVICE_FD,
            name.as_ptr().cast_mut(),
        )
    }?;
    // SAFETY: on success the ioctl returns a new descriptor that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Region `index`'s size, offset and flags; `sparse_first` is the first mmap-able area
/// (offset, size) when the region lists sparse areas (a BAR that holds the MSI-X table).
pub fn region_info(device: &OwnedFd, index: u32) -> io::Result<(RegionInfo, Option<(u64, u64)>)> {
    const BUF_WORDS: usize = 64;
    // A buffer large enough for the info and its capability chain, u64-aligned.
    let mut buf = [0u64; BUF_WORDS];
    let info = RegionInfo {
        argsz: (BUF_WORDS * 8) as u32,
        index,
        ..RegionInfo::default()
    };
    // SAFETY: RegionInfo (32 bytes) fits at the start of the 512-byte, 8-aligned buffer.
    unsafe { buf.as_mut_ptr().cast::<RegionInfo>().write(info) };
    // SAFETY: VFIO_DEVICE_GET_REGION_INFO takes a vfio_region_info followed by up to
    // argsz - 32 bytes of capabilities; argsz is the buffer's size.
    unsafe {
        ioctl_ptr(
            device.as_raw_fd(),
            VFIO_DEVICE_GET_REGION_INFO,
            buf.as_mut_ptr(),
        )
    }?;
    // SAFETY: the buffer starts with the RegionInfo the kernel filled in.
    let info = unsafe { buf.as_ptr().cast::<RegionInfo>().read() };
    let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let mut sparse = None;
    if info.flags & VFIO_REGION_INFO_FLAG_CAPS != 0 {
        let mut at = info.cap_offset as usize;
        let mut hops = 0;
        while at != 0 && at + 16 <= bytes.len() && hops < 16 {
            let id = u16::from_ne_bytes([bytes[at], bytes[at + 1]]);
            let next = u32::from_ne_bytes(bytes[at + 4..at + 8].try_into().expect("4 bytes"));
            if id == VFIO_REGION_INFO_CAP_SPARSE_MMAP {
                let nr = u32::from_ne_bytes(bytes[at + 8..at + 12].try_into().expect("4"));
                if nr > 0 && at + 32 <= bytes.len() {
                    let off = u64::from_ne_bytes(bytes[at + 16..at + 24].try_into().expect("8"));
                    let size = u64::from_ne_bytes(bytes[at + 24..at + 32].try_into().expect("8"));
                    sparse = Some((off, size));
                }
            }
            at = next as usize;
            hops += 1;
        }
    }
    Ok((info, sparse))
}

pub fn irq_info(device: &OwnedFd, index: u32) -> io::Result<IrqInfo> {
    let mut info = IrqInfo {
        argsz: std::mem::size_of::<IrqInfo>() as u32,
        index,
        ..IrqInfo::default()
    };
    // SAFETY: VFIO_DEVICE_GET_IRQ_INFO takes a vfio_irq_info, which `info` is.
    unsafe { ioctl_ptr(device.as_raw_fd(), VFIO_DEVICE_GET_IRQ_INFO, &mut info) }?;
    Ok(info)
}

/// Routes MSI-X vectors 0..fds.len() to the eventfds `fds` (at most [`IRQ_VECTORS_MAX`]).
pub fn set_msix_eventfds(device: &OwnedFd, fds: &[RawFd]) -> io::Result<()> {
    assert!(
        fds.len() <= IRQ_VECTORS_MAX,
        "at most {IRQ_VECTORS_MAX} vectors"
    );
    let mut set = IrqSet {
        argsz: (20 + 4 * fds.len()) as u32,
        flags: VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
        index: VFIO_PCI_MSIX_IRQ_INDEX,
        start: 0,
        count: fds.len() as u32,
        fds: [-1; IRQ_VECTORS_MAX],
    };
    set.fds[..fds.len()].copy_from_slice(fds);
    // SAFETY: VFIO_DEVICE_SET_IRQS takes a vfio_irq_set with `count` s32 eventfds after it;
    // argsz covers exactly those, all inside `set`.
    unsafe { ioctl_ptr(device.as_raw_fd(), VFIO_DEVICE_SET_IRQS, &mut set) }.map(drop)
}

/// Turns MSI-X off again (count 0, no data).
pub fn disable_msix(device: &OwnedFd) -> io::Result<()> {
    let mut set = IrqSet {
        argsz: 20,
        flags: VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
        index: VFIO_PCI_MSIX_IRQ_INDEX,
        start: 0,
        count: 0,
        fds: [-1; IRQ_VECTORS_MAX],
    };
    // SAFETY: as in set_msix_eventfds, with no eventfds (argsz is the 20-byte header).
    unsafe { ioctl_ptr(device.as_raw_fd(), VFIO_DEVICE_SET_IRQS, &mut set) }.map(drop)
}

/// Maps `size_bytes` of this process's memory at `vaddr` for the device at `iova`, read and
/// write. The kernel pins the pages (counted against RLIMIT_MEMLOCK without CAP_IPC_LOCK).
///
/// # Safety
/// `vaddr..vaddr + size_bytes` must be memory this process owns and keeps mapped until
/// [`unmap_dma`] has returned for the same IOVA range: from now on the device may write it.
pub unsafe fn map_dma(
    container: &OwnedFd,
    vaddr: u64,
    iova: u64,
    size_bytes: u64,
) -> io::Result<()> {
    let mut map = DmaMap {
        argsz: std::mem::size_of::<DmaMap>() as u32,
        flags: VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE,
        vaddr,
        iova,
        size: size_bytes,
    };
    // SAFETY: VFIO_IOMMU_MAP_DMA takes a vfio_iommu_type1_dma_map, which `map` is; the
    // caller vouches for the memory it names.
    unsafe { ioctl_ptr(container.as_raw_fd(), VFIO_IOMMU_MAP_DMA, &mut map) }.map(drop)
}

pub fn unmap_dma(container: &OwnedFd, iova: u64, size_bytes: u64) -> io::Result<()> {
    let mut unmap = DmaUnmap {
        argsz: std::mem::size_of::<DmaUnmap>() as u32,
        flags: 0,
        iova,
        size: size_bytes,
    };
    // SAFETY: VFIO_IOMMU_UNMAP_DMA takes a vfio_iommu_type1_dma_unmap, which `unmap` is.
    unsafe { ioctl_ptr(container.as_raw_fd(), VFIO_IOMMU_UNMAP_DMA, &mut unmap) }.map(drop)
}

/// Reads a u16 from the device's PCI configuration space.
pub fn config_read_u16(device: &OwnedFd, config_offset: u64, reg: u64) -> io::Result<u16> {
    let mut v = [0u8; 2];
    // SAFETY: reads 2 bytes into a live 2-byte array.
    let n = unsafe {
        libc::pread(
            device.as_raw_fd(),
            v.as_mut_ptr().cast(),
            2,
            (config_offset + reg) as libc::off_t,
        )
    };
    if n != 2 {
        return Err(io::Error::last_os_error());
    }
    Ok(u16::from_le_bytes(v))
}

pub fn config_write_u16(device: &OwnedFd, config_offset: u64, reg: u64, v: u16) -> io::Result<()> {
    let bytes = v.to_le_bytes();
    // SAFETY: writes 2 bytes from a live 2-byte array.
    let n = unsafe {
        libc::pwrite(
            device.as_raw_fd(),
            bytes.as_ptr().cast(),
            2,
            (config_offset + reg) as libc::off_t,
        )
    };
    if n != 2 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// An anonymous or device mapping, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: *mut u8,
    len_bytes: usize,
}

// SAFETY: a Mapping is an address range; who may touch the bytes is governed by the types
// that hold it (registers through volatile access, DMA memory through its owner).
unsafe impl Send for Mapping {}
// SAFETY: as above; Mapping itself hands out only the raw pointer.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// `len_bytes` of zeroed, populated, private anonymous memory.
    pub fn anonymous(len_bytes: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len_bytes,
        })
    }

    /// Maps `len_bytes` of the device region at file offset `offset` (a BAR), shared.
    pub fn device(device: &OwnedFd, offset: u64, len_bytes: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh shared mapping of the device's region; no existing memory changes.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                device.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len_bytes,
        })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the range mmap returned; nothing references it any more
        // (owners unmap DMA before dropping the memory, or leak the Mapping).
        unsafe { libc::munmap(self.ptr.cast(), self.len_bytes) };
    }
}

/// Reads a 32-bit register at `offset` bytes into a device mapping.
///
/// # Safety
/// `offset + 4` must be within the mapping, 4-aligned, and the mapping must be MMIO (or
/// memory) that may be read at any time.
pub unsafe fn mmio_read32(map: &Mapping, offset: usize) -> u32 {
    debug_assert!(offset + 4 <= map.len_bytes && offset.is_multiple_of(4));
    // SAFETY: in bounds and aligned per the caller; volatile so the load really happens.
    unsafe { map.ptr.add(offset).cast::<u32>().read_volatile() }
}

/// Writes a 32-bit register.
///
/// # Safety
/// As [`mmio_read32`], and the write must be one the device expects.
pub unsafe fn mmio_write32(map: &Mapping, offset: usize, value: u32) {
    debug_assert!(offset + 4 <= map.len_bytes && offset.is_multiple_of(4));
    // SAFETY: in bounds and aligned per the caller; volatile so the store really happens.
    unsafe { map.ptr.add(offset).cast::<u32>().write_volatile(value) }
}

/// RLIMIT_MEMLOCK's soft limit in bytes (`None` = unlimited), for error messages.
pub fn memlock_limit_bytes() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into a live value.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(lim.rlim_cur)
    }
}

/// An epoll instance watching one descriptor, whose interest can be switched on and off:
/// the queue pair's interrupt fd, readable only while armed (the MSI-X eventfd under it
/// counts every interrupt, armed or not).
#[derive(Debug)]
pub struct Gate {
    epoll: OwnedFd,
    watched: RawFd,
}

impl Gate {
    /// Watches `watched` (which must outlive the gate) with interest off.
    pub fn new(watched: RawFd) -> io::Result<Gate> {
        // SAFETY: plain syscall; on success the descriptor is ours alone.
        let raw = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(raw) };
        let gate = Gate { epoll, watched };
        gate.ctl(libc::EPOLL_CTL_ADD, 0)?;
        Ok(gate)
    }

    fn ctl(&self, op: libc::c_int, events: u32) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: 0 };
        // SAFETY: one live epoll_event for a descriptor the owner keeps open.
        cvt(unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, self.watched, &mut ev) }).map(drop)
    }

    /// Makes the gate readable whenever the watched fd is.
    pub fn open(&self) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, libc::EPOLLIN as u32)
    }

    /// Makes the gate unreadable whatever the watched fd does.
    pub fn close(&self) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, 0)
    }

    pub fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.epoll.as_fd()
    }
}
