//! What the mount keeps open: one client file handle per open inode, shared by every kernel
//! open of it on this mount, and one listing per open directory.
//!
//! Sharing one handle per inode means every descriptor on this mount reads what any other
//! wrote (the handle orders its own writes and knows the size they reached), and a `stat`
//! sees sizes that are still on their way to the meta server. The handle is opened for
//! reading and writing as root: the kernel's `default_permissions` has already checked the
//! caller's access and it enforces each descriptor's own mode.
//!
//! A directory listing is numbered as the kernel sees it: 0 is the start, then ".", "..",
//! and the entries in name order; a kernel offset is the number of entries before the next
//! one. Entries are fetched from the meta server a page at a time and kept for the life of
//! the open directory, so `seekdir` back to any offset works.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use freeflow_client::{Client, ClientError, DirEntry, ErrorCode, FileHandle, InodeId, OpenAccess};

/// Most inodes open at once on one mount (each holds a handle at the meta server).
pub const OPEN_FILES_MAX: usize = 65_536;
/// Most directories open at once on one mount.
pub const OPEN_DIRECTORIES_MAX: usize = 16_384;
/// Entries fetched from the meta server per page of a listing.
pub const DIRECTORY_PAGE_ENTRIES: u32 = 1024;

struct OpenFile {
    handle: Arc<FileHandle>,
    open_count: u64,
    /// Held (shared) by each read of a writeback mount from the handle's answer until the
    /// kernel has it; see [`OpenFiles::get_for_reading`].
    reads: Arc<tokio::sync::RwLock<()>>,
    /// A read or a write reached the mount since the last close here: the kernel may have
    /// dropped the file's access time or its size and times (see `KernelCache::touched`).
    accessed: bool,
}

/// Kernel opens with write access, this mount's truncations, and files whose size the
/// mount is raising in the kernel (`MountState::follow_growth`): the raise excludes the
/// others, and is given up if one of them came (even and went) while it was being
/// prepared. Every table holds files open here only (`told` goes at the last close,
/// `preparing` with its follow), or files being written (`counts`).
#[derive(Default)]
struct Writers {
    counts: HashMap<InodeId, u64>,
    growing: HashSet<InodeId>,
    /// Growths being prepared, and whether a local change came meanwhile.
    preparing: HashMap<InodeId, bool>,
    /// The size a growth last showed the kernel, per file (gone at a local change, after
    /// which the kernel's size is this host's own).
    told: HashMap<InodeId, u64>,
}

impl Writers {
    /// A write open or a truncation by this mount.
    fn local_change(&mut self, inode: InodeId) {
        self.told.remove(&inode);
        if let Some(spoiled) = self.preparing.get_mut(&inode) {
            *spoiled = true;
        }
    }
}

/// A growth of one file being prepared (`OpenFiles::prepare_growth`); forgotten when
/// dropped unless [`OpenFiles::begin_growth`] took it.
pub struct Preparing<'a> {
    files: &'a OpenFiles,
    inode: InodeId,
    /// The size a growth last showed the kernel, if any since the last local change.
    pub told: Option<u64>,
}

impl Drop for Preparing<'_> {
    fn drop(&mut self) {
        self.files.writers().preparing.remove(&self.inode);
    }
}

/// The open files of the mount, by inode.
pub struct OpenFiles {
    files: Mutex<HashMap<InodeId, OpenFile>>,
    writers: Mutex<Writers>,
    /// Kernel opens that read through its page cache, by inode (one entry per inode open so).
    readers: Mutex<HashMap<InodeId, u32>>,
    /// Wakes write opens that wait for a growth to end.
    growth_ended: tokio::sync::Notify,
    /// Releases of regular files received from the kernel and not answered yet, by inode:
    /// until answered, the kernel holds the inode (and the size it keeps of it).
    releasing: Mutex<HashMap<InodeId, u32>>,
    /// Wakes lookups that wait for a release to be answered.
    release_answered: tokio::sync::Notify,
}

