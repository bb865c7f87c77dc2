//! What the kernel caches of this mount, and the replies that hand it over: entry and
//! attribute replies with their time-outs under the meta server's leases (`cache/`
//! admits them), negative entries, this mount's own listings kept right after its changes
//! (`note_made`, `note_removed`, `note_unsure`), evictions, the inodes the kernel holds and
//! the sizes it keeps of them, and on writeback mounts the growth of held-open files
//! (`follow_growth`). Methods of [`MountState`], called by the handlers in the sibling
//! files.

use std::sync::Arc;
use std::time::Duration;

use freeflow_client::{Attr, FileKind, InodeId, Lease, TimeSpec};
use fuser::{Errno, Generation, INodeNo};

use super::{regular_size, MountState};
use crate::cache::Admission;
use crate::convert::file_attr;
use crate::reply::{ReplyAttr, ReplyEntry};

/// Attributes for a negative entry (only its node id, 0, matters to the kernel).
fn negative_attr() -> Attr {
    Attr {
        inode: 0,
        kind: FileKind::Regular,
        permissions: 0,
        link_count: 0,
        user_id: 0,
        group_id: 0,
        size_bytes: 0,
        access_time: TimeSpec::default(),
        modify_time: TimeSpec::default(),
        change_time: TimeSpec::default(),
        birth_time: TimeSpec::default(),
        device: 0,
        layout: None,
        generation: 0,
        allocated_bytes: 0,
    }
}

impl MountState {
    /// After handing the kernel the regular file `inode` as `name` of `parent` without a
    /// lease on its attributes (`attr_ttl` zero), on a writeback mount: have the kernel
    /// drop that name again, on a blocking task (the kernel may hold the directory's lock
    /// for this very request), so that its size is taken afresh at the next lookup.
    pub(super) fn evict_unleased(
        &self,
        kind: FileKind,
        parent: InodeId,
        name: &str,
        attr_ttl: Duration,
    ) {
        if self.writeback && kind == FileKind::Regular && attr_ttl.is_zero() {
            self.evict_names(parent, vec![name.to_owned()]);
        }
    }

    /// Have the kernel drop `names` of `parent`, on one blocking task nobody waits for
    /// (the kernel may hold the directory's lock for a request of this mount).
    pub(super) fn evict_names(&self, parent: InodeId, names: Vec<String>) {
        self.evict_off_runtime(names.into_iter().map(|name| (parent, name)).collect());
    }

    /// Have the kernel drop the regular file `inode` under every name it holds it as (once
    /// nothing uses it), so that its next lookup takes the size afresh.
    fn evict_held(&self, inode: InodeId) {
        self.evict_off_runtime(self.cache.held_names(inode));
    }

    /// Have the kernel drop `names` (parent, name), on one blocking task nobody waits for.
    fn evict_off_runtime(&self, names: Vec<(InodeId, String)>) {
        if names.is_empty() {
            return;
        }
        let cache = self.cache.clone();
        self.runtime
            .spawn_blocking(move || cache.evict_names(&names));
    }

    /// Have the kernel drop its pages of `inode` in `offset..offset + length`, on a
    /// blocking thread, and wait for it. Never on a runtime worker: the kernel locks each
    /// page to drop it, and a page under a read of this mount stays locked until that
    /// read is answered, by a task that may be queued on the very worker that waits
    /// (tokio's next-task slot is not stolen), so the mount would hang.
    pub(super) async fn drop_pages(&self, inode: InodeId, offset: u64, length: u64) {
        let cache = self.cache.clone();
        let _ = tokio::task::spawn_blocking(move || cache.drop_pages(inode, offset, length)).await;
    }

