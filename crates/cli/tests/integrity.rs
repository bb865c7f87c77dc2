//! Nothing read back that was not written (issue 8): the truncate bug and its variants as
//! regression tests, the random-operation exerciser on real mounts and on the library,
//! size changes authorised by descriptors, `st_blocks` against ext4, copy_file_range,
//! fallocate's modes, an unreachable I/O server as EIO, and a clean SIGINT unmount.
//!
//! Real servers and real `freeflow mount` processes (see `common`); every test skips with a
//! message when /dev/fuse is missing.

mod common;

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::mount::{errno_of, fuse_available, open_rw, Mount};
use common::{assert_bytes_eq, Cluster, ClusterOptions, Xorshift};
use freeflow_client::{ErrorCode, OpenOptions as ClusterOpen};
use freeflow_exercise::library::LibraryTarget;
use freeflow_exercise::posix::PosixTarget;

const A_BYTES: usize = 8192;

/// A change made to a file through its descriptor and its path.
type SizeChange = dyn Fn(&File, &Path);

fn c_path(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("no NUL in paths")
}

fn read_at(file: &File, offset: u64, length: usize) -> Vec<u8> {
    let mut buffer = vec![0u8; length];
    let read = file.read_at(&mut buffer, offset).expect("pread");
    buffer.truncate(read);
    buffer
}

fn copy_file_range(
    source: &File,
    source_offset: u64,
    target: &File,
    target_offset: u64,
    length: usize,
) -> isize {
    let mut from = source_offset as libc::loff_t;
    let mut to = target_offset as libc::loff_t;
    // SAFETY: two open descriptors; the offsets are ours.
    unsafe {
        libc::copy_file_range(
            source.as_raw_fd(),
            &mut from,
            target.as_raw_fd(),
            &mut to,
            length,
            0,
        )
    }
}

fn fallocate(file: &File, mode: libc::c_int, offset: u64, length: u64) -> std::io::Result<()> {
    // SAFETY: a plain syscall on an open descriptor.
    let result = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            mode,
            offset as libc::off_t,
            length as libc::off_t,
        )
    };
    if result == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The minimal case of issue 8 and every variant it lists. Bug: a size change reached the
/// meta server before the size of acknowledged writes was committed; the meta server saw
/// no shrink (0 → 0) and cut nothing, so the bytes came back when the file grew again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_written_before_a_truncate_never_come_back() {
    if !fuse_available() {
        return;
    }
    let cluster = Cluster::start(3).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let zeros = vec![0u8; A_BYTES];
    let variants: [(&str, &SizeChange); 5] = [
        ("ftruncate 0 then pwrite past the end", &|file, _| {
            file.set_len(0).expect("ftruncate 0");
            file.write_all_at(b"x", 16384).expect("pwrite at 16384");
        }),
        ("ftruncate 0 then ftruncate up", &|file, _| {
            file.set_len(0).expect("ftruncate 0");
            file.set_len(A_BYTES as u64).expect("ftruncate up");
        }),
        ("truncate(path) 0 then ftruncate up", &|file, path| {
            // SAFETY: a valid NUL-terminated path.
            let cut = unsafe { libc::truncate(c_path(path).as_ptr(), 0) };
            assert_eq!(
                cut,
                0,
                "truncate(path): {}",
                std::io::Error::last_os_error()
            );
            file.set_len(A_BYTES as u64).expect("ftruncate up");
        }),
        (
            "O_TRUNC open on a second descriptor then ftruncate up",
            &|file, path| {
                drop(
                    OpenOptions::new()
                        .write(true)
                        .truncate(true)
                        .open(path)
                        .expect("O_TRUNC open"),
                );
                file.set_len(A_BYTES as u64).expect("ftruncate up");
            },
        ),
        (
            "ftruncate 0 then copy_file_range past the end",
            &|file, path| {
                let source_path = path.with_extension("source");
                fs::write(&source_path, b"y").expect("write the source");
                let source = File::open(&source_path).expect("open the source");
                file.set_len(0).expect("ftruncate 0");
                assert_eq!(copy_file_range(&source, 0, file, 16384, 1), 1);
            },
        ),
    ];
    for (index, (name, change)) in variants.iter().enumerate() {
        let path = mount.path(&format!("case-{index}"));
        let file = open_rw(&path);
        file.write_all_at(&[b'A'; A_BYTES], 0)
            .expect("pwrite 8 KiB of A");
        change(&file, &path);
        assert_eq!(
            read_at(&file, 0, A_BYTES),
            zeros,
            "{name}: read through the descriptor"
        );
        drop(file);
        // After close, a new open (and so the I/O servers) shows the same.
        let again = File::open(&path).expect("reopen");
        assert_eq!(
            read_at(&again, 0, A_BYTES),
            zeros,
            "{name}: read after close"
        );
    }
    // And through the library, with no kernel in between.
    let client = cluster.client().await;
    let data = client
        .open_path("/case-0", &ClusterOpen::new().read(true))
        .await
        .expect("open through the library");
    assert_eq!(
        data.read_at(0, A_BYTES as u64).await.expect("read"),
        Bytes::from(zeros)
    );
    data.close().await.expect("close");
}

/// The same through the client library: a size change by handle, by path, and an O_TRUNC
/// open by another client are each ordered after the writes made before them. The last
/// races writes still in flight against another client's cuts (the cuts wait for this
/// client to answer the recall of its writes), so it runs many rounds with larger writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn library_size_changes_are_ordered_after_earlier_writes() {
    const WRITTEN: usize = 32 << 20;
    let cluster = Cluster::start(3).await;
    let client = cluster.client().await;
    let other = cluster.client().await;
    let zeros = Bytes::from(vec![0u8; WRITTEN]);
    let options = ClusterOpen::new().read(true).write(true).create(true);
    for round in 0..8 {
        let case = round.min(2);
        let path = format!("/library-{round}");
        let file = client.open_path(&path, &options).await.expect("create");
        file.write_at(0, Bytes::from(vec![b'A'; WRITTEN]))
            .await
            .expect("write");
        match case {
            0 => {
                file.set_size(0).await.expect("set_size 0");
            }
            1 => {
                client.truncate_path(&path, 0).await.expect("truncate_path");
            }
            _ => {
                let truncating = other
                    .open_path(&path, &ClusterOpen::new().write(true).truncate(true))
                    .await
                    .expect("O_TRUNC open by another client");
                truncating.close().await.expect("close");
                // This handle learns the new size at its next refresh (close-to-open).
                file.refresh().await.expect("refresh");
            }
        }
        file.write_at(WRITTEN as u64 * 2, Bytes::from_static(b"x"))
            .await
            .expect("write past the end");
        let read = file.read_at(0, WRITTEN as u64).await.expect("read");
        assert!(
            read == zeros,
            "round {round} (case {case}): {} bytes of A came back",
            read.iter().filter(|byte| **byte == b'A').count()
        );
        file.close().await.expect("close");
    }
}