impl OpenFiles {
    pub fn new() -> OpenFiles {
        OpenFiles {
            files: Mutex::new(HashMap::new()),
            writers: Mutex::new(Writers::default()),
            readers: Mutex::new(HashMap::new()),
            growth_ended: tokio::sync::Notify::new(),
            releasing: Mutex::new(HashMap::new()),
            release_answered: tokio::sync::Notify::new(),
        }
    }

    /// The kernel sent a release of `inode`; [`OpenFiles::release_answered`] once it is
    /// answered.
    pub fn release_began(&self, inode: InodeId) {
        count_up(
            &mut self.releasing.lock().expect("releasing not poisoned"),
            inode,
        );
    }

    /// A release of `inode` was answered: the kernel let go of the inode for it.
    pub fn release_answered(&self, inode: InodeId) {
        count_down(
            &mut self.releasing.lock().expect("releasing not poisoned"),
            inode,
        );
        self.release_answered.notify_waiters();
    }

    /// Wait until every release of `inode` received so far is answered.
    pub async fn wait_released(&self, inode: InodeId) {
        loop {
            let answered = self.release_answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            if !self
                .releasing
                .lock()
                .expect("releasing not poisoned")
                .contains_key(&inode)
            {
                return;
            }
            answered.await;
        }
    }

    /// The kernel is being told it opened `inode` to read through its page cache (called
    /// before the reply, so counted before it can read).
    pub fn opened_for_reading(&self, inode: InodeId) {
        count_up(
            &mut self.readers.lock().expect("readers not poisoned"),
            inode,
        );
    }

    /// The kernel released an open of `inode` that read through its page cache.
    pub fn closed_for_reading(&self, inode: InodeId) {
        count_down(
            &mut self.readers.lock().expect("readers not poisoned"),
            inode,
        );
    }

    /// Whether the kernel has `inode` open here to read through its page cache (it may
    /// hold pages of it).
    pub fn is_read(&self, inode: InodeId) -> bool {
        self.readers
            .lock()
            .expect("readers not poisoned")
            .contains_key(&inode)
    }

