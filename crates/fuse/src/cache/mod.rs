//! What the mount lets the kernel cache, under the meta server's leases (issue 9).
//!
//! A reply that came with a lease is given to the kernel with that lease's remaining time
//! as its entry and attribute time-out (names, missing names, attributes); without one,
//! the mount's configured time-outs apply. The mount remembers what it handed out with a
//! lease (names by directory, inodes whose attributes were cached: bounded), so that a
//! revocation can be turned into the kernel's invalidations: `inval_entry` for each name
//! of a directory that changed, `inval_inode` (attributes only) for an inode that changed,
//! and all of them when the meta server restarted.
//!
//! It also keeps the complete list of names of the directories this mount made itself
//! (`Listing`), while it holds the lease on their names: the mount then answers a lookup of
//! a name that is not there without asking the meta server (a create's lookup of its new
//! name, after CephFS's "complete" directories). Another client's change of such a
//! directory revokes that lease, and the listing goes with it; the mount's own changes keep
//! it up to date. Adding a name is always safe (a known name is asked for as before); only
//! the claim that a name is missing needs the lease, and it is checked at every use.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use compact_str::CompactString;
use foldhash::{HashMap, HashMapExt, HashSet};
use freeflow_client::{DirEntry, FileKind, InodeId, Lease, Revocation};

mod kernel;
pub use kernel::Kernel;

/// Most directories whose whole listing the kernel may keep in its readdir cache under a
/// lease ([`Index::kernel_listings`]); when full, those whose leases ended for good go,
/// and past it a listing read is not recorded (the next open of that directory has the
/// kernel read it again).
pub const KERNEL_LISTINGS_MAX: usize = 65_536;

/// Most names and inodes remembered as handed to the kernel under a lease; past it (once
/// those whose lease ran out are dropped), replies are given the configured time-outs
/// instead (no more caching).
pub const CACHED_MAX: usize = 1 << 20;

/// Least time left on what the kernel holds of a name and its file for a `READDIRPLUS`
/// entry to go without the file's attributes ([`Admission::kernel_holds`]).
pub const KERNEL_HELD_MIN_LEFT: Duration = Duration::from_secs(1);

/// How often a full index is swept for what ran out (a sweep visits every entry).
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

/// Most names kept over all complete listings; a directory that would pass it is dropped
/// (its lookups go to the meta server again).
pub const LISTED_NAMES_MAX: usize = 1 << 20;

/// How often a write-back that is still running looks for a truncation by this mount of
/// the same file (see [`KernelCache::write_back`]).
const WRITE_BACK_POLL: Duration = Duration::from_millis(5);
/// Most files written back at once, each on a thread of its own (a recall may name
/// thousands); a thread left waiting for this mount's own truncation ends with it.
const WRITE_BACK_THREADS_MAX: usize = 16;

/// Most names kept for one file in [`Index::held`] (hard links); past it the oldest is
/// dropped, and a revocation cannot evict the file through that name.
pub const HELD_NAMES_PER_FILE_MAX: usize = 64;

/// Every name of a directory, known under `lease` on its names.
struct Listing {
    /// In the meta server's order (of the names' bytes), each with the inode and kind of
    /// the file this mount made or learned with it (for unlinks answered ahead, which must
    /// know the file they remove, and for listings answered from here); None where not
    /// known (a rename's new name). Names are kept inline where short (most are): a
    /// listing answered from here reads them in order without a cache miss each.
    names: BTreeMap<CompactString, Option<(InodeId, FileKind)>>,
    /// Names whose file is not known.
    unknown: usize,
    lease: Lease,
    /// The group new files get there when it is not the creator's (a setgid directory).
    group_of_new: Option<u32>,
}