/// A writer whose lease on the file ran out long ago is recalled all the same: the meta
/// server asks every client with the file open for writing to land what it has in flight
/// before it cuts, lease or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_clients_truncation_recalls_writes_without_a_lease() {
    const WRITTEN: usize = 32 << 20;
    let cluster = Cluster::start_with(ClusterOptions {
        cache_lease_ms: 100,
        ..ClusterOptions::new(3)
    })
    .await;
    // Small writes wait at the client far longer than the test: only the recall sends them.
    let client = cluster
        .client_with(|config| config.gather_wait_ms = 1_000)
        .await;
    let other = cluster.client().await;
    let zeros = Bytes::from(vec![0u8; WRITTEN]);
    let options = ClusterOpen::new().read(true).write(true).create(true);
    for round in 0..6 {
        let path = format!("/unleased-{round}");
        let file = client.open_path(&path, &options).await.expect("create");
        // Past the lease the open came with.
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Large writes are in flight; small ones are still gathered at the client (the
        // recall sends them first).
        let piece = if round % 2 == 0 { WRITTEN / 4 } else { 1000 };
        let written = piece * 3;
        for index in 0..3 {
            file.write_at((index * piece) as u64, Bytes::from(vec![b'A'; piece]))
                .await
                .expect("write");
        }
        other
            .truncate_path(&path, 0)
            .await
            .expect("truncate by another client");
        let read = file.read_at(0, written as u64).await.expect("read");
        assert!(
            read == zeros[..written],
            "round {round}: {} bytes of A came back",
            read.iter().filter(|byte| **byte == b'A').count()
        );
        file.close().await.expect("close");
    }
}

/// A read sees small writes made before it even while they are on their way out: taken
/// from the gathering buffer by the timer but not in flight yet (the I/O server is stopped
/// and the dirty-byte bound is full), or by a caller that was then cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gathered_writes_on_their_way_are_read_and_never_dropped() {
    const FULL: usize = freeflow_types::limits::IO_REQUEST_BYTES_MAX as usize;
    let cluster = Cluster::start(1).await;
    for (round, gather_wait_ms) in [(0, 1), (1, 1_000)] {
        // One request fills the dirty-byte bound: a later write waits for it to land.
        let client = cluster
            .client_with(|config| {
                config.dirty_bytes_max = FULL as u64;
                config.gather_wait_ms = gather_wait_ms;
            })
            .await;
        let path = format!("/on-their-way-{round}");
        let options = ClusterOpen::new().read(true).write(true).create(true);
        let file = Arc::new(client.open_path(&path, &options).await.expect("create"));
        // Space for what follows is granted while the server runs (a write that extends
        // the file waits for its grant; this test is about what happens after that).
        file.write_at(0, Bytes::from_static(b"x"))
            .await
            .expect("a first write");
        file.flush().await.expect("flush");
        cluster.signal_io(0, libc::SIGSTOP);
        file.write_at(0, Bytes::from(vec![b'A'; FULL]))
            .await
            .expect("a write filling the bound");
        let far = 2 * FULL as u64;
        file.write_at(far, Bytes::from_static(b"gathered"))
            .await
            .expect("a small write, gathered");
        if round == 0 {
            // The timer takes the bytes and waits for room to send them.
            tokio::time::sleep(Duration::from_millis(100)).await;
        } else {
            // A read sends the bytes, then is given up while they wait for room.
            let given_up =
                tokio::time::timeout(Duration::from_millis(100), file.read_at(far, 8)).await;
            assert!(given_up.is_err(), "the read waited for the stopped server");
        }
        let reader = file.clone();
        let read = tokio::spawn(async move { reader.read_at(far, 8).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        cluster.signal_io(0, libc::SIGCONT);
        let read = read.await.expect("read task").expect("read");
        assert_eq!(
            &read[..],
            b"gathered",
            "round {round}: the read missed the gathered bytes"
        );
        Arc::into_inner(file)
            .expect("one owner")
            .close()
            .await
            .expect("close reports no lost write");
        let reopened = client
            .open_path(&path, &ClusterOpen::new().read(true))
            .await
            .expect("open");
        assert_eq!(
            &reopened.read_at(far, 8).await.expect("read")[..],
            b"gathered"
        );
    }
}

/// Large writes that do not follow stripe unit boundaries, arriving out of order (as a
/// writeback mount's session threads hand over the kernel's write-back), reach the I/O
/// servers as whole, aligned units, which they write past their page cache; and nothing
/// parked at the client is lost or lands over a later write: a rewrite across parked
/// pieces, a read, and the close each see every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unaligned_large_writes_go_out_as_whole_units_and_lose_nothing() {
    const UNIT: u64 = 1 << 20;
    const LEAD: u64 = 300 << 10;
    const UNITS: u64 = 9;
    let cluster = Cluster::start_with(ClusterOptions {
        metrics: true,
        stripe_unit_bytes: UNIT as u32,
        ..ClusterOptions::new(2)
    })
    .await;
    // Parked pieces wait far longer than the test: only whole units and the calls that
    // must see the bytes send them.
    let client = cluster
        .client_with(|config| config.gather_wait_ms = 1_000)
        .await;
    let size = LEAD + UNITS * UNIT;
    let mut random = Xorshift::new(11);
    let mut model = random.bytes(size as usize);
    let options = ClusterOpen::new().read(true).write(true).create(true);
    let file = client
        .open_path("/drifted", &options)
        .await
        .expect("create");
    // [0, LEAD), then 1 MiB writes from LEAD (each across a unit boundary, the last one
    // ending inside the last unit); handed over in pairs swapped, as the mount's threads
    // may.
    let mut writes: Vec<(u64, u64)> = vec![(0, LEAD)];
    let mut offset = LEAD;
    while offset < size {
        let end = (offset + UNIT).min(size);
        writes.push((offset, end));
        offset = end;
    }
    for pair in writes.chunks_mut(2) {
        pair.reverse();
    }
    let before = io_requests(&cluster, "freeflow_rpc_requests_total", "WriteObject").await;
    let direct_before = io_requests(&cluster, "freeflow_io_direct_operations_total", "write").await;
    for (start, end) in &writes {
        let bytes = Bytes::copy_from_slice(&model[*start as usize..*end as usize]);
        file.write_at(*start, bytes).await.expect("write");
    }
    // A read sends what is parked, and sees it.
    let read = file.read_at(0, size).await.expect("read");
    assert_bytes_eq(&read, &model, "read back before the close");
    let requests =
        io_requests(&cluster, "freeflow_rpc_requests_total", "WriteObject").await - before;
    let direct =
        io_requests(&cluster, "freeflow_io_direct_operations_total", "write").await - direct_before;
    // Nine whole units and the last unit's part: ten requests, not the nineteen the
    // pieces would make, and every whole unit written past the page cache.
    assert_eq!(
        requests,
        (UNITS + 1) as f64,
        "WriteObject requests for {} writes",
        writes.len()
    );
    assert_eq!(direct, UNITS as f64, "whole units written with O_DIRECT");

    // Parked pieces, then a rewrite across them: the newer bytes win.
    for (start, end) in [
        (LEAD + 2 * UNIT, LEAD + 3 * UNIT),
        (5 * UNIT + 4096, 5 * UNIT + 200_000),
    ] {
        let fresh = random.bytes((end - start) as usize);
        model[start as usize..end as usize].copy_from_slice(&fresh);
        file.write_at(start, Bytes::from(fresh))
            .await
            .expect("write");
    }
    let (start, end) = (2 * UNIT + 100, 5 * UNIT + 150_000);
    let fresh = random.bytes((end - start) as usize);
    model[start as usize..end as usize].copy_from_slice(&fresh);
    file.write_at(start, Bytes::from(fresh))
        .await
        .expect("rewrite across parked pieces");
    file.close().await.expect("close sends what is parked");
    let reopened = client
        .open_path("/drifted", &ClusterOpen::new().read(true))
        .await
        .expect("open");
    assert_eq!(reopened.attr().size_bytes, size, "size after the close");
    let read = reopened.read_at(0, size).await.expect("read");
    assert_bytes_eq(&read, &model, "read back after the close");
}

