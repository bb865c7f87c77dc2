//! The object store against a model, for both disk engines: whatever sequence of writes,
//! reads, truncates and removes, a read returns exactly what a `BTreeMap<offset, byte>` model
//! says (holes as zeros, short at the object's end, empty when the object does not exist).
//! Plus the concurrency promises: disjoint writes from many tasks all land, more requests than
//! buffers complete (waiters are woken), and the descriptor cache stays within its bound.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use freeflow_ioserver::engine::threads::ThreadEngine;
use freeflow_ioserver::engine::uring::{UringEngine, UringOptions};
use freeflow_ioserver::engine::DiskEngine;
use freeflow_ioserver::store::ObjectStore;
use freeflow_ioserver::StoreError;
use freeflow_proto::ErrorCode;
use freeflow_types::{limits, ObjectId};
use proptest::prelude::*;

#[derive(Clone, Copy, Debug)]
enum Kind {
    Uring,
    Threads,
}

/// Small buffers so that requests span several of them and the pool runs dry.
const BUFFER_BYTES: usize = 16 << 10;
const BUFFER_COUNT: usize = 4;

fn engine(kind: Kind) -> Arc<dyn DiskEngine> {
    match kind {
        Kind::Uring => {
            let engine = UringEngine::new(UringOptions {
                ring_entries: 16,
                buffer_count: BUFFER_COUNT,
                buffer_bytes: BUFFER_BYTES,
            })
            .expect("io_uring is available on the test machines");
            Arc::new(engine)
        }
        Kind::Threads => Arc::new(ThreadEngine::new(3, 8).unwrap()),
    }
}

fn store(kind: Kind, directory: &tempfile::TempDir, open_files_max: usize) -> ObjectStore {
    ObjectStore::open(9, directory.path(), engine(kind), open_files_max).unwrap()
}

const OBJECT: ObjectId = ObjectId {
    inode: 0x1234_5678,
    stripe_index: 3,
};

/// The model: which bytes were written (absent = hole) and the object's length, or `None`
/// when the object does not exist.
#[derive(Default)]
struct Model {
    bytes: BTreeMap<u64, u8>,
    length_bytes: Option<u64>,
}

impl Model {
    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        for (index, &byte) in data.iter().enumerate() {
            self.bytes.insert(offset + index as u64, byte);
        }
        let end = offset + data.len() as u64;
        self.length_bytes = Some(self.length_bytes.unwrap_or(0).max(end));
    }

    fn read(&self, offset: u64, length_bytes: u32) -> Vec<u8> {
        let end = (offset + u64::from(length_bytes)).min(self.length_bytes.unwrap_or(0));
        (offset..end.max(offset))
            .map(|at| self.bytes.get(&at).copied().unwrap_or(0))
            .collect()
    }

    /// A cut: never creates the object and never makes it longer.
    fn truncate(&mut self, length_bytes: u64) {
        let Some(length) = self.length_bytes else {
            return;
        };
        self.bytes.retain(|&at, _| at < length_bytes);
        self.length_bytes = Some(length.min(length_bytes));
    }

    fn remove(&mut self) {
        *self = Model::default();
    }
}

#[derive(Clone, Debug)]
enum Step {
    Write {
        offset: u64,
        length_bytes: usize,
        seed: u8,
    },
    Read {
        offset: u64,
        length_bytes: u32,
    },
    /// Whole pages at a page offset: what O_DIRECT takes.
    PageWrite {
        page: u64,
        pages: usize,
        seed: u8,
    },
    PageRead {
        page: u64,
        pages: u32,
    },
    Truncate {
        length_bytes: u64,
    },
    Sync,
    Remove,
}

fn step() -> impl Strategy<Value = Step> {
    // Offsets up to 96 KiB, lengths up to 40 KiB: several buffers per request, holes and
    // reads past the end are all common.
    prop_oneof![
        4 => (0u64..96 << 10, 0usize..40 << 10, any::<u8>())
            .prop_map(|(offset, length_bytes, seed)| Step::Write { offset, length_bytes, seed }),
        4 => (0u64..128 << 10, 0u32..48 << 10)
            .prop_map(|(offset, length_bytes)| Step::Read { offset, length_bytes }),
        3 => (0u64..24, 1usize..12, any::<u8>())
            .prop_map(|(page, pages, seed)| Step::PageWrite { page, pages, seed }),
        3 => (0u64..32, 1u32..12).prop_map(|(page, pages)| Step::PageRead { page, pages }),
        2 => (0u64..128 << 10).prop_map(|length_bytes| Step::Truncate { length_bytes }),
        1 => Just(Step::Sync),
        1 => Just(Step::Remove),
    ]
}

fn pattern(length_bytes: usize, seed: u8) -> Vec<u8> {
    (0..length_bytes)
        .map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed) | 1)
        .collect()
}