/// What the kernel may hold under a lease, each until when.
#[derive(Default)]
struct Index {
    names: HashMap<InodeId, HashMap<String, Instant>>,
    name_count: usize,
    attributes: HashMap<InodeId, Instant>,
    /// Inodes of `attributes` the kernel may have marked partly stale on its own since it
    /// was last given their attributes: opened, listed or read as a link here (it drops a
    /// file's access time after a read, its size and times after a write), so that a
    /// listing gives them with attributes again ([`Admission::kernel_holds`]).
    touched: HashSet<InodeId>,
    swept_at: Option<Instant>,
    listings: HashMap<InodeId, Listing>,
    listed_names: usize,
    /// Directories the kernel read to their end through this mount, every page of it
    /// under a lease still good when the end was answered (those leases): the kernel's
    /// readdir cache then holds that listing (`FOPEN_CACHE_DIR`), and the next open may
    /// keep it (`FOPEN_KEEP_CACHE`) while the leases hold. Any revocation of the directory
    /// removes it. Bounded by [`KERNEL_LISTINGS_MAX`].
    kernel_listings: HashMap<InodeId, Vec<Lease>>,
    /// Writeback mounts: the names under which the kernel holds each regular file, leased
    /// or not. The kernel owns such a file's size; a revocation of its attributes
    /// invalidates every one of these names so that the kernel drops the inode (and that
    /// size) unless a descriptor holds it open. The kernel's inode cache bounds the table
    /// (an inode's names go when the kernel forgets it), and [`HELD_NAMES_PER_FILE_MAX`]
    /// bounds each file's list.
    held: HashMap<InodeId, Vec<(InodeId, String)>>,
    /// Writeback mounts: when the attribute leases in `attributes` run out, at most one
    /// entry per inode (those in `scheduled`); a renewed lease is put back when its old
    /// time comes (see [`KernelCache::lapsing`]). Bounded by the inodes leased within one
    /// lease time.
    expiries: BinaryHeap<Reverse<(Instant, InodeId)>>,
    scheduled: HashSet<InodeId>,
    /// Writeback mounts: held files without a live attribute lease, to be evicted until
    /// the kernel forgets them or a new lease comes (see [`KernelCache::lapsing`]).
    lapsed: HashSet<InodeId>,
}

impl Index {
    /// Note `inode`'s attribute lease until `until` (writeback mounts), unless its expiry
    /// is scheduled already (a renewal is found when that time comes).
    fn schedule_expiry(&mut self, inode: InodeId, until: Instant) {
        if self.scheduled.insert(inode) {
            self.expiries.push(Reverse((until, inode)));
        }
    }

    fn drop_listing(&mut self, directory: InodeId) {
        if let Some(listing) = self.listings.remove(&directory) {
            self.listed_names -= listing.names.len();
        }
    }

    /// `name` of `directory` stands for `child` now (None: a file not known here), in the
    /// listing of `directory` if this mount keeps one. `existing`: the name was there
    /// already (an exchange); a listing without it is not complete after all, and goes.
    fn set_listed(
        &mut self,
        directory: InodeId,
        name: &str,
        child: Option<(InodeId, FileKind)>,
        existing: bool,
    ) {
        let Some(listing) = self.listings.get_mut(&directory) else {
            return;
        };
        match listing.names.get_mut(name) {
            Some(known) => {
                listing.unknown -= usize::from(known.is_none());
                *known = child;
            }
            None if existing => {
                self.drop_listing(directory);
                return;
            }
            None => {
                if self.listed_names >= LISTED_NAMES_MAX {
                    self.drop_listing(directory);
                    return;
                }
                listing.names.insert(CompactString::from(name), child);
                self.listed_names += 1;
            }
        }
        listing.unknown += usize::from(child.is_none());
    }
}

