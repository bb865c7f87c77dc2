//! The object store: one sparse local file per (inode, stripe) under the data directory,
//! created lazily by the first write (a file create touches only the meta server).
//!
//! ## On-disk layout
//! | path                                    | contents                                      |
//! |-----------------------------------------|-----------------------------------------------|
//! | `server-id`                             | the server id, decimal, then `\n` (see [`crate::identity`]) |
//! | `objects/<inode % 256, 2 hex>/`         | 256 shard directories, made at start          |
//! | `objects/<sh>/<inode, 16 hex>.<stripe>` | the object: bytes at their object offsets; holes read as zeros |
//!
//! Objects carry no header: the file *is* the data, so a read is one `pread` and an object
//! can be inspected with ordinary tools. Durability is what `fdatasync` gives on the local
//! file system: after a `SyncObjects` reply, every byte written before it is on stable
//! storage; without a sync, a crash may lose recent writes (never reorder them into place).
//!
//! ## Object count
//! Start-up must not be slow however many objects there are (DESIGN.md §2), so the count is
//! not computed before ready: [`ObjectStore::count_objects`] scans the 256 shard directories
//! in a background task after the server is ready. Each shard has a counter guarded by a
//! lock that is also held around object creation and removal in that shard; before a shard is
//! scanned, creations and removals there do not touch its counter (the scan will see the
//! result), after it they do. So the final count is exact, never double-counted, and until
//! the scan finishes [`ObjectStore::object_count`] reports a partial count and says so.
//!
//! There is no per-object lock on the data path: reads and writes go straight to the engine
//! with the cached `Arc<File>`.

use std::collections::{BTreeSet, HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use freeflow_proto::io::{AllocateMode, ObjectSpace};
use freeflow_types::{limits, InodeId, ObjectId, ServerId};

mod files;
mod listing;

pub use files::{shard_of, Space, SHARD_COUNT};

use files::{
    allocate_range, blocking, check_range, copy_object_range, create_object, lock, lock_set,
    open_object, remove_object, statvfs, ShardCount,
};

use crate::engine::DiskEngine;
use crate::error::{object_name, StoreError};
use crate::fd_cache::FdCache;

/// Most objects one `SyncObjects` may name, and most syncs run at once for it: a request
/// cannot make the server hold more descriptors than this.
pub const SYNC_OBJECTS_MAX: usize = 4096;
const SYNC_CONCURRENCY_MAX: usize = 64;

/// How many recently removed inodes are remembered. A write that arrives for one of them
/// (a straggler from a client that timed out before the file was deleted) is refused
/// instead of recreating an object that nothing would ever remove. Kept in memory: after a
/// restart the window starts empty, which only reopens that (already unlikely) leak.
const REMOVED_INODES_REMEMBERED: usize = 65536;

/// A bounded first-in first-out set of removed inodes.
#[derive(Default)]
struct RemovedInodes {
    order: VecDeque<InodeId>,
    members: HashSet<InodeId>,
}

impl RemovedInodes {
    fn insert(&mut self, inode: InodeId) {
        if self.members.insert(inode) {
            self.order.push_back(inode);
            if self.order.len() > REMOVED_INODES_REMEMBERED {
                if let Some(oldest) = self.order.pop_front() {
                    self.members.remove(&oldest);
                }
            }
        }
    }
}

/// The number of objects, and whether the start-up scan has finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ObjectCount {
    pub objects: u64,
    /// False while the background scan runs: `objects` then counts only scanned shards
    /// (and what was created in them since).
    pub complete: bool,
}

pub struct ObjectStore {
    server_id: ServerId,
    data_dir: PathBuf,
    objects_dir: PathBuf,
    engine: Arc<dyn DiskEngine>,
    cache: FdCache,
    /// One counter per shard directory, shared with the blocking tasks that create and
    /// remove objects.
    shards: Arc<[Mutex<ShardCount>]>,
    count_complete: AtomicBool,
    /// Objects created since their shard directory was last synced: their directory entry
    /// is made durable by the next sync that names them.
    created_unsynced: Mutex<HashSet<ObjectId>>,
    removed: Mutex<RemovedInodes>,
    /// The last stamp given to an [`ObjectSpace`] report (see [`ObjectStore::next_stamp`]).
    last_stamp: AtomicU64,
    /// O_DIRECT for large aligned requests, when the config asks for it.
    direct: Option<DirectIo>,
    /// Reads served from the page cache in the calling task (see [`CACHED_READ_MAX`]).
    cached_reads: AtomicU64,
    /// False when the config turns cached reads off, or once the file system refused
    /// `RWF_NOWAIT`: then every read goes to the engine.
    cached_reads_on: AtomicBool,
}