/// `data` in memory that starts on a page, as a large frame's payload does.
fn page_aligned(data: &[u8]) -> Bytes {
    let mut buffer = vec![0u8; data.len() + 4095];
    let lead = (4096 - buffer.as_ptr() as usize % 4096) % 4096;
    buffer[lead..lead + data.len()].copy_from_slice(data);
    Bytes::from(buffer).slice(lead..lead + data.len())
}

fn run_model(
    kind: Kind,
    direct: bool,
    cached_reads: bool,
    steps: Vec<Step>,
) -> Result<(), TestCaseError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let directory = tempfile::tempdir().unwrap();
    let mut store = store(kind, &directory, 4);
    store.set_cached_reads(cached_reads);
    if direct {
        store.use_direct_io(4096, true, 2);
    }
    let mut model = Model::default();
    // Once removed, an inode's objects are gone for good: ids are never reused, so a later
    // write is a straggler and is refused (Stale), and a truncate creates nothing.
    let mut removed = false;
    runtime.block_on(async {
        for step in steps {
            let step = match step {
                Step::PageWrite { page, pages, seed } => Step::Write {
                    offset: page * 4096,
                    length_bytes: pages * 4096,
                    seed,
                },
                Step::PageRead { page, pages } => Step::Read {
                    offset: page * 4096,
                    length_bytes: pages * 4096,
                },
                other => other,
            };
            match step {
                Step::Write {
                    offset,
                    length_bytes,
                    seed,
                } => {
                    let data = pattern(length_bytes, seed);
                    let written = store.write(OBJECT, offset, page_aligned(&data)).await;
                    if removed {
                        let error = written.expect_err("a write after removal is refused");
                        prop_assert_eq!(error.code(), freeflow_proto::ErrorCode::Stale);
                    } else {
                        written.unwrap();
                        model.write(offset, &data);
                    }
                }
                Step::Read {
                    offset,
                    length_bytes,
                } => {
                    let read = store.read(OBJECT, offset, length_bytes).await.unwrap();
                    let expected = model.read(offset, length_bytes);
                    prop_assert_eq!(
                        read.len(),
                        expected.len(),
                        "read at {} of {}",
                        offset,
                        length_bytes
                    );
                    prop_assert!(
                        read[..] == expected[..],
                        "contents differ at {} of {}",
                        offset,
                        length_bytes
                    );
                }
                Step::Truncate { length_bytes } => {
                    store.truncate(OBJECT, length_bytes).await.unwrap();
                    if !removed {
                        model.truncate(length_bytes);
                    }
                }
                Step::Sync => store
                    .sync(&[
                        OBJECT,
                        ObjectId {
                            inode: 77,
                            stripe_index: 0,
                        },
                    ])
                    .await
                    .unwrap(),
                Step::PageWrite { .. } | Step::PageRead { .. } => unreachable!("mapped above"),
                Step::Remove => {
                    store
                        .remove(OBJECT.inode, &[OBJECT.stripe_index, 99])
                        .await
                        .unwrap();
                    model.remove();
                    removed = true;
                }
            }
            // The object exists exactly when the model says so (lazy creation).
            prop_assert_eq!(
                store.object_path(OBJECT).exists(),
                model.length_bytes.is_some()
            );
        }
        // And a whole read at the end agrees too.
        let length_bytes = model.length_bytes.unwrap_or(0) as u32;
        let read = store.read(OBJECT, 0, length_bytes + 100).await.unwrap();
        prop_assert!(read[..] == model.read(0, length_bytes + 100)[..]);
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn the_store_matches_the_model_with_io_uring(steps in prop::collection::vec(step(), 1..40)) {
        run_model(Kind::Uring, false, true, steps.clone())?;
        // Every read through the engine too (small cached ones skip it by default).
        run_model(Kind::Uring, false, false, steps)?;
    }

    #[test]
    fn the_store_matches_the_model_with_direct_io(steps in prop::collection::vec(step(), 1..40)) {
        run_model(Kind::Uring, true, true, steps)?;
    }

    #[test]
    fn the_store_matches_the_model_with_threads(steps in prop::collection::vec(step(), 1..40)) {
        run_model(Kind::Threads, false, true, steps.clone())?;
        run_model(Kind::Threads, false, false, steps)?;
    }
}

/// Whether the first page of `file` is in the page cache: a one-byte `RWF_NOWAIT` read
/// succeeds only if it is.
fn first_page_cached(file: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    // Asked of a mapping with mincore, which reads nothing: a read with RWF_NOWAIT that
    // misses starts reading the page ahead, and the store's next read could find it.
    // SAFETY: sysconf reads a constant of the system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    // SAFETY: a read-only shared mapping of the first page of a file held open (at least a
    // page long), never touched, and unmapped before return; mincore writes one byte per
    // page of the range into `resident`.
    unsafe {
        let map = libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        );
        assert_ne!(map, libc::MAP_FAILED, "mmap of the object");
        let mut resident = 0u8;
        let asked = libc::mincore(map, page, &mut resident);
        libc::munmap(map, page);
        assert_eq!(asked, 0, "mincore");
        resident & 1 == 1
    }
}

