//! The cache's side of the kernel: the notifications that take back what the mount handed
//! out (`inval_entry`, `inval_inode`, `store`), behind [`Kernel`] so that their order can
//! be tested without a mount.

use std::ffi::OsStr;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use foldhash::HashSet;
use freeflow_client::{InodeId, Revocation};
use fuser::{INodeNo, Notifier};

use super::{KernelCache, Taken, WRITE_BACK_POLL, WRITE_BACK_THREADS_MAX};
use crate::shadow::PAGE_BYTES;

/// The kernel's notifications the cache uses (`fuser::Notifier` on a mount). Each returns
/// once the kernel did what it says; `inval_entry` may wait for the directory's lock and
/// `inval_inode` over a range for the pages' locks.
pub trait Kernel: Send + Sync {
    /// Drop `name` of `parent` from the kernel's name cache.
    fn inval_entry(&self, parent: INodeNo, name: &OsStr) -> io::Result<()>;
    /// Drop the attributes of `inode`, and its pages in `offset..offset + length` unless
    /// `offset` is negative (a length of 0: to the end).
    fn inval_inode(&self, inode: INodeNo, offset: i64, length: i64) -> io::Result<()>;
    /// Store `data` at `offset` in the kernel's pages of `inode`.
    fn store(&self, inode: INodeNo, offset: u64, data: &[u8]) -> io::Result<()>;
}

impl Kernel for Notifier {
    fn inval_entry(&self, parent: INodeNo, name: &OsStr) -> io::Result<()> {
        Notifier::inval_entry(self, parent, name)
    }

    fn inval_inode(&self, inode: INodeNo, offset: i64, length: i64) -> io::Result<()> {
        Notifier::inval_inode(self, inode, offset, length)
    }

    fn store(&self, inode: INodeNo, offset: u64, data: &[u8]) -> io::Result<()> {
        Notifier::store(self, inode, offset, data)
    }
}

impl KernelCache {
    fn notifier(&self) -> Option<Arc<dyn Kernel>> {
        self.notifier.lock().expect("notifier not poisoned").clone()
    }

    /// Have the kernel write back and drop its pages of those of `inodes` it holds as
    /// regular files (writeback mounts, at a recall of their writes): `inval_inode` from
    /// offset 0 returns once each dirty page went out as a write through this mount.
    ///
    /// The kernel holds a file's write-back from the moment it starts a truncation of it
    /// until this mount answers that truncation, which may wait for the recall that called
    /// this. So each file is written back on a thread of its own, and a file whose
    /// truncation by this mount began is no longer waited for (its thread finishes once the
    /// truncation is answered). Returns when every other file is written back.
    pub fn write_back(&self, inodes: &[InodeId]) {
        let Some(notifier) = self.notifier() else {
            return;
        };
        let held: Vec<InodeId> = {
            let truncating = self.truncating.lock().expect("not poisoned");
            let index = self.index();
            inodes
                .iter()
                .copied()
                .filter(|inode| index.held.contains_key(inode) && !truncating.contains_key(inode))
                .collect()
        };
        for some in held.chunks(WRITE_BACK_THREADS_MAX) {
            self.write_back_some(&notifier, some);
        }
    }