/// Reads up to this long are first tried against the page cache in the request's own task,
/// with `preadv2(RWF_NOWAIT)`, which copies what is cached and never waits for the disk: a
/// cached read answered there skips the engine's path (the thread engine's two thread hops,
/// on this 2-core machine a third of a small read's cost; the io_uring engine's pool buffer,
/// ring slot and lock). Anything not wholly cached goes to the engine as before. Larger
/// reads always go to the engine: their copy is better done off the tasks' threads.
pub const CACHED_READ_MAX: u32 = 128 << 10;

/// Bytes of memory, offset and length a request must be a multiple of to go through O_DIRECT.
pub const DIRECT_ALIGNMENT: u64 = 4096;

/// Large aligned writes (and reads, with the io_uring engine, whose buffers are page
/// aligned) go through a second descriptor of the object opened with O_DIRECT: no copy into
/// the page cache and no write-back work later. Everything else, and everything on a file
/// system that refuses O_DIRECT, uses the cached descriptor. Linux keeps the two coherent
/// (a direct write drops the cached pages of its range; a direct read first writes back
/// dirty pages of its range).
struct DirectIo {
    min_bytes: u64,
    reads: bool,
    cache: FdCache,
    /// Set when the file system refused an O_DIRECT open: from then on, none is tried.
    refused: AtomicBool,
    reads_done: AtomicU64,
    writes_done: AtomicU64,
}

impl DirectIo {
    /// The file system refused O_DIRECT: from now on every request uses the page cache.
    fn refuse(&self, data_dir: &Path) {
        if !self.refused.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                data_dir = %data_dir.display(),
                "the file system refuses O_DIRECT: every request uses the page cache"
            );
        }
    }
}

/// Device and inode of an open file: which file a descriptor is.
fn file_identity(file: &File) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    file.metadata()
        .ok()
        .map(|metadata| (metadata.dev(), metadata.ino()))
}

/// Requests that went through O_DIRECT since the start (for metrics and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DirectCounts {
    pub reads: u64,
    pub writes: u64,
}

impl ObjectStore {
    /// Opens the store in `data_dir` (whose identity the caller has already checked) and makes
    /// the shard directories. O(1) in the number of objects.
    pub fn open(
        server_id: ServerId,
        data_dir: &Path,
        engine: Arc<dyn DiskEngine>,
        open_files_max: usize,
    ) -> io::Result<ObjectStore> {
        let objects_dir = data_dir.join("objects");
        for shard in 0..SHARD_COUNT {
            std::fs::create_dir_all(objects_dir.join(format!("{shard:02x}")))?;
        }
        Ok(ObjectStore {
            server_id,
            data_dir: data_dir.to_path_buf(),
            objects_dir,
            engine,
            cache: FdCache::new(open_files_max),
            shards: (0..SHARD_COUNT)
                .map(|_| Mutex::new(ShardCount::default()))
                .collect::<Vec<_>>()
                .into(),
            count_complete: AtomicBool::new(false),
            created_unsynced: Mutex::default(),
            removed: Mutex::default(),
            last_stamp: AtomicU64::new(0),
            direct: None,
            cached_reads: AtomicU64::new(0),
            cached_reads_on: AtomicBool::new(true),
        })
    }

    /// Send requests of at least `min_bytes` whose offset, length and memory are aligned to
    /// [`DIRECT_ALIGNMENT`] through O_DIRECT: writes always, reads when `reads` (the engine
    /// reads into page-aligned buffers). `open_files_max` bounds the direct descriptors.
    pub fn use_direct_io(&mut self, min_bytes: u64, reads: bool, open_files_max: usize) {
        self.direct = Some(DirectIo {
            min_bytes: min_bytes.max(DIRECT_ALIGNMENT),
            reads,
            cache: FdCache::new(open_files_max),
            refused: AtomicBool::new(false),
            reads_done: AtomicU64::new(0),
            writes_done: AtomicU64::new(0),
        });
    }

