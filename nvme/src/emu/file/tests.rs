//! What opening a file backing refuses, what it creates, and what it leaves alone.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::*;
use crate::emu::{EmuConfig, EmuController};
use crate::qpair::Controller;

const MIB: u64 = 1 << 20;

fn write_file(path: &Path, data: &[u8]) {
    std::fs::write(path, data).unwrap();
}

fn len_of(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

fn device(path: &Path, size: &str) -> EmuConfig {
    let text = format!("emu:dram,size={size},backing=file:{}", path.display());
    match text.parse::<crate::DeviceConfig>().unwrap() {
        crate::DeviceConfig::Emu(cfg) => cfg,
        other => panic!("not emu: {other:?}"),
    }
}

/// The typed refusal inside the `io::Error` a controller returns.
fn refusal_of(e: &io::Error) -> &FileBackingError {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<FileBackingError>())
        .unwrap_or_else(|| panic!("not a file backing refusal: {e}"))
}

#[test]
fn a_symbolic_link_is_refused_and_its_target_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("someone-elses.conf");
    write_file(&target, b"sixteen bytes!!\n");
    let link = dir.path().join("ns.img");
    std::os::unix::fs::symlink(&target, &link).unwrap();

    let err = EmuController::new(device(&link, "1M"))
        .err()
        .expect("a link is refused");
    assert!(
        matches!(refusal_of(&err), FileBackingError::Symlink { path } if *path == link.display().to_string()),
        "{err}"
    );
    assert!(
        err.to_string().contains(&link.display().to_string()),
        "{err}"
    );
    assert_eq!(len_of(&target), 16, "the link's target is not grown");

    // A dangling link is not followed to create its target either.
    let dangling = dir.path().join("dangling.img");
    let nowhere = dir.path().join("nowhere.img");
    std::os::unix::fs::symlink(&nowhere, &dangling).unwrap();
    assert!(matches!(
        FileStore::open(&dangling, MIB, false),
        Err(FileBackingError::Symlink { .. })
    ));
    assert!(!nowhere.exists(), "nothing is created through a link");
}

#[test]
fn an_existing_file_smaller_than_the_namespace_is_refused_not_grown() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.img");
    write_file(&path, &[7u8; 16]);
    let err = EmuController::new(device(&path, "1M"))
        .err()
        .expect("a small file is refused");
    match refusal_of(&err) {
        FileBackingError::TooSmall {
            file_bytes,
            size_bytes,
            ..
        } => assert_eq!((*file_bytes, *size_bytes), (16, MIB)),
        other => panic!("{other}"),
    }
    let text = err.to_string();
    for needed in [
        &path.display().to_string(),
        "16 bytes",
        "size=1048576",
        "truncate",
    ] {
        assert!(text.contains(needed), "{text:?} lacks {needed:?}");
    }
    assert_eq!(len_of(&path), 16, "the file keeps its size");
    assert_eq!(std::fs::read(&path).unwrap(), [7u8; 16]);
}

#[test]
fn a_new_file_is_created_for_its_owner_alone_and_sized_to_the_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new.img");
    let store = FileStore::open(&path, 2 * MIB, false).unwrap();
    drop(store);
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, CREATED_FILE_MODE);
    assert_eq!(meta.len(), 2 * MIB);
}

#[test]
fn a_larger_file_serves_its_first_size_bytes_and_keeps_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("large.img");
    let data: Vec<u8> = (0..2 * MIB).map(|i| (i % 251) as u8).collect();
    write_file(&path, &data);
    let ctrl = EmuController::new(device(&path, "1M")).unwrap();
    assert_eq!(ctrl.namespace().capacity_bytes(), MIB);
    drop(ctrl);
    let store = FileStore::open(&path, MIB, false).unwrap();
    let mut head = vec![0u8; 4096];
    store.file.read_exact_at(&mut head, 0).unwrap();
    assert_eq!(head[..], data[..4096], "the prefix is the file's own data");
    store.zero(0, MIB, false).unwrap();
    drop(store);
    assert_eq!(
        len_of(&path),
        2 * MIB,
        "the file is not cut to the namespace"
    );
    let back = std::fs::read(&path).unwrap();
    assert!(back[..MIB as usize].iter().all(|&b| b == 0));
    assert_eq!(
        back[MIB as usize..],
        data[MIB as usize..],
        "past the namespace: untouched"
    );
}