    /// [`KernelCache::write_back`] of at most [`WRITE_BACK_THREADS_MAX`] files at once.
    fn write_back_some(&self, notifier: &Arc<dyn Kernel>, held: &[InodeId]) {
        let (done, finished) = std::sync::mpsc::channel();
        for inode in held {
            let (kernel, sender, inode) = (notifier.clone(), done.clone(), *inode);
            let spawned = std::thread::Builder::new()
                .name("write-back".to_string())
                .spawn(move || {
                    let _ = kernel.inval_inode(INodeNo(inode), 0, 0);
                    let _ = sender.send(inode);
                });
            if spawned.is_err() {
                // No thread to be had: written back here, waited for whatever happens.
                let _ = notifier.inval_inode(INodeNo(inode), 0, 0);
                let _ = done.send(inode);
            }
        }
        drop(done);
        let mut waiting: HashSet<InodeId> = held.iter().copied().collect();
        while !waiting.is_empty() {
            match finished.recv_timeout(WRITE_BACK_POLL) {
                Ok(inode) => {
                    waiting.remove(&inode);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    let truncating = self.truncating.lock().expect("not poisoned");
                    waiting.retain(|inode| !truncating.contains_key(inode));
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    /// [`KernelCache::evict_name`] for each of `names` (parent, name).
    pub fn evict_names(&self, names: &[(InodeId, String)]) {
        for (parent, name) in names {
            self.evict_name(*parent, name);
        }
    }

    /// Make the kernel drop `name` of `parent`, so that the regular file behind it is
    /// evicted once nothing uses it (a writeback mount handed it out without a lease on
    /// its attributes: the size the kernel took with it must not outlive this access).
    pub fn evict_name(&self, parent: InodeId, name: &str) {
        if let Some(notifier) = self.notifier() {
            let _ = notifier.inval_entry(INodeNo(parent), OsStr::new(name));
        }
    }

    /// Have the kernel drop its pages of `inode` in `offset..offset + length` (and its
    /// attributes); returns once it did. Nothing without a notifier. Blocks until every
    /// page in the range is unlocked: not on a thread that answers this mount's reads.
    pub fn drop_pages(&self, inode: InodeId, offset: u64, length: u64) {
        if let Some(notifier) = self.notifier() {
            // ENOENT: the kernel holds nothing of the file.
            let _ = notifier.inval_inode(INodeNo(inode), offset as i64, length as i64);
        }
    }

    /// Wire the cache to the kernel (the session's notifier; a recording one in tests):
    /// from here on, what is handed out under a lease can be taken back.
    pub fn set_notifier(&self, notifier: impl Kernel + 'static) {
        *self.notifier.lock().expect("notifier not poisoned") = Some(Arc::new(notifier));
        self.enabled.store(true, Ordering::Release);
    }

    /// Drop from the kernel what `revocations` name; returns once the kernel did.
    ///
    /// On a writeback mount a revoked regular file is first written back and its pages
    /// dropped (`inval_inode` from offset 0: the kernel writes each dirty page through
    /// this mount before it returns; the caller then waits for those writes), then every
    /// name the kernel holds it under is invalidated, so that the kernel evicts it unless
    /// a descriptor holds it open, and takes the size from the next lookup.
    pub fn revoke(&self, revocations: &[Revocation]) {
        let Some(notifier) = self.notifier() else {
            return;
        };
        // Everything this mount keeps of them goes first, then the kernel's copies in the
        // order least likely to wait: `inval_entry` waits for the directory's lock, which
        // the kernel holds while a request of this mount in that directory is at the meta
        // server (possibly waiting for another client's acknowledgement), and the poll
        // acknowledges after `HANDLER_WAIT_MS` whether or not this returned. Attributes
        // (which take no lock) must not queue behind such a name: another client's size
        // commit would reply while this kernel still answers `stat` with the old size.
        let taken: Vec<Taken> = revocations
            .iter()
            .map(|revocation| self.take(revocation))
            .collect();
        for inode in taken.iter().flat_map(|taken| &taken.inodes) {
            // A negative offset: the attributes only (pages are dropped at each open).
            let _ = notifier.inval_inode(INodeNo(*inode), -1, 0);
        }
        for (parent, name) in taken.iter().flat_map(|taken| &taken.entries) {
            // ENOENT: the kernel no longer had it. Nothing else can be done either way.
            let _ = notifier.inval_entry(INodeNo(*parent), OsStr::new(name));
        }
        // Last, as it may write pages back (slow): a meta server restart drops every held
        // file's pages (another client may have changed them meanwhile).
        let files: Vec<InodeId> = taken.into_iter().flat_map(|taken| taken.files).collect();
        self.write_back(&files);
        if self.writeback {
            self.revoked_held.notify_one();
        }
    }

    /// Show the kernel that the regular file `inode`, which it holds open here on a
    /// writeback mount, grew elsewhere to `size` bytes (it keeps its own size of such a
    /// file and ignores the meta server's). First its pages go (the old last one ends in
    /// zeros where the new bytes are), then the file's last byte, `last`, is stored at
    /// `size - 1`: a store is the only notification that changes a size the kernel keeps,
    /// and it raises it only with at least one byte. The caller makes sure that no open
    /// here can write the file meanwhile (the store would land on its byte) and that no
    /// read answered at the old size is still on its way. Blocking: the kernel takes page
    /// locks, which reads waiting for this mount may hold. Returns whether the kernel took
    /// the store.
    pub fn raise_size(&self, inode: InodeId, size: u64, last: u8) -> bool {
        let Some(notifier) = self.notifier() else {
            return false;
        };
        if size == 0 {
            return false;
        }
        // ENOENT: the kernel forgot the file; nothing to raise.
        let _ = notifier.inval_inode(INodeNo(inode), 0, 0);
        if let Err(error) = notifier.store(INodeNo(inode), size - 1, &[last]) {
            tracing::debug!(inode, size, %error, "the kernel did not take a held file's new size");
            return false;
        }
        // The last page once more: the byte stored was read before the pages went, and a
        // read since may have brought a newer one into that page (a larger page than
        // `PAGE_BYTES` is dropped whole all the same).
        let page = (size - 1) & !(PAGE_BYTES - 1);
        let _ = notifier.inval_inode(INodeNo(inode), page as i64, PAGE_BYTES as i64);
        true
    }
}