/// A full cluster (issue 12, capacity grants): three clients write (one of them appends)
/// until the small file systems of the I/O servers are full. The write that does not fit fails with `NoSpace`
/// at the write itself, with nothing of it acknowledged; the close after it reports no
/// failure (no acknowledged write was refused later); every acknowledged byte reads back;
/// and removing a file makes room for new writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_cluster_refuses_the_write_that_does_not_fit_and_keeps_every_acknowledged_byte() {
    if !common::small_file_systems_available() {
        return;
    }
    const FILE_SYSTEM: u64 = 24 << 20;
    const WRITE: usize = 256 << 10;
    const WRITERS: usize = 3;
    let cluster = Arc::new(
        Cluster::start_with(ClusterOptions {
            io_tmpfs_bytes: Some(FILE_SYSTEM),
            ..ClusterOptions::new(2)
        })
        .await,
    );
    let pattern = |writer: usize, index: usize| {
        let mut random = Xorshift::new((writer * 100_000 + index + 1) as u64);
        random.bytes(WRITE)
    };
    let mut tasks = Vec::new();
    for writer in 0..WRITERS {
        let cluster = cluster.clone();
        tasks.push(tokio::spawn(async move {
            let client = cluster.client().await;
            let path = format!("/full-{writer}");
            let options = ClusterOpen::new().read(true).write(true).create(true);
            let file = client.open_path(&path, &options).await.expect("create");
            let mut acknowledged = 0;
            loop {
                assert!(
                    acknowledged * WRITE < 4 * FILE_SYSTEM as usize,
                    "writer {writer}: never refused"
                );
                let data = Bytes::from(pattern(writer, acknowledged));
                // The last writer appends (its offsets come from the handle's size).
                let written = if writer == WRITERS - 1 {
                    file.append(data).await.map(|_| ())
                } else {
                    file.write_at((acknowledged * WRITE) as u64, data).await
                };
                match written {
                    Ok(()) => acknowledged += 1,
                    Err(error) => {
                        assert_eq!(error.code(), ErrorCode::NoSpace, "writer {writer}: {error}");
                        break;
                    }
                }
            }
            file.close()
                .await
                .expect("the close: no acknowledged write was refused later");
            (path, acknowledged)
        }));
    }
    let mut written = Vec::new();
    for task in tasks {
        written.push(task.await.expect("writer"));
    }
    let total: usize = written.iter().map(|(_, count)| count * WRITE).sum();
    eprintln!(
        "acknowledged {total} bytes of {} on the servers",
        2 * FILE_SYSTEM
    );
    // Each server keeps a floor of 1 MiB; grants held idle are taken back when short.
    assert!(
        total as u64 >= 2 * FILE_SYSTEM * 3 / 4,
        "only {total} bytes fitted on two file systems of {FILE_SYSTEM}"
    );
    let reader = cluster.client().await;
    for (writer, (path, count)) in written.iter().enumerate() {
        let file = reader
            .open_path(path, &ClusterOpen::new().read(true))
            .await
            .expect("open");
        assert_eq!(
            file.attr().size_bytes,
            (count * WRITE) as u64,
            "{path}: size"
        );
        for index in 0..*count {
            let read = file
                .read_at((index * WRITE) as u64, WRITE as u64)
                .await
                .expect("read");
            assert_bytes_eq(
                &read,
                &pattern(writer, index),
                &format!("{path} write {index}"),
            );
        }
        file.close().await.expect("close");
    }
    // Room again once a file is gone (its objects are removed in the background).
    reader.remove_path(&written[0].0).await.expect("remove");
    let options = ClusterOpen::new().read(true).write(true).create(true);
    let file = reader.open_path("/after", &options).await.expect("create");
    let mut fitted = false;
    for _ in 0..100 {
        if file.write_at(0, Bytes::from(pattern(9, 0))).await.is_ok() {
            fitted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(fitted, "no room after removing a file");
    file.close().await.expect("close");
}

/// Sum of a counter with `op` = `op` over the I/O servers.
async fn io_requests(cluster: &Cluster, metric: &str, op: &str) -> f64 {
    let mut total = 0.0;
    for index in 0..cluster.io_count() {
        let address = cluster.io_metrics_address(index).expect("metrics are on");
        let text = freeflow_metrics::scrape(address, Duration::from_secs(10))
            .await
            .unwrap_or_else(|error| panic!("scrape {address}: {error}"));
        total += freeflow_metrics::text::Snapshot::parse(&text).sum(metric, &[("op", op)]);
    }
    total
}

/// ReadObject requests the I/O servers served so far.
async fn io_reads(cluster: &Cluster) -> f64 {
    io_requests(cluster, "freeflow_rpc_requests_total", "ReadObject").await
}

/// A sequential reader of small pieces is served from what the library fetched ahead
/// (far fewer, larger requests), and never from before a change: a write through its
/// handle into what was fetched ahead, and another client's truncation, are both seen by
/// the next read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_ahead_serves_sequential_readers_and_never_hides_a_change() {
    const SIZE: usize = 24 << 20;
    const READ: u64 = 64 << 10;
    // Stripe units of 1 MiB: a request per unit, so the request count shows the reads'
    // size (64 KiB units would make every read one request whatever is fetched ahead).
    let cluster = Cluster::start_with(ClusterOptions {
        metrics: true,
        stripe_unit_bytes: 1 << 20,
        ..ClusterOptions::new(3)
    })
    .await;
    let writer = cluster.client().await;
    let mut random = Xorshift::new(7);
    let original = random.bytes(SIZE);
    let options = ClusterOpen::new().read(true).write(true).create(true);
    let file = writer
        .open_path("/sequential", &options)
        .await
        .expect("create");
    file.write_at(0, Bytes::from(original.clone()))
        .await
        .expect("write");
    file.close().await.expect("close");

    // Read-ahead on (the default): 384 reads of 64 KiB in far fewer requests, with a
    // write through the handle just ahead of the reader, into what it fetched ahead.
    let reader = cluster.client().await;
    let before = io_reads(&cluster).await;
    let file = reader
        .open_path("/sequential", &ClusterOpen::new().read(true).write(true))
        .await
        .expect("open");
    let mut current = original.clone();
    // Four pieces (of one 3 MiB stripe row) past the reader: fetched ahead by then.
    let patch_at = (12 << 20) + 17;
    let mut offset = 0u64;
    let mut requests = 0.0;
    while offset < SIZE as u64 {
        if offset == 8 << 20 {
            // The first 8 MiB (128 reads) without a change: counted.
            requests = io_reads(&cluster).await - before;
            file.write_at(patch_at, Bytes::from(vec![0xAB; 100_000]))
                .await
                .expect("patch");
            current[patch_at as usize..patch_at as usize + 100_000].fill(0xAB);
        }
        let data = file.read_at(offset, READ).await.expect("read");
        assert!(!data.is_empty(), "short file at {offset}");
        let end = offset as usize + data.len();
        assert_bytes_eq(
            &data,
            &current[offset as usize..end],
            &format!("read at {offset}"),
        );
        offset += data.len() as u64;
    }
    assert!(
        requests <= 40.0,
        "{requests} requests for 128 reads of 64 KiB"
    );

    // Read sequentially to 4 MiB again (what lies past it is fetched ahead); another
    // client cuts the file there and writes new bytes past the cut; after a refresh (what
    // an open does: close-to-open) the next sequential read sees them, not the old bytes
    // it had fetched ahead.
    let mut offset = 0u64;
    while offset < 4 << 20 {
        offset += file.read_at(offset, READ).await.expect("read").len() as u64;
    }
    writer
        .truncate_path("/sequential", 4 << 20)
        .await
        .expect("truncate");
    let other = writer
        .open_path("/sequential", &ClusterOpen::new().write(true))
        .await
        .expect("open to write");
    other
        .write_at(4 << 20, Bytes::from(vec![0xCD; READ as usize]))
        .await
        .expect("write past the cut");
    other.close().await.expect("close");
    file.refresh().await.expect("refresh");
    let after = file
        .read_at(4 << 20, READ)
        .await
        .expect("read past the cut");
    assert!(
        after.iter().all(|byte| *byte == 0xCD) && after.len() == READ as usize,
        "the read past the cut returned what was fetched before it"
    );
    file.close().await.expect("close");

    // Read-ahead off: one request per read (the count above could have failed).
    let plain = cluster
        .client_with(|config| config.readahead_bytes = 0)
        .await;
    let before = io_reads(&cluster).await;
    let file = plain
        .open_path("/sequential", &ClusterOpen::new().read(true))
        .await
        .expect("open");
    let mut offset = 0;
    while offset < 4 << 20 {
        offset += file.read_at(offset, READ).await.expect("read").len() as u64;
    }
    let requests = io_reads(&cluster).await - before;
    assert!(
        requests >= (4 << 20) as f64 / READ as f64,
        "{requests} requests without read-ahead"
    );
    file.close().await.expect("close");
}