impl Index {
    fn full(&mut self, now: Instant) -> bool {
        if self.name_count + self.attributes.len() < CACHED_MAX {
            return false;
        }
        if self
            .swept_at
            .is_some_and(|at| now.duration_since(at) < SWEEP_INTERVAL)
        {
            return true;
        }
        self.swept_at = Some(now);
        self.attributes.retain(|_, until| *until > now);
        let attributes = &self.attributes;
        self.touched.retain(|inode| attributes.contains_key(inode));
        let mut count = 0;
        self.names.retain(|_, names| {
            names.retain(|_, until| *until > now);
            count += names.len();
            !names.is_empty()
        });
        self.name_count = count;
        self.name_count + self.attributes.len() >= CACHED_MAX
    }
}

/// The cache index and the kernel's notifier.
pub struct KernelCache {
    index: Mutex<Index>,
    notifier: Mutex<Option<Arc<dyn Kernel>>>,
    /// Set with the notifier: without one (`--no-cache`) nothing is cached under a lease,
    /// as nothing could take it back from the kernel.
    enabled: AtomicBool,
    /// The kernel's writeback cache is on: it owns regular files' sizes and holds dirty
    /// pages, so a revocation also writes those back and evicts the file (see `revoke`).
    writeback: bool,
    /// Files this mount is truncating now (count of such requests by inode): the kernel
    /// holds their write-back (and the inode's lock) until the truncation is answered, so
    /// asking it to write them back would wait for that answer, which may itself wait for
    /// this mount's acknowledgement (`write_back` skips them).
    truncating: Mutex<HashMap<InodeId, usize>>,
    /// Wakes the writeback mount's sweep at each revocation, so that a file held open here
    /// that another client changed is followed at once (`evict_lapsing_files`), not at the
    /// next tick.
    pub revoked_held: tokio::sync::Notify,
}

/// A truncation of this mount under way (see `KernelCache::truncating`); ends on drop.
pub struct Truncating {
    cache: Arc<KernelCache>,
    inode: InodeId,
}

impl Drop for Truncating {
    fn drop(&mut self) {
        let mut truncating = self.cache.truncating.lock().expect("not poisoned");
        if let Some(count) = truncating.get_mut(&self.inode) {
            *count -= 1;
            if *count == 0 {
                truncating.remove(&self.inode);
            }
        }
    }
}

/// The right to hand the kernel something under a lease. Held from the lease check until
/// the reply is written to the kernel, so that a revocation handled meanwhile either made
/// the check fail or finds the name in the index and invalidates it after the reply.
pub struct Admission<'a> {
    index: MutexGuard<'a, Index>,
    enabled: bool,
    writeback: bool,
}