    fn writers(&self) -> std::sync::MutexGuard<'_, Writers> {
        self.writers.lock().expect("writers not poisoned")
    }

    /// The kernel is being told it opened `inode` with write access (called before the
    /// reply, so counted before it can write). Waits while the mount is raising the
    /// file's size in the kernel: that copies a byte into the kernel's page, which must
    /// not land on one this open wrote.
    /// `then` runs under the same lock as the count (see [`OpenFiles::closed_for_writing`]).
    pub async fn opened_for_writing(&self, inode: InodeId, then: impl FnOnce()) {
        self.after_growth(inode, |writers| {
            *writers.counts.entry(inode).or_insert(0) += 1;
            writers.local_change(inode);
            then();
        })
        .await;
    }

    /// Once no growth of `inode` is under way, `then` under the same lock (so none can
    /// begin before it is done).
    async fn after_growth(&self, inode: InodeId, then: impl FnOnce(&mut Writers)) {
        let mut then = Some(then);
        loop {
            let ended = self.growth_ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            {
                let mut writers = self.writers();
                if !writers.growing.contains(&inode) {
                    if let Some(then) = then.take() {
                        then(&mut writers);
                    }
                    return;
                }
            }
            ended.await;
        }
    }

    /// [`OpenFiles::opened_for_writing`] of a file this mount just created (answered ahead
    /// of the meta server, on the FUSE thread): no growth of it can be under way.
    pub fn created_for_writing(&self, inode: InodeId, then: impl FnOnce()) {
        let mut writers = self.writers();
        *writers.counts.entry(inode).or_insert(0) += 1;
        writers.local_change(inode);
        then();
    }

    /// This mount begins truncating `inode` (while `KernelCache::truncating` is held): a
    /// growth being prepared is given up.
    pub fn truncation_began(&self, inode: InodeId) {
        self.writers().local_change(inode);
    }

    /// Start preparing a growth of `inode`: taken before it asks the meta server, so that
    /// any local change from here on gives it up.
    pub fn prepare_growth(&self, inode: InodeId) -> Preparing<'_> {
        let mut writers = self.writers();
        writers.preparing.insert(inode, false);
        Preparing {
            files: self,
            inode,
            told: writers.told.get(&inode).copied(),
        }
    }

    /// The kernel released an open of `inode` that had write access (its dirty pages went
    /// out before: the kernel flushes them at close, and a shared writable mapping keeps
    /// its open until unmapped). `at_last` runs when it was the last, under the lock the
    /// opens are counted under, so a write open counted after it runs after it too.
    pub fn closed_for_writing(&self, inode: InodeId, at_last: impl FnOnce()) {
        let mut writers = self.writers();
        if let Some(count) = writers.counts.get_mut(&inode) {
            *count -= 1;
            if *count == 0 {
                writers.counts.remove(&inode);
                at_last();
            }
        }
    }

    /// Whether the kernel has `inode` open with write access here.
    pub fn is_written(&self, inode: InodeId) -> bool {
        self.writers().counts.contains_key(&inode)
    }

    /// Begin raising the size of the file `prepared` in the kernel if no kernel open of
    /// it has write access and nothing here changed it since the preparation began (then
    /// write opens and truncations wait until [`OpenFiles::end_growth`]); false otherwise.
    pub fn begin_growth(&self, prepared: Preparing<'_>) -> bool {
        let inode = prepared.inode;
        let mut writers = self.writers();
        let spoiled = writers.preparing.remove(&inode).unwrap_or(true);
        // Taken: its drop must not remove a later preparation of the same file.
        std::mem::forget(prepared);
        if spoiled || writers.counts.contains_key(&inode) {
            return false;
        }
        writers.growing.insert(inode)
    }

    /// Wait until no growth of `inode` is under way (a truncation by this mount waits: a
    /// store after it would raise the size it cut).
    pub async fn wait_growth(&self, inode: InodeId) {
        self.after_growth(inode, |_| {}).await;
    }

    /// The growth of `inode` ended, having shown the kernel `shown` bytes if it did.
    pub fn end_growth(&self, inode: InodeId, shown: Option<u64>) {
        {
            let mut writers = self.writers();
            writers.growing.remove(&inode);
            if let Some(size) = shown {
                writers.told.insert(inode, size);
            }
        }
        self.growth_ended.notify_waiters();
    }

    /// The shared handle of `inode`, and the lock its reads hold until their answer is in
    /// the kernel (a writeback mount's growth waits for the reads already answering).
    pub fn get_for_reading(
        &self,
        inode: InodeId,
    ) -> Option<(Arc<FileHandle>, Arc<tokio::sync::RwLock<()>>)> {
        let mut files = self.files.lock().expect("open files not poisoned");
        files.get_mut(&inode).map(|file| {
            file.accessed = true;
            (file.handle.clone(), file.reads.clone())
        })
    }

    /// The shared handle of `inode` for a write, if this mount has it open.
    pub fn get_for_writing(&self, inode: InodeId) -> Option<Arc<FileHandle>> {
        let mut files = self.files.lock().expect("open files not poisoned");
        files.get_mut(&inode).map(|file| {
            file.accessed = true;
            file.handle.clone()
        })
    }

    /// Whether a read or a write of `inode` reached the mount since the last call (a
    /// close).
    pub fn take_accessed(&self, inode: InodeId) -> bool {
        let mut files = self.files.lock().expect("open files not poisoned");
        files
            .get_mut(&inode)
            .is_some_and(|file| std::mem::take(&mut file.accessed))
    }

    /// The shared handle of `inode` if this mount has it open.
    pub fn get(&self, inode: InodeId) -> Option<Arc<FileHandle>> {
        let files = self.files.lock().expect("open files not poisoned");
        files.get(&inode).map(|file| file.handle.clone())
    }

    /// Take one more reference to the handle of `inode`, opening it if needed. A handle
    /// already open is refreshed from the meta server, so this open sees what other clients
    /// closed before it (close-to-open).
    pub async fn acquire(
        &self,
        root: &Client,
        inode: InodeId,
    ) -> Result<Arc<FileHandle>, ClientError> {
        let existing = {
            let mut files = self.files.lock().expect("open files not poisoned");
            files.get_mut(&inode).map(|file| {
                file.open_count += 1;
                file.handle.clone()
            })
        };
        if let Some(handle) = existing {
            if let Err(error) = handle.refresh().await {
                // Give the reference back; the open fails.
                let _ = self.release(inode, || {}).await;
                return Err(error);
            }
            return Ok(handle);
        }
        let access = OpenAccess {
            read: true,
            write: true,
        };
        let handle = Arc::new(root.open(inode, access).await?);
        self.adopt(handle).await
    }

    /// Register a handle this mount just opened (by `open` or `create`) with one reference.
    /// If another open of the same inode won the race, that one is used and this one closed.
    pub async fn adopt(&self, handle: Arc<FileHandle>) -> Result<Arc<FileHandle>, ClientError> {
        let inode = handle.inode();
        let winner = {
            let mut files = self.files.lock().expect("open files not poisoned");
            if let Some(file) = files.get_mut(&inode) {
                file.open_count += 1;
                Some(file.handle.clone())
            } else if files.len() >= OPEN_FILES_MAX {
                None
            } else {
                files.insert(
                    inode,
                    OpenFile {
                        handle: handle.clone(),
                        open_count: 1,
                        reads: Arc::new(tokio::sync::RwLock::new(())),
                        accessed: false,
                    },
                );
                return Ok(handle);
            }
        };
        // Either way this handle is not kept.
        let _ = handle.close_shared().await;
        match winner {
            Some(existing) => {
                existing.refresh().await?;
                Ok(existing)
            }
            None => Err(ClientError::Inode {
                inode,
                code: ErrorCode::Busy,
                reason: format!("this mount has {OPEN_FILES_MAX} files open already"),
            }),
        }
    }

    /// Drop one open of `inode`; the last one calls `at_last` at once (before anything can
    /// open the file again here), then closes the handle (flush, then close at the meta
    /// server) and reports how that went.
    pub async fn release(&self, inode: InodeId, at_last: impl FnOnce()) -> Result<(), ClientError> {
        let last = {
            let mut files = self.files.lock().expect("open files not poisoned");
            let file = files.get_mut(&inode);
            let last = match file {
                None => None,
                Some(file) => {
                    file.open_count = file.open_count.saturating_sub(1);
                    if file.open_count > 0 {
                        return Ok(());
                    }
                    self.writers().told.remove(&inode);
                    files.remove(&inode).map(|file| file.handle)
                }
            };
            at_last();
            last
        };
        match last {
            Some(handle) => handle.close_deferred().await,
            None => Ok(()),
        }
    }

    /// Every handle still open (for unmount).
    pub fn drain(&self) -> Vec<Arc<FileHandle>> {
        let mut files = self.files.lock().expect("open files not poisoned");
        files.drain().map(|(_, file)| file.handle).collect()
    }
}