    /// Whether small reads are first tried against the page cache (see [`CACHED_READ_MAX`]);
    /// on by default.
    pub fn set_cached_reads(&mut self, on: bool) {
        *self.cached_reads_on.get_mut() = on;
    }

    /// Reads answered from the page cache without the engine so far.
    pub fn cached_reads(&self) -> u64 {
        self.cached_reads.load(Ordering::Relaxed)
    }

    /// `length_bytes` at `offset` if every byte of it is in the page cache (or the file
    /// ends first, all of what is there being cached); None if some of it would need the
    /// disk, or the file system does not do `RWF_NOWAIT`.
    fn read_cached(&self, file: &File, offset: u64, length_bytes: u32) -> Option<Bytes> {
        if length_bytes > CACHED_READ_MAX || !self.cached_reads_on.load(Ordering::Relaxed) {
            return None;
        }
        let length = length_bytes as usize;
        let mut buffer = Vec::<u8>::with_capacity(length);
        let vector = libc::iovec {
            iov_base: buffer.as_mut_ptr().cast(),
            iov_len: length,
        };
        let position = libc::off_t::try_from(offset).ok()?;
        // SAFETY: the iovec covers `buffer`'s allocation of `length` bytes, which outlives
        // the call; the kernel writes at most `length` bytes into it.
        let done =
            unsafe { libc::preadv2(file.as_raw_fd(), &vector, 1, position, libc::RWF_NOWAIT) };
        if done < 0 {
            let error = io::Error::last_os_error();
            if error.raw_os_error() == Some(libc::EOPNOTSUPP) {
                tracing::warn!(
                    data_dir = %self.data_dir.display(),
                    "the file system refuses RWF_NOWAIT: every read goes to the disk engine"
                );
                self.cached_reads_on.store(false, Ordering::Relaxed);
            }
            // EAGAIN: not all cached. Anything else: the engine's read says it properly.
            return None;
        }
        let done = done as usize;
        if done < length {
            // Short: the end of the file, or a part not cached. Only the first is an answer.
            let size = file.metadata().ok()?.len();
            if offset + done as u64 != size.max(offset) {
                return None;
            }
        }
        // SAFETY: the kernel wrote `done` (≤ `length`) bytes at the start of `buffer`.
        unsafe { buffer.set_len(done) };
        self.cached_reads.fetch_add(1, Ordering::Relaxed);
        self.engine.note_cached_read(done as u64);
        Some(Bytes::from(buffer))
    }

    /// Requests done with O_DIRECT so far.
    pub fn direct_counts(&self) -> DirectCounts {
        self.direct
            .as_ref()
            .map(|direct| DirectCounts {
                reads: direct.reads_done.load(Ordering::Relaxed),
                writes: direct.writes_done.load(Ordering::Relaxed),
            })
            .unwrap_or_default()
    }