/// The kernel sends a mount the reads of its read-ahead window together (four of 1 MiB for
/// its default 4 MiB window), and they reach the handle in any order: they are still read
/// ahead, every unit is fetched once (but for the first window's reads that come before
/// one counts as sequential: each fetches its own), and each read gets its own bytes. A
/// reader going backwards is not read ahead for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_ahead_serves_a_window_of_reads_arriving_out_of_order() {
    const UNIT: u64 = 1 << 20;
    const UNITS: u64 = 32;
    const WINDOW: u64 = 4;
    let cluster = Cluster::start_with(ClusterOptions {
        metrics: true,
        stripe_unit_bytes: UNIT as u32,
        ..ClusterOptions::new(4)
    })
    .await;
    let writer = cluster.client().await;
    let mut random = Xorshift::new(11);
    let original = random.bytes((UNITS * UNIT) as usize);
    let file = writer
        .open_path(
            "/window",
            &ClusterOpen::new().read(true).write(true).create(true),
        )
        .await
        .expect("create");
    file.write_at(0, Bytes::from(original.clone()))
        .await
        .expect("write");
    file.close().await.expect("close");

    let reader = cluster.client().await;
    let file = Arc::new(
        reader
            .open_path("/window", &ClusterOpen::new().read(true))
            .await
            .expect("open"),
    );
    let before = io_reads(&cluster).await;
    for window in 0..UNITS / WINDOW {
        let mut order: Vec<u64> = (0..WINDOW).collect();
        for at in (1..order.len()).rev() {
            order.swap(at, random.below(at as u64 + 1) as usize);
        }
        let reads = order.iter().map(|index| {
            let (file, offset) = (file.clone(), (window * WINDOW + index) * UNIT);
            async move { (offset, file.read_at(offset, UNIT).await.expect("read")) }
        });
        for (offset, data) in futures::future::join_all(reads).await {
            let at = offset as usize;
            assert_bytes_eq(
                &data,
                &original[at..at + UNIT as usize],
                &format!("read at {offset}"),
            );
        }
    }
    let requests = io_reads(&cluster).await - before;
    assert!(
        requests <= (UNITS + WINDOW) as f64,
        "{requests} requests for {UNITS} units read once each"
    );
    // Backwards, a unit at a time from the end: one request per read, nothing ahead.
    let before = io_reads(&cluster).await;
    for unit in (0..UNITS).rev() {
        let offset = unit * UNIT;
        let data = file.read_at(offset, UNIT).await.expect("read backwards");
        let at = offset as usize;
        assert_bytes_eq(
            &data,
            &original[at..at + UNIT as usize],
            &format!("backwards read at {offset}"),
        );
    }
    let requests = io_reads(&cluster).await - before;
    assert!(
        requests <= UNITS as f64,
        "{requests} requests for {UNITS} units read backwards"
    );
    let file = Arc::into_inner(file).expect("no read holds the handle");
    file.close().await.expect("close");
}