impl Admission<'_> {
    /// Whether `name` is known to be missing from `directory`: it holds a complete listing
    /// whose lease is still good (`left` says what remains of a lease). Returns the lease
    /// to answer with; a listing whose lease is over is dropped.
    pub fn known_missing(
        &mut self,
        directory: InodeId,
        name: &str,
        left: impl Fn(&Lease) -> Option<Duration>,
    ) -> Option<Lease> {
        let listing = self.index.listings.get(&directory)?;
        if left(&listing.lease).is_none() {
            self.index.drop_listing(directory);
            return None;
        }
        (!listing.names.contains_key(name)).then_some(listing.lease)
    }

    /// Like [`Admission::known_missing`], for a create answered ahead (`delegation.rs` in
    /// the client): the lease and the group a new file there gets if not the creator's.
    pub fn known_missing_for_create(
        &mut self,
        directory: InodeId,
        name: &str,
        left: impl Fn(&Lease) -> Option<Duration>,
    ) -> Option<(Lease, Option<u32>)> {
        let lease = self.known_missing(directory, name, left)?;
        let listing = self.index.listings.get(&directory)?;
        Some((lease, listing.group_of_new))
    }

    /// The file `name` of `directory` stands for, when this mount holds a complete listing
    /// of it under a lease still good (`left`) and made or learned that name itself: the
    /// lease and the inode (for an unlink answered ahead).
    pub fn known_child(
        &mut self,
        directory: InodeId,
        name: &str,
        left: impl Fn(&Lease) -> Option<Duration>,
    ) -> Option<(Lease, InodeId)> {
        let listing = self.index.listings.get(&directory)?;
        if left(&listing.lease).is_none() {
            self.index.drop_listing(directory);
            return None;
        }
        let (child, _) = (*listing.names.get(name)?)?;
        Some((listing.lease, child))
    }

    /// Every entry of `directory` (name, inode and kind; no attributes), in the meta
    /// server's order (of the names' bytes), and the lease they are known under, when
    /// this mount holds a complete listing of it under a lease still good (`left`) and
    /// knows the file of every name (not so after a rename): a listing answered without
    /// the meta server.
    pub fn complete_listing(
        &mut self,
        directory: InodeId,
        left: impl Fn(&Lease) -> Option<Duration>,
    ) -> Option<(Vec<DirEntry>, Lease)> {
        let listing = self.index.listings.get(&directory)?;
        if left(&listing.lease).is_none() {
            self.index.drop_listing(directory);
            return None;
        }
        if listing.unknown > 0 {
            return None;
        }
        let mut entries = Vec::with_capacity(listing.names.len());
        entries.extend(listing.names.iter().filter_map(|(name, child)| {
            child.map(|(inode, kind)| DirEntry {
                name: name.as_str().to_owned(),
                inode,
                kind,
                attr: None,
            })
        }));
        Some((entries, listing.lease))
    }

    /// This mount made `directory` (empty) and holds the lease on its names; new files
    /// there get group `group_of_new` if set (a setgid directory).
    pub fn listing_started(&mut self, directory: InodeId, lease: Lease, group_of_new: Option<u32>) {
        self.index.drop_listing(directory);
        if !self.enabled || self.index.listed_names >= LISTED_NAMES_MAX {
            return;
        }
        self.index.listings.insert(
            directory,
            Listing {
                names: BTreeMap::new(),
                unknown: 0,
                lease,
                group_of_new,
            },
        );
    }

    /// This mount added `name` to `directory`, standing for `child` (its inode and kind) if
    /// known; `lease`, if the reply came with one that is still good (`left`), renews the
    /// listing's. Dropped past [`LISTED_NAMES_MAX`].
    pub fn listing_added(
        &mut self,
        directory: InodeId,
        name: &str,
        child: Option<(InodeId, FileKind)>,
        lease: Option<Lease>,
        left: impl Fn(&Lease) -> Option<Duration>,
    ) {
        let index = &mut *self.index;
        let Some(listing) = index.listings.get_mut(&directory) else {
            return;
        };
        if index.listed_names >= LISTED_NAMES_MAX {
            index.drop_listing(directory);
            return;
        }
        match listing.names.get_mut(name) {
            Some(known) => {
                listing.unknown -= usize::from(known.is_none());
                *known = child;
            }
            None => {
                listing.names.insert(CompactString::from(name), child);
                index.listed_names += 1;
            }
        }
        listing.unknown += usize::from(child.is_none());
        // Renewed only without a gap: the old lease still good, the new one newer.
        if let Some(lease) = lease {
            if lease.seq > listing.lease.seq
                && left(&listing.lease).is_some()
                && left(&lease).is_some()
            {
                listing.lease = lease;
            }
        }
    }

    /// `lease` came with a change of `directory` by this mount: it renews the listing's
    /// lease if newer, without a gap (as in [`Admission::listing_added`]).
    pub fn listing_renewed(
        &mut self,
        directory: InodeId,
        lease: Lease,
        left: impl Fn(&Lease) -> Option<Duration>,
    ) {
        if let Some(listing) = self.index.listings.get_mut(&directory) {
            if lease.seq > listing.lease.seq
                && left(&listing.lease).is_some()
                && left(&lease).is_some()
            {
                listing.lease = lease;
            }
        }
    }

    /// This mount removed `name` from `directory` (unlink, rmdir, the source of a rename).
    pub fn listing_removed(&mut self, directory: InodeId, name: &str) {
        let index = &mut *self.index;
        if let Some(listing) = index.listings.get_mut(&directory) {
            if let Some(child) = listing.names.remove(name) {
                index.listed_names -= 1;
                listing.unknown -= usize::from(child.is_none());
            }
        }
    }

    /// This mount renamed `source` of `source_parent` to `target` of `target_parent`
    /// (`exchange`: swapped the two). The listings of both directories follow: a moved
    /// name takes the file its old name stood for, where that is known (else it is
    /// unknown, and the directory's listing is asked of the meta server again). An
    /// exchange keeps both names but swaps their files: a listing left showing the old
    /// file under a name would hand the kernel the wrong inode for it in a `READDIRPLUS`
    /// (issue 41: a directory exchanged with another then listed the other's entries).
    pub fn listing_renamed(
        &mut self,
        source_parent: InodeId,
        source: &str,
        target_parent: InodeId,
        target: &str,
        exchange: bool,
    ) {
        let index = &mut *self.index;
        let child_of = |listings: &HashMap<InodeId, Listing>, directory: InodeId, name: &str| {
            listings
                .get(&directory)
                .and_then(|listing| listing.names.get(name).copied())
                .flatten()
        };
        let source_child = child_of(&index.listings, source_parent, source);
        let target_child = child_of(&index.listings, target_parent, target);
        if exchange {
            index.set_listed(source_parent, source, target_child, true);
            index.set_listed(target_parent, target, source_child, true);
        } else {
            if let Some(listing) = index.listings.get_mut(&source_parent) {
                if let Some(child) = listing.names.remove(source) {
                    index.listed_names -= 1;
                    listing.unknown -= usize::from(child.is_none());
                }
            }
            index.set_listed(target_parent, target, source_child, false);
        }
    }

    /// A change of `directory` by this mount ended in an error: what it did is not known.
    pub fn listing_unsure(&mut self, directory: InodeId) {
        self.index.drop_listing(directory);
    }

    /// Note that the kernel may cache `name` in `parent` (and, with `child`, that inode's
    /// attributes) for `left`, what remains of its lease; returns the time-out to give
    /// it, None if there is no lease or the index is full (do not cache then).
    pub fn entry(
        &mut self,
        left: Option<Duration>,
        parent: InodeId,
        name: &str,
        child: Option<InodeId>,
    ) -> Option<Duration> {
        let left = left.filter(|_| self.enabled)?;
        let now = Instant::now();
        if self.index.full(now) {
            return None;
        }
        let until = now + left;
        let index = &mut *self.index;
        let names = index.names.entry(parent).or_default();
        match names.get_mut(name) {
            Some(known) => *known = (*known).max(until),
            None => {
                names.insert(name.to_string(), until);
                index.name_count += 1;
            }
        }
        if let Some(child) = child {
            index.touched.remove(&child);
            let known = index.attributes.entry(child).or_insert(until);
            *known = (*known).max(until);
            if self.writeback {
                index.schedule_expiry(child, until);
            }
        }
        Some(left)
    }

    /// Note that the kernel holds the regular file `inode` under `name` in `parent`
    /// (writeback mounts only; see [`Index::held`]). Called before the reply, like
    /// [`Admission::entry`].
    pub fn held_as(&mut self, inode: InodeId, parent: InodeId, name: &str) {
        if !self.enabled || !self.writeback {
            return;
        }
        let names = self.index.held.entry(inode).or_default();
        if names
            .iter()
            .any(|(at, known)| *at == parent && known == name)
        {
            return;
        }
        if names.len() >= HELD_NAMES_PER_FILE_MAX {
            names.remove(0);
        }
        names.push((parent, name.to_string()));
        let now = Instant::now();
        if self
            .index
            .attributes
            .get(&inode)
            .is_none_or(|until| *until <= now)
        {
            self.index.lapsed.insert(inode);
        }
    }

    /// For each of `entries` (name and inode) of `parent`: whether this mount gave the
    /// kernel the name and the inode's attributes under leases that have at least
    /// [`KERNEL_HELD_MIN_LEFT`] to run and were not revoked since, and the inode was not
    /// touched since ([`KernelCache::touched`]). A `READDIRPLUS` reply
    /// then gives such an entry's name alone (no inode: the kernel keeps what it has, and
    /// counts no lookup). Always safe: at worst the kernel no longer has it and looks the
    /// name up when it needs it.
    pub fn kernel_holds<'n>(
        &self,
        parent: InodeId,
        entries: impl Iterator<Item = (&'n str, InodeId)>,
    ) -> Vec<bool> {
        let names = self.index.names.get(&parent);
        let enough = Instant::now() + KERNEL_HELD_MIN_LEFT;
        entries
            .map(|(name, inode)| {
                self.enabled
                    && names
                        .and_then(|names| names.get(name))
                        .is_some_and(|until| *until >= enough)
                    && self
                        .index
                        .attributes
                        .get(&inode)
                        .is_some_and(|until| *until >= enough)
                    && !self.index.touched.contains(&inode)
            })
            .collect()
    }

    /// Whether the kernel may keep the listing of `directory` it has cached at this
    /// open: it read it to the end under leases that are all still good (`left`). A
    /// listing whose leases are over is forgotten.
    pub fn kernel_listing_good(
        &mut self,
        directory: InodeId,
        left: impl Fn(&Lease) -> Option<Duration>,
    ) -> bool {
        if !self.enabled {
            return false;
        }
        let Some(leases) = self.index.kernel_listings.get(&directory) else {
            return false;
        };
        if leases.iter().all(|lease| left(lease).is_some()) {
            return true;
        }
        self.index.kernel_listings.remove(&directory);
        false
    }

    /// The kernel was answered the end of `directory`'s listing, read in pages under
    /// `pages` (each page's lease) by a handle that was the only one of that directory
    /// open since its open (`alone`; else answers of several handles, read at different
    /// times, may have gone into the kernel's cache). Recorded if every lease is still
    /// good (`left`), so that the next open keeps what the kernel cached
    /// ([`Admission::kernel_listing_good`]). A handle opened keeping the kernel's cache
    /// (`kept`) only filled in what the cache lacked: the leases of the rest are added to
    /// it, if it is still recorded. Called before the reply is written, like
    /// [`Admission::entry`].
    pub fn kernel_listing_read(
        &mut self,
        directory: InodeId,
        pages: &[Lease],
        alone: bool,
        kept: bool,
        left: impl Fn(&Lease) -> Option<Duration>,
    ) {
        let earlier = self.index.kernel_listings.remove(&directory);
        let mut leases = match earlier {
            Some(leases) if kept => leases,
            None if kept => return,
            _ => Vec::new(),
        };
        if !self.enabled || !alone || pages.is_empty() {
            return;
        }
        let listings = &mut self.index.kernel_listings;
        if listings.len() >= KERNEL_LISTINGS_MAX {
            // Directories never opened again since their leases ended are still here.
            let now = tokio::time::Instant::now();
            listings.retain(|_, leases| !leases.iter().any(|lease| lease.ended_for_good(now)));
            if listings.len() >= KERNEL_LISTINGS_MAX {
                return;
            }
        }
        for lease in pages {
            if !leases.iter().any(|known| known.seq == lease.seq) {
                leases.push(*lease);
            }
        }
        if leases.iter().all(|lease| left(lease).is_some()) {
            self.index.kernel_listings.insert(directory, leases);
        }
    }

    /// The kernel forgot `inode` (its last lookup reference went).
    pub fn forgotten(&mut self, inode: InodeId) {
        self.index.held.remove(&inode);
        self.index.lapsed.remove(&inode);
    }

    /// [`KernelCache::touched`], under an admission already held.
    pub fn touched(&mut self, inode: InodeId) {
        // Writeback mounts give every entry its attributes.
        if self.writeback || !self.enabled {
            return;
        }
        if self.index.attributes.contains_key(&inode) {
            self.index.touched.insert(inode);
        }
    }

    /// Note that the kernel may cache `inode`'s attributes for `left`.
    pub fn attributes(&mut self, left: Option<Duration>, inode: InodeId) -> Option<Duration> {
        let left = left.filter(|_| self.enabled)?;
        let now = Instant::now();
        if self.index.full(now) {
            return None;
        }
        let until = now + left;
        self.index.touched.remove(&inode);
        let known = self.index.attributes.entry(inode).or_insert(until);
        *known = (*known).max(until);
        if self.writeback {
            self.index.schedule_expiry(inode, until);
        }
        Some(left)
    }
}

