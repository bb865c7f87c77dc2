//! Tests of the kernel-cache index: revocations, listings, held names and leases.

use super::*;
use fuser::INodeNo;

fn enabled_cache() -> KernelCache {
    let cache = KernelCache::new(false);
    cache.enabled.store(true, Ordering::Release);
    cache
}

fn ten_second_lease(seq: u64) -> Lease {
    Lease {
        until: Some(tokio::time::Instant::now() + Duration::from_secs(10)),
        seq,
        epoch: 1,
        delegated: false,
        span_until: None,
    }
}

/// What is left of `lease` by its own time.
fn good(lease: &Lease) -> Option<Duration> {
    lease
        .until
        .and_then(|until| until.checked_duration_since(tokio::time::Instant::now()))
}

fn revocation(inode: InodeId, names: &[&str], attributes: bool, whole: bool) -> Revocation {
    Revocation {
        id: 1,
        inode,
        names: names.iter().map(|name| name.to_string()).collect(),
        attributes,
        whole_directory: whole,
    }
}

#[test]
fn revocations_take_what_they_name_out_of_the_index() {
    let cache = enabled_cache();
    let lease = Some(Duration::from_secs(10));
    {
        let mut admission = cache.admit();
        assert_eq!(admission.entry(lease, 1, "a", Some(10)), lease);
        assert_eq!(admission.entry(lease, 1, "b", Some(11)), lease);
        assert_eq!(admission.entry(lease, 2, "c", None), lease);
        assert_eq!(
            admission.entry(None, 2, "d", None),
            None,
            "no lease: not cached"
        );
    }
    let Taken {
        entries, inodes, ..
    } = cache.take(&revocation(1, &["a", "zz"], false, false));
    assert_eq!(entries, vec![(1, "a".to_string()), (1, "zz".to_string())]);
    assert!(inodes.is_empty());
    let Taken {
        entries, inodes, ..
    } = cache.take(&revocation(11, &[], true, false));
    assert!(entries.is_empty());
    assert_eq!(inodes, vec![11]);
    let Taken { entries, .. } = cache.take(&revocation(1, &[], false, true));
    assert_eq!(entries, vec![(1, "b".to_string())]);
    let Taken {
        entries, inodes, ..
    } = cache.take(&revocation(0, &[], true, true));
    assert_eq!(entries, vec![(2, "c".to_string())]);
    assert_eq!(inodes, vec![10]);
    assert_eq!(cache.index().name_count, 0);
}

#[test]
fn the_kernel_keeps_a_listing_read_alone_under_leases_until_one_ends_or_is_revoked() {
    let cache = enabled_cache();
    let lease = ten_second_lease;
    let all_but_seq_2 = |lease: &Lease| if lease.seq == 2 { None } else { good(lease) };
    let mut admission = cache.admit();
    assert!(!admission.kernel_listing_good(7, good), "nothing read yet");
    admission.kernel_listing_read(7, &[lease(1), lease(2)], false, false, good);
    assert!(
        !admission.kernel_listing_good(7, good),
        "another handle of it was open: the kernel's cache may mix two readings"
    );
    admission.kernel_listing_read(7, &[lease(1), lease(2)], true, false, all_but_seq_2);
    assert!(
        !admission.kernel_listing_good(7, good),
        "a page's lease is over"
    );
    admission.kernel_listing_read(7, &[], true, false, good);
    assert!(!admission.kernel_listing_good(7, good), "no page: no lease");
    admission.kernel_listing_read(7, &[lease(1), lease(2)], true, false, good);
    assert!(admission.kernel_listing_good(7, good));
    // A handle that kept the cache filled in its end: the earlier leases still count.
    admission.kernel_listing_read(7, &[lease(3)], true, true, good);
    assert!(admission.kernel_listing_good(7, good));
    assert!(
        !admission.kernel_listing_good(7, all_but_seq_2),
        "a lease of the earlier reading ended"
    );
    assert!(
        !admission.kernel_listing_good(7, good),
        "and it was forgotten"
    );
    admission.kernel_listing_read(7, &[lease(3)], true, true, good);
    assert!(
        !admission.kernel_listing_good(7, good),
        "what a kept cache held is not known any more"
    );
    admission.kernel_listing_read(7, &[lease(4)], true, false, good);
    admission.kernel_listing_read(8, &[lease(4)], true, false, good);
    drop(admission);
    cache.take(&revocation(7, &["a"], false, false));
    let mut admission = cache.admit();
    assert!(!admission.kernel_listing_good(7, good), "revoked");
    assert!(admission.kernel_listing_good(8, good), "another directory");
    drop(admission);
    cache.take(&revocation(0, &[], true, true));
    assert!(
        !cache.admit().kernel_listing_good(8, good),
        "everything revoked"
    );

    // Full of directories never opened again: those whose leases ended make room.
    let ended = Lease {
        until: Some(tokio::time::Instant::now()),
        span_until: None,
        ..lease(5)
    };
    let mut admission = cache.admit();
    for directory in 0..KERNEL_LISTINGS_MAX as InodeId {
        admission.kernel_listing_read(100 + directory, &[ended], true, false, |_| {
            Some(Duration::from_secs(1))
        });
    }
    admission.kernel_listing_read(9, &[lease(6)], true, false, good);
    assert!(
        admission.kernel_listing_good(9, good),
        "recorded once room was made"
    );
    assert_eq!(admission.index.kernel_listings.len(), 1);
}