/// Small reads whose bytes are all cached are answered without the engine (and counted);
/// one whose pages were dropped from the cache goes to the engine and reads the disk; one
/// cut short by the object's end is answered from the cache with what there is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_cached_reads_skip_the_engine_and_uncached_ones_use_it() {
    use std::os::fd::AsRawFd;
    for kind in [Kind::Uring, Kind::Threads] {
        // Not /tmp: on a tmpfs the pages cannot leave the cache.
        let directory = tempfile::tempdir_in("/var/tmp").unwrap();
        let store = store(kind, &directory, 4);
        let data = pattern(40_000, 9);
        store
            .write(OBJECT, 0, Bytes::from(data.clone()))
            .await
            .unwrap();
        let engine_before = store.engine().stats().completions;
        let read = store.read(OBJECT, 100, 4096).await.unwrap();
        assert_eq!(&read[..], &data[100..4196], "{kind:?}");
        let short = store.read(OBJECT, 36_000, 8192).await.unwrap();
        assert_eq!(&short[..], &data[36_000..], "{kind:?}: cut at the end");
        let past = store.read(OBJECT, 50_000, 4096).await.unwrap();
        assert!(past.is_empty(), "{kind:?}: past the end");
        assert_eq!(store.cached_reads(), 3, "{kind:?}");
        assert_eq!(
            store.engine().stats().completions,
            engine_before,
            "{kind:?}: the engine did nothing"
        );

        // Written back and dropped from the cache: the next read needs the disk.
        let file = std::fs::File::open(store.object_path(OBJECT)).unwrap();
        file.sync_all().unwrap();
        // SAFETY: an advice call on a descriptor we hold open.
        let advised =
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(advised, 0);
        assert!(
            !first_page_cached(&file),
            "{kind:?}: the pages left the cache"
        );
        let read = store.read(OBJECT, 0, 4096).await.unwrap();
        assert_eq!(&read[..], &data[..4096], "{kind:?}");
        assert_eq!(store.cached_reads(), 3, "{kind:?}: not from the cache");
        assert!(
            store.engine().stats().completions > engine_before,
            "{kind:?}: the engine read it"
        );
        // Now cached again.
        let read = store.read(OBJECT, 0, 4096).await.unwrap();
        assert_eq!(&read[..], &data[..4096], "{kind:?}");
        assert_eq!(store.cached_reads(), 4, "{kind:?}");
        // Longer than CACHED_READ_MAX: always the engine.
        let big = vec![5u8; freeflow_ioserver::store::CACHED_READ_MAX as usize + 4096];
        store
            .write(OBJECT, 0, Bytes::from(big.clone()))
            .await
            .unwrap();
        let read = store.read(OBJECT, 0, big.len() as u32).await.unwrap();
        assert_eq!(&read[..], &big[..], "{kind:?}");
        assert_eq!(
            store.cached_reads(),
            4,
            "{kind:?}: a large read is the engine's"
        );
    }
}