impl KernelCache {
    pub fn new(writeback: bool) -> KernelCache {
        KernelCache {
            index: Mutex::new(Index::default()),
            notifier: Mutex::new(None),
            enabled: AtomicBool::new(false),
            writeback,
            truncating: Mutex::new(HashMap::new()),
            revoked_held: tokio::sync::Notify::new(),
        }
    }

    /// The kernel opened, listed or read as a link `inode` through this mount (or closed it
    /// after that): it may have marked part of the attributes it holds stale on its own,
    /// so a listing gives them again (see [`Index::touched`]). Only an inode whose
    /// attributes the kernel was given under a lease is noted (that bounds the set).
    pub fn touched(&self, inode: InodeId) {
        self.admit().touched(inode);
    }

    /// Note a truncation of `inode` by this mount until the returned guard is dropped.
    pub fn truncating(self: &Arc<Self>, inode: InodeId) -> Truncating {
        *self
            .truncating
            .lock()
            .expect("not poisoned")
            .entry(inode)
            .or_insert(0) += 1;
        Truncating {
            cache: self.clone(),
            inode,
        }
    }

    /// Whether this mount is truncating `inode` now.
    pub fn is_truncating(&self, inode: InodeId) -> bool {
        self.truncating
            .lock()
            .expect("not poisoned")
            .contains_key(&inode)
    }