#[test]
fn the_kernel_holds_what_it_was_given_under_leases_with_time_to_run() {
    let cache = enabled_cache();
    let ten = Some(Duration::from_secs(10));
    let mut admission = cache.admit();
    admission.entry(ten, 7, "both", Some(20));
    admission.entry(ten, 7, "name-alone", None);
    admission.attributes(ten, 22);
    admission.entry(Some(Duration::from_millis(500)), 7, "short", Some(23));
    assert_eq!(
        admission.kernel_holds(
            7,
            [
                ("both", 20),
                ("name-alone", 21),
                ("attributes-alone", 22),
                ("short", 23),
                ("never", 24)
            ]
            .into_iter()
        ),
        vec![true, false, false, false, false],
        "only a name and its attributes, both with a second to run"
    );
    assert_eq!(
        admission.kernel_holds(8, [("both", 20)].into_iter()),
        vec![false],
        "the name in another directory"
    );
    admission.entry(ten, 7, "again", Some(30));
    admission.entry(ten, 7, "opened", Some(31));
    drop(admission);
    cache.touched(31);
    assert_eq!(
        cache.admit().kernel_holds(7, [("opened", 31)].into_iter()),
        vec![false],
        "opened since: the kernel may have dropped its access time"
    );
    cache.admit().attributes(ten, 31);
    assert_eq!(
        cache.admit().kernel_holds(7, [("opened", 31)].into_iter()),
        vec![true],
        "given its attributes again"
    );
    cache.take(&revocation(7, &["both"], false, false));
    cache.take(&revocation(30, &[], true, false));
    assert_eq!(
        cache
            .admit()
            .kernel_holds(7, [("both", 20), ("again", 30)].into_iter()),
        vec![false, false],
        "a revoked name, revoked attributes"
    );
    let disabled = KernelCache::new(false);
    let mut admission = disabled.admit();
    admission.entry(ten, 7, "both", Some(20));
    assert_eq!(
        admission.kernel_holds(7, [("both", 20)].into_iter()),
        vec![false],
        "nothing without the notifier"
    );
}