/// 64 tasks write disjoint 24 KiB ranges of one object at once (each range needs two of the
/// four buffers' worth of pieces), so requests outnumber buffers 16 to 1: all must complete
/// and land. (Whether some had to wait for a buffer depends on how the two cores schedule
/// the tasks, so it is printed, not asserted; waking waiters in order is tested
/// deterministically in `buffer_pool`'s unit tests.)
async fn disjoint_concurrent_writes(kind: Kind) {
    const WRITERS: u64 = 64;
    const RANGE_BYTES: usize = 24 << 10;
    let directory = tempfile::tempdir().unwrap();
    let store = Arc::new(store(kind, &directory, 16));
    let mut writers = tokio::task::JoinSet::new();
    // Reverse order, so the object grows from its far end first.
    for writer in (0..WRITERS).rev() {
        let store = Arc::clone(&store);
        writers.spawn(async move {
            let data = Bytes::from(pattern(RANGE_BYTES, writer as u8));
            store.write(OBJECT, writer * RANGE_BYTES as u64, data).await
        });
    }
    while let Some(result) = writers.join_next().await {
        result.unwrap().unwrap();
    }
    for writer in 0..WRITERS {
        let read = store
            .read(OBJECT, writer * RANGE_BYTES as u64, RANGE_BYTES as u32)
            .await
            .unwrap();
        assert!(
            read[..] == pattern(RANGE_BYTES, writer as u8)[..],
            "range of writer {writer}"
        );
    }
    let all = store
        .read(OBJECT, 0, (WRITERS as u32) * RANGE_BYTES as u32 + 1)
        .await
        .unwrap();
    assert_eq!(all.len(), WRITERS as usize * RANGE_BYTES);
    let stats = store.engine().stats();
    if matches!(kind, Kind::Uring) {
        // Each writer needs at least two pieces; plus the reads.
        assert!(stats.completions >= WRITERS * 2, "{stats:?}");
    }
    println!("{kind:?}: {stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disjoint_concurrent_writes_all_land_with_io_uring() {
    disjoint_concurrent_writes(Kind::Uring).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disjoint_concurrent_writes_all_land_with_threads() {
    disjoint_concurrent_writes(Kind::Threads).await;
}

/// Many concurrent reads and syncs on a pool of four buffers: every one completes.
async fn more_requests_than_buffers(kind: Kind) {
    let directory = tempfile::tempdir().unwrap();
    let store = Arc::new(store(kind, &directory, 64));
    let objects: Vec<ObjectId> = (0..32)
        .map(|inode| ObjectId {
            inode: inode + 1,
            stripe_index: 0,
        })
        .collect();
    for object in &objects {
        let data = Bytes::from(pattern(BUFFER_BYTES * 2, object.inode as u8));
        store.write(*object, 0, data).await.unwrap();
    }
    let mut requests = tokio::task::JoinSet::new();
    for round in 0..8 {
        for object in objects.clone() {
            let store = Arc::clone(&store);
            requests.spawn(async move {
                if round % 4 == 3 {
                    store.sync(&[object]).await.unwrap();
                    return;
                }
                let read = store
                    .read(object, 0, (BUFFER_BYTES * 2) as u32)
                    .await
                    .unwrap();
                assert!(read[..] == pattern(BUFFER_BYTES * 2, object.inode as u8)[..]);
            });
        }
    }
    let completed = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        let mut completed = 0;
        while let Some(result) = requests.join_next().await {
            result.unwrap();
            completed += 1;
        }
        completed
    })
    .await
    .expect("requests stalled waiting for buffers");
    assert_eq!(completed, 8 * 32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_requests_than_buffers_complete_with_io_uring() {
    more_requests_than_buffers(Kind::Uring).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_requests_than_buffers_complete_with_threads() {
    more_requests_than_buffers(Kind::Threads).await;
}

/// 200 objects through a cache of 8 descriptors: the bound holds after every request and
/// every object reads back.
async fn descriptor_cache_bound(kind: Kind) {
    const OPEN_FILES_MAX: usize = 8;
    let directory = tempfile::tempdir().unwrap();
    let store = store(kind, &directory, OPEN_FILES_MAX);
    for inode in 1..=200u64 {
        let object = ObjectId {
            inode,
            stripe_index: (inode % 3) as u32,
        };
        store
            .write(object, inode * 7, Bytes::from(vec![inode as u8; 100]))
            .await
            .unwrap();
        assert!(store.fd_cache().len() <= OPEN_FILES_MAX);
    }
    for inode in 1..=200u64 {
        let object = ObjectId {
            inode,
            stripe_index: (inode % 3) as u32,
        };
        let read = store.read(object, 0, 10_000).await.unwrap();
        assert_eq!(read.len(), inode as usize * 7 + 100);
        assert!(read[..inode as usize * 7].iter().all(|&byte| byte == 0));
        assert!(read[inode as usize * 7..]
            .iter()
            .all(|&byte| byte == inode as u8));
        assert!(store.fd_cache().len() <= OPEN_FILES_MAX);
    }
    assert_eq!(store.fd_cache().len(), OPEN_FILES_MAX);
}

#[tokio::test]
async fn descriptor_cache_bound_holds_with_io_uring() {
    descriptor_cache_bound(Kind::Uring).await;
}

#[tokio::test]
async fn descriptor_cache_bound_holds_with_threads() {
    descriptor_cache_bound(Kind::Threads).await;
}

#[tokio::test]
async fn objects_are_created_lazily_and_counted_exactly() {
    let directory = tempfile::tempdir().unwrap();
    let store = store(Kind::Uring, &directory, 16);
    let object = |inode: u64| ObjectId {
        inode,
        stripe_index: 1,
    };
    // Reads, empty writes, zero-length truncates and syncs create nothing.
    assert!(store.read(object(1), 0, 100).await.unwrap().is_empty());
    store.write(object(1), 10, Bytes::new()).await.unwrap();
    store.truncate(object(1), 0).await.unwrap();
    store.sync(&[object(1)]).await.unwrap();
    assert!(!store.object_path(object(1)).exists());
    assert_eq!(
        store
            .object_path(object(0x1ff))
            .parent()
            .unwrap()
            .file_name()
            .unwrap(),
        "ff"
    );

    for inode in 1..=5 {
        store
            .write(object(inode), 0, Bytes::from_static(b"x"))
            .await
            .unwrap();
    }
    assert!(!store.object_count().complete);
    assert_eq!(store.count_objects().unwrap(), 5);
    // A cut never creates an object.
    store.truncate(object(6), 4096).await.unwrap();
    assert!(!store.object_path(object(6)).exists());
    store
        .write(object(6), 4091, Bytes::from_static(b"again"))
        .await
        .unwrap();
    assert_eq!(store.object_count().objects, 6);
    store.remove(1, &[1, 2, 3]).await.unwrap();
    store.remove(1, &[1]).await.unwrap();
    let count = store.object_count();
    assert_eq!((count.objects, count.complete), (5, true));
    drop(store);

    // A restart counts the same objects again.
    let reopened = self::store(Kind::Threads, &directory, 16);
    assert_eq!(reopened.object_count().objects, 0);
    assert_eq!(reopened.count_objects().unwrap(), 5);
    assert_eq!(
        reopened.read(object(6), 0, 10_000).await.unwrap().len(),
        4096
    );
}

#[tokio::test]
async fn bad_arguments_get_their_codes() {
    let directory = tempfile::tempdir().unwrap();
    let store = store(Kind::Uring, &directory, 16);
    let past_end = store
        .write(OBJECT, limits::FILE_SIZE_MAX - 1, Bytes::from_static(b"ab"))
        .await;
    assert_eq!(past_end.unwrap_err().code(), ErrorCode::FileTooBig);
    let overflow = store.read(OBJECT, u64::MAX, 10).await;
    assert_eq!(overflow.unwrap_err().code(), ErrorCode::FileTooBig);
    let too_long = store
        .read(OBJECT, 0, limits::IO_REQUEST_BYTES_MAX + 1)
        .await;
    assert_eq!(too_long.unwrap_err().code(), ErrorCode::InvalidArgument);
    let huge = store.truncate(OBJECT, limits::FILE_SIZE_MAX + 1).await;
    assert_eq!(huge.unwrap_err().code(), ErrorCode::FileTooBig);
    // Exactly at the limit is fine for a read (it reads nothing).
    assert!(store
        .read(OBJECT, limits::FILE_SIZE_MAX - 10, 10)
        .await
        .unwrap()
        .is_empty());
}

#[test]
fn disk_full_names_the_server_and_the_path() {
    let error = StoreError::from_io(
        4,
        "write",
        "/data/objects/01/0000000000000001.0".into(),
        std::io::Error::from_raw_os_error(libc_enospc()),
    );
    assert_eq!(error.code(), ErrorCode::NoSpace);
    let message = error.to_string();
    assert!(
        message.contains("server 4") && message.contains("0000000000000001.0"),
        "{message}"
    );
}

fn libc_enospc() -> i32 {
    28
}

/// FLAIM's lesson, observed: while an fdatasync of 64 MiB of dirty data is in flight, reads
/// submitted after it complete at once (they do not wait behind the oldest operation), and
/// each such completion is counted as out of order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_overtake_a_slow_sync_and_are_counted_out_of_order() {
    const READS: u64 = 20;
    let engine = Arc::new(
        UringEngine::new(UringOptions {
            ring_entries: 16,
            buffer_count: 2,
            buffer_bytes: 4096,
        })
        .unwrap(),
    );
    let directory = tempfile::tempdir().unwrap();
    let big_path = directory.path().join("big");
    std::fs::write(&big_path, vec![7u8; 64 << 20]).unwrap();
    std::fs::write(directory.path().join("small"), vec![3u8; 4096]).unwrap();
    let open = |name: &str| {
        let path = directory.path().join(name);
        Arc::new(
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .unwrap(),
        )
    };
    let (big, small) = (open("big"), open("small"));
    let sync = {
        let engine = Arc::clone(&engine);
        tokio::spawn(async move { engine.sync_data(big).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let before = engine.stats().out_of_order_completions;
    for _ in 0..READS {
        let read = engine.read_at(Arc::clone(&small), 0, 4096).await.unwrap();
        assert!(read.iter().all(|&byte| byte == 3));
    }
    let sync_still_running = !sync.is_finished();
    sync.await.unwrap().unwrap();
    let overtaken = engine.stats().out_of_order_completions - before;
    println!(
        "sync still running after {READS} reads: {sync_still_running}; out of order: {overtaken}"
    );
    if sync_still_running {
        assert!(
            overtaken >= READS,
            "reads overtook the sync but only {overtaken} were counted"
        );
    }
}

/// Regression: a write arriving after the reaper removed a file's objects (a straggler of a
/// client that timed out) recreated the object, which nothing would ever remove again.
#[tokio::test]
async fn a_write_after_removal_is_refused_and_creates_nothing() {
    for kind in [Kind::Uring, Kind::Threads] {
        let directory = tempfile::tempdir().unwrap();
        let store = store(kind, &directory, 4);
        store
            .write(OBJECT, 0, Bytes::from_static(b"before"))
            .await
            .unwrap();
        store
            .remove(OBJECT.inode, &[OBJECT.stripe_index])
            .await
            .unwrap();
        let error = store
            .write(OBJECT, 0, Bytes::from_static(b"late"))
            .await
            .unwrap_err();
        assert_eq!(error.code(), ErrorCode::Stale, "{kind:?}: {error}");
        store.truncate(OBJECT, 4096).await.unwrap();
        assert!(
            !store.object_path(OBJECT).exists(),
            "{kind:?}: the removed object came back"
        );
        assert!(store.read(OBJECT, 0, 10).await.unwrap().is_empty());
    }
}

/// One request cannot make the server open and sync an unbounded number of objects.
#[tokio::test]
async fn a_sync_of_too_many_objects_is_refused() {
    let directory = tempfile::tempdir().unwrap();
    let store = store(Kind::Threads, &directory, 4);
    let objects: Vec<ObjectId> = (0..=freeflow_ioserver::store::SYNC_OBJECTS_MAX as u64)
        .map(|inode| ObjectId {
            inode: inode + 1,
            stripe_index: 0,
        })
        .collect();
    let error = store.sync(&objects).await.unwrap_err();
    assert_eq!(error.code(), ErrorCode::InvalidArgument, "{error}");
    store.sync(&objects[..10]).await.unwrap();
}

/// A read that fits one buffer is replied to from the registered buffer itself (no copy):
/// the buffer stays out of the pool while the reply lives and comes back when it is
/// dropped. When buffers are scarce (a quarter or less free) reads copy and let go at once,
/// so replies waiting on a slow peer can never hold the whole pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_buffer_read_lends_its_buffer_until_the_reply_is_dropped() {
    let engine = UringEngine::new(UringOptions {
        ring_entries: 16,
        buffer_count: 4,
        buffer_bytes: 64 << 10,
    })
    .expect("io_uring is available on the test machines");
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("object");
    let data: Vec<u8> = (0..(48u32 << 10))
        .map(|index| (index % 251) as u8)
        .collect();
    std::fs::write(&path, &data).unwrap();
    let file = Arc::new(std::fs::File::open(&path).unwrap());
    let pool = engine.pool().clone();

    let mut replies = Vec::new();
    for expected_free in [3, 2, 1] {
        let reply = engine
            .read_at(Arc::clone(&file), 0, 48 << 10)
            .await
            .unwrap();
        assert_eq!(&reply[..], &data[..]);
        assert_eq!(
            pool.free_count(),
            expected_free,
            "the reply holds its buffer"
        );
        replies.push(reply);
    }
    // One buffer of four left: this read copies and returns its buffer at once.
    let copied = engine.read_at(Arc::clone(&file), 1000, 5000).await.unwrap();
    assert_eq!(&copied[..], &data[1000..6000]);
    assert_eq!(pool.free_count(), 1);
    drop(replies);
    assert_eq!(pool.free_count(), 4, "dropped replies return their buffers");
}

fn object(inode: u64, stripe_index: u32) -> ObjectId {
    ObjectId {
        inode,
        stripe_index,
    }
}

/// Every change reports the space the object holds, with stamps that only go up, so the
/// meta server can keep the newest report per object whatever order they reach it in.
#[tokio::test]
async fn changes_report_the_space_held_with_rising_stamps() {
    let directory = tempfile::tempdir().unwrap();
    let store = store(Kind::Uring, &directory, 16);
    let first = store
        .write(object(5, 0), 0, Bytes::from(vec![7u8; 100]))
        .await
        .unwrap();
    assert!(first.allocated_bytes >= 100, "{first:?}");
    let far = store
        .write(object(5, 0), 1 << 20, Bytes::from(vec![7u8; 65536]))
        .await
        .unwrap();
    assert!(far.stamp > first.stamp);
    assert!(far.allocated_bytes >= first.allocated_bytes + 65536);
    // Sparse: 1 MiB of hole between the two writes holds nothing.
    assert!(far.allocated_bytes < 1 << 20, "{far:?}");
    let cut = store.truncate(object(5, 0), 4096).await.unwrap();
    assert!(cut.stamp > far.stamp);
    assert!(cut.allocated_bytes <= 4096, "{cut:?}");
    // A missing object holds nothing, and asking creates nothing.
    let missing = store.truncate(object(6, 0), 0).await.unwrap();
    assert_eq!(missing.allocated_bytes, 0);
    assert!(!store.object_path(object(6, 0)).exists());
}

#[tokio::test]
async fn allocate_punch_and_zero_ranges_of_an_object() {
    use freeflow_proto::io::AllocateMode;
    let directory = tempfile::tempdir().unwrap();
    let store = store(Kind::Threads, &directory, 16);
    let data = Bytes::from(vec![0xabu8; 256 << 10]);
    let written = store.write(object(8, 1), 0, data.clone()).await.unwrap();

    let punched = store
        .allocate(object(8, 1), 64 << 10, 64 << 10, AllocateMode::PunchHole)
        .await
        .unwrap();
    assert!(punched.allocated_bytes < written.allocated_bytes);
    let read = store.read(object(8, 1), 0, 256 << 10).await.unwrap();
    assert_eq!(read.len(), 256 << 10, "the object keeps its length");
    assert!(read[..64 << 10].iter().all(|&byte| byte == 0xab));
    assert!(read[64 << 10..128 << 10].iter().all(|&byte| byte == 0));
    assert!(read[128 << 10..].iter().all(|&byte| byte == 0xab));

    store
        .allocate(object(8, 1), 200 << 10, 100, AllocateMode::ZeroRange)
        .await
        .unwrap();
    let read = store.read(object(8, 1), 0, 300 << 10).await.unwrap();
    assert_eq!(read.len(), 256 << 10);
    assert!(read[200 << 10..(200 << 10) + 100]
        .iter()
        .all(|&byte| byte == 0));
    assert_eq!(read[(200 << 10) + 100], 0xab);

    // Allocating creates the object and reserves blocks without changing its length.
    let reserved = store
        .allocate(object(9, 0), 0, 1 << 20, AllocateMode::Allocate)
        .await
        .unwrap();
    assert!(reserved.allocated_bytes >= 1 << 20, "{reserved:?}");
    assert!(store.read(object(9, 0), 0, 10).await.unwrap().is_empty());
    // Punching or zeroing a missing object creates nothing.
    for mode in [AllocateMode::PunchHole, AllocateMode::ZeroRange] {
        store.allocate(object(10, 0), 0, 4096, mode).await.unwrap();
        assert!(!store.object_path(object(10, 0)).exists());
    }
    // After a removal, an allocation is refused like a write.
    store.remove(9, &[0]).await.unwrap();
    let refused = store
        .allocate(object(9, 0), 0, 4096, AllocateMode::Allocate)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), ErrorCode::Stale);
}

#[tokio::test]
async fn copies_between_objects_zero_past_the_source_end_and_handle_overlap() {
    let directory = tempfile::tempdir().unwrap();
    let store = store(Kind::Uring, &directory, 16);
    let source: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8 + 1).collect();
    store
        .write(object(20, 0), 0, Bytes::from(source.clone()))
        .await
        .unwrap();
    // The target holds other bytes where the copy goes, past the source's end too.
    store
        .write(object(21, 2), 0, Bytes::from(vec![0xeeu8; 200_000]))
        .await
        .unwrap();
    store
        .copy_range(object(20, 0), 50_000, object(21, 2), 1000, 80_000)
        .await
        .unwrap();
    let read = store.read(object(21, 2), 0, 200_000).await.unwrap();
    assert!(read[..1000].iter().all(|&byte| byte == 0xee));
    assert_eq!(&read[1000..51_000], &source[50_000..]);
    // The source ended 30,000 bytes into the copy: those read as zeros now.
    assert!(read[51_000..81_000].iter().all(|&byte| byte == 0));
    assert!(read[81_000..].iter().all(|&byte| byte == 0xee));

    // Within one object, overlapping: as if read first, then written.
    store
        .copy_range(object(20, 0), 0, object(20, 0), 10, 1000)
        .await
        .unwrap();
    let read = store.read(object(20, 0), 0, 1010).await.unwrap();
    assert_eq!(&read[10..1010], &source[..1000]);

    // A missing source is all zeros; a missing target stays missing.
    store
        .copy_range(object(30, 0), 0, object(31, 0), 0, 4096)
        .await
        .unwrap();
    assert!(!store.object_path(object(31, 0)).exists());
    store
        .copy_range(object(30, 0), 0, object(21, 2), 0, 500)
        .await
        .unwrap();
    let read = store.read(object(21, 2), 0, 600).await.unwrap();
    assert!(read[..500].iter().all(|&byte| byte == 0));
    assert_eq!(read[500], 0xee);
}

/// O_DIRECT takes exactly the large aligned requests and agrees with the page cache: bytes
/// written through the cache are seen by a direct read of their pages, and the reverse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_io_takes_large_aligned_requests_and_agrees_with_the_cache() {
    let directory = tempfile::tempdir().unwrap();
    let mut store = store(Kind::Uring, &directory, 4);
    store.use_direct_io(64 << 10, true, 2);
    let block = pattern(64 << 10, 1);

    store.write(OBJECT, 0, page_aligned(&block)).await.unwrap();
    assert_eq!(store.direct_counts().writes, 1, "aligned and large: direct");
    store
        .write(OBJECT, 4096, page_aligned(&block[..4096]))
        .await
        .unwrap();
    store
        .write(OBJECT, 100, Bytes::copy_from_slice(&block[..7]))
        .await
        .unwrap();
    // Aligned offset and length, memory one byte past a page: through the cache.
    let unaligned_memory = page_aligned(&[5u8; (64 << 10) + 1][..]).slice(1..);
    store
        .write(OBJECT, 64 << 10, unaligned_memory)
        .await
        .unwrap();
    let direct_writes = store.direct_counts().writes;
    assert_eq!(direct_writes, 1, "small, or unaligned: through the cache");

    // A direct read of the first 64 KiB sees the cached writes made over the direct one.
    let read = store.read(OBJECT, 0, 64 << 10).await.unwrap();
    assert_eq!(store.direct_counts().reads, 1);
    let mut expected = block.clone();
    expected[4096..8192].copy_from_slice(&block[..4096]);
    expected[100..107].copy_from_slice(&block[..7]);
    assert!(read[..] == expected[..], "direct read sees cached writes");
    // Past the end of the object: through the cache, short.
    let tail = store.read(OBJECT, 64 << 10, 128 << 10).await.unwrap();
    assert_eq!(tail.len(), 64 << 10);
    assert!(tail.iter().all(|byte| *byte == 5));
    assert_eq!(
        store.direct_counts().reads,
        1,
        "a read past the end is not direct"
    );

    // A direct write over cached pages: a cached read sees it.
    let second = pattern(64 << 10, 9);
    store.write(OBJECT, 0, page_aligned(&second)).await.unwrap();
    assert_eq!(store.direct_counts().writes, direct_writes + 1);
    let head = store.read(OBJECT, 0, 4096 + 10).await.unwrap();
    assert!(
        head[..] == second[..4096 + 10],
        "cached read sees the direct write"
    );
}