/// POSIX judges a size change through a descriptor by the descriptor: a user who creates a
/// file with mode 0 may still truncate it through the descriptor the create gave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_size_change_through_a_descriptor_is_authorised_by_the_descriptor() {
    if !fuse_available() {
        return;
    }
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        eprintln!("skipping: needs root to act as another user");
        return;
    }
    let cluster = Cluster::start(1).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let shared = mount.path("shared");
    fs::create_dir(&shared).expect("mkdir");
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o777)).expect("chmod 777");
    let path = c_path(&shared.join("mode-zero"));
    // The child only makes system calls between fork and _exit.
    // SAFETY: fork in a test process; the child calls async-signal-safe functions only.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork");
    if child == 0 {
        // SAFETY: plain system calls in the forked child, then _exit.
        unsafe {
            let fail = |step: i32| libc::_exit(10 + step);
            if libc::setresgid(1000, 1000, 1000) != 0 || libc::setresuid(1000, 1000, 1000) != 0 {
                fail(0);
            }
            let fd = libc::open(path.as_ptr(), libc::O_CREAT | libc::O_RDWR, 0);
            if fd < 0 {
                fail(1);
            }
            if libc::ftruncate(fd, 0) != 0 {
                fail(2);
            }
            if libc::write(fd, b"data".as_ptr().cast(), 4) != 4 {
                fail(3);
            }
            if libc::ftruncate(fd, 2) != 0 {
                fail(4);
            }
            // By path, the mode bits decide: mode 0 refuses.
            if libc::truncate(path.as_ptr(), 0) == 0 {
                fail(5);
            }
            if *libc::__errno_location() != libc::EACCES {
                fail(6);
            }
            libc::close(fd);
            libc::_exit(0);
        }
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(libc::WIFEXITED(status), "the child did not exit");
    let code = libc::WEXITSTATUS(status);
    let steps = [
        "setresuid",
        "open(O_CREAT|O_RDWR, 0)",
        "ftruncate(fd, 0)",
        "write",
        "ftruncate(fd, 2)",
        "truncate(path) by a user without write permission succeeded",
        "truncate(path) failed with another errno than EACCES",
    ];
    assert_eq!(
        code,
        0,
        "failed at {}:\n{}",
        steps[(code as usize).saturating_sub(10).min(6)],
        mount.log_text()
    );
    assert_eq!(
        fs::read(shared.join("mode-zero")).expect("read as root"),
        b"da"
    );
}

fn blocks_bytes(path: &Path) -> u64 {
    fs::metadata(path).expect("stat").blocks() * 512
}

/// `st_blocks` counts what the I/O servers store: a sparse file is small, a tree of small
/// files costs what it does on ext4 (the objects live on ext4), within 10%.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn st_blocks_counts_what_the_servers_store() {
    if !fuse_available() {
        return;
    }
    let cluster = Cluster::start(3).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let local = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("local dir");

    // A file made long by truncate holds nothing.
    let sparse = mount.path("sparse");
    File::create(&sparse)
        .expect("create")
        .set_len(10 << 30)
        .expect("truncate -s 10G");
    assert_eq!(fs::metadata(&sparse).expect("stat").len(), 10 << 30);
    assert_eq!(blocks_bytes(&sparse), 0);

    // Two 1 MiB islands in 100 MiB, here and on ext4.
    let mut random = Xorshift::new(5);
    let island = random.bytes(1 << 20);
    for directory in [mount.path(""), local.path().to_path_buf()] {
        let file = File::create(directory.join("islands")).expect("create");
        file.write_all_at(&island, 0).expect("write");
        file.write_all_at(&island, 100 << 20).expect("write");
    }
    let ours = blocks_bytes(&mount.path("islands"));
    let theirs = blocks_bytes(&local.path().join("islands"));
    let ratio = ours as f64 / theirs as f64;
    assert!(
        (0.9..=1.1).contains(&ratio),
        "islands: {ours} vs ext4 {theirs}"
    );

    // A tree of small files.
    let (mut ours, mut theirs) = (0u64, 0u64);
    for directory in [mount.path("tree"), local.path().join("tree")] {
        fs::create_dir(&directory).expect("mkdir");
    }
    for index in 0..150 {
        let length = 1 + random.below(40_000) as usize;
        let data = random.bytes(length);
        fs::write(mount.path(&format!("tree/{index}")), &data).expect("write on the mount");
        fs::write(local.path().join(format!("tree/{index}")), &data).expect("write locally");
    }
    for index in 0..150 {
        ours += blocks_bytes(&mount.path(&format!("tree/{index}")));
        theirs += blocks_bytes(&local.path().join(format!("tree/{index}")));
    }
    let ratio = ours as f64 / theirs as f64;
    assert!(
        (0.9..=1.1).contains(&ratio),
        "tree: {ours} vs ext4 {theirs}"
    );

    // A punched hole gives its blocks back; a shrink too.
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(mount.path("islands"))
        .expect("open");
    fallocate(
        &file,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        0,
        1 << 20,
    )
    .expect("punch");
    drop(file);
    let punched = blocks_bytes(&mount.path("islands"));
    assert!(
        punched <= (1 << 20) + (64 << 10),
        "after the punch: {punched}"
    );
    File::options()
        .write(true)
        .open(mount.path("islands"))
        .expect("open")
        .set_len(4096)
        .expect("shrink");
    assert!(blocks_bytes(&mount.path("islands")) <= 4096 * 3);
}