    /// Writeback mounts: the held files whose attribute lease runs out before `before` (or
    /// that have none), with the names to evict them under. The kernel keeps a file's size
    /// past its lease, and no revocation comes after it: such a file must leave the kernel
    /// before its lease does, or another client's change would go unseen here. A file the
    /// caller cannot evict (open here) stays listed until the kernel forgets it or a lease
    /// comes again.
    pub fn lapsing(&self, before: Instant) -> Vec<(InodeId, Vec<(InodeId, String)>)> {
        let mut index = self.index();
        let index = &mut *index;
        while let Some(Reverse((until, inode))) = index.expiries.peek().copied() {
            if until >= before {
                break;
            }
            index.expiries.pop();
            index.scheduled.remove(&inode);
            match index.attributes.get(&inode).copied() {
                // Renewed since: looked at again when the new time comes.
                Some(current) if current >= before => index.schedule_expiry(inode, current),
                _ if index.held.contains_key(&inode) => {
                    index.lapsed.insert(inode);
                }
                _ => {}
            }
        }
        let (held, attributes) = (&index.held, &index.attributes);
        index.lapsed.retain(|inode| {
            held.contains_key(inode)
                && attributes
                    .get(inode)
                    .is_none_or(|current| *current < before)
        });
        index
            .lapsed
            .iter()
            .map(|inode| (*inode, index.held[inode].clone()))
            .collect()
    }