/// One more of `inode` in `counts`.
fn count_up(counts: &mut HashMap<InodeId, u32>, inode: InodeId) {
    *counts.entry(inode).or_insert(0) += 1;
}

/// One fewer of `inode` in `counts` (none left: no entry).
fn count_down(counts: &mut HashMap<InodeId, u32>, inode: InodeId) {
    if let Some(count) = counts.get_mut(&inode) {
        *count -= 1;
        if *count == 0 {
            counts.remove(&inode);
        }
    }
}

/// One open directory: the entries fetched so far.
pub struct DirectoryListing {
    pub inode: InodeId,
    /// Its kernel handle number.
    pub handle: u64,
    /// The kernel was told to keep the listing it had cached at this open
    /// (`FOPEN_KEEP_CACHE`): it asks only for what its cache lacks.
    pub kept_cache: bool,
    /// No other handle of the directory was open when this one was opened.
    pub alone_at_open: bool,
    pub entries: Vec<DirEntry>,
    /// The lease of the page each entry came in (parallel to `entries`).
    pub leases: Vec<freeflow_client::Lease>,
    /// The lease of each page fetched, empty ones too: what the whole listing was read
    /// under (see `KernelCache`'s cached listings).
    pub pages: Vec<freeflow_client::Lease>,
    pub end: bool,
    /// Counts the changes of the directory's names known here (this mount's own, and
    /// other clients' through revocations) while it is open ([`OpenDirectories::changed`]).
    changes: Arc<AtomicU64>,
    /// `changes` when the entries not yet answered were fetched.
    seen_changes: u64,
}