/// fallocate's modes on the mount: allocate (with and without KEEP_SIZE), punch a hole,
/// zero a range; the data around them stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallocate_allocates_punches_and_zeroes() {
    if !fuse_available() {
        return;
    }
    let cluster = Cluster::start(3).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let path = mount.path("f");
    let file = open_rw(&path);
    let data = Xorshift::new(3).bytes(512 << 10);
    file.write_all_at(&data, 0).expect("write");

    fallocate(
        &file,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        100_000,
        200_000,
    )
    .expect("punch");
    fallocate(
        &file,
        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
        400_000,
        1000,
    )
    .expect("zero");
    let mut expected = data.clone();
    expected[100_000..300_000].fill(0);
    expected[400_000..401_000].fill(0);
    assert_bytes_eq(
        &read_at(&file, 0, 1 << 20),
        &expected,
        "after punch and zero",
    );
    assert_eq!(file.metadata().expect("fstat").len(), 512 << 10);

    fallocate(&file, libc::FALLOC_FL_KEEP_SIZE, 0, 2 << 20).expect("allocate, keep size");
    assert_eq!(file.metadata().expect("fstat").len(), 512 << 10);
    fallocate(&file, 0, 1 << 20, 1 << 20).expect("allocate and grow");
    assert_eq!(file.metadata().expect("fstat").len(), 2 << 20);
    fallocate(&file, libc::FALLOC_FL_ZERO_RANGE, 3 << 20, 4096).expect("zero and grow");
    assert_eq!(file.metadata().expect("fstat").len(), (3 << 20) + 4096);
    expected.resize((3 << 20) + 4096, 0);
    assert_bytes_eq(
        &read_at(&file, 0, 4 << 20),
        &expected,
        "after the allocations",
    );
    // A punch without KEEP_SIZE is refused, as Linux does.
    assert_eq!(
        errno_of(fallocate(&file, libc::FALLOC_FL_PUNCH_HOLE, 0, 4096)),
        Some(libc::EOPNOTSUPP)
    );
    drop(file);
    assert_bytes_eq(
        &fs::read(&path).expect("read after close"),
        &expected,
        "after close",
    );
}

/// copy_file_range is served by the mount (never the kernel's page-by-page fallback): on
/// the I/O servers where both pieces live on one server, through the client otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_file_range_copies_on_the_servers_and_through_the_client() {
    if !fuse_available() {
        return;
    }
    let mut options = ClusterOptions::new(3);
    options.metrics = true;
    let cluster = Cluster::start_with(options).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let client = cluster.client().await;
    // Another layout: 1 MiB units, so its pieces and the 64 KiB ones rarely share a server.
    fs::create_dir(mount.path("wide")).expect("mkdir");
    client
        .set_dir_layout_path("/wide", Some(1 << 20), None, None)
        .await
        .expect("stripe set");
    let data = Xorshift::new(8).bytes((10 << 20) + 12345);
    fs::write(mount.path("source"), &data).expect("write the source");
    let mut expected_server_copies = 0u64;
    for (target, offset) in [("same-layout", 0u64), ("wide/other-layout", 4096 + 17)] {
        let source = File::open(mount.path("source")).expect("open source");
        let target_file = open_rw(&mount.path(target));
        let mut copied = 0usize;
        while copied < data.len() {
            let count = copy_file_range(
                &source,
                copied as u64,
                &target_file,
                offset + copied as u64,
                data.len() - copied,
            );
            assert!(
                count > 0,
                "copy_file_range: {}",
                std::io::Error::last_os_error()
            );
            copied += count as usize;
        }
        drop(target_file);
        let read = fs::read(mount.path(target)).expect("read the copy");
        assert_eq!(read.len() as u64, offset + data.len() as u64);
        assert!(read[..offset as usize].iter().all(|&byte| byte == 0));
        assert_bytes_eq(&read[offset as usize..], &data, target);
        // The pieces whose source and target objects share a server are copied there.
        let layout_of = |path: String| {
            let client = &client;
            async move {
                client
                    .stat(&path)
                    .await
                    .expect("stat")
                    .layout
                    .expect("layout")
            }
        };
        let source_layout = layout_of("/source".into()).await;
        let target_layout = layout_of(format!("/{target}")).await;
        let mut at = 0u64;
        while at < data.len() as u64 {
            let (source_stripe, source_object) = source_layout.locate(at);
            let (target_stripe, target_object) = target_layout.locate(offset + at);
            let source_unit = u64::from(source_layout.stripe_unit_bytes);
            let target_unit = u64::from(target_layout.stripe_unit_bytes);
            let piece = (data.len() as u64 - at)
                .min(source_unit - source_object % source_unit)
                .min(target_unit - target_object % target_unit);
            if source_layout.servers[source_stripe as usize]
                == target_layout.servers[target_stripe as usize]
            {
                expected_server_copies += 1;
            }
            at += piece;
        }
    }
    let mut copies = 0.0;
    for index in 0..3 {
        let address = cluster
            .io_metrics_address(index)
            .expect("metrics on")
            .to_string();
        let text = freeflow_metrics::scrape(&address, Duration::from_secs(10))
            .await
            .expect("scrape");
        copies += freeflow_metrics::text::Snapshot::parse(&text)
            .sum("freeflow_rpc_requests_total", &[("op", "CopyObjectRange")]);
    }
    assert!(
        expected_server_copies > 0,
        "no piece shares a server: change the sizes"
    );
    assert_eq!(copies as u64, expected_server_copies, "server-side copies");
    let log = mount.log_text();
    assert!(!log.contains("Not Implemented"), "{log}");
}

/// Issue 8's random-operation exerciser on real mounts, on two mounts alternating, and on
/// the library: several seeds, every read checked against the model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exerciser_finds_nothing_on_mounts_and_on_the_library() {
    if !fuse_available() {
        return;
    }
    // On Unix sockets, as `freeflow up` runs: the mounts and the library read locally.
    let cluster = Cluster::start_with(ClusterOptions {
        unix_sockets: true,
        ..ClusterOptions::new(3)
    })
    .await;
    let left = Mount::start(&cluster, "left", &[]);
    let right = Mount::start(&cluster, "right", &[]);
    let operations = std::env::var("FREEFLOW_EXERCISE_OPS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(4_000u64);
    let options = |seed| freeflow_exercise::Options {
        operations,
        seed,
        size_max: 1 << 20,
        length_max: 128 << 10,
        ..freeflow_exercise::Options::default()
    };
    let mut runs: Vec<(String, Box<dyn freeflow_exercise::Target + Send>, u64)> = Vec::new();
    for seed in 1..=3 {
        let target = PosixTarget::open(vec![left.path(&format!("one-{seed}"))]).expect("open");
        runs.push((format!("mount, seed {seed}"), Box::new(target), seed));
    }
    let target = PosixTarget::open(vec![left.path("two"), right.path("two")]).expect("open");
    runs.push(("two mounts, seed 4".into(), Box::new(target), 4));
    let runtime = tokio::runtime::Handle::current();
    for seed in 5..=6 {
        let clients = vec![cluster.client().await, cluster.client().await];
        let path = format!("/library-{seed}");
        let handle = runtime.clone();
        let target =
            tokio::task::spawn_blocking(move || LibraryTarget::open(clients, &path, handle))
                .await
                .expect("open task")
                .expect("open through the library");
        runs.push((
            format!("library, two clients, seed {seed}"),
            Box::new(target),
            seed,
        ));
    }
    for (name, mut target, seed) in runs {
        let options = options(seed);
        let outcome = tokio::task::spawn_blocking(move || {
            freeflow_exercise::run(target.as_mut(), &options, 0, |_| {})
        })
        .await
        .expect("exerciser task");
        match outcome {
            Ok(report) => {
                assert_eq!(report.operations, operations);
                eprintln!("{name}: {report}");
            }
            Err(failure) => panic!("{name}: {failure}\n{}", left.log_text()),
        }
    }
}