    /// The names the kernel holds the regular file `inode` under (writeback mounts).
    pub fn held_names(&self, inode: InodeId) -> Vec<(InodeId, String)> {
        self.index().held.get(&inode).cloned().unwrap_or_default()
    }

    fn index(&self) -> MutexGuard<'_, Index> {
        self.index.lock().expect("cache index not poisoned")
    }

    /// Hold off revocations until the reply under a lease is written (see [`Admission`]).
    pub fn admit(&self) -> Admission<'_> {
        Admission {
            index: self.index(),
            enabled: self.enabled.load(Ordering::Acquire),
            writeback: self.writeback,
        }
    }

    /// Whether anything may be cached under leases (a notifier can take it back).
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// What one revocation covers, taken out of the index.
    fn take(&self, revocation: &Revocation) -> Taken {
        let mut index = self.index();
        // Writeback: the files' pages and every name they are held under (kept: the
        // kernel forgetting the file removes them).
        let mut files = Vec::new();
        let mut held_names = Vec::new();
        if revocation.inode == 0 {
            for (inode, names) in &index.held {
                files.push(*inode);
                held_names.extend(names.iter().cloned());
            }
        } else if revocation.attributes {
            // Its pages were written back by the recall (`write_back`) before this.
            if let Some(names) = index.held.get(&revocation.inode) {
                held_names.extend(names.iter().cloned());
                // Evicted below unless held open: then again at every sweep.
                index.lapsed.insert(revocation.inode);
            }
        }
        let (mut entries, inodes) = Self::take_leased(&mut index, revocation);
        entries.extend(held_names);
        Taken {
            entries,
            inodes,
            files,
        }
    }

    /// The names and attributes a revocation covers among those handed out under leases.
    fn take_leased(
        index: &mut Index,
        revocation: &Revocation,
    ) -> (Vec<(InodeId, String)>, Vec<InodeId>) {
        let mut entries = Vec::new();
        let mut inodes = Vec::new();
        if revocation.inode == 0 {
            // The meta server restarted: everything.
            let names = std::mem::take(&mut index.names);
            for (parent, names) in names {
                entries.extend(names.into_keys().map(|name| (parent, name)));
            }
            index.name_count = 0;
            inodes.extend(index.attributes.drain().map(|(inode, _)| inode));
            index.touched.clear();
            index.listings.clear();
            index.listed_names = 0;
            index.kernel_listings.clear();
            return (entries, inodes);
        }
        // Whatever changed, the kernel's cached listing of it is not kept at the next open.
        index.kernel_listings.remove(&revocation.inode);
        // Another client changed it: the listing may be wrong from here on.
        index.drop_listing(revocation.inode);
        if revocation.whole_directory {
            if let Some(names) = index.names.remove(&revocation.inode) {
                index.name_count -= names.len();
                entries.extend(names.into_keys().map(|name| (revocation.inode, name)));
            }
        } else {
            let mut emptied = false;
            if let Some(names) = index.names.get_mut(&revocation.inode) {
                for name in &revocation.names {
                    if names.remove(name).is_some() {
                        entries.push((revocation.inode, name.clone()));
                    }
                }
                emptied = names.is_empty();
            }
            index.name_count -= entries.len();
            if emptied {
                index.names.remove(&revocation.inode);
            }
            // A name the kernel may hold as missing is not in the index unless it was
            // looked up: invalidate the named ones in any case.
            for name in &revocation.names {
                if !entries.iter().any(|(_, known)| known == name) {
                    entries.push((revocation.inode, name.clone()));
                }
            }
        }
        if revocation.attributes {
            index.touched.remove(&revocation.inode);
        }
        if revocation.attributes && index.attributes.remove(&revocation.inode).is_some() {
            inodes.push(revocation.inode);
        }
        (entries, inodes)
    }
}

/// What one revocation makes the kernel drop.
#[derive(Default)]
struct Taken {
    /// Names (parent, name).
    entries: Vec<(InodeId, String)>,
    /// Inodes whose attributes go.
    inodes: Vec<InodeId>,
    /// Regular files whose pages go too, written back first (writeback mounts, after a
    /// meta server restart).
    files: Vec<InodeId>,
}

#[cfg(test)]
mod tests;