impl DirectoryListing {
    /// Make sure entry `index` (0-based, after "." and "..") is fetched if it exists.
    /// Returns false when the directory has fewer entries.
    pub async fn ensure(
        &mut self,
        client: &Client,
        index: usize,
        with_attributes: bool,
    ) -> Result<bool, ClientError> {
        loop {
            if let Some(exists) = self.known(index) {
                return Ok(exists);
            }
            let after = self.entries.last().map(|entry| entry.name.clone());
            let (page, lease) = client
                .readdir_leased(
                    self.inode,
                    after.as_deref(),
                    DIRECTORY_PAGE_ENTRIES,
                    with_attributes,
                )
                .await?;
            self.end = page.end || page.entries.is_empty();
            self.pages.push(lease);
            self.leases
                .extend(std::iter::repeat_n(lease, page.entries.len()));
            self.entries.extend(page.entries);
        }
    }

    /// Whether entry `index` exists, if that is known without fetching: Some(true) when
    /// it was fetched, Some(false) when the listing ends before it, None when the next
    /// page must be asked for.
    pub fn known(&self, index: usize) -> Option<bool> {
        if index < self.entries.len() {
            Some(true)
        } else if self.end {
            Some(false)
        } else {
            None
        }
    }

    /// Before answering from entry `first` on: if the directory's names changed since its
    /// entries were fetched, those from `first` on are fetched again (after the last name
    /// answered: the meta server lists in name order, so none comes twice). A fetched entry
    /// may name a file that was moved, exchanged or removed since, and a `READDIRPLUS`
    /// answer links the kernel's name to the inode it gives (issue 41); POSIX leaves it
    /// open whether names added or removed after the open are listed.
    pub fn follow_changes(&mut self, first: usize) {
        let now = self.changes.load(Ordering::Acquire);
        if now == self.seen_changes {
            return;
        }
        self.seen_changes = now;
        if first < self.entries.len() || self.end {
            let first = first.min(self.entries.len());
            self.entries.truncate(first);
            self.leases.truncate(first);
            self.end = false;
        }
    }

    /// Nothing was fetched yet.
    pub fn untouched(&self) -> bool {
        self.entries.is_empty() && !self.end
    }

    /// Take the whole listing as known by this mount (see `KernelCache::complete_listing`)
    /// instead of asking the meta server, if nothing was fetched yet.
    pub fn take_known(&mut self, entries: Vec<DirEntry>, lease: freeflow_client::Lease) {
        if !self.untouched() {
            return;
        }
        self.leases = vec![lease; entries.len()];
        self.pages = vec![lease];
        self.entries = entries;
        self.end = true;
    }
}