/// `freeflow exercise` as a user runs it: the report on success, and exit status 65 (data
/// error) with the seed on a mismatch, here forced by a second writer changing the file
/// behind the exerciser's back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exercise_command_reports_its_run() {
    if !fuse_available() {
        return;
    }
    let cluster = Cluster::start(2).await;
    let mount = Mount::start(&cluster, "mnt", &[]);
    let output = std::process::Command::new(common::FREEFLOW)
        .args(["exercise", "--ops", "500", "--seed", "9", "--progress", "0"])
        .arg(mount.path("cmd"))
        .output()
        .expect("run freeflow exercise");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("500 operations") && stdout.contains("all reads matched"),
        "{stdout}"
    );

    let output = std::process::Command::new(common::FREEFLOW)
        .arg("--cluster")
        .arg(cluster.client_toml())
        .args([
            "exercise",
            "--ops",
            "300",
            "--seed",
            "2",
            "--progress",
            "0",
            "ff:/cmd-library",
        ])
        .output()
        .expect("run freeflow exercise through the library");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    // A disturbance the model cannot know of: another process scribbles over the file.
    let path = mount.path("disturbed");
    let mut child = std::process::Command::new(common::FREEFLOW)
        .args([
            "exercise",
            "--ops",
            "200000",
            "--seed",
            "3",
            "--progress",
            "0",
            "--no-mmap",
        ])
        .arg(&path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start freeflow exercise");
    std::thread::sleep(Duration::from_millis(1500));
    for _ in 0..200 {
        if let Ok(file) = OpenOptions::new().write(true).open(&path) {
            let _ = file.write_all_at(&[0xee; 1 << 20], 0);
        }
        if child.try_wait().expect("poll").is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let output = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(65), "{stderr}");
    assert!(stderr.contains("seed 3, operation #"), "{stderr}");
}

/// A file shrunk while one of its I/O servers was down leaves a cut owed on that server.
/// When the server comes back it serves no data until the meta server has made that cut:
/// no byte the truncate removed is read back after the file grows again, and no write made
/// after the server's return is destroyed by the late cut. The meta server is stopped while
/// the server comes back, so the server cannot learn of the cut; reads and writes wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_back_from_an_outage_makes_its_owed_cuts_before_serving_data() {
    const SIZE: usize = 4 << 20;
    const PATCH: std::ops::Range<usize> = (64 << 10)..(64 << 10) + 1000;
    let mut cluster = Cluster::start(2).await;
    let client = cluster.client().await;
    let options = ClusterOpen::new().read(true).write(true).create(true);
    let file = client.open_path("/owed", &options).await.expect("create");
    // 64 KiB stripe units: half of it on each server.
    file.write_at(0, Bytes::from(vec![b'A'; SIZE]))
        .await
        .expect("write");
    file.close().await.expect("close");

    cluster.kill_io(1);
    let refused = client
        .truncate_path("/owed", 0)
        .await
        .expect_err("a cut on a down server cannot be made");
    assert!(refused.to_string().contains("pending"), "{refused}");
    client
        .truncate_path("/owed", SIZE as u64)
        .await
        .expect("grow again");
    let reader = client
        .open_path("/owed", &ClusterOpen::new().read(true).write(true))
        .await
        .expect("open");
    assert_eq!(reader.attr().size_bytes, SIZE as u64);

    cluster.signal_meta(libc::SIGSTOP);
    cluster.respawn_io(1).await;
    let reader = Arc::new(reader);
    // A write into the stripe the down server holds, and a read of the whole file.
    let writing = {
        let reader = Arc::clone(&reader);
        tokio::spawn(async move {
            reader
                .write_at(PATCH.start as u64, Bytes::from(vec![b'B'; PATCH.len()]))
                .await
        })
    };
    let reading = {
        let reader = Arc::clone(&reader);
        tokio::spawn(async move { reader.read_at(0, SIZE as u64).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !reading.is_finished(),
        "a server that may owe cuts served a read before the meta server answered it"
    );
    cluster.signal_meta(libc::SIGCONT);
    writing.await.expect("write task").expect("write");
    let read = reading.await.expect("read task").expect("read");
    let stale = read.iter().filter(|byte| **byte == b'A').count();
    assert_eq!(stale, 0, "{stale} bytes the truncate removed came back");

    let reader = Arc::into_inner(reader).expect("tasks done");
    reader.close().await.expect("close");
    let check = client
        .open_path("/owed", &ClusterOpen::new().read(true))
        .await
        .expect("open");
    let mut expected = vec![0u8; SIZE];
    expected[PATCH].fill(b'B');
    let read = check.read_at(0, SIZE as u64).await.expect("read");
    assert_bytes_eq(&read, &expected, "after the owed cut");
    check.close().await.expect("close");
    assert!(
        cluster.io_log(1).contains("serving data"),
        "{}",
        cluster.io_log(1)
    );
}

/// An I/O server that is down makes reads of its stripes fail with EIO (not ENOTCONN,
/// which reads as "the mount is gone"), and the mount's log names the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_io_server_gives_eio_and_is_named_in_the_log() {
    if !fuse_available() {
        return;
    }
    let mut cluster = Cluster::start(2).await;
    let mount = Mount::start(&cluster, "mnt", &["--call-timeout-ms", "3000"]);
    // 1 MiB over 64 KiB units: stripes on both servers.
    fs::write(mount.path("f"), vec![1u8; 1 << 20]).expect("write");
    cluster.kill_io(1);
    let path = mount.path("f");
    let outcome = tokio::task::spawn_blocking(move || fs::read(path))
        .await
        .expect("read task");
    assert_eq!(errno_of(outcome), Some(libc::EIO));
    let log = mount.log_text();
    assert!(
        log.contains("I/O server is unreachable") && log.contains("server_id=1"),
        "{log}"
    );
    cluster.restart_io(1).await;
}