/// A FIFO opened for reading and writing (so the open does not wait for a peer): an
/// engine read of it stays in the kernel until bytes are written, and completes only then,
/// outside the submission that started it.
fn fifo(directory: &tempfile::TempDir) -> Arc<std::fs::File> {
    let path = directory.path().join("fifo");
    let name = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path that lives across the call.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    Arc::new(
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap(),
    )
}

/// Bytes waiting in a pipe (FIONREAD).
fn pipe_bytes_waiting(file: &std::fs::File) -> i32 {
    use std::os::fd::AsRawFd;
    let mut waiting: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through a pointer to a live local.
    assert_eq!(
        unsafe { libc::ioctl(file.as_raw_fd(), libc::FIONREAD, &mut waiting) },
        0
    );
    waiting
}

/// The io_uring engine reaps its completions on the runtime of its requests: made outside
/// any runtime, used on one that then ends, it serves the next runtime's requests (a new
/// reaper starts there; without it a completion that comes after its submission would never
/// be reaped).
#[test]
fn the_io_uring_engine_outlives_the_runtime_that_first_used_it() {
    use std::io::Write;
    let engine = Arc::new(
        UringEngine::new(UringOptions {
            ring_entries: 8,
            buffer_count: 2,
            buffer_bytes: 4096,
        })
        .unwrap(),
    );
    let directory = tempfile::tempdir().unwrap();
    let pipe = fifo(&directory);
    for round in 0..3u8 {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let read = {
                let (engine, pipe) = (Arc::clone(&engine), Arc::clone(&pipe));
                tokio::spawn(async move { engine.read_at(pipe, 0, 4096).await })
            };
            // The read is in the kernel, waiting for bytes, before they come.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            assert!(!read.is_finished(), "round {round}: read of an empty FIFO");
            (&*pipe).write_all(&[round; 4096]).unwrap();
            let bytes = tokio::time::timeout(std::time::Duration::from_secs(10), read)
                .await
                .unwrap_or_else(|_| panic!("round {round}: the read's completion was never reaped"))
                .unwrap()
                .unwrap();
            assert_eq!(bytes.len(), 4096);
            assert!(bytes.iter().all(|&byte| byte == round));
        });
        drop(runtime);
    }
}