    /// Time-outs (entry, attributes) for `name` in `parent` (and `child`'s attributes)
    /// answered with `lease`: what is left of the lease (its whole span while this client
    /// renews its leases: a lapse takes everything back, see the client's `leases.rs`), or
    /// the configured ones. The reply must be written before `admission` is dropped.
    pub(super) fn entry_time_outs(
        &self,
        admission: &mut Admission<'_>,
        lease: &Lease,
        parent: InodeId,
        name: &str,
        child: Option<InodeId>,
    ) -> (Duration, Duration) {
        let inodes: Vec<InodeId> = [Some(parent), child].into_iter().flatten().collect();
        let left = self.client.kernel_time_out(lease, &inodes);
        match admission.entry(left, parent, name, child) {
            Some(left) => (left, left),
            None => (self.entry_ttl, self.attr_ttl),
        }
    }

    /// The attribute time-out of `inode` answered with `lease` (as `entry_time_outs`).
    fn attribute_time_out(
        &self,
        admission: &mut Admission<'_>,
        lease: &Lease,
        inode: InodeId,
    ) -> Duration {
        let left = self.client.kernel_time_out(lease, &[inode]);
        admission.attributes(left, inode).unwrap_or(self.attr_ttl)
    }

    /// The last write open of `inode` here closed: if another client grew the file
    /// meanwhile, the kernel still has this host's size of it. Raise it if the file is
    /// still open here for reading, or have the kernel drop the file, so that the next
    /// open takes the size afresh.
    pub(super) fn after_last_write_close(self: &Arc<Self>, inode: InodeId) {
        let grown = self
            .grown_elsewhere
            .lock()
            .expect("not poisoned")
            .remove(&inode);
        if !grown {
            return;
        }
        if !self.files.is_read(inode) {
            return self.evict_held(inode);
        }
        let state = self.clone();
        self.runtime
            .spawn(async move { state.follow_growth(inode).await });
    }

    /// A regular file the kernel holds open here on a writeback mount, whose attribute
    /// lease ran out or was revoked (the kernel keeps its own size of it and ignores the
    /// meta server's): take a lease on its attributes again, so that the next change
    /// elsewhere is revoked, and if it grew past the size last shown to the kernel (not
    /// known: at the first follow after an open or a local change), raise the kernel's
    /// size to the new one.
    ///
    /// Order matters, so that no read returns zeros for bytes that were written: the
    /// handle learns the size first (never lowering it: reads from then on return the new
    /// bytes), the reads already answering at the old size are waited for (their pages end
    /// in zeros), and only then are the kernel's pages dropped and its size raised
    /// (`raise_size`), while no open here has write access and nothing here wrote or
    /// truncated the file since the start (a store would land on a byte it wrote, or
    /// raise a size it cut).
    pub(crate) async fn follow_growth(self: &Arc<Self>, inode: InodeId) {
        let from = self.files.prepare_growth(inode);
        let (attr, lease) = match self.client.getattr_leased(inode).await {
            Ok(answer) => answer,
            Err(error) => {
                tracing::debug!(inode, %error, "cannot follow a held-open file");
                return;
            }
        };
        {
            let mut admission = self.cache.admit();
            self.attribute_time_out(&mut admission, &lease, inode);
        }
        let known = from.told.unwrap_or(0);
        if attr.kind != FileKind::Regular || attr.size_bytes <= known {
            return;
        }
        if self.files.is_written(inode) {
            // Grown by another client past the size this host's kernel keeps (its size at
            // the first write open, grown by this host's writes; not the handle's, which
            // learns other clients' growth from the meta server): shown at the last write
            // close here (`after_last_write_close`).
            let own = self
                .shadows
                .extent(inode)
                .unwrap_or_else(|| self.files.get(inode).map_or(0, |handle| handle.size()));
            if attr.size_bytes <= own {
                return;
            }
            self.grown_elsewhere
                .lock()
                .expect("not poisoned")
                .insert(inode);
            if self.files.is_written(inode) {
                return;
            }
            // Closed meanwhile: shown here and now.
            self.grown_elsewhere
                .lock()
                .expect("not poisoned")
                .remove(&inode);
        }
        let Some((handle, reads)) = self.files.get_for_reading(inode) else {
            // Closed here since the sweep found it open: the kernel still has the size it
            // had then.
            if !self.files.is_read(inode) && !self.files.is_written(inode) {
                self.evict_held(inode);
            }
            return;
        };
        let size = match handle.learn_growth().await {
            Ok(size) => size,
            Err(error) => {
                tracing::debug!(inode, %error, "cannot refresh a held-open file");
                return;
            }
        };
        if size <= known {
            return;
        }
        drop(reads.write().await);
        let last = match handle.read_at(size - 1, 1).await {
            Ok(last) if last.len() == 1 => last[0],
            Ok(_) => return,
            Err(error) => {
                tracing::debug!(inode, %error, "cannot read a held-open file's last byte");
                return;
            }
        };
        if !self.files.begin_growth(from) {
            return;
        }
        // On a thread of its own to the end, whatever becomes of this task: the growth
        // ends there (write opens and truncations wait for it). A truncation by this mount
        // that began before `from` is not raised over (one that begins after gives the
        // growth up, or waits for it).
        let state = self.clone();
        let raised = tokio::task::spawn_blocking(move || {
            let shown = (!state.cache.is_truncating(inode)
                && state.cache.raise_size(inode, size, last))
            .then_some(size);
            if let Some(size) = shown {
                state.held.size_is(inode, size);
            }
            state.files.end_growth(inode, shown);
        });
        let _ = raised.await;
    }