/// Ctrl-C on `freeflow mount` unmounts cleanly and logs no warning (fuser used to try a
/// second unmount of its own after ours and warn "Unmount failed: Invalid argument").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_unmounts_cleanly_without_a_warning() {
    if !fuse_available() {
        return;
    }
    let cluster = Cluster::start(1).await;
    let mut mount = Mount::start(&cluster, "mnt", &[]);
    fs::write(mount.path("f"), b"x").expect("write");
    // An ioctl the mount does not know (what isatty asks) is "not a terminal", quietly.
    let file = File::open(mount.path("f")).expect("open");
    // SAFETY: all-zero is a valid termios.
    let mut terminal: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and a pointer to a live termios.
    let asked = unsafe { libc::ioctl(file.as_raw_fd(), libc::TCGETS, &mut terminal) };
    assert_eq!(asked, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENOTTY)
    );
    drop(file);
    mount.signal(libc::SIGINT);
    let child = mount.child.as_mut().expect("running");
    let status = common::poll_sync(20_000, || child.try_wait().ok().flatten().is_some());
    assert!(status, "the mount did not exit after SIGINT");
    mount.child = None;
    assert!(!common::mount::is_mounted(&mount.mountpoint));
    let log = mount.log_text();
    assert!(log.contains("unmounted"), "{log}");
    assert!(!log.contains("WARN"), "{log}");
}

/// Bytes a client read through descriptors of objects on this host (local reads).
fn local_read_bytes(client: &freeflow_client::Client) -> f64 {
    freeflow_metrics::text::Snapshot::parse(&client.metrics().render())
        .sum("freeflow_client_local_read_bytes_total", &[])
}

/// A reader on the I/O servers' host reads their objects through descriptors they hand
/// out (local reads), and sees through them what the served path would: another client's
/// cut and regrowth as zeros, its writes at once, and, once a server is killed while a
/// cut is owed to it, neither the bytes the cut removes nor anything else of that server
/// until it is back and has made the cut. A client told not to read locally never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_reads_see_cuts_and_writes_and_stop_with_their_server() {
    const SIZE: usize = 4 << 20;
    const MIB: usize = 1 << 20;
    let mut cluster = Cluster::start_with(ClusterOptions {
        unix_sockets: true,
        ..ClusterOptions::new(2)
    })
    .await;
    let writer = cluster.client().await;
    let reader = cluster.client().await;
    let served = cluster
        .client_with(|config| config.local_reads = false)
        .await;
    let options = ClusterOpen::new().read(true).write(true).create(true);
    let file = writer.open_path("/local", &options).await.expect("create");
    file.write_at(0, Bytes::from(vec![b'A'; SIZE]))
        .await
        .expect("write");
    file.close().await.expect("close");

    let handle = reader
        .open_path("/local", &ClusterOpen::new().read(true))
        .await
        .expect("open");
    let read = handle.read_at(0, SIZE as u64).await.expect("read");
    assert_bytes_eq(&read, &vec![b'A'; SIZE], "first read");
    assert!(
        local_read_bytes(&reader) >= SIZE as f64,
        "the reader read {} bytes locally",
        local_read_bytes(&reader)
    );

    // Another client cuts the file to 1 MiB and grows it back, then writes into it: the
    // reader's open handle, holding its descriptors, sees zeros past the cut and the write.
    writer
        .truncate_path("/local", MIB as u64)
        .await
        .expect("cut");
    writer
        .truncate_path("/local", SIZE as u64)
        .await
        .expect("grow");
    let mut expected = vec![0u8; SIZE];
    expected[..MIB].fill(b'A');
    let read = handle.read_at(0, SIZE as u64).await.expect("read");
    assert_bytes_eq(&read, &expected, "after another client's cut");
    let patch = (2 * MIB)..(2 * MIB + 100_000);
    let file = writer
        .open_path("/local", &ClusterOpen::new().write(true))
        .await
        .expect("open to write");
    file.write_at(patch.start as u64, Bytes::from(vec![b'C'; patch.len()]))
        .await
        .expect("write");
    file.close().await.expect("close");
    expected[patch.clone()].fill(b'C');
    let read = handle.read_at(0, SIZE as u64).await.expect("read");
    assert_bytes_eq(&read, &expected, "after another client's write");

    let read = served
        .open_path("/local", &ClusterOpen::new().read(true))
        .await
        .expect("open")
        .read_at(0, SIZE as u64)
        .await
        .expect("read");
    assert_bytes_eq(&read, &expected, "through the served path");
    assert_eq!(
        local_read_bytes(&served),
        0.0,
        "local reads were turned off"
    );

    // Server 1 dies; a cut to 0 is owed to it, the file grows again. Nothing of what it
    // held may be read through the reader's old descriptors now.
    cluster.kill_io(1);
    let refused = writer
        .truncate_path("/local", 0)
        .await
        .expect_err("a cut on a down server cannot be made");
    assert!(refused.to_string().contains("pending"), "{refused}");
    // The file is open (the reader), so the growth cuts too: the size is set, the cut
    // on the down server owed.
    if let Err(error) = writer.truncate_path("/local", SIZE as u64).await {
        assert!(error.to_string().contains("is set"), "{error}");
    }
    let before = local_read_bytes(&reader);
    match tokio::time::timeout(Duration::from_secs(20), handle.read_at(0, SIZE as u64)).await {
        Ok(Ok(read)) => {
            let stale = read.iter().filter(|byte| **byte != 0).count();
            assert_eq!(stale, 0, "{stale} bytes the cut removed were read");
        }
        Ok(Err(error)) => eprintln!("the read failed, as a down server's reads do: {error}"),
        Err(_) => eprintln!("the read waited for the down server"),
    }
    cluster.respawn_io(1).await;
    let read = handle.read_at(0, SIZE as u64).await.expect("read");
    assert_bytes_eq(&read, &vec![0u8; SIZE], "after the server made its cut");
    let file = writer
        .open_path("/local", &ClusterOpen::new().write(true))
        .await
        .expect("open to write");
    file.write_at(0, Bytes::from(vec![b'D'; SIZE]))
        .await
        .expect("write");
    file.close().await.expect("close");
    let read = handle.read_at(0, SIZE as u64).await.expect("read");
    assert_bytes_eq(
        &read,
        &vec![b'D'; SIZE],
        "after a write with the server back",
    );
    // At least server 0's half (the other may still be paused after its refusals).
    assert!(
        local_read_bytes(&reader) >= before + (SIZE / 2) as f64,
        "local reads go on: {} bytes before, {} after",
        before,
        local_read_bytes(&reader)
    );
    handle.close().await.expect("close");
}