/// Dropping the engine while the kernel still has an operation in flight (a read into a
/// pool buffer, of a FIFO nobody writes yet) lets the ring and the buffers go only once that
/// operation is done: written to after the drop, the FIFO's bytes are taken by that read
/// (had the ring been closed at once, the read would have been cancelled and the bytes left
/// in the pipe). The wait happens on a thread of its own, so the dropping task, here one
/// aborted on a runtime worker, is not held up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_io_uring_engine_waits_for_operations_in_the_kernel() {
    use std::io::Write;
    let directory = tempfile::tempdir().unwrap();
    let pipe = fifo(&directory);
    let engine = UringEngine::new(UringOptions {
        ring_entries: 8,
        buffer_count: 2,
        buffer_bytes: 4096,
    })
    .unwrap();
    let task = {
        let pipe = Arc::clone(&pipe);
        tokio::spawn(async move { engine.read_at(pipe, 0, 4096).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(!task.is_finished());
    task.abort();
    let outcome = tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .expect("dropping the engine held up the aborted task");
    assert!(outcome.unwrap_err().is_cancelled());
    (&*pipe).write_all(&[1; 4096]).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while pipe_bytes_waiting(&pipe) > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the read in flight at the drop never took the FIFO's bytes: it was cancelled, \
             not waited for"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