#[test]
fn a_listing_answers_missing_names_until_its_lease_or_a_revocation_ends_it() {
    let cache = enabled_cache();
    let lease = ten_second_lease(5);
    {
        let mut admission = cache.admit();
        assert_eq!(
            admission.known_missing(7, "a", good),
            None,
            "nothing known yet"
        );
        admission.listing_started(7, lease, None);
        assert_eq!(admission.known_missing(7, "a", good), Some(lease));
        admission.listing_added(7, "a", None, None, good);
        assert_eq!(
            admission.known_missing(7, "a", good),
            None,
            "a name it made"
        );
        assert_eq!(admission.known_missing(7, "b", good), Some(lease));
        assert_eq!(
            admission.complete_listing(7, good),
            None,
            "the inode of \"a\" is not known"
        );
        admission.listing_added(7, "a", Some((12, FileKind::Regular)), None, good);
        admission.listing_added(7, "B", Some((11, FileKind::Directory)), None, good);
        let entries = |listing: Option<(Vec<DirEntry>, Lease)>| {
            listing.map(|(entries, lease)| {
                let entries: Vec<(String, InodeId, FileKind)> = entries
                    .into_iter()
                    .map(|entry| (entry.name, entry.inode, entry.kind))
                    .collect();
                (entries, lease)
            })
        };
        assert_eq!(
            entries(admission.complete_listing(7, good)),
            Some((
                vec![
                    ("B".to_string(), 11, FileKind::Directory),
                    ("a".to_string(), 12, FileKind::Regular)
                ],
                lease
            )),
            "every name, in the order of their bytes"
        );
        admission.listing_removed(7, "B");
        admission.listing_removed(7, "a");
        assert_eq!(admission.complete_listing(7, good), Some((vec![], lease)));
        assert_eq!(admission.known_missing(7, "a", good), Some(lease));
        assert_eq!(
            admission.known_missing(7, "a", |_| None),
            None,
            "lease over"
        );
        assert_eq!(
            admission.known_missing(7, "a", good),
            None,
            "and the listing went with it"
        );
        admission.listing_started(7, lease, None);
        admission.listing_unsure(7);
        assert_eq!(admission.known_missing(7, "a", good), None, "an error");
        admission.listing_started(7, lease, None);
    }
    cache.take(&revocation(7, &["z"], false, false));
    assert_eq!(
        cache.admit().known_missing(7, "a", good),
        None,
        "another client changed it"
    );
    assert_eq!(cache.index().listed_names, 0);
    // Without a notifier (`--no-cache`) nothing is kept.
    let off = KernelCache::new(false);
    off.admit().listing_started(7, lease, None);
    assert_eq!(off.admit().known_missing(7, "a", good), None);
}

#[test]
fn a_held_file_lapses_only_when_its_newest_lease_runs_out() {
    let cache = KernelCache::new(true);
    cache.enabled.store(true, Ordering::Release);
    {
        let mut admission = cache.admit();
        admission.held_as(10, 1, "a");
        admission.attributes(Some(Duration::from_secs(2)), 10);
        admission.attributes(Some(Duration::from_secs(60)), 10);
        admission.held_as(11, 1, "b");
    }
    let soon = Instant::now() + Duration::from_secs(5);
    let lapsing = cache.lapsing(soon);
    assert_eq!(
        lapsing,
        vec![(11, vec![(1, "b".to_string())])],
        "10 was renewed; 11 never had a lease"
    );
    assert_eq!(
        cache.index().expiries.len(),
        1,
        "10's renewal is scheduled once"
    );
    let later = Instant::now() + Duration::from_secs(120);
    let mut lapsing = cache.lapsing(later);
    lapsing.sort();
    assert_eq!(lapsing.len(), 2, "both lapse once the renewal runs out");
    cache.admit().forgotten(10);
    cache.admit().forgotten(11);
    assert!(cache.lapsing(later).is_empty(), "forgotten by the kernel");
    // Looked up again with a new lease: it lapses again when that one runs out.
    {
        let mut admission = cache.admit();
        admission.attributes(Some(Duration::from_secs(180)), 10);
        admission.held_as(10, 1, "a");
    }
    assert!(cache.lapsing(later).is_empty(), "the new lease holds");
    let much_later = Instant::now() + Duration::from_secs(300);
    assert_eq!(cache.lapsing(much_later).len(), 1, "and then runs out");
}

#[test]
fn a_writeback_mount_evicts_a_revoked_file_under_every_name_it_was_held_as() {
    let cache = KernelCache::new(true);
    cache.enabled.store(true, Ordering::Release);
    {
        let mut admission = cache.admit();
        admission.held_as(10, 1, "a");
        admission.held_as(10, 1, "a");
        admission.held_as(10, 2, "link");
        admission.held_as(11, 1, "b");
    }
    let Taken { entries, files, .. } = cache.take(&revocation(10, &[], true, false));
    assert!(
        files.is_empty(),
        "its pages went with the recall (write_back)"
    );
    assert_eq!(
        entries,
        vec![(1, "a".to_string()), (2, "link".to_string())],
        "each name once"
    );
    let Taken { files, .. } = cache.take(&revocation(1, &["a"], false, false));
    assert!(files.is_empty(), "a change of names only: no file evicted");
    cache.admit().forgotten(10);
    let Taken { files, entries, .. } = cache.take(&revocation(10, &[], true, false));
    assert!(
        files.is_empty() && entries.is_empty(),
        "forgotten by the kernel"
    );
    let Taken { files, entries, .. } = cache.take(&revocation(0, &[], true, true));
    assert_eq!((files, entries), (vec![11], vec![(1, "b".to_string())]));
    // Past the bound, the oldest name goes.
    let mut admission = cache.admit();
    for at in 0..=HELD_NAMES_PER_FILE_MAX as u64 {
        admission.held_as(12, at + 100, "n");
    }
    let names = &admission.index.held[&12];
    assert_eq!(names.len(), HELD_NAMES_PER_FILE_MAX);
    assert_eq!(names[0].0, 101);
    drop(admission);
    // Without writeback nothing is held.
    let plain = KernelCache::new(false);
    plain.enabled.store(true, Ordering::Release);
    plain.admit().held_as(10, 1, "a");
    assert!(plain
        .take(&revocation(10, &[], true, false))
        .files
        .is_empty());
}