    /// The O_DIRECT descriptor of the object whose cached descriptor is `cached`, if this
    /// request may use one. It is opened through `/proc/self/fd` from the cached descriptor,
    /// so it is the same file by construction, and a cached one is used only while it still
    /// is (an object removed and made again is a new file under the same name).
    async fn direct_file(
        &self,
        object: ObjectId,
        cached: &File,
        offset: u64,
        length: u64,
        memory: Option<usize>,
    ) -> Option<(&DirectIo, Arc<File>)> {
        let direct = self.direct.as_ref()?;
        let aligned = offset.is_multiple_of(DIRECT_ALIGNMENT)
            && length.is_multiple_of(DIRECT_ALIGNMENT)
            && memory.is_none_or(|address| (address as u64).is_multiple_of(DIRECT_ALIGNMENT));
        if !aligned || length < direct.min_bytes || direct.refused.load(Ordering::Relaxed) {
            return None;
        }
        let identity = file_identity(cached)?;
        if let Some(file) = direct.cache.get(object) {
            if file_identity(&file) == Some(identity) {
                return Some((direct, file));
            }
            direct.cache.remove(object);
        }
        let path = PathBuf::from(format!("/proc/self/fd/{}", cached.as_raw_fd()));
        let opened = blocking(move || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC | libc::O_DIRECT)
                .open(&path)
        })
        .await;
        match opened {
            Ok(file) if file_identity(&file) == Some(identity) => {
                Some((direct, direct.cache.insert(object, Arc::new(file))))
            }
            Ok(_) => None,
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                direct.refuse(&self.data_dir);
                None
            }
            // Out of descriptors, say: the cached descriptor does the request.
            Err(_) => None,
        }
    }

    pub fn server_id(&self) -> ServerId {
        self.server_id
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn engine(&self) -> &Arc<dyn DiskEngine> {
        &self.engine
    }

    pub fn fd_cache(&self) -> &FdCache {
        &self.cache
    }

    /// Where `object` lives.
    pub fn object_path(&self, object: ObjectId) -> PathBuf {
        self.objects_dir
            .join(format!("{:02x}", shard_of(object.inode)))
            .join(object_name(object))
    }

    /// A stamp for a space report: strictly larger than every stamp this server gave
    /// before, and at least the wall clock in nanoseconds, so reports made after a restart
    /// still order after those from before it (unless the clock went back by more than
    /// the time between them).
    pub fn next_stamp(&self) -> u64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|since| since.as_nanos() as u64)
            .unwrap_or(0);
        let previous = self
            .last_stamp
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |last| {
                Some(now.max(last + 1))
            })
            .unwrap_or_else(|last| last);
        now.max(previous + 1)
    }

    /// The space `file` (the object) occupies now, stamped. `fstat` only: no disk I/O.
    fn space_of(&self, object: ObjectId, file: &File) -> Result<ObjectSpace, StoreError> {
        use std::os::unix::fs::MetadataExt;
        let metadata = file
            .metadata()
            .map_err(|error| self.error("stat", object, error))?;
        Ok(ObjectSpace {
            allocated_bytes: metadata.blocks().saturating_mul(512),
            stamp: self.next_stamp(),
        })
    }

    /// The space of an object that may not exist (an absent one holds nothing).
    async fn space_of_existing(&self, object: ObjectId) -> Result<ObjectSpace, StoreError> {
        match self.open_existing(object).await? {
            Some(file) => self.space_of(object, &file),
            None => Ok(ObjectSpace {
                allocated_bytes: 0,
                stamp: self.next_stamp(),
            }),
        }
    }

    /// Writes `data` at `offset`, creating the object if it does not exist. Returns the
    /// space the object holds after the write.
    pub async fn write(
        &self,
        object: ObjectId,
        offset: u64,
        data: Bytes,
    ) -> Result<ObjectSpace, StoreError> {
        check_range(object, offset, data.len() as u64)?;
        self.check_not_removed(object)?;
        if data.is_empty() {
            return self.space_of_existing(object).await;
        }
        let file = self.open_or_create(object).await?;
        let length = data.len() as u64;
        if let Some((direct, direct_file)) = self
            .direct_file(object, &file, offset, length, Some(data.as_ptr() as usize))
            .await
        {
            match self
                .engine
                .write_at(direct_file, offset, data.clone())
                .await
            {
                Ok(()) => {
                    direct.writes_done.fetch_add(1, Ordering::Relaxed);
                    return self.space_of(object, &file);
                }
                // A file system that takes O_DIRECT opens but not such requests: the
                // cached descriptor does this one (all of it again), and every later one.
                Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                    direct.refuse(&self.data_dir);
                }
                Err(error) => return Err(self.error("write", object, error)),
            }
        }
        self.engine
            .write_at(Arc::clone(&file), offset, data)
            .await
            .map_err(|error| self.error("write", object, error))?;
        self.space_of(object, &file)
    }

    /// The object's length (`st_size`); 0 when it does not exist.
    pub async fn object_length(&self, object: ObjectId) -> Result<u64, StoreError> {
        match self.open_existing(object).await? {
            Some(file) => file
                .metadata()
                .map(|metadata| metadata.len())
                .map_err(|error| self.error("stat", object, error)),
            None => Ok(0),
        }
    }

    /// Reads up to `length_bytes` at `offset`: fewer when the object ends first, none when
    /// it does not exist.
    pub async fn read(
        &self,
        object: ObjectId,
        offset: u64,
        length_bytes: u32,
    ) -> Result<Bytes, StoreError> {
        check_range(object, offset, u64::from(length_bytes))?;
        if length_bytes == 0 {
            return Ok(Bytes::new());
        }
        let Some(file) = self.open_existing(object).await? else {
            return Ok(Bytes::new());
        };
        if self.direct.as_ref().is_some_and(|direct| direct.reads) {
            // Only a range inside the object: a direct read cut short by the end of the
            // file could not be continued from an unaligned offset.
            let inside = file
                .metadata()
                .is_ok_and(|metadata| offset + u64::from(length_bytes) <= metadata.len());
            if inside {
                if let Some((direct, direct_file)) = self
                    .direct_file(object, &file, offset, u64::from(length_bytes), None)
                    .await
                {
                    match self
                        .engine
                        .read_at(direct_file, offset, length_bytes as usize)
                        .await
                    {
                        Ok(data) => {
                            direct.reads_done.fetch_add(1, Ordering::Relaxed);
                            return Ok(data);
                        }
                        // Cut meanwhile, or refused: read through the cache.
                        Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {}
                        Err(error) => return Err(self.error("read", object, error)),
                    }
                }
            }
        }
        if let Some(data) = self.read_cached(&file, offset, length_bytes) {
            return Ok(data);
        }
        self.engine
            .read_at(file, offset, length_bytes as usize)
            .await
            .map_err(|error| self.error("read", object, error))
    }

    /// A read-only descriptor of the object for a reader on this host
    /// (`local_reads.rs`), None when it does not exist. Opened again through the store's
    /// own descriptor (`/proc/self/fd`), so it is the same file whatever happened to its
    /// name, and cannot write.
    pub async fn open_for_reading(&self, object: ObjectId) -> Result<Option<File>, StoreError> {
        let Some(file) = self.open_existing(object).await? else {
            return Ok(None);
        };
        let own = format!("/proc/self/fd/{}", file.as_raw_fd());
        blocking(move || {
            // Keeps the store's descriptor open until this one is.
            let _held = file;
            std::fs::OpenOptions::new().read(true).open(&own).map(Some)
        })
        .await
        .map_err(|error| self.error("open for reading", object, error))
    }

    /// Cuts the object to `length_bytes` if it is longer; never extends or creates one (a
    /// file's size is the meta server's; past an object's end the file reads zeros).
    /// Returns the space the object holds after the cut.
    pub async fn truncate(
        &self,
        object: ObjectId,
        length_bytes: u64,
    ) -> Result<ObjectSpace, StoreError> {
        if length_bytes > limits::FILE_SIZE_MAX {
            return Err(StoreError::FileTooBig {
                object,
                offset: 0,
                length_bytes,
            });
        }
        if self.check_not_removed(object).is_err() {
            // The file is gone: there is nothing to cut, and nothing must be recreated.
            return Ok(ObjectSpace {
                allocated_bytes: 0,
                stamp: self.next_stamp(),
            });
        }
        let Some(file) = self.open_existing(object).await? else {
            return self.space_of_existing(object).await;
        };
        let cut = Arc::clone(&file);
        blocking(move || {
            if cut.metadata()?.len() > length_bytes {
                cut.set_len(length_bytes)?;
            }
            Ok(())
        })
        .await
        .map_err(|error| self.error("truncate", object, error))?;
        self.space_of(object, &file)
    }

    /// `fallocate` on the object's range, always keeping the object's length (see
    /// [`AllocateMode`]). Allocating creates a missing object; punching or zeroing one
    /// that does not exist does nothing (it reads as zeros already). Where the local file
    /// system lacks a mode, the same result is made another way: zeroing as a punch and an
    /// allocation, punching as writing zeros.
    pub async fn allocate(
        &self,
        object: ObjectId,
        offset: u64,
        length_bytes: u64,
        mode: AllocateMode,
    ) -> Result<ObjectSpace, StoreError> {
        match offset.checked_add(length_bytes) {
            Some(end) if end <= limits::FILE_SIZE_MAX => {}
            _ => {
                return Err(StoreError::FileTooBig {
                    object,
                    offset,
                    length_bytes,
                })
            }
        }
        self.check_not_removed(object)?;
        if mode == AllocateMode::Allocate {
            if length_bytes > limits::ALLOCATE_BYTES_MAX {
                return Err(StoreError::AllocationTooLong { length_bytes });
            }
            // Refused whole rather than filling the disk and failing part way.
            let space = self.space()?;
            if length_bytes > space.free_bytes {
                return Err(StoreError::NoSpace {
                    server_id: self.server_id,
                    path: self.object_path(object),
                });
            }
        }
        let file = match mode {
            AllocateMode::Allocate => self.open_or_create(object).await?,
            AllocateMode::PunchHole | AllocateMode::ZeroRange => {
                match self.open_existing(object).await? {
                    Some(file) => file,
                    None => return self.space_of_existing(object).await,
                }
            }
        };
        if length_bytes > 0 {
            let target = Arc::clone(&file);
            blocking(move || allocate_range(&target, offset, length_bytes, mode))
                .await
                .map_err(|error| self.error("fallocate", object, error))?;
        }
        self.space_of(object, &file)
    }

    /// Make `length_bytes` at `target_offset` of `target` what `source` holds at
    /// `source_offset` (zeros past its end), inside this server: `copy_file_range(2)`, or
    /// a read then a write where the kernel cannot (the same object with overlapping
    /// ranges). Returns the target's space.
    pub async fn copy_range(
        &self,
        source: ObjectId,
        source_offset: u64,
        target: ObjectId,
        target_offset: u64,
        length_bytes: u32,
    ) -> Result<ObjectSpace, StoreError> {
        check_range(source, source_offset, u64::from(length_bytes))?;
        check_range(target, target_offset, u64::from(length_bytes))?;
        self.check_not_removed(target)?;
        let source_file = self.open_existing(source).await?;
        if length_bytes == 0 {
            return self.space_of_existing(target).await;
        }
        let target_file = match &source_file {
            Some(_) => self.open_or_create(target).await?,
            // The source is all hole: the target range becomes one.
            None => match self.open_existing(target).await? {
                Some(file) => file,
                None => return self.space_of_existing(target).await,
            },
        };
        let writer = Arc::clone(&target_file);
        blocking(move || {
            copy_object_range(
                source_file.as_deref(),
                source_offset,
                &writer,
                target_offset,
                u64::from(length_bytes),
            )
        })
        .await
        .map_err(|error| self.error("copy", target, error))?;
        self.space_of(target, &target_file)
    }

    /// `fdatasync` of every listed object (up to [`SYNC_CONCURRENCY_MAX`] at once), then of
    /// the shard directories of those created since their last sync, so that a new object's
    /// name is as durable as its data. Missing objects are skipped.
    pub async fn sync(&self, objects: &[ObjectId]) -> Result<(), StoreError> {
        if objects.len() > SYNC_OBJECTS_MAX {
            return Err(StoreError::TooManyObjects {
                count: objects.len(),
                max: SYNC_OBJECTS_MAX,
            });
        }
        let unique: BTreeSet<ObjectId> = objects.iter().copied().collect();
        let mut first_error = None;
        let mut pending = unique.iter().copied();
        let mut syncs = tokio::task::JoinSet::new();
        loop {
            while syncs.len() < SYNC_CONCURRENCY_MAX {
                let Some(object) = pending.next() else { break };
                let Some(file) = self.open_existing(object).await? else {
                    continue;
                };
                let engine = Arc::clone(&self.engine);
                syncs.spawn(async move { (object, engine.sync_data(file).await) });
            }
            let Some(joined) = syncs.join_next().await else {
                break;
            };
            let (object, result) = joined.map_err(|error| StoreError::Io {
                server_id: self.server_id,
                operation: "sync",
                path: self.objects_dir.clone(),
                source: io::Error::other(format!("sync task failed: {error}")),
            })?;
            if let Err(error) = result {
                first_error.get_or_insert_with(|| self.error("sync", object, error));
            }
        }
        if let Some(error) = first_error {
            return Err(error);
        }
        self.sync_new_directory_entries(&unique).await
    }

    async fn sync_new_directory_entries(
        &self,
        objects: &BTreeSet<ObjectId>,
    ) -> Result<(), StoreError> {
        let shards: BTreeSet<usize> = {
            let mut created = lock_set(&self.created_unsynced);
            objects
                .iter()
                .filter(|object| created.remove(object))
                .map(|object| shard_of(object.inode))
                .collect()
        };
        for shard in shards {
            let directory = self.objects_dir.join(format!("{shard:02x}"));
            let path = directory.clone();
            blocking(move || File::open(&path)?.sync_all())
                .await
                .map_err(|error| {
                    StoreError::from_io(self.server_id, "sync directory", directory, error)
                })?;
        }
        Ok(())
    }

    /// Refuses writes to an inode whose objects were removed (see [`REMOVED_INODES_REMEMBERED`]).
    fn check_not_removed(&self, object: ObjectId) -> Result<(), StoreError> {
        let removed = self
            .removed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if removed.members.contains(&object.inode) {
            return Err(StoreError::Removed { object });
        }
        Ok(())
    }

    /// Removes these stripes' objects of `inode`; missing ones are fine.
    pub async fn remove(&self, inode: InodeId, stripes: &[u32]) -> Result<(), StoreError> {
        if stripes.len() > limits::STRIPE_COUNT_MAX as usize {
            return Err(StoreError::TooManyObjects {
                count: stripes.len(),
                max: limits::STRIPE_COUNT_MAX as usize,
            });
        }
        self.removed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(inode);
        for &stripe_index in stripes {
            let object = ObjectId {
                inode,
                stripe_index,
            };
            self.forget_descriptors(object);
            let path = self.object_path(object);
            let removed = {
                let path = path.clone();
                let shards = Arc::clone(&self.shards);
                blocking(move || remove_object(&shards[shard_of(inode)], &path)).await
            };
            // A task that opened the file just before the unlink may have cached it; inode
            // ids are never reused, so only that stale descriptor could be hit, and we drop it.
            self.forget_descriptors(object);
            removed.map_err(|error| StoreError::from_io(self.server_id, "remove", path, error))?;
        }
        Ok(())
    }

    /// Remove `object` alone, leaving its inode writable here (see `RemoveObject`).
    pub async fn remove_one(&self, object: ObjectId) -> Result<(), StoreError> {
        self.forget_descriptors(object);
        let path = self.object_path(object);
        let removed = {
            let path = path.clone();
            let shards = Arc::clone(&self.shards);
            blocking(move || remove_object(&shards[shard_of(object.inode)], &path)).await
        };
        self.forget_descriptors(object);
        removed.map_err(|error| StoreError::from_io(self.server_id, "remove", path, error))
    }

    /// Statistics of the data directory's file system.
    pub fn space(&self) -> Result<Space, StoreError> {
        statvfs(&self.data_dir).map_err(|error| {
            StoreError::from_io(self.server_id, "statvfs", self.data_dir.clone(), error)
        })
    }

    pub fn object_count(&self) -> ObjectCount {
        // Read `complete` first: if it is true, every shard's count below is final.
        let complete = self.count_complete.load(Ordering::Acquire);
        let objects = self.shards.iter().map(|shard| lock(shard).objects).sum();
        ObjectCount { objects, complete }
    }

    async fn open_existing(&self, object: ObjectId) -> Result<Option<Arc<File>>, StoreError> {
        if let Some(file) = self.cache.get(object) {
            return Ok(Some(file));
        }
        let path = self.object_path(object);
        let opened = {
            let path = path.clone();
            blocking(move || match open_object(&path, false) {
                Ok(file) => Ok(Some(file)),
                Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(error) => Err(error),
            })
            .await
        };
        match opened {
            Ok(Some(file)) => Ok(Some(self.cache.insert(object, Arc::new(file)))),
            Ok(None) => Ok(None),
            Err(error) => Err(StoreError::from_io(self.server_id, "open", path, error)),
        }
    }

    async fn open_or_create(&self, object: ObjectId) -> Result<Arc<File>, StoreError> {
        if let Some(file) = self.cache.get(object) {
            return Ok(file);
        }
        let path = self.object_path(object);
        let opened = {
            let path = path.clone();
            let shards = Arc::clone(&self.shards);
            blocking(move || create_object(&shards[shard_of(object.inode)], &path)).await
        };
        match opened {
            Ok((file, created)) => {
                if created {
                    lock_set(&self.created_unsynced).insert(object);
                }
                Ok(self.cache.insert(object, Arc::new(file)))
            }
            Err(error) => Err(StoreError::from_io(self.server_id, "create", path, error)),
        }
    }

    fn forget_descriptors(&self, object: ObjectId) {
        self.cache.remove(object);
        if let Some(direct) = &self.direct {
            direct.cache.remove(object);
        }
    }

    fn error(&self, operation: &'static str, object: ObjectId, error: io::Error) -> StoreError {
        StoreError::from_io(self.server_id, operation, self.object_path(object), error)
    }
}