/// The open directories of the mount, by kernel handle number.
pub struct OpenDirectories {
    open: Mutex<Directories>,
    next_handle: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct Directories {
    /// By handle: the directory and its listing.
    listings: HashMap<u64, (InodeId, Arc<tokio::sync::Mutex<DirectoryListing>>)>,
    /// By directory: its open handles.
    by_inode: HashMap<InodeId, Opened>,
}

/// The open handles of one directory.
struct Opened {
    count: usize,
    newest: u64,
    /// Changes of its names since the first of them opened (see
    /// [`DirectoryListing::follow_changes`]).
    changes: Arc<AtomicU64>,
}

impl OpenDirectories {
    pub fn new() -> OpenDirectories {
        OpenDirectories {
            open: Mutex::new(Directories::default()),
            next_handle: std::sync::atomic::AtomicU64::new(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Directories> {
        self.open.lock().expect("directories not poisoned")
    }

    /// Open `inode`; `kept_cache`: the kernel keeps the listing it cached (see
    /// [`DirectoryListing::kept_cache`]).
    pub fn open(&self, inode: InodeId, kept_cache: bool) -> Option<u64> {
        let mut open = self.lock();
        if open.listings.len() >= OPEN_DIRECTORIES_MAX {
            return None;
        }
        let handle = self
            .next_handle
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let opens = open.by_inode.entry(inode).or_insert_with(|| Opened {
            count: 0,
            newest: 0,
            changes: Arc::new(AtomicU64::new(0)),
        });
        let alone_at_open = opens.count == 0;
        opens.count += 1;
        opens.newest = handle;
        let changes = opens.changes.clone();
        let seen_changes = changes.load(Ordering::Acquire);
        let listing = DirectoryListing {
            inode,
            handle,
            kept_cache,
            alone_at_open,
            entries: Vec::new(),
            leases: Vec::new(),
            pages: Vec::new(),
            end: false,
            changes,
            seen_changes,
        };
        open.listings
            .insert(handle, (inode, Arc::new(tokio::sync::Mutex::new(listing))));
        Some(handle)
    }

    pub fn get(&self, handle: u64) -> Option<Arc<tokio::sync::Mutex<DirectoryListing>>> {
        self.lock()
            .listings
            .get(&handle)
            .map(|(_, listing)| listing.clone())
    }

    /// Whether `listing` was the only handle of its directory open from its open until
    /// now: then only its answers went into the kernel's cache of that listing since the
    /// open (which dropped the cache unless told to keep it).
    pub fn alone(&self, listing: &DirectoryListing) -> bool {
        listing.alone_at_open
            && self
                .lock()
                .by_inode
                .get(&listing.inode)
                .is_some_and(|opens| opens.count == 1 && opens.newest == listing.handle)
    }

    /// The names of `directories` changed (0: of every directory): their open listings
    /// fetch again what they have not answered yet ([`DirectoryListing::follow_changes`]).
    pub fn changed(&self, directories: &[InodeId]) {
        let open = self.lock();
        if open.by_inode.is_empty() {
            return;
        }
        for directory in directories {
            if *directory == 0 {
                for opens in open.by_inode.values() {
                    opens.changes.fetch_add(1, Ordering::AcqRel);
                }
            } else if let Some(opens) = open.by_inode.get(directory) {
                opens.changes.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    /// Closes `handle`; returns its listing, for the caller to drop after its reply (a
    /// large listing takes a while to free).
    #[must_use]
    pub fn close(&self, handle: u64) -> Option<Arc<tokio::sync::Mutex<DirectoryListing>>> {
        let mut open = self.lock();
        let (inode, listing) = open.listings.remove(&handle)?;
        if let Some(opens) = open.by_inode.get_mut(&inode) {
            opens.count -= 1;
            if opens.count == 0 {
                open.by_inode.remove(&inode);
            }
        }
        Some(listing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_lookup_waits_for_every_release_of_its_file_received_before_it() {
        let files = Arc::new(OpenFiles::new());
        // Nothing being released: no wait.
        files.wait_released(5).await;
        files.release_began(5);
        files.release_began(5);
        files.release_began(6);
        let waiter = tokio::spawn({
            let files = files.clone();
            async move { files.wait_released(5).await }
        });
        tokio::task::yield_now().await;
        files.release_answered(5);
        files.release_answered(6);
        tokio::task::yield_now().await;
        assert!(
            !waiter.is_finished(),
            "one release of the file is still unanswered"
        );
        files.release_answered(5);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("woken once the last release is answered")
            .expect("waiter");
        // An answer for a file with no release outstanding changes nothing.
        files.release_answered(7);
        files.wait_released(7).await;
    }
}