#[test]
fn anything_but_a_regular_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("a-directory");
    std::fs::create_dir(&sub).unwrap();
    assert!(matches!(
        FileStore::open(&sub, MIB, false),
        Err(FileBackingError::NotRegularFile {
            kind: "a directory",
            ..
        })
    ));
    let sock = dir.path().join("a-socket");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    assert!(matches!(
        FileStore::open(&sock, MIB, false),
        Err(FileBackingError::NotRegularFile {
            kind: "a socket",
            ..
        })
    ));
    let null = Path::new("/dev/null");
    let err = FileStore::open(null, MIB, false)
        .err()
        .expect("a device is refused");
    assert!(
        matches!(
            err,
            FileBackingError::NotRegularFile {
                kind: "a character device",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("/dev/null"), "{err}");
}

/// Blocks of 512 bytes the file holds on disk.
fn allocated_blocks(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks()
}

#[test]
fn deallocating_gives_the_space_back_and_zeroing_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns.img");
    let store = FileStore::open(&path, 4 * MIB, false).unwrap();
    store
        .file
        .write_all_at(&vec![0xa5; 4 * MIB as usize], 0)
        .unwrap();
    store.file.sync_data().unwrap();
    let full = allocated_blocks(&path);
    assert!(
        full >= 4 * MIB / 512,
        "written data is allocated ({full} blocks)"
    );

    store.zero(0, 2 * MIB, false).unwrap();
    store.zero(2 * MIB, 2 * MIB, true).unwrap();
    store.file.sync_data().unwrap();
    let back = std::fs::read(&path).unwrap();
    assert!(back.iter().all(|&b| b == 0), "both ranges read as zeroes");
    let after = allocated_blocks(&path);
    assert!(
        after <= full - 2 * MIB / 512 && after >= 2 * MIB / 512,
        "the deallocated half is given back, the zeroed half kept: {full} -> {after} blocks"
    );
}

/// A read-only device (a read-only export) opens its file without write access: it reads
/// the file's data, its writes, write zeroes and deallocations fail and leave the file as
/// it was, and a missing file is refused, not created.
#[test]
fn a_read_only_device_opens_its_file_without_write_access_and_creates_none() {
    use crate::sync::SyncIo;
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ro.img");
    let data: Vec<u8> = (0..MIB).map(|i| (i % 253) as u8).collect();
    write_file(&path, &data);
    let store = FileStore::open(&path, MIB, true).unwrap();
    // SAFETY: F_GETFL on a descriptor the store owns reads its flags and changes nothing.
    let flags = unsafe { libc::fcntl(store.file.as_raw_fd(), libc::F_GETFL) };
    assert_eq!(
        flags & libc::O_ACCMODE,
        libc::O_RDONLY,
        "opened for writing"
    );
    drop(store);

    let crate::DeviceConfig::Emu(cfg) = crate::DeviceConfig::Emu(device(&path, "1M")).read_only()
    else {
        unreachable!("read_only keeps the kind")
    };
    let ctrl = EmuController::new(cfg).unwrap();
    let mut qp = ctrl.create_queue_pair(8).unwrap();
    let mut io = SyncIo::new(qp.as_mut(), Duration::from_secs(10));
    assert_eq!(io.read(0, 8).unwrap()[..], data[..4096]);
    assert!(io.write(8, &[0xcd; 4096]).is_err(), "a write went through");
    assert!(
        io.write_zeroes(16, 8).is_err(),
        "a write zeroes went through"
    );
    assert!(io.deallocate(24, 8).is_err(), "a deallocate went through");
    drop(io);
    assert!(std::fs::read(&path).unwrap() == data, "the file changed");

    let missing = dir.path().join("missing.img");
    let crate::DeviceConfig::Emu(cfg) =
        crate::DeviceConfig::Emu(device(&missing, "1M")).read_only()
    else {
        unreachable!("read_only keeps the kind")
    };
    let err = EmuController::new(cfg)
        .err()
        .expect("a missing file is refused");
    assert!(
        matches!(refusal_of(&err), FileBackingError::Missing { .. }),
        "{err}"
    );
    assert!(!missing.exists(), "a read-only device created its file");
}