    /// Note a truncation of `inode` by this mount until the guard is dropped: the kernel
    /// holds the file's write-back meanwhile (`KernelCache::truncating`), and a growth
    /// being prepared is given up (`OpenFiles::truncation_began`; the truncation still
    /// waits for one under way, `wait_growth`, before it is sent).
    pub(super) fn begin_truncation(&self, inode: InodeId) -> crate::cache::Truncating {
        self.files.truncation_began(inode);
        self.cache.truncating(inode)
    }

    /// Reply with `attr` for what is left of `lease`.
    pub(super) fn reply_attr(&self, reply: ReplyAttr, attr: &Attr, lease: &Lease) {
        let mut admission = self.cache.admit();
        let ttl = self.attribute_time_out(&mut admission, lease, attr.inode);
        reply.attr(&ttl, &self.kernel_attr(attr));
    }

    pub(super) fn kernel_attr(&self, attr: &Attr) -> fuser::FileAttr {
        match self.files.get(attr.inode) {
            Some(handle) if attr.kind == FileKind::Regular => {
                let mut attr = attr.clone();
                attr.allocated_bytes = attr.allocated_bytes.max(handle.allocated_bytes());
                file_attr(&attr, attr.size_bytes.max(handle.size()))
            }
            _ => file_attr(attr, attr.size_bytes),
        }
    }

    /// A change by this host past the kernel's pages (a direct write, `fallocate` without
    /// `KEEP_SIZE`, `copy_file_range`) ended at `end`, and the kernel raises its size to
    /// it: both the shadows and the size the kernel keeps follow.
    pub(super) fn grown_here(&self, inode: InodeId, end: u64) {
        self.shadows.grown(inode, end);
        self.held.grown_to(inode, end);
    }

    /// The kernel takes a reference to `inode` from an entry reply that gives it `size`
    /// (a regular file's).
    pub(super) fn remember(&self, inode: InodeId, size: Option<u64>) {
        self.held.remember(&[(inode, size)]);
    }

    pub(super) fn forget(&self, inode: InodeId, count: u64) {
        // The cache index before the lookup counts, as where a reply counts a lookup under
        // an admission (readdirplus, creates answered ahead): one order, no deadlock.
        let mut admission = self.cache.admit();
        if self.held.forget(inode, count) {
            admission.forgotten(inode);
        }
    }

    /// Reply with a new or found entry `name` of `parent`, counting the kernel's reference;
    /// cached for what is left of `lease`.
    pub(super) fn reply_entry(
        &self,
        reply: ReplyEntry,
        parent: InodeId,
        name: &str,
        attr: &Attr,
        lease: &Lease,
    ) {
        let kernel_attr = self.kernel_attr(attr);
        self.remember(attr.inode, regular_size(&kernel_attr));
        let mut admission = self.cache.admit();
        let (entry_ttl, attr_ttl) =
            self.entry_time_outs(&mut admission, lease, parent, name, Some(attr.inode));
        if attr.kind == FileKind::Regular {
            admission.held_as(attr.inode, parent, name);
        }
        reply.entry_with_ttls(&attr_ttl, &entry_ttl, &kernel_attr, Generation(0));
        drop(admission);
        self.evict_unleased(attr.kind, parent, name, attr_ttl);
    }