/// A kernel whose `inval_entry` waits until let go, as the real one does while this mount's
/// own request holds the directory's lock; it records what it was asked, in order.
#[derive(Clone, Default)]
struct LockedDirectories(Arc<LockedState>);

#[derive(Default)]
struct LockedState {
    calls: Mutex<(Vec<String>, bool)>,
    changed: std::sync::Condvar,
}

impl LockedDirectories {
    fn let_go(&self) {
        self.0.calls.lock().expect("not poisoned").1 = true;
        self.0.changed.notify_all();
    }

    /// Waits up to `bound` for a call matching `wanted`.
    fn saw(&self, wanted: &str, bound: Duration) -> bool {
        let calls = self.0.calls.lock().expect("not poisoned");
        let (calls, _) = self
            .0
            .changed
            .wait_timeout_while(calls, bound, |(calls, _)| {
                !calls.iter().any(|call| call == wanted)
            })
            .expect("not poisoned");
        calls.0.iter().any(|call| call == wanted)
    }
}

impl Kernel for LockedDirectories {
    fn inval_entry(&self, parent: INodeNo, name: &std::ffi::OsStr) -> std::io::Result<()> {
        let mut calls = self.0.calls.lock().expect("not poisoned");
        calls
            .0
            .push(format!("entry {} {}", parent.0, name.to_string_lossy()));
        self.0.changed.notify_all();
        let _released = self
            .0
            .changed
            .wait_while(calls, |(_, released)| !*released)
            .expect("not poisoned");
        Ok(())
    }

    fn inval_inode(&self, inode: INodeNo, offset: i64, length: i64) -> std::io::Result<()> {
        let mut calls = self.0.calls.lock().expect("not poisoned");
        calls.0.push(format!("inode {} {offset} {length}", inode.0));
        self.0.changed.notify_all();
        Ok(())
    }

    fn store(&self, inode: INodeNo, offset: u64, _data: &[u8]) -> std::io::Result<()> {
        let mut calls = self.0.calls.lock().expect("not poisoned");
        calls.0.push(format!("store {} {offset}", inode.0));
        Ok(())
    }
}

/// Issue 41: one batch held another client's create in directory 20 (a name) and its size
/// commit of file 21 (attributes). The name waited for the directory's lock; the poll
/// acknowledged after `HANDLER_WAIT_MS`, the size commit replied, and this kernel kept
/// answering `stat` of file 21 with the old size until the lock was let go.
#[test]
fn a_name_waiting_for_its_directory_lock_holds_back_no_attributes() {
    let cache = Arc::new(KernelCache::new(false));
    let kernel = LockedDirectories::default();
    cache.set_notifier(kernel.clone());
    let lease = Some(Duration::from_secs(10));
    {
        let mut admission = cache.admit();
        assert_eq!(admission.entry(lease, 20, "f", Some(21)), lease);
        assert_eq!(admission.entry(lease, 20, "e", Some(22)), lease);
    }
    let batch = vec![
        revocation(20, &["g"], false, false),
        revocation(21, &[], true, false),
    ];
    let revoking = {
        let cache = cache.clone();
        std::thread::spawn(move || cache.revoke(&batch))
    };
    assert!(
        kernel.saw("entry 20 g", Duration::from_secs(5)),
        "the name was asked for"
    );
    assert!(
        kernel.saw("inode 21 -1 0", Duration::from_secs(5)),
        "file 21's attributes were dropped while the directory's lock was held"
    );
    assert!(
        !cache.index().attributes.contains_key(&21),
        "and the mount's own record of them"
    );
    kernel.let_go();
    revoking.join().expect("revoke returned");
    assert!(
        cache.index().attributes.contains_key(&22),
        "attributes not revoked stay"
    );
}
