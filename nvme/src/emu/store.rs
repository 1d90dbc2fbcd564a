//! Backing stores of the emulated namespace: memory (eager or sparse) or a file (in
//! `file`). Data really moves: what was written is what is read back.
//!
//! Memory stores are split into 1 MiB chunks, each behind its own lock, so reactors on
//! different cores writing different regions do not contend (the locks model the device's
//! internal parallelism and sit on the device's side of the queue pair, never the host's).

use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

use parking_lot::Mutex;

use super::config::Backing;
use super::file::FileStore;

/// Bytes per memory chunk.
pub const CHUNK_BYTES: u64 = 1 << 20;

pub enum Store {
    Memory(MemoryStore),
    File(FileStore),
}

impl Store {
    pub fn open(backing: &Backing, size_bytes: u64, read_only: bool) -> io::Result<Store> {
        Ok(match backing {
            Backing::Ram => Store::Memory(MemoryStore::new(size_bytes, true)),
            Backing::Sparse => Store::Memory(MemoryStore::new(size_bytes, false)),
            Backing::File(path) => Store::File(FileStore::open(path, size_bytes, read_only)?),
        })
    }

    pub fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        match self {
            Store::Memory(m) => {
                m.read(offset, buf);
                Ok(())
            }
            Store::File(f) => f.file.read_exact_at(buf, offset),
        }
    }

    pub fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        match self {
            Store::Memory(m) => {
                m.write(offset, data);
                Ok(())
            }
            Store::File(f) => f.file.write_all_at(data, offset),
        }
    }

    /// Zeroes `len_bytes` at `offset`; `deallocate` also gives the space back where it can.
    pub fn zero(&self, offset: u64, len_bytes: u64, deallocate: bool) -> io::Result<()> {
        match self {
            Store::Memory(m) => {
                m.zero(offset, len_bytes, deallocate);
                Ok(())
            }
            Store::File(f) => f.zero(offset, len_bytes, deallocate),
        }
    }

    /// Makes completed writes durable.
    pub fn flush(&self) -> io::Result<()> {
        match self {
            Store::Memory(_) => Ok(()),
            Store::File(f) => {
                f.syncs.fetch_add(1, Ordering::Relaxed);
                f.file.sync_data()
            }
        }
    }

    /// Times [`Store::flush`] made a file backing durable (0 for memory).
    pub fn syncs(&self) -> u64 {
        match self {
            Store::Memory(_) => 0,
            Store::File(f) => f.syncs.load(Ordering::Relaxed),
        }
    }
}

/// One chunk: `None` until first written (sparse) or after a whole-chunk deallocate.
type Chunk = Mutex<Option<Box<[u8]>>>;

/// Memory split into chunks; a sparse store allocates a chunk on its first write.
pub struct MemoryStore {
    chunks: Box<[Chunk]>,
    size_bytes: u64,
}

impl MemoryStore {
    fn new(size_bytes: u64, eager: bool) -> MemoryStore {
        let count = size_bytes.div_ceil(CHUNK_BYTES) as usize;
        let chunks = (0..count)
            .map(|_| Mutex::new(eager.then(Self::new_chunk)))
            .collect();
        MemoryStore { chunks, size_bytes }
    }

    fn new_chunk() -> Box<[u8]> {
        // vec![0; n] asks the allocator for zeroed memory (calloc), which the OS maps lazily.
        vec![0u8; CHUNK_BYTES as usize].into_boxed_slice()
    }

    /// Calls `f(chunk index, offset in chunk, range in the caller's buffer)` for each chunk
    /// that `[offset, offset + len)` touches.
    fn for_each_piece(
        &self,
        offset: u64,
        len_bytes: u64,
        mut f: impl FnMut(usize, usize, std::ops::Range<usize>),
    ) {
        assert!(
            offset + len_bytes <= self.size_bytes,
            "store access past the namespace end: the controller checks ranges first"
        );
        let mut done = 0u64;
        while done < len_bytes {
            let at = offset + done;
            let in_chunk = at % CHUNK_BYTES;
            let n = (CHUNK_BYTES - in_chunk).min(len_bytes - done);
            f(
                (at / CHUNK_BYTES) as usize,
                in_chunk as usize,
                done as usize..(done + n) as usize,
            );
            done += n;
        }
    }

    fn read(&self, offset: u64, buf: &mut [u8]) {
        self.for_each_piece(offset, buf.len() as u64, |chunk, at, range| {
            let dst = &mut buf[range];
            match &*self.chunks[chunk].lock() {
                Some(data) => dst.copy_from_slice(&data[at..at + dst.len()]),
                None => dst.fill(0),
            }
        });
    }

    fn write(&self, offset: u64, data: &[u8]) {
        self.for_each_piece(offset, data.len() as u64, |chunk, at, range| {
            let src = &data[range];
            let mut slot = self.chunks[chunk].lock();
            let chunk_data = slot.get_or_insert_with(Self::new_chunk);
            chunk_data[at..at + src.len()].copy_from_slice(src);
        });
    }

    fn zero(&self, offset: u64, len_bytes: u64, deallocate: bool) {
        self.for_each_piece(offset, len_bytes, |chunk, at, range| {
            let mut slot = self.chunks[chunk].lock();
            if deallocate && range.len() as u64 == CHUNK_BYTES {
                *slot = None;
            } else if let Some(data) = slot.as_mut() {
                data[at..at + range.len()].fill(0);
            }
        });
    }

    /// Chunks that hold memory (for tests of sparseness).
    pub fn allocated_chunks(&self) -> usize {
        self.chunks.iter().filter(|c| c.lock().is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(store: &Store) {
        let data: Vec<u8> = (0..3 * CHUNK_BYTES as usize / 2).map(|i| i as u8).collect();
        // Straddles a chunk boundary.
        let offset = CHUNK_BYTES - 4096;
        store.write(offset, &data).unwrap();
        let mut back = vec![0u8; data.len()];
        store.read(offset, &mut back).unwrap();
        assert_eq!(back, data);
        store.zero(offset + 100, 1000, false).unwrap();
        store.read(offset, &mut back).unwrap();
        assert!(back[100..1100].iter().all(|&b| b == 0));
        assert_eq!(back[1100], data[1100]);
        store.flush().unwrap();
    }

    #[test]
    fn memory_and_file_stores_keep_what_was_written() {
        round_trip(&Store::open(&Backing::Ram, 4 * CHUNK_BYTES, false).unwrap());
        round_trip(&Store::open(&Backing::Sparse, 4 * CHUNK_BYTES, false).unwrap());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ns.img");
        round_trip(&Store::open(&Backing::File(path.clone()), 4 * CHUNK_BYTES, false).unwrap());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 4 * CHUNK_BYTES);
    }

    #[test]
    fn a_sparse_64_gib_namespace_costs_nothing_until_written() {
        let store = MemoryStore::new(64 << 30, false);
        assert_eq!(store.allocated_chunks(), 0);
        let mut buf = [1u8; 512];
        store.read(40 << 30, &mut buf);
        assert_eq!(buf, [0u8; 512]);
        store.write(40 << 30, &[7u8; 512]);
        assert_eq!(store.allocated_chunks(), 1);
        store.zero(40 << 30, CHUNK_BYTES, true);
        assert_eq!(store.allocated_chunks(), 0);
    }
}