    /// Reply that `name` is not in `parent`: a negative entry the kernel keeps for what is
    /// left of `lease` (another client's create of the name revokes it), else `ENOENT`.
    pub(super) fn reply_missing(
        &self,
        reply: ReplyEntry,
        parent: InodeId,
        name: &str,
        lease: &Lease,
    ) {
        let mut admission = self.cache.admit();
        self.answer_missing(&mut admission, reply, parent, name, lease);
    }

    /// Answer a lookup from this mount's complete listing of `parent` when it shows `name`
    /// missing (no request to the meta server); gives the reply back otherwise.
    pub(super) fn reply_if_known_missing(
        &self,
        reply: ReplyEntry,
        parent: InodeId,
        name: &str,
    ) -> Option<ReplyEntry> {
        let mut admission = self.cache.admit();
        let client = &self.client;
        let known = admission.known_missing(parent, name, |lease| {
            client.lease_remaining(lease, &[parent])
        });
        match known {
            Some(lease) => {
                self.answer_missing(&mut admission, reply, parent, name, &lease);
                None
            }
            None => Some(reply),
        }
    }

    /// Keep this mount's listing of `parent` right after it made `name` there (and, for a
    /// directory it made, start one of `made_directory`). Called before the reply.
    pub(super) fn note_made(
        &self,
        parent: InodeId,
        name: &str,
        child: Option<(InodeId, FileKind)>,
        lease: &Lease,
        made_directory: Option<&Attr>,
    ) {
        self.directories.changed(&[parent]);
        let mut admission = self.cache.admit();
        let client = &self.client;
        admission.listing_added(parent, name, child, Some(*lease), |lease| {
            client.lease_remaining(lease, &[parent])
        });
        if let Some(directory) = made_directory {
            if client.lease_remaining(lease, &[directory.inode]).is_some() {
                let setgid = directory.permissions & 0o2000 != 0;
                let group_of_new = setgid.then_some(directory.group_id);
                admission.listing_started(directory.inode, *lease, group_of_new);
            }
        }
    }

    /// Make the kernel forget `name` in `parent` (and the directory's attributes with
    /// `attributes`) after an op answered ahead was refused: on a blocking task not waited
    /// for, since the kernel may hold the directory's lock for a request of this mount.
    pub(super) fn forget_name(self: &Arc<Self>, parent: InodeId, name: String, attributes: bool) {
        let cache = self.cache.clone();
        self.runtime.spawn_blocking(move || {
            cache.revoke(&[freeflow_client::Revocation {
                id: 0,
                inode: parent,
                names: vec![name],
                attributes,
                whole_directory: false,
            }])
        });
    }

    pub(super) fn note_removed(&self, parent: InodeId, name: &str) {
        self.directories.changed(&[parent]);
        self.cache.admit().listing_removed(parent, name);
    }

    pub(super) fn note_unsure(&self, directories: &[InodeId]) {
        self.directories.changed(directories);
        let mut admission = self.cache.admit();
        for directory in directories {
            admission.listing_unsure(*directory);
        }
    }

    fn answer_missing(
        &self,
        admission: &mut Admission<'_>,
        reply: ReplyEntry,
        parent: InodeId,
        name: &str,
        lease: &Lease,
    ) {
        let left = self.client.lease_remaining(lease, &[parent]);
        match admission.entry(left, parent, name, None) {
            Some(left) => {
                // Node id 0: "no such entry, for this long".
                let mut missing = file_attr(&negative_attr(), 0);
                missing.ino = INodeNo(0);
                reply.entry(&left, &missing, Generation(0));
            }
            None => reply.error(Errno::ENOENT),
        }
    }
}
