//! The request handlers: one `fuser::Filesystem` method per kernel operation, each mapped
//! onto the client library's inode API.
//!
//! A handler never waits for the cluster on the thread that read the request: it takes what
//! it needs from the request (names, data, credentials), moves the reply object into a task
//! on the tokio runtime and returns to read the next request. So one slow request (a read
//! from a far server, an fsync) never holds up the others, and a sequential writer keeps
//! several writes in flight. [`REQUESTS_IN_FLIGHT_MAX`] bounds the tasks: past it, the
//! reading thread waits for one to finish.
//!
//! Inode numbers are Freeflow's inode ids (never reused, so the FUSE generation is 0; the
//! `generation` of an `Attr` counts changes of the inode and is not a FUSE generation).

use std::ffi::OsStr;
use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use freeflow_client::{
    Allocation, Attr, Client, ClientError, ErrorCode, FileKind, InodeId, Lease, LockKind, LockSpec,
    RenameMode, SetAttr, TimeSpec, XattrSetMode,
};
use freeflow_metrics::Counter;
use fuser::{
    AccessFlags, Errno, FileHandle, FileType, FopenFlags, Generation, INodeNo, InitFlags,
    IoctlFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, TimeOrNow, WriteFlags,
};
use tokio::sync::Semaphore;

use crate::cache::{Admission, KernelCache};
use crate::caller::GroupsCache;
use crate::convert::{self, errno, file_attr, STATFS_BLOCK_BYTES};
use crate::handles::{DirectoryListing, OpenDirectories, OpenFiles};
use crate::held::KernelInodes;
use crate::reply::{
    Caller, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty,
    ReplyEntry, ReplyIoctl, ReplyLock, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr,
};
use crate::session::{MountOptions, REQUESTS_IN_FLIGHT_MAX};
use crate::shadow::Shadows;

/// Largest write the kernel sends in one request (and the read size it asks for): 1 MiB,
/// one stripe unit by default (DESIGN.md §6.1).
pub const MAX_WRITE_BYTES: u32 = 1 << 20;
/// Read-ahead asked of the kernel at init (it caps this at its own offer; the mount raises
/// the bdi's read-ahead after mounting).
pub const MAX_READAHEAD_BYTES: u32 = 1 << 20;
/// Background requests (read-ahead, async direct I/O) the kernel keeps in flight.
pub const MAX_BACKGROUND_REQUESTS: u16 = 64;
/// The kernel's `OFFSET_MAX`: a lock to the end of the file, however far.
const KERNEL_OFFSET_MAX: u64 = i64::MAX as u64;

fn lock_kind(kind: i32) -> Result<Option<LockKind>, Errno> {
    match kind {
        libc::F_RDLCK => Ok(Some(LockKind::Read)),
        libc::F_WRLCK => Ok(Some(LockKind::Write)),
        libc::F_UNLCK => Ok(None),
        _ => Err(Errno::EINVAL),
    }
}

fn lock_end_from_kernel(end: u64) -> u64 {
    if end >= KERNEL_OFFSET_MAX {
        u64::MAX
    } else {
        end
    }
}

fn lock_end_to_kernel(end: u64) -> u64 {
    end.min(KERNEL_OFFSET_MAX)
}

/// Most entries fetched for one `readdirplus` reply (the kernel's buffer holds ~200 of
/// 32 KiB; what does not fit is answered from the listing at the next call).
const READDIRPLUS_GATHER_MAX: usize = 256;
/// Least lease on a directory's names left for a create there to be answered ahead of the
/// meta server: the create then has that long to reach it before the delegation could end.
const AHEAD_LEASE_LEFT_MIN: Duration = Duration::from_secs(1);

/// How long the kernel may keep the attributes of a directory with creates or unlinks
/// answered ahead on their way (see `getattr`): long enough for the two permission checks
/// of one create or unlink (the search at the lookup, then the write), short enough that
/// the meta server's times are asked for soon after the changes landed.
const AHEAD_DIRECTORY_ATTR_TTL: Duration = Duration::from_millis(10);

/// Longest read a session thread answers itself (`FreeflowFs::answer_read`): one piece.
pub const READ_HERE_BYTES_MAX: u32 = 128 << 10;

/// Free inodes reported by statfs: Freeflow has no inode table to run out of.
pub const STATFS_FREE_INODES: u64 = 1 << 32;

/// Everything the handlers share; the tasks hold it through an `Arc`.
pub(crate) struct MountState {
    /// Acting as root; per-request clients come from `with_caller`.
    pub client: Client,
    pub attr_ttl: Duration,
    pub entry_ttl: Duration,
    pub sync_on_close: bool,
    pub files: OpenFiles,
    pub directories: OpenDirectories,
    groups: GroupsCache,
    /// The inodes the kernel holds and the sizes it keeps of them (`held.rs`).
    pub held: KernelInodes,
    runtime: tokio::runtime::Handle,
    in_flight: Arc<Semaphore>,
    /// A lone read may be answered on the session thread that took it (`answer_read`):
    /// plain mounts with more than one session thread.
    reads_here: bool,
    /// A session thread is answering a read itself now (one at a time).
    reading_here: AtomicBool,
    /// The kernel lets opens answered past its page cache be mapped shared
    /// (`FUSE_DIRECT_IO_ALLOW_MMAP`, set at init).
    direct_mmap: AtomicBool,
    /// Set when the connection is aborted: a read answered on a session thread is given
    /// up, so the thread ends with the session.
    ending: tokio::sync::watch::Sender<bool>,
    /// What the kernel caches under leases, and how to take it back (`cache.rs`).
    pub cache: Arc<KernelCache>,
    /// The kernel's writeback cache is on (`MountOptions::writeback`).
    pub writeback: bool,
    /// INIT asks for FUSE over io_uring (`MountOptions::transport`, the kernel's
    /// parameter on and rings possible here: `session::mount` found out).
    ring_wanted: bool,
    /// The kernel granted it at INIT: the rings are to be registered.
    pub ring_granted: AtomicBool,
    /// The mount fails unless granted (`Transport::IoUring`).
    ring_required: bool,
    /// Writeback mounts: the pages of files open for writing as the kernel got them, so
    /// that a page written back carries only what changed here (`shadow.rs`).
    pub shadows: Shadows,
    /// Writeback mounts: files open for writing here that another client grew meanwhile
    /// (`follow_growth` leaves the kernel's size alone while a write open is here); their
    /// last write close here shows the kernel the new size.
    grown_elsewhere: Mutex<std::collections::HashSet<InodeId>>,
    /// `READDIRPLUS` entries given with their attributes, and as names alone (the kernel
    /// held the name and the attributes already: `KernelCache::kernel_holds`).
    listed_with_attributes: Counter,
    listed_names_alone: Counter,
}

const LISTED_ENTRIES_HELP: &str = "Entries of READDIRPLUS replies, by whether their \
     attributes went with them (given) or the kernel held the name and attributes already \
     and got the name alone (held).";

/// The size an entry reply gives the kernel, if it is a regular file's.
fn regular_size(attr: &fuser::FileAttr) -> Option<u64> {
    (attr.kind == fuser::FileType::RegularFile).then_some(attr.size)
}

impl MountState {
    pub fn new(
        client: Client,
        options: &MountOptions,
        runtime: tokio::runtime::Handle,
        ring_wanted: bool,
    ) -> MountState {
        let listed = |attributes: &'static str| {
            client.metrics().counter(
                "freeflow_mount_listed_entries_total",
                LISTED_ENTRIES_HELP,
                &[("attributes", attributes)],
            )
        };
        MountState {
            listed_with_attributes: listed("given"),
            listed_names_alone: listed("held"),
            client: client.with_caller(freeflow_client::Caller::root()),
            attr_ttl: Duration::from_millis(options.attr_timeout_ms),
            entry_ttl: Duration::from_millis(options.entry_timeout_ms),
            sync_on_close: options.sync_on_close,
            files: OpenFiles::new(),
            directories: OpenDirectories::new(),
            groups: GroupsCache::new(),
            held: KernelInodes::new(options.writeback),
            runtime,
            in_flight: Arc::new(Semaphore::new(REQUESTS_IN_FLIGHT_MAX)),
            reads_here: !options.writeback && options.threads > 1,
            reading_here: AtomicBool::new(false),
            direct_mmap: AtomicBool::new(false),
            ending: tokio::sync::watch::channel(false).0,
            cache: Arc::new(KernelCache::new(options.writeback)),
            writeback: options.writeback,
            ring_wanted,
            ring_granted: AtomicBool::new(false),
            ring_required: options.transport == crate::session::Transport::IoUring,
            shadows: Shadows::new(options.writeback),
            grown_elsewhere: Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// The connection is being aborted: a read a session thread answers itself is given
    /// up (`FreeflowFs::answer_read`).
    pub fn aborting(&self) {
        self.ending.send_replace(true);
    }

    /// After handing the kernel the regular file `inode` as `name` of `parent` without a
    /// lease on its attributes (`attr_ttl` zero), on a writeback mount: have the kernel
    /// drop that name again, on a blocking task (the kernel may hold the directory's lock
    /// for this very request), so that its size is taken afresh at the next lookup.
    fn evict_unleased(&self, kind: FileKind, parent: InodeId, name: &str, attr_ttl: Duration) {
        if self.writeback && kind == FileKind::Regular && attr_ttl.is_zero() {
            self.evict_names(parent, vec![name.to_owned()]);
        }
    }

    /// Have the kernel drop `names` of `parent`, on one blocking task nobody waits for
    /// (the kernel may hold the directory's lock for a request of this mount).
    fn evict_names(&self, parent: InodeId, names: Vec<String>) {
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
    async fn drop_pages(&self, inode: InodeId, offset: u64, length: u64) {
        let cache = self.cache.clone();
        let _ = tokio::task::spawn_blocking(move || cache.drop_pages(inode, offset, length)).await;
    }

    /// Time-outs (entry, attributes) for `name` in `parent` (and `child`'s attributes)
    /// answered with `lease`: what is left of the lease (its whole span while this client
    /// renews its leases: a lapse takes everything back, see the client's `leases.rs`), or
    /// the configured ones. The reply must be written before `admission` is dropped.
    fn entry_time_outs(
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

    /// The entries of `listing` from `first` on that a `READDIRPLUS` reply may hold, with
    /// their attributes, if all of it is here: fetched (or past the end), and each
    /// entry's attributes from the listing or kept under a good lease (or not needed:
    /// [`PlusEntry::Held`]). None when a page or attributes must be asked for. Stops early
    /// at a page not fetched yet (a short reply: the kernel asks again from there).
    fn known_entries_plus(
        &self,
        listing: &DirectoryListing,
        first: usize,
        names_alone: bool,
    ) -> Option<Vec<PlusEntry>> {
        let mut end = first;
        while end < first + READDIRPLUS_GATHER_MAX {
            match listing.known(end) {
                Some(true) => end += 1,
                Some(false) => break,
                None if end == first => return None,
                None => break,
            }
        }
        let entries = self.entries_with_attributes(listing, first, end, names_alone);
        if entries
            .iter()
            .any(|entry| matches!(entry, PlusEntry::Ask { .. }))
        {
            return None;
        }
        Some(entries)
    }

    /// The fetched entries `first..end` of `listing`: with `names_alone` (the reply may
    /// give an entry without attributes), those whose names and attributes the kernel
    /// holds with time to run go as names alone (`KernelCache::kernel_holds`); the others
    /// with the lease of their name and their attributes with theirs, from the listing's
    /// page or kept under a good lease (taken under one lock), or to be asked for.
    fn entries_with_attributes(
        &self,
        listing: &DirectoryListing,
        first: usize,
        end: usize,
        names_alone: bool,
    ) -> Vec<PlusEntry> {
        let entries = &listing.entries[first..end];
        let held = if names_alone && !self.writeback {
            self.cache.admit().kernel_holds(
                listing.inode,
                entries
                    .iter()
                    .map(|entry| (entry.name.as_str(), entry.inode)),
            )
        } else {
            vec![false; entries.len()]
        };
        let without: Vec<InodeId> = entries
            .iter()
            .zip(&held)
            .filter(|(entry, held)| entry.attr.is_none() && !**held)
            .map(|(entry, _)| entry.inode)
            .collect();
        let mut kept = self.client.kept_attributes_leased_of(&without).into_iter();
        entries
            .iter()
            .zip(&listing.leases[first..end])
            .zip(held)
            .map(|((entry, names_lease), held)| {
                let name = entry.name.clone();
                if held {
                    return PlusEntry::Held {
                        name,
                        inode: entry.inode,
                        kind: entry.kind,
                    };
                }
                let attr = match &entry.attr {
                    Some(attr) => Some((attr.clone(), *names_lease)),
                    None => kept.next().flatten(),
                };
                match attr {
                    Some((attr, attr_lease)) => PlusEntry::Full {
                        name,
                        attr,
                        names_lease: *names_lease,
                        attr_lease,
                    },
                    None => PlusEntry::Ask {
                        name,
                        inode: entry.inode,
                        names_lease: *names_lease,
                    },
                }
            })
            .collect()
    }

    /// Answer a `READDIRPLUS` of `listing` at `offset` with `found` (its entries from
    /// there, with their attributes and leases) and, before them, "." and ".." with the
    /// directory's attributes (`directory`, from offset 0 or 1): the time-outs are worked
    /// out with revocations held off (see `Admission`).
    fn answer_plus(
        &self,
        listing: &DirectoryListing,
        inode: INodeNo,
        offset: u64,
        directory: Option<fuser::FileAttr>,
        found: Vec<PlusEntry>,
        mut reply: ReplyDirectoryPlus,
    ) {
        if found.is_empty() && directory.is_none() {
            // Nothing more: the kernel now holds the whole listing.
            let _admission = self.listing_read(listing);
            return reply.ok();
        }
        let ttl = self.attr_ttl.min(self.entry_ttl);
        let mut admission = self.cache.admit();
        let mut unleased = Vec::new();
        let mut index = offset;
        if let Some(attr) = &directory {
            if index == 0 && reply.add(inode, 1, ".", &ttl, attr, Generation(0)) {
                return reply.ok();
            }
            if index <= 1 && reply.add(inode, 2, "..", &ttl, attr, Generation(0)) {
                return reply.ok();
            }
            index = 2;
        }
        // Time-outs asked for each run of entries under one lease at once (the locks
        // of the lease tables taken once, not per entry).
        let mut names_left: Option<(Lease, Option<Duration>)> = None;
        let mut attributes_left = Vec::with_capacity(found.len());
        let mut start = 0;
        while start < found.len() {
            let PlusEntry::Full {
                attr_lease: lease, ..
            } = found[start]
            else {
                start += 1;
                continue;
            };
            let inodes: Vec<InodeId> = found[start..]
                .iter()
                .map_while(|entry| match entry {
                    PlusEntry::Full {
                        attr, attr_lease, ..
                    } if *attr_lease == lease => Some(attr.inode),
                    _ => None,
                })
                .collect();
            start += inodes.len();
            attributes_left.extend(self.client.kernel_time_outs(&lease, &inodes));
        }
        let mut attributes_left = attributes_left.into_iter();
        let mut taken = Vec::with_capacity(found.len());
        for entry in found {
            let (name, attr, names_lease) = match entry {
                PlusEntry::Full {
                    name,
                    attr,
                    names_lease,
                    ..
                } => (name, attr, names_lease),
                PlusEntry::Held { name, inode, kind } => {
                    if reply.add_name(INodeNo(inode), index + 1, convert::file_type(kind), &name) {
                        break;
                    }
                    self.listed_names_alone.increment();
                    index += 1;
                    continue;
                }
                PlusEntry::Ask { .. } => unreachable!("entries without attributes were asked for"),
            };
            let attr_left = attributes_left.next().flatten();
            let left = match names_left {
                Some((lease, left)) if lease == names_lease => left,
                _ => {
                    let left = self.client.kernel_time_out(&names_lease, &[inode.0]);
                    names_left = Some((names_lease, left));
                    left
                }
            };
            let entry_ttl = admission
                .entry(left, inode.0, &name, None)
                .unwrap_or(self.entry_ttl);
            let attr_ttl = admission
                .attributes(attr_left, attr.inode)
                .unwrap_or(self.attr_ttl);
            let kernel_attr = self.kernel_attr(&attr);
            let full = reply.add(
                INodeNo(attr.inode),
                index + 1,
                &name,
                &entry_ttl.min(attr_ttl),
                &kernel_attr,
                Generation(0),
            );
            if full {
                break;
            }
            self.listed_with_attributes.increment();
            taken.push((attr.inode, regular_size(&kernel_attr)));
            if attr.kind == FileKind::Regular {
                admission.held_as(attr.inode, inode.0, &name);
                if self.writeback && attr_ttl.min(entry_ttl).is_zero() {
                    unleased.push(name);
                }
            }
            index += 1;
        }
        // The kernel counts a lookup for each entry it takes.
        self.held.remember(&taken);
        reply.ok();
        drop(admission);
        self.evict_names(inode.0, unleased);
    }

    /// Before `listing` asks the meta server for its first page: take the whole listing
    /// from what this mount knows, if it made the directory and still holds the lease on
    /// its names, and keeps the attributes of every entry from its own changes under
    /// leases still good (see `KernelCache::complete_listing`). No request then.
    fn take_known_listing(&self, listing: &mut DirectoryListing) {
        if !listing.untouched() {
            return;
        }
        let directory = listing.inode;
        let known = {
            let mut admission = self.cache.admit();
            admission.complete_listing(directory, |lease| {
                self.client.lease_remaining(lease, &[directory])
            })
        };
        let Some((entries, lease)) = known else {
            return;
        };
        // The attributes themselves are taken when entries are answered (a `READDIRPLUS`
        // reply's at once, `entries_with_attributes`), so they are those kept then.
        listing.take_known(entries, lease);
    }

    /// The kernel is about to be answered the end of `listing`: note what it was read
    /// under (see `KernelCache`'s kernel listings). The reply must be written before the
    /// returned admission is dropped.
    fn listing_read(&self, listing: &DirectoryListing) -> Admission<'_> {
        let alone = self.directories.alone(listing);
        let mut admission = self.cache.admit();
        let directory = listing.inode;
        admission.kernel_listing_read(
            directory,
            &listing.pages,
            alone,
            listing.kept_cache,
            |lease| self.client.kernel_time_out(lease, &[directory]),
        );
        admission
    }

    /// The last write open of `inode` here closed: if another client grew the file
    /// meanwhile, the kernel still has this host's size of it. Raise it if the file is
    /// still open here for reading, or have the kernel drop the file, so that the next
    /// open takes the size afresh.
    fn after_last_write_close(self: &Arc<Self>, inode: InodeId) {
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
    fn begin_truncation(&self, inode: InodeId) -> crate::cache::Truncating {
        self.files.truncation_began(inode);
        self.cache.truncating(inode)
    }

    /// Reply with `attr` for what is left of `lease`.
    fn reply_attr(&self, reply: ReplyAttr, attr: &Attr, lease: &Lease) {
        let mut admission = self.cache.admit();
        let ttl = self.attribute_time_out(&mut admission, lease, attr.inode);
        reply.attr(&ttl, &self.kernel_attr(attr));
    }

    fn kernel_attr(&self, attr: &Attr) -> fuser::FileAttr {
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
    fn grown_here(&self, inode: InodeId, end: u64) {
        self.shadows.grown(inode, end);
        self.held.grown_to(inode, end);
    }

    /// The kernel takes a reference to `inode` from an entry reply that gives it `size`
    /// (a regular file's).
    fn remember(&self, inode: InodeId, size: Option<u64>) {
        self.held.remember(&[(inode, size)]);
    }

    fn forget(&self, inode: InodeId, count: u64) {
        // The cache index before the lookup counts, as where a reply counts a lookup under
        // an admission (readdirplus, creates answered ahead): one order, no deadlock.
        let mut admission = self.cache.admit();
        if self.held.forget(inode, count) {
            admission.forgotten(inode);
        }
    }

    /// Reply with a new or found entry `name` of `parent`, counting the kernel's reference;
    /// cached for what is left of `lease`.
    fn reply_entry(
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
    fn reply_missing(&self, reply: ReplyEntry, parent: InodeId, name: &str, lease: &Lease) {
        let mut admission = self.cache.admit();
        self.answer_missing(&mut admission, reply, parent, name, lease);
    }

    /// Answer a lookup from this mount's complete listing of `parent` when it shows `name`
    /// missing (no request to the meta server); gives the reply back otherwise.
    fn reply_if_known_missing(
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
    fn note_made(
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
    fn forget_name(self: &Arc<Self>, parent: InodeId, name: String, attributes: bool) {
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

    fn note_removed(&self, parent: InodeId, name: &str) {
        self.directories.changed(&[parent]);
        self.cache.admit().listing_removed(parent, name);
    }

    fn note_unsure(&self, directories: &[InodeId]) {
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

/// The `fuser` file system: a thin shell that hands each request to a task.
pub(crate) struct FreeflowFs {
    state: Arc<MountState>,
}

/// Longest a lookup on a writeback mount waits for a release of the same file to be
/// answered (a release takes milliseconds; bounded, as both hold a place among the
/// requests in flight).
const RELEASE_WAIT_MS: u64 = 2_000;

/// Marks a release answered when dropped: after its reply, or with its task if that never
/// runs (see `release`).
struct ReleaseAnswered {
    state: Arc<MountState>,
    inode: InodeId,
}

impl Drop for ReleaseAnswered {
    fn drop(&mut self) {
        self.state.files.release_answered(self.inode);
    }
}

/// What of a write-back goes (`Shadows::write_back`): the spans of it to send, and the size
/// the file grows to without a byte there.
struct Spans {
    spans: Vec<std::ops::Range<usize>>,
    grow: Option<u64>,
}

impl FreeflowFs {
    pub fn new(state: Arc<MountState>) -> FreeflowFs {
        FreeflowFs { state }
    }

    /// Run `task` on the runtime, waiting here first if too many are in flight.
    /// Answer a create before the meta server has it (`delegation.rs` in the client):
    /// when this mount made `parent` and knows all its names under a lease with at least
    /// `AHEAD_LEASE_LEFT_MIN` left, `name` is not among them, the meta server delegated
    /// `parent` to this client and a reserved inode number is left. The create is sent
    /// after the answer; a refusal (no space, say) is logged, and the name and the file
    /// vanish from this mount. Gives the reply back when it cannot answer ahead.
    fn create_ahead(
        &self,
        request: &Caller,
        parent: InodeId,
        name: &str,
        mode: u32,
        flags: i32,
        reply: ReplyCreate,
    ) -> Option<ReplyCreate> {
        let state = &self.state;
        if state.sync_on_close {
            return Some(reply);
        }
        let client = &state.client;
        let mut admission = state.cache.admit();
        let Some((lease, group_of_new)) =
            admission.known_missing_for_create(parent, name, |lease| {
                client.lease_remaining(lease, &[parent])
            })
        else {
            return Some(reply);
        };
        if client
            .lease_remaining(&lease, &[parent])
            .is_none_or(|left| left < AHEAD_LEASE_LEFT_MIN)
        {
            return Some(reply);
        }
        let Some(ahead) = client.begin_ahead_create(parent, name, &state.runtime) else {
            return Some(reply);
        };
        let inode = ahead.inode();
        let now = convert::time_spec(std::time::SystemTime::now());
        let attr = Attr::new_inode(
            inode,
            FileKind::Regular,
            mode & 0o7777,
            request.uid,
            group_of_new.unwrap_or(request.gid),
            now,
        );
        admission.listing_added(
            parent,
            name,
            Some((inode, FileKind::Regular)),
            None,
            |lease| client.lease_remaining(lease, &[parent]),
        );
        state.directories.changed(&[parent]);
        state.remember(inode, Some(0));
        let (entry_ttl, attr_ttl) =
            state.entry_time_outs(&mut admission, &lease, parent, name, Some(inode));
        admission.held_as(inode, parent, name);
        if writes(flags) {
            state
                .files
                .created_for_writing(inode, || state.shadows.begin(inode, 0));
        }
        let answer = open_reply_flags(state, flags);
        if reads_pages(open_handle(inode, answer), flags) {
            state.files.opened_for_reading(inode);
        }
        reply.created(
            &attr_ttl.min(entry_ttl),
            &file_attr(&attr, 0),
            Generation(0),
            open_handle(inode, answer),
            answer,
        );
        drop(admission);
        let (creator, state, name) = (self.caller(request), self.state.clone(), name.to_owned());
        self.spawn(async move {
            let access = freeflow_client::OpenAccess {
                read: true,
                write: true,
            };
            let created = creator
                .create_open_reserved(parent, &name, mode & 0o7777, access, inode)
                .await;
            match created {
                Ok((handle, lease)) => {
                    if let Err(error) = state.files.adopt(Arc::new(handle)).await {
                        tracing::warn!(inode, %error, "a file created ahead cannot be kept open");
                    }
                    state.note_made(parent, &name, Some((inode, FileKind::Regular)), &lease, None);
                    ahead.finish();
                }
                Err(error) => {
                    tracing::error!(
                        parent,
                        name = %name,
                        inode,
                        %error,
                        "a create answered ahead of the meta server was refused; the file is gone from this mount"
                    );
                    state.note_unsure(&[parent]);
                    // Finished first: a request of this mount in the directory may be
                    // waiting for it while the kernel holds the directory's lock, which
                    // the invalidation needs.
                    ahead.finish();
                    state.forget_name(parent, name, true);
                }
            }
        });
        None
    }

    /// Answer an unlink before the meta server has it, under the same conditions as a
    /// create (`create_ahead`), when this mount knows which file the name stands for and
    /// nothing about that file is on its way. The kernel has checked already that it is
    /// not a directory and that the caller may remove it. Gives the reply back otherwise.
    fn unlink_ahead(
        &self,
        request: &Caller,
        parent: InodeId,
        name: &str,
        reply: ReplyEmpty,
    ) -> Option<ReplyEmpty> {
        let state = &self.state;
        if state.sync_on_close {
            return Some(reply);
        }
        let client = &state.client;
        let mut admission = state.cache.admit();
        let Some((lease, child)) = admission.known_child(parent, name, |lease| {
            client.lease_remaining(lease, &[parent])
        }) else {
            return Some(reply);
        };
        if client
            .lease_remaining(&lease, &[parent])
            .is_none_or(|left| left < AHEAD_LEASE_LEFT_MIN)
        {
            return Some(reply);
        }
        let Some(ahead) = client.begin_ahead_unlink(parent, name, child) else {
            return Some(reply);
        };
        admission.listing_removed(parent, name);
        state.directories.changed(&[parent]);
        reply.ok();
        drop(admission);
        let (remover, state, name) = (self.caller(request), self.state.clone(), name.to_owned());
        self.spawn(async move {
            match remover.unlink_ahead_sent(parent, &name).await {
                Ok(lease) => {
                    state.cache.admit().listing_renewed(parent, lease, |lease| {
                        state.client.lease_remaining(lease, &[parent])
                    });
                    ahead.finish();
                }
                Err(error) => {
                    tracing::error!(
                        parent,
                        name = %name,
                        inode = child,
                        %error,
                        "an unlink answered ahead of the meta server was refused; the name is asked for again"
                    );
                    state.note_unsure(&[parent]);
                    ahead.finish();
                    state.forget_name(parent, name, false);
                }
            }
        });
        None
    }

    /// Wait (on this kernel thread) until no create answered ahead of the meta server is
    /// on its way in or of `inodes` (0: anywhere), so that what this request does or asks
    /// sees it. Rare: only a request within moments of such a create waits.
    fn settle(&self, inodes: &[InodeId]) {
        let client = &self.state.client;
        if client.ahead_unsettled(inodes) {
            self.state.runtime.block_on(client.settle_ahead(inodes));
        }
    }

    fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let semaphore = self.state.in_flight.clone();
        let permit = match semaphore.clone().try_acquire_owned() {
            Ok(permit) => permit,
            // This is a fuser thread, not a runtime thread: blocking here is the back pressure.
            Err(_) => self
                .state
                .runtime
                .block_on(semaphore.acquire_owned())
                .expect("the in-flight semaphore is never closed"),
        };
        self.state.runtime.spawn(async move {
            task.await;
            drop(permit);
        });
    }

    /// Answers a read: on this session thread when it is the mount's only request (a
    /// reader at queue depth 1), else as a task like every request. Here, the read's
    /// future is driven by this thread and a local read that misses the page cache waits
    /// for the disk here too (`freeflow_client::reads_in_place`): no hand-off to a runtime
    /// worker, then to the blocking pool and back, each the wake-up of an idle CPU. One
    /// session thread at a time does it, so the others keep taking the kernel's requests
    /// (a read that waits for another request's answer is answered by them); writeback
    /// mounts never do (their reads may wait on page locks the kernel holds for others).
    /// Only reads of at most [`READ_HERE_BYTES_MAX`]: a longer one may span several
    /// stripe units, whose reads from the disk should run at once on the blocking pool,
    /// not one after another here.
    fn answer_read<F>(&self, size: u32, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let state = &self.state;
        let alone = state.reads_here
            && size <= READ_HERE_BYTES_MAX
            && state.in_flight.available_permits() == REQUESTS_IN_FLIGHT_MAX
            && state
                .reading_here
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok();
        if !alone {
            return self.spawn(task);
        }
        struct Done<'a>(&'a AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _done = Done(&state.reading_here);
        let mut ending = state.ending.subscribe();
        // A panic of the read is the read's alone, as in a task: unwinding drops its
        // reply (fuser answers it with an error), and this thread goes on taking requests.
        let answered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            freeflow_client::reads_in_place(|| {
                state.runtime.block_on(async move {
                    tokio::select! {
                        () = task => {}
                        // Dropped unanswered (fuser answers it with an error), as the tasks
                        // are when the runtime stops.
                        _ = ending.wait_for(|ending| *ending) => {}
                    }
                })
            })
        }));
        if answered.is_err() {
            tracing::error!("a read answered on a session thread panicked");
        }
    }

    /// A write-back of `data` at `offset` of which only `sent.spans` (offsets into `data`)
    /// changed here (`shadow.rs`): those go, the file grows to `sent.grow` once they are
    /// on their way (`FileHandle::extend_to` commits it after them), and the kernel is
    /// told all was written.
    fn write_spans(
        &self,
        handle: Arc<freeflow_client::FileHandle>,
        offset: u64,
        data: Bytes,
        sent: Spans,
        kill_privileges: bool,
        reply: ReplyWrite,
    ) {
        let Ok(length) = u32::try_from(data.len()) else {
            return reply.error(Errno::EINVAL);
        };
        let pieces: Vec<(u64, Bytes)> = sent
            .spans
            .iter()
            .map(|span| (offset + span.start as u64, data.slice(span.clone())))
            .collect();
        let privileged_client = kill_privileges.then(|| {
            self.state
                .client
                .with_caller(freeflow_client::Caller::root())
        });
        let state = self.state.clone();
        self.spawn(async move {
            if let Some(client) = privileged_client {
                if let Err(error) = kill_set_id_bits(&client, handle.inode()).await {
                    // The copies took bytes that were not sent.
                    state.shadows.failed(handle.inode());
                    return reply.error(errno(&error));
                }
            }
            // Disjoint pieces: sent at once, each seen through to its end.
            let writes = pieces
                .into_iter()
                .map(|(at, piece)| handle.write_at(at, piece));
            let results = futures::future::join_all(writes).await;
            let mut error = results.into_iter().find_map(Result::err);
            if let (None, Some(end)) = (&error, sent.grow) {
                error = handle.extend_to(end).err();
            }
            match error {
                None => reply.written(length),
                Some(error) => {
                    state.shadows.failed(handle.inode());
                    reply.error(errno(&error))
                }
            }
        });
    }

    /// The times a writeback mount's kernel sends for a file right after an unlink of it
    /// (inside the unlink: it writes the new change time at once), while that unlink,
    /// answered ahead, is on its way: answered from the attributes kept for the file (one
    /// link fewer, not cached), and sent once the unlink has landed, instead of holding
    /// the unlinking program until it has (the meta server sets the change time at the
    /// unlink itself). Returns the reply if it is not such a case.
    fn times_of_unlinked(
        &self,
        inode: InodeId,
        modify_time: Option<TimeOrNow>,
        change_time: Option<std::time::SystemTime>,
        reply: ReplyAttr,
    ) -> Option<ReplyAttr> {
        let client = &self.state.client;
        if !self.state.writeback || !client.ahead_unlinking(inode) {
            return Some(reply);
        }
        let Some(mut attr) = client.kept_attributes(inode) else {
            return Some(reply);
        };
        attr.link_count = attr.link_count.saturating_sub(1);
        let modify_time = modify_time.map(convert::time_or_now);
        if let Some(time) = modify_time {
            attr.modify_time = time;
        }
        if let Some(time) = change_time {
            attr.change_time = convert::time_spec(time);
        }
        self.state.reply_attr(reply, &attr, &Lease::default());
        // Only the modify time is the kernel's news: the change time is the unlink's.
        if let Some(modify_time) = modify_time {
            // A task like any request's (within `REQUESTS_IN_FLIGHT_MAX`).
            let client = client.clone();
            self.spawn(async move {
                client.settle_ahead(&[inode]).await;
                let changes = SetAttr {
                    modify_time: Some(modify_time),
                    ..SetAttr::default()
                };
                // Gone with its last name, or linked elsewhere: either way nothing waits.
                if let Err(error) = client.setattr_leased(inode, changes, None).await {
                    tracing::debug!(inode, %error, "times of a file unlinked here not set");
                }
            });
        }
        None
    }

    /// The client acting for the process that made `request`.
    fn caller(&self, request: &Caller) -> Client {
        let caller = self
            .state
            .groups
            .caller(request.uid, request.gid, request.pid);
        self.state.client.with_caller(caller)
    }
}

fn rename_mode(flags: RenameFlags) -> Result<RenameMode, Errno> {
    if flags.is_empty() {
        Ok(RenameMode::Replace)
    } else if flags == RenameFlags::RENAME_NOREPLACE {
        Ok(RenameMode::NoReplace)
    } else if flags == RenameFlags::RENAME_EXCHANGE {
        Ok(RenameMode::Exchange)
    } else {
        Err(Errno::EINVAL)
    }
}

fn kind_of_mode(mode: u32) -> Option<FileKind> {
    FileKind::from_mode(mode)
}

/// Clear setuid, and setgid when group-executable, as a write by an unprivileged caller
/// does on Linux.
async fn kill_set_id_bits(client: &Client, inode: u64) -> Result<(), freeflow_client::ClientError> {
    let attr = client.getattr(inode).await?;
    let mut permissions = attr.permissions & !0o4000;
    if permissions & 0o010 != 0 {
        permissions &= !0o2000;
    }
    if permissions != attr.permissions {
        let changes = freeflow_client::SetAttr {
            permissions: Some(permissions),
            ..Default::default()
        };
        client.setattr(inode, changes).await?;
    }
    Ok(())
}

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

/// How far [`fill_names`] got.
enum Filled {
    /// The reply holds what it can (full, or the listing ended): send it.
    Answered,
    /// Entry `at` must be fetched first.
    Fetch(usize),
}

/// Entries of a listing from which a closed directory's listing is freed on a runtime
/// thread, not on the thread that answered the close.
const LISTING_FREED_ASIDE_MIN: usize = 1024;

/// One entry of a `READDIRPLUS` reply, as the mount gathered it. Held unboxed: a reply's
/// entries live only while it is written, and a box would cost an allocation each.
#[allow(clippy::large_enum_variant)]
enum PlusEntry {
    /// The kernel holds the name and the file's attributes with time to run: the name
    /// alone goes (see `KernelCache::kernel_holds`).
    Held {
        name: String,
        inode: InodeId,
        kind: FileKind,
    },
    /// With its attributes and the leases of both.
    Full {
        name: String,
        attr: Attr,
        names_lease: Lease,
        attr_lease: Lease,
    },
    /// Its attributes are to be asked for.
    Ask {
        name: String,
        inode: InodeId,
        names_lease: Lease,
    },
}

/// Add the names of `listing` to a `READDIR` reply from `index` on (it moves along), while
/// they are fetched. Reaching the end of the listing at the first entry asked for (the
/// kernel's last call) notes that the kernel read the whole listing.
fn fill_names(
    state: &MountState,
    listing: &DirectoryListing,
    inode: INodeNo,
    offset: u64,
    index: &mut u64,
    reply: &mut ReplyDirectory,
) -> Filled {
    loop {
        let full = match *index {
            0 => reply.add(inode, 1, FileType::Directory, "."),
            1 => reply.add(inode, 2, FileType::Directory, ".."),
            _ => {
                let at = (*index - 2) as usize;
                match listing.known(at) {
                    Some(true) => {}
                    Some(false) => {
                        if *index == offset {
                            // Nothing more: the kernel now holds the whole listing.
                            let _admission = state.listing_read(listing);
                        }
                        return Filled::Answered;
                    }
                    None => return Filled::Fetch(at),
                }
                let entry = &listing.entries[at];
                reply.add(
                    INodeNo(entry.inode),
                    *index + 1,
                    convert::file_type(entry.kind),
                    &entry.name,
                )
            }
        };
        if full {
            return Filled::Answered;
        }
        *index += 1;
    }
}

/// Whether open flags give write access (the kernel has checked the caller's right to it).
fn writes(flags: i32) -> bool {
    flags & libc::O_ACCMODE != libc::O_RDONLY
}

/// Whether open flags give read access.
fn reads(flags: i32) -> bool {
    flags & libc::O_ACCMODE != libc::O_WRONLY
}

/// Set in the file handle number of an open answered past the kernel's page cache (the
/// rest is the inode): a program may switch `O_DIRECT` on or off with `fcntl` later, and
/// the kernel sends the flags of that moment with each write and the release, but the
/// answer stays; writes and the release go by this bit.
const PAST_CACHE: u64 = 1 << 63;

/// The file handle number of an open of `inode` answered with `answer`.
fn open_handle(inode: InodeId, answer: FopenFlags) -> FileHandle {
    let past_cache = answer.contains(FopenFlags::FOPEN_DIRECT_IO);
    FileHandle(inode | if past_cache { PAST_CACHE } else { 0 })
}

/// Whether an open with `flags` answered with the handle `handle` reads through the
/// kernel's page cache (it may then keep pages of the file).
fn reads_pages(handle: FileHandle, flags: i32) -> bool {
    reads(flags) && handle.0 & PAST_CACHE == 0
}

/// What an open of a regular file with `flags` is answered with. Without the writeback
/// cache, an open for writing only goes past the kernel's page cache (`FOPEN_DIRECT_IO`):
/// its writes were sent through at once anyway (write-through), the copy into the page
/// cache bought nothing (every open drops the file's pages, and such an open can neither
/// read nor map the file), and the kernel then hands the writer's own pages to the mount.
/// So does an `O_DIRECT` open, which asked for no cache, where the kernel lets such opens
/// be mapped shared (`FUSE_DIRECT_IO_ALLOW_MMAP`, `direct_mmap`: it then caches the file
/// for the mapping; an older kernel refuses the mapping, so there `O_DIRECT` opens that
/// can read take the page cache's direct path as before). Their
/// writes may run at once (`FOPEN_PARALLEL_DIRECT_WRITES`): the kernel takes its lock of
/// the file shared for them, not exclusive (still exclusive for an append, a write past
/// its size, or while the file is mapped), as the mount takes writes of one file in any
/// order; without it, every writer of a file waited for the one before, whatever the
/// ranges. With the writeback cache the kernel's pages are what gathers small writes.
fn open_reply_flags(state: &MountState, flags: i32) -> FopenFlags {
    let write_only = flags & libc::O_ACCMODE == libc::O_WRONLY;
    let direct = flags & libc::O_DIRECT != 0 && state.direct_mmap.load(Ordering::Relaxed);
    if !state.writeback && (write_only || direct) {
        FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES
    } else {
        FopenFlags::empty()
    }
}

/// An error for a file handle the mount does not know.
fn bad_handle() -> Errno {
    Errno::EBADF
}

/// The handlers, one per kernel operation, with the operation's arguments as the kernel
/// gives them (hence their many parameters); `dev.rs` and `ring/dispatch.rs` call them.
#[allow(clippy::too_many_arguments)]
impl FreeflowFs {
    /// What the mount asks of the kernel at INIT (fuser answers it on `/dev/fuse`).
    pub(crate) fn init_kernel(&mut self, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(nearest) = config.set_max_write(MAX_WRITE_BYTES) {
            let _ = config.set_max_write(nearest);
        }
        if let Err(nearest) = config.set_max_readahead(MAX_READAHEAD_BYTES) {
            let _ = config.set_max_readahead(nearest);
        }
        let _ = config.set_max_background(MAX_BACKGROUND_REQUESTS);
        let _ = config.set_congestion_threshold(MAX_BACKGROUND_REQUESTS * 3 / 4);
        // Each one alone, so a kernel without one still gets the others.
        for wanted in [
            InitFlags::FUSE_DO_READDIRPLUS,
            InitFlags::FUSE_READDIRPLUS_AUTO,
            InitFlags::FUSE_PARALLEL_DIROPS,
            InitFlags::FUSE_ATOMIC_O_TRUNC,
            InitFlags::FUSE_ASYNC_DIO,
            InitFlags::FUSE_MAX_PAGES,
            InitFlags::FUSE_BIG_WRITES,
            // We clear setuid/setgid ourselves (write flag below; the meta server on truncate
            // and chown). Without this the kernel asks for security.capability before every
            // write: one metadata round trip per write request.
            InitFlags::FUSE_HANDLE_KILLPRIV_V2,
            // Locks are the cluster's (held at the meta server), not this host's alone.
            InitFlags::FUSE_POSIX_LOCKS,
            InitFlags::FUSE_FLOCK_LOCKS,
        ] {
            if config.add_capabilities(wanted).is_err() {
                tracing::debug!(?wanted, "the kernel lacks a FUSE capability");
            }
        }
        // O_DIRECT opens go past the page cache only where they may still be mapped shared
        // (`open_reply_flags`).
        if self.state.ring_wanted {
            let granted = config
                .add_capabilities(InitFlags::FUSE_OVER_IO_URING)
                .is_ok();
            if !granted && self.state.ring_required {
                return Err(std::io::Error::other(format!(
                    "the kernel does not offer FUSE over io_uring: it needs Linux 6.14 or \
                     later with {} set to 1 (mount without --io-uring otherwise)",
                    crate::ring::ENABLE_PARAMETER
                )));
            }
            self.state.ring_granted.store(granted, Ordering::Relaxed);
        }
        let direct_mmap = config
            .add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP)
            .is_ok();
        self.state.direct_mmap.store(direct_mmap, Ordering::Relaxed);
        let data_cache = if self.state.writeback {
            // The kernel gathers writes in its page cache and owns sizes and times of the
            // files it holds; revocations write back and evict them (`cache.rs`). Not with
            // automatic invalidation: it compares the kernel's own modify time with the
            // meta server's and would write back and drop the pages at every attribute
            // fetch.
            InitFlags::FUSE_WRITEBACK_CACHE
        } else {
            // Pages are dropped when another client's change shows in the attributes.
            InitFlags::FUSE_AUTO_INVAL_DATA
        };
        if config.add_capabilities(data_cache).is_err() {
            if self.state.writeback {
                return Err(std::io::Error::other(
                    "the kernel does not offer FUSE's writeback cache: mount without --writeback",
                ));
            }
            tracing::debug!(wanted = ?data_cache, "the kernel lacks a FUSE capability");
        }
        Ok(())
    }

    pub(crate) fn lookup(
        &self,
        request: &Caller,
        parent: INodeNo,
        name: &OsStr,
        reply: ReplyEntry,
    ) {
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let Some(reply) = self.state.reply_if_known_missing(reply, parent.0, &name) else {
            return;
        };
        self.settle(&[parent.0]);
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client.lookup_entry(parent.0, &name).await {
                Ok((Some(attr), lease)) => {
                    // A writeback mount's kernel still holds a regular file whose release
                    // is not answered, with its own size: the reply would hand that inode
                    // out again (it ignores the size in it), and a program opening the file
                    // after another client grew and closed it would read it short. Once
                    // the release is answered the kernel lets go of it (its names were
                    // dropped at the revocation) and takes this reply's size.
                    if state.writeback && attr.kind == FileKind::Regular {
                        let wait = Duration::from_millis(RELEASE_WAIT_MS);
                        let _ =
                            tokio::time::timeout(wait, state.files.wait_released(attr.inode)).await;
                    }
                    state.reply_entry(reply, parent.0, &name, &attr, &lease)
                }
                Ok((None, lease)) => state.reply_missing(reply, parent.0, &name, &lease),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn forget_inode(&self, inode: INodeNo, count: u64) {
        self.state.forget(inode.0, count);
    }

    pub(crate) fn getattr(
        &self,
        _request: &Caller,
        inode: INodeNo,
        _handle: Option<FileHandle>,
        reply: ReplyAttr,
    ) {
        // The kernel holds the inode it asks about (`held.rs`).
        self.state.held.opened(inode.0);
        // A directory with creates answered ahead on their way (the kernel asks for it at
        // every create there, to check the creator's permissions: it drops the directory's
        // attributes after each change it makes there): answered from the attributes kept
        // under the lease, with the times of a change now, cached only for the checks of
        // one create or unlink, so that once they landed it is asked again. No other client
        // changes the directory meanwhile: it would recall the delegation first, and the
        // revocation drops the attributes from the kernel.
        let client = &self.state.client;
        if client.ahead_creating_in(inode.0) {
            if let Some(mut attr) = client.kept_attributes(inode.0) {
                let now = convert::time_spec(std::time::SystemTime::now());
                attr.modify_time = attr.modify_time.max(now);
                attr.change_time = attr.change_time.max(now);
                return reply.attr(&AHEAD_DIRECTORY_ATTR_TTL, &self.state.kernel_attr(&attr));
            }
        }
        self.settle(&[inode.0]);
        // Attributes kept from this mount's own changes: answered here, without a task
        // (a writeback mount's kernel asks again after every close of a file).
        if let Some((attr, lease)) = client.kept_attributes_leased(inode.0) {
            return self.state.reply_attr(reply, &attr, &lease);
        }
        let state = self.state.clone();
        self.spawn(async move {
            match state.client.getattr_leased(inode.0).await {
                Ok((attr, lease)) => state.reply_attr(reply, &attr, &lease),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn setattr(
        &self,
        request: &Caller,
        inode: INodeNo,
        mode: Option<u32>,
        user_id: Option<u32>,
        group_id: Option<u32>,
        size: Option<u64>,
        access_time: Option<TimeOrNow>,
        modify_time: Option<TimeOrNow>,
        change_time: Option<std::time::SystemTime>,
        handle: Option<FileHandle>,
        reply: ReplyAttr,
    ) {
        // A writeback mount's kernel keeps a file's times itself and sends them with the
        // change time: at a write-back of the file, or as the explicit times of a `touch`
        // (no "now" flag then). It checked the caller's right to either (default
        // permissions) before sending, so they are set as root: a writer who is not the
        // owner may set the times to now, which the meta server could not tell apart.
        self.state.held.opened(inode.0);
        let kernel_times = change_time.is_some()
            && mode.is_none()
            && user_id.is_none()
            && group_id.is_none()
            && size.is_none();
        let reply = if kernel_times {
            match self.times_of_unlinked(inode.0, modify_time, change_time, reply) {
                Some(reply) => reply,
                None => return,
            }
        } else {
            reply
        };
        self.settle(&[inode.0]);
        let changes = SetAttr {
            permissions: mode.map(|mode| mode & 0o7777),
            user_id,
            group_id,
            size_bytes: size,
            access_time: access_time.map(convert::time_or_now),
            // A writeback mount's kernel adds its own times to a size change; the meta
            // server sets them with the size anyway, and they would need the owner's right
            // where the descriptor's write access is enough (ftruncate).
            modify_time: modify_time
                .filter(|_| size.is_none() || change_time.is_none())
                .map(convert::time_or_now),
            change_time: None,
        };
        // A size change through a descriptor (ftruncate) is authorised by the descriptor,
        // which the kernel opened for writing, not by the mode bits (a file created with
        // mode 0 can be truncated through the descriptor that created it).
        let through = match (handle, size) {
            (Some(_), Some(_)) => self.state.files.get(inode.0),
            _ => None,
        };
        let client = if kernel_times {
            self.state.client.clone()
        } else {
            self.caller(request)
        };
        let state = self.state.clone();
        // The kernel holds this file's write-back until a truncation is answered.
        let truncating = size.map(|_| self.state.begin_truncation(inode.0));
        self.spawn(async move {
            let _truncating = truncating;
            if size.is_some() {
                state.files.wait_growth(inode.0).await;
            }
            let result = if changes == SetAttr::default() {
                client.getattr_leased(inode.0).await
            } else {
                let through = through.map(|open| open.handle_ref());
                client.setattr_leased(inode.0, changes, through).await
            };
            match result {
                Ok((attr, lease)) => {
                    if let Some(size) = size {
                        state.shadows.truncated(inode.0, size);
                        // The kernel takes the size of the reply.
                        state.held.size_is(inode.0, state.kernel_attr(&attr).size);
                    }
                    state.reply_attr(reply, &attr, &lease)
                }
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn readlink(&self, _request: &Caller, inode: INodeNo, reply: ReplyData) {
        self.state.cache.touched(inode.0);
        let state = self.state.clone();
        self.spawn(async move {
            match state.client.readlink(inode.0).await {
                Ok(target) => reply.data(target.as_bytes()),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn mknod(
        &self,
        request: &Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        device: u32,
        reply: ReplyEntry,
    ) {
        self.settle(&[parent.0]);
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        // The kernel applied the umask already (no FUSE_DONT_MASK).
        let Some(kind) = kind_of_mode(mode) else {
            return reply.error(Errno::EINVAL);
        };
        if kind == FileKind::Directory || kind == FileKind::Symlink {
            return reply.error(Errno::EINVAL);
        }
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            let created = client
                .create_leased(
                    parent.0,
                    &name,
                    kind,
                    mode & 0o7777,
                    u64::from(device),
                    true,
                )
                .await;
            match created {
                Ok((attr, lease)) => {
                    state.note_made(parent.0, &name, Some((attr.inode, attr.kind)), &lease, None);
                    state.reply_entry(reply, parent.0, &name, &attr, &lease)
                }
                Err(error) => {
                    state.note_unsure(&[parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn mkdir(
        &self,
        request: &Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        self.settle(&[parent.0]);
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client.mkdir_leased(parent.0, &name, mode & 0o7777).await {
                Ok((attr, lease)) => {
                    state.note_made(
                        parent.0,
                        &name,
                        Some((attr.inode, attr.kind)),
                        &lease,
                        Some(&attr),
                    );
                    state.reply_entry(reply, parent.0, &name, &attr, &lease)
                }
                Err(error) => {
                    state.note_unsure(&[parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn unlink(
        &self,
        request: &Caller,
        parent: INodeNo,
        name: &OsStr,
        reply: ReplyEmpty,
    ) {
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let Some(reply) = self.unlink_ahead(request, parent.0, &name, reply) else {
            return;
        };
        self.settle(&[parent.0]);
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client.unlink(parent.0, &name).await {
                Ok(()) => {
                    state.note_removed(parent.0, &name);
                    reply.ok()
                }
                Err(error) => {
                    state.note_unsure(&[parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn rmdir(&self, request: &Caller, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.settle(&[0]);
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client.rmdir(parent.0, &name).await {
                Ok(()) => {
                    state.note_removed(parent.0, &name);
                    reply.ok()
                }
                Err(error) => {
                    state.note_unsure(&[parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn symlink(
        &self,
        request: &Caller,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        self.settle(&[parent.0]);
        let (name, target) = match (convert::name(link_name), target.to_str()) {
            (Ok(name), Some(target)) => (name.to_owned(), target.to_owned()),
            _ => return reply.error(Errno::EINVAL),
        };
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client.symlink_leased(parent.0, &name, &target).await {
                Ok((attr, lease)) => {
                    state.note_made(parent.0, &name, Some((attr.inode, attr.kind)), &lease, None);
                    state.reply_entry(reply, parent.0, &name, &attr, &lease)
                }
                Err(error) => {
                    state.note_unsure(&[parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn rename(
        &self,
        request: &Caller,
        parent: INodeNo,
        name: &OsStr,
        new_parent: INodeNo,
        new_name: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        self.settle(&[0]);
        let (source, target) = match (convert::name(name), convert::name(new_name)) {
            (Ok(source), Ok(target)) => (source.to_owned(), target.to_owned()),
            _ => return reply.error(Errno::EINVAL),
        };
        let mode = match rename_mode(flags) {
            Ok(mode) => mode,
            Err(error) => return reply.error(error),
        };
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client
                .rename(parent.0, &source, new_parent.0, &target, mode)
                .await
            {
                Ok(()) => {
                    state.cache.admit().listing_renamed(
                        parent.0,
                        &source,
                        new_parent.0,
                        &target,
                        mode == RenameMode::Exchange,
                    );
                    state.directories.changed(&[parent.0, new_parent.0]);
                    reply.ok();
                    // The kernel moved its entry to the new name with the time-out it had
                    // under the old one, a lease on the old directory's names: another
                    // client's later change of the new directory might not revoke it here
                    // (a directory left linked at a name it was moved from makes the
                    // kernel refuse a lookup of its new place with ESTALE while a rename
                    // runs). So the moved names are dropped and looked up again, under a
                    // lease of their own; a writeback mount also knows its files by the
                    // names it handed out (`Index::held`).
                    state.evict_names(new_parent.0, vec![target.clone()]);
                    if mode == RenameMode::Exchange {
                        state.evict_names(parent.0, vec![source.clone()]);
                    }
                }
                Err(error) => {
                    state.note_unsure(&[parent.0, new_parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn link(
        &self,
        request: &Caller,
        inode: INodeNo,
        new_parent: INodeNo,
        new_name: &OsStr,
        reply: ReplyEntry,
    ) {
        self.settle(&[inode.0, new_parent.0]);
        // The kernel holds the inode it links: the reply does not make it.
        self.state.held.opened(inode.0);
        let name = match convert::name(new_name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match client.link_leased(inode.0, new_parent.0, &name).await {
                Ok((attr, lease)) => {
                    state.note_made(
                        new_parent.0,
                        &name,
                        Some((attr.inode, attr.kind)),
                        &lease,
                        None,
                    );
                    state.reply_entry(reply, new_parent.0, &name, &attr, &lease)
                }
                Err(error) => {
                    state.note_unsure(&[new_parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn open(
        &self,
        request: &Caller,
        inode: INodeNo,
        flags: OpenFlags,
        reply: ReplyOpen,
    ) {
        self.settle(&[inode.0]);
        // The kernel holds the inode now, with the size the reply that made it gave.
        self.state.held.opened(inode.0);
        let truncate = flags.0 & libc::O_TRUNC != 0;
        if truncate {
            // The kernel drops the size and times it holds at a truncating open.
            self.state.cache.touched(inode.0);
        }
        let (client, state) = (self.caller(request), self.state.clone());
        let truncating = truncate.then(|| self.state.begin_truncation(inode.0));
        self.spawn(async move {
            let _truncating = truncating;
            let handle = match state.files.acquire(&state.client, inode.0).await {
                Ok(handle) => handle,
                Err(error) => return reply.error(errno(&error)),
            };
            if truncate {
                state.files.wait_growth(inode.0).await;
                // FUSE_ATOMIC_O_TRUNC: the truncate comes with the open, which the kernel
                // has checked for write access: authorised by the handle.
                let changes = SetAttr {
                    size_bytes: Some(0),
                    ..SetAttr::default()
                };
                let through = Some(handle.handle_ref());
                if let Err(error) = client.setattr_through(inode.0, changes, through).await {
                    let _ = state.files.release(inode.0, || {}).await;
                    return reply.error(errno(&error));
                }
                state.shadows.truncated(inode.0, 0);
                state.held.size_is(inode.0, 0);
            }
            if writes(flags.0) {
                // The size read under the count (after any growth under way ended).
                state
                    .files
                    .opened_for_writing(inode.0, || {
                        let from = state.held.writing_from(inode.0, handle.size());
                        state.shadows.begin(inode.0, from)
                    })
                    .await;
            }
            let answer = open_reply_flags(&state, flags.0);
            if reads_pages(open_handle(inode.0, answer), flags.0) {
                state.files.opened_for_reading(inode.0);
            }
            // No FOPEN_KEEP_CACHE: the kernel drops the file's pages at every open, which
            // the writeback mount's shadows count on (`shadow.rs`).
            reply.opened(open_handle(handle.inode(), answer), answer);
        });
    }

    pub(crate) fn read(
        &self,
        _request: &Caller,
        inode: INodeNo,
        _handle: FileHandle,
        offset: u64,
        size: u32,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.settle(&[inode.0]);
        let Some((handle, reads)) = self.state.files.get_for_reading(inode.0) else {
            return reply.error(bad_handle());
        };
        let writeback = self.state.writeback;
        // A read into the kernel's pages (not a direct one) of a file open for writing
        // here is copied (`shadow.rs`), unless the file changed otherwise meanwhile.
        let copy = (writeback && flags.0 & libc::O_DIRECT == 0)
            .then(|| (self.state.clone(), self.state.shadows.reading(inode.0)));
        self.answer_read(size, async move {
            // A writeback mount's growth of a held-open file waits for the reads already
            // answering (their pages may end at the size the handle knew before it).
            let _reading = if writeback {
                Some(reads.read().await)
            } else {
                None
            };
            match handle.read_at(offset, u64::from(size)).await {
                Ok(data) => {
                    // Copied before the kernel has the page and can change it.
                    if let Some((state, start)) = &copy {
                        let size = u64::from(size);
                        state.shadows.read(inode.0, *start, offset, size, &data);
                    }
                    reply.data(&data)
                }
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn write(
        &self,
        _request: &Caller,
        inode: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        self.settle(&[inode.0]);
        let Some(handle) = self.state.files.get_for_writing(inode.0) else {
            return reply.error(bad_handle());
        };
        // The kernel asks us to drop setuid/setgid (a write by a caller without CAP_FSETID
        // to such a file): do it before the data lands, as a local file system would. The
        // kernel has made the decision, so it is carried out as root: a writer who is not
        // the owner could not chmod the file itself.
        let kill_privileges = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        let direct = !write_flags.contains(WriteFlags::FUSE_WRITE_CACHE);
        // A write through an open answered past the page cache (`open_reply_flags`): the
        // kernel dropped its pages of the range before sending it, but a read by another
        // descriptor here may have brought the old bytes back before the write reached
        // the handle. While the file is open for reading here they are dropped again once
        // it has (reads reaching the handle after that are ordered after the write).
        let past_cache = fh.0 & PAST_CACHE != 0;
        // The request buffer is reused for the next request: the data is copied out of it
        // once, here or below.
        let mut copied = None;
        if self.state.writeback {
            if direct {
                self.state
                    .shadows
                    .written_directly(inode.0, offset, data.len() as u64);
            } else {
                // A write-back never passes the size the kernel keeps.
                let end = offset + data.len() as u64;
                self.state.held.grown_to(inode.0, end);
                // Pages from the kernel's cache: only what changed here goes, and the
                // shadows keep views of the copy that is sent (`shadow.rs`).
                let bytes = Bytes::copy_from_slice(data);
                let (spans, grow) = self.state.shadows.write_back(inode.0, offset, &bytes);
                let whole = spans.len() == 1 && spans[0] == (0..data.len());
                if !whole {
                    let sent = Spans { spans, grow };
                    return self.write_spans(handle, offset, bytes, sent, kill_privileges, reply);
                }
                copied = Some(bytes);
            }
        }
        if !kill_privileges {
            // A small write that joins those gathered is answered here, on the session
            // thread, without a task or a request of its own.
            // In the runtime's context: the gathered bytes, once full, go on a task.
            let gathered = {
                let _runtime = self.state.runtime.enter();
                handle.write_gathered(offset, data)
            };
            match gathered {
                // Gathered writes are shorter than GATHER_WRITE_MAX: the length fits.
                Ok(true) => {
                    if direct {
                        let end = offset + data.len() as u64;
                        self.state.grown_here(inode.0, end);
                    }
                    if past_cache && self.state.files.is_read(inode.0) {
                        let (state, length) = (self.state.clone(), data.len() as u64);
                        self.spawn(async move {
                            state.drop_pages(inode.0, offset, length).await;
                            reply.written(length as u32)
                        });
                        return;
                    }
                    return reply.written(data.len() as u32);
                }
                Ok(false) => {}
                Err(error) => {
                    self.state.shadows.failed(inode.0);
                    return reply.error(errno(&error));
                }
            }
        }
        let privileged_client = kill_privileges.then(|| {
            self.state
                .client
                .with_caller(freeflow_client::Caller::root())
        });
        // Straight into the memory shared with the I/O servers on this host, where it
        // can be: the request then refers to it without another copy.
        let data = copied.unwrap_or_else(|| self.state.client.payload(data));
        let Ok(length) = u32::try_from(data.len()) else {
            return reply.error(Errno::EINVAL);
        };
        let state = self.state.clone();
        self.spawn(async move {
            if let Some(client) = privileged_client {
                if let Err(error) = kill_set_id_bits(&client, inode.0).await {
                    // The copies took bytes that were not sent.
                    state.shadows.failed(inode.0);
                    return reply.error(errno(&error));
                }
            }
            match handle.write_at(offset, data).await {
                Ok(()) => {
                    if direct {
                        let end = offset + u64::from(length);
                        state.grown_here(inode.0, end);
                    }
                    if past_cache && state.files.is_read(inode.0) {
                        state.drop_pages(inode.0, offset, u64::from(length)).await;
                    }
                    reply.written(length)
                }
                Err(error) => {
                    state.shadows.failed(inode.0);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn flush(
        &self,
        _request: &Caller,
        inode: INodeNo,
        _handle: FileHandle,
        lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let handle = self.state.files.get(inode.0);
        let (state, sync) = (self.state.clone(), self.state.sync_on_close);
        // Nothing to release or flush (a file closed unwritten): answered here, without a
        // task.
        if !sync
            && !state.client.owner_holds_locks(inode.0, lock_owner.0)
            && handle.as_ref().is_none_or(|handle| handle.flush_is_empty())
        {
            return reply.ok();
        }
        self.spawn(async move {
            // A close releases the POSIX locks its process holds on the file (the kernel
            // leaves that to file systems with their own locks).
            if let Err(error) = state
                .client
                .release_owner_locks(inode.0, lock_owner.0)
                .await
            {
                tracing::warn!(inode = inode.0, %error, "releasing a record lock at close failed");
            }
            let Some(handle) = handle else {
                return reply.ok();
            };
            let result = if sync {
                handle.fsync().await
            } else {
                handle.flush().await
            };
            match result {
                Ok(()) => reply.ok(),
                Err(error) => {
                    // Gathered writes fail here: the copies may claim what never landed.
                    state.shadows.failed(inode.0);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn release(
        &self,
        _request: &Caller,
        inode: INodeNo,
        fh: FileHandle,
        flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // Until the answer, the kernel holds the inode with the size it keeps of it on a
        // writeback mount: a lookup meanwhile would hand that inode out again, whatever
        // size another client has given the file since (see `lookup`). Noted first, before
        // anything slow here: a lookup read after this release may be answered on another
        // thread meanwhile.
        let answered = self.state.writeback.then(|| {
            self.state.files.release_began(inode.0);
            ReleaseAnswered {
                state: self.state.clone(),
                inode: inode.0,
            }
        });
        // Read or written while open: the kernel may have dropped some of its attributes.
        if self.state.files.take_accessed(inode.0) {
            self.state.cache.touched(inode.0);
        }
        if writes(flags.0) {
            let state = &self.state;
            let mut last = false;
            state.files.closed_for_writing(inode.0, || {
                state.shadows.end(inode.0);
                last = true;
            });
            if reads_pages(fh, flags.0) {
                state.files.closed_for_reading(inode.0);
            }
            if last {
                state.after_last_write_close(inode.0);
            }
        } else if reads_pages(fh, flags.0) {
            self.state.files.closed_for_reading(inode.0);
        }
        let state = self.state.clone();
        self.spawn(async move {
            // Dropped at the end, once the reply is written.
            let _answered = answered;
            // A file created ahead of the meta server is released once it is there.
            state.client.settle_ahead(&[inode.0]).await;
            // The last close of a file that held `flock` locks: they go with it.
            if let Some(owner) = lock_owner {
                if let Err(error) = state.client.release_owner_locks(inode.0, owner.0).await {
                    tracing::warn!(inode = inode.0, %error, "releasing a flock lock failed");
                }
            }
            // At the last close here, OFD locks (which the kernel does not announce at
            // close) belong to nothing open any more: their owners are taken at that
            // moment, so a file opened again meanwhile keeps its own locks.
            let mut owners = Vec::new();
            let released = state
                .files
                .release(inode.0, || {
                    owners = state.client.take_inode_lock_owners(inode.0)
                })
                .await;
            if let Err(error) = state.client.release_locks_of(inode.0, &owners).await {
                tracing::warn!(inode = inode.0, %error, "releasing locks at close failed");
            }
            match released {
                Ok(()) => reply.ok(),
                Err(error) => {
                    // close(2) has returned already; the error can only be logged.
                    tracing::warn!(inode = inode.0, %error, "closing a file failed");
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn getlk(
        &self,
        _request: &Caller,
        inode: INodeNo,
        _handle: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        kind: i32,
        _pid: u32,
        reply: ReplyLock,
    ) {
        self.settle(&[inode.0]);
        let kind = match lock_kind(kind) {
            Ok(Some(kind)) => kind,
            Ok(None) => return reply.error(Errno::EINVAL),
            Err(error) => return reply.error(error),
        };
        let state = self.state.clone();
        self.spawn(async move {
            let end = lock_end_from_kernel(end);
            match state
                .client
                .get_lock(inode.0, lock_owner.0, kind, start, end)
                .await
            {
                Ok(Some(found)) => {
                    let kind = match found.kind {
                        LockKind::Read => libc::F_RDLCK,
                        LockKind::Write => libc::F_WRLCK,
                    };
                    reply.locked(found.start, lock_end_to_kernel(found.end), kind, found.pid)
                }
                Ok(None) => reply.locked(start, lock_end_to_kernel(end), libc::F_UNLCK, 0),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn setlk(
        &self,
        request: &Caller,
        inode: INodeNo,
        _handle: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        kind: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        self.settle(&[inode.0]);
        let kind = match lock_kind(kind) {
            Ok(kind) => kind,
            Err(error) => return reply.error(error),
        };
        let spec = LockSpec {
            owner: lock_owner.0,
            pid,
            kind,
            start,
            end: lock_end_from_kernel(end),
        };
        let state = self.state.clone();
        let tid = request.pid;
        let task = async move {
            let set = if sleep {
                // A waiter whose thread has a signal to take gives up (the kernel's
                // INTERRUPT never reaches this mount: fuser answers it itself): EINTR,
                // which the kernel turns into a restart or an error as the program's
                // handler asks, as for a local lock.
                let interrupted = move || crate::caller::signal_waits(tid);
                state
                    .client
                    .set_lock_unless(inode.0, spec, &interrupted)
                    .await
            } else {
                state
                    .client
                    .set_lock(inode.0, spec, false)
                    .await
                    .map(|()| true)
            };
            match set {
                Ok(true) => reply.ok(),
                Ok(false) => reply.error(Errno::EINTR),
                Err(error) => reply.error(errno(&error)),
            }
        };
        if sleep {
            // A waiter waits for another process, not for this mount's work: outside the
            // bound of requests in flight, which 1,024 waiters would otherwise fill and
            // so hold up the holder's unlock. (The kernel's ring entries and the meta
            // server's long-poll slots bound waiters instead.)
            self.state.runtime.spawn(task);
        } else {
            self.spawn(task);
        }
    }

    pub(crate) fn fsync(
        &self,
        _request: &Caller,
        inode: INodeNo,
        _handle: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.settle(&[inode.0]);
        let Some(handle) = self.state.files.get(inode.0) else {
            return reply.error(bad_handle());
        };
        let state = self.state.clone();
        self.spawn(async move {
            match handle.fsync().await {
                Ok(()) => reply.ok(),
                Err(error) => {
                    // Gathered writes fail here: the copies may claim what never landed.
                    state.shadows.failed(inode.0);
                    reply.error(errno(&error))
                }
            }
        });
    }

    pub(crate) fn opendir(
        &self,
        _request: &Caller,
        inode: INodeNo,
        _flags: OpenFlags,
        reply: ReplyOpen,
    ) {
        self.settle(&[inode.0]);
        // The kernel caches what it reads of a listing (`FOPEN_CACHE_DIR`) and keeps it at
        // this open only while the leases it was read under hold (else it drops it here);
        // its own changes of the directory make it read the listing again. Without the
        // lease cache (`--no-cache`) nothing would take a cached listing back.
        let mut admission = self.state.cache.admit();
        // Listed, the directory's access time goes from the kernel.
        admission.touched(inode.0);
        let client = &self.state.client;
        let mut flags = FopenFlags::empty();
        if self.state.cache.enabled() {
            flags |= FopenFlags::FOPEN_CACHE_DIR;
            if admission
                .kernel_listing_good(inode.0, |lease| client.kernel_time_out(lease, &[inode.0]))
            {
                flags |= FopenFlags::FOPEN_KEEP_CACHE;
            }
        }
        let kept = flags.contains(FopenFlags::FOPEN_KEEP_CACHE);
        match self.state.directories.open(inode.0, kept) {
            Some(handle) => reply.opened(FileHandle(handle), flags),
            None => reply.error(Errno::EMFILE),
        }
        drop(admission);
    }

    pub(crate) fn readdir(
        &self,
        request: &Caller,
        inode: INodeNo,
        handle: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        self.settle(&[inode.0]);
        let Some(listing) = self.state.directories.get(handle.0) else {
            return reply.error(bad_handle());
        };
        // What is fetched already (the last, empty call of every listing; a listing this
        // mount knows) is answered here, on the session thread, without a task.
        if let Ok(mut known) = listing.try_lock() {
            known.follow_changes(offset.saturating_sub(2) as usize);
            self.state.take_known_listing(&mut known);
            let first = offset.saturating_sub(2) as usize;
            if known.known(first).is_some() {
                let mut index = offset;
                fill_names(&self.state, &known, inode, offset, &mut index, &mut reply);
                return reply.ok();
            }
        }
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            let mut listing = listing.lock().await;
            listing.follow_changes(offset.saturating_sub(2) as usize);
            state.take_known_listing(&mut listing);
            let mut index = offset;
            loop {
                match fill_names(&state, &listing, inode, offset, &mut index, &mut reply) {
                    Filled::Answered => return reply.ok(),
                    Filled::Fetch(at) => {
                        if let Err(error) = listing.ensure(&client, at, false).await {
                            return reply.error(errno(&error));
                        }
                    }
                }
            }
        });
    }

    pub(crate) fn readdirplus(
        &self,
        request: &Caller,
        inode: INodeNo,
        handle: FileHandle,
        offset: u64,
        reply: ReplyDirectoryPlus,
    ) {
        self.settle(&[inode.0]);
        let Some(listing) = self.state.directories.get(handle.0) else {
            return reply.error(bad_handle());
        };
        // Entries fetched already whose attributes this mount holds (a listing it knows,
        // the last call of every listing) are answered here, without a task.
        if let Ok(mut known) = listing.try_lock() {
            known.follow_changes(offset.saturating_sub(2) as usize);
            self.state.take_known_listing(&mut known);
            let directory = if offset < 2 {
                self.state
                    .client
                    .kept_attributes_leased(inode.0)
                    .map(|(attr, _)| self.state.kernel_attr(&attr))
            } else {
                None
            };
            if offset >= 2 || directory.is_some() {
                let first = offset.saturating_sub(2) as usize;
                let names_alone = reply.takes_names_alone();
                if let Some(found) = self.state.known_entries_plus(&known, first, names_alone) {
                    return self
                        .state
                        .answer_plus(&known, inode, offset, directory, found, reply);
                }
            }
        }
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            let mut listing = listing.lock().await;
            listing.follow_changes(offset.saturating_sub(2) as usize);
            state.take_known_listing(&mut listing);
            // "." and ".." need attributes too (the kernel ignores them): leased ones do.
            let directory = if offset < 2 {
                match state.client.getattr_leased(inode.0).await {
                    Ok((attr, _)) => Some(state.kernel_attr(&attr)),
                    Err(error) => return reply.error(errno(&error)),
                }
            } else {
                None
            };
            // First what the reply may hold, fetched; then, with revocations held off
            // (see `Admission`), the time-outs and the reply itself.
            let first = offset.saturating_sub(2) as usize;
            let mut end = first;
            while end < first + READDIRPLUS_GATHER_MAX {
                match listing.ensure(&client, end, true).await {
                    Ok(true) => end += 1,
                    Ok(false) => break,
                    Err(error) => return reply.error(errno(&error)),
                }
            }
            // Entries without attributes (a listing this mount took from what it knows):
            // those kept under good leases at once, the others asked.
            let names_alone = reply.takes_names_alone();
            let entries = state.entries_with_attributes(&listing, first, end, names_alone);
            let mut found = Vec::with_capacity(entries.len());
            for entry in entries {
                found.push(match entry {
                    PlusEntry::Ask {
                        name,
                        inode,
                        names_lease,
                    } => match state.client.getattr_leased(inode).await {
                        Ok((attr, attr_lease)) => PlusEntry::Full {
                            name,
                            attr,
                            names_lease,
                            attr_lease,
                        },
                        Err(error) => return reply.error(errno(&error)),
                    },
                    known => known,
                });
            }
            state.answer_plus(&listing, inode, offset, directory, found, reply);
        });
    }

    pub(crate) fn releasedir(
        &self,
        _request: &Caller,
        _inode: INodeNo,
        handle: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        let listing = self.state.directories.close(handle.0);
        reply.ok();
        // A large listing is freed on a runtime thread: on a ring's queue thread it would
        // hold up the reply, committed at the thread's next turn.
        if let Some(listing) = listing {
            let large = listing
                .try_lock()
                .is_ok_and(|listing| listing.entries.len() >= LISTING_FREED_ASIDE_MIN);
            if large {
                self.spawn(async move { drop(listing) });
            }
        }
    }

    pub(crate) fn fsyncdir(
        &self,
        _request: &Caller,
        _inode: INodeNo,
        _handle: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.settle(&[0]);
        // Namespace changes are answered before they are durable: make them durable now.
        let state = self.state.clone();
        self.spawn(async move {
            match state.client.sync().await {
                Ok(()) => reply.ok(),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn statfs(&self, _request: &Caller, _inode: INodeNo, reply: ReplyStatfs) {
        let state = self.state.clone();
        self.spawn(async move {
            match state.client.statfs().await {
                Ok(stats) => {
                    let block = u64::from(STATFS_BLOCK_BYTES);
                    reply.statfs(
                        stats.capacity_bytes / block,
                        stats.free_bytes / block,
                        stats.free_bytes / block,
                        stats.inode_count.saturating_add(STATFS_FREE_INODES),
                        STATFS_FREE_INODES,
                        STATFS_BLOCK_BYTES,
                        freeflow_types::limits::NAME_LENGTH_MAX as u32,
                        STATFS_BLOCK_BYTES,
                    )
                }
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn setxattr(
        &self,
        request: &Caller,
        inode: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        self.settle(&[inode.0]);
        // The kernel drops the times (and, for an allocation, the size) it holds.
        self.state.cache.touched(inode.0);
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let mode = match flags {
            0 => XattrSetMode::Any,
            libc::XATTR_CREATE => XattrSetMode::CreateOnly,
            libc::XATTR_REPLACE => XattrSetMode::ReplaceOnly,
            _ => return reply.error(Errno::EINVAL),
        };
        let value = value.to_vec();
        let client = self.caller(request);
        self.spawn(async move {
            match client.set_xattr(inode.0, &name, &value, mode).await {
                Ok(()) => reply.ok(),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn getxattr(
        &self,
        request: &Caller,
        inode: INodeNo,
        name: &OsStr,
        size: u32,
        reply: ReplyXattr,
    ) {
        self.settle(&[inode.0]);
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let client = self.caller(request);
        self.spawn(async move {
            match client.get_xattr(inode.0, &name).await {
                Ok(value) => reply_xattr(reply, &value, size),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn listxattr(&self, request: &Caller, inode: INodeNo, size: u32, reply: ReplyXattr) {
        self.settle(&[inode.0]);
        let client = self.caller(request);
        self.spawn(async move {
            match client.list_xattr(inode.0).await {
                Ok(names) => {
                    let mut list = Vec::new();
                    for name in names {
                        list.extend_from_slice(name.as_bytes());
                        list.push(0);
                    }
                    reply_xattr(reply, &list, size)
                }
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn removexattr(
        &self,
        request: &Caller,
        inode: INodeNo,
        name: &OsStr,
        reply: ReplyEmpty,
    ) {
        self.settle(&[inode.0]);
        // The kernel drops the times (and, for an allocation, the size) it holds.
        self.state.cache.touched(inode.0);
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let client = self.caller(request);
        self.spawn(async move {
            match client.remove_xattr(inode.0, &name).await {
                Ok(()) => reply.ok(),
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn access(
        &self,
        _request: &Caller,
        _inode: INodeNo,
        _mask: AccessFlags,
        reply: ReplyEmpty,
    ) {
        // default_permissions: the kernel checks access itself and never asks.
        reply.ok();
    }

    pub(crate) fn create(
        &self,
        request: &Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let name = match convert::name(name) {
            Ok(name) => name.to_owned(),
            Err(error) => return reply.error(error),
        };
        let Some(reply) = self.create_ahead(request, parent.0, &name, mode, flags, reply) else {
            return;
        };
        self.settle(&[parent.0]);
        let exclusive = flags & libc::O_EXCL != 0;
        let truncate = flags & libc::O_TRUNC != 0;
        let (client, state) = (self.caller(request), self.state.clone());
        self.spawn(async move {
            match create_and_open(&state, &client, parent.0, &name, mode, exclusive, truncate).await
            {
                Ok((attr, lease)) => {
                    // Counted first: the shadows start from the size this reply gives if
                    // it makes the kernel's inode.
                    let kernel_attr = state.kernel_attr(&attr);
                    state.remember(attr.inode, regular_size(&kernel_attr));
                    if writes(flags) {
                        state
                            .files
                            .opened_for_writing(attr.inode, || {
                                let from = state.held.writing_from(attr.inode, attr.size_bytes);
                                state.shadows.begin(attr.inode, from)
                            })
                            .await;
                    }
                    let answer = open_reply_flags(&state, flags);
                    if reads_pages(open_handle(attr.inode, answer), flags) {
                        state.files.opened_for_reading(attr.inode);
                    }
                    state.note_made(parent.0, &name, Some((attr.inode, attr.kind)), &lease, None);
                    // One time-out covers both the entry and the attributes here: under a
                    // lease, what is left of it; without, the shorter of the two, so the
                    // new name is revalidated like any other (with the attribute
                    // time-out, another mount's later changes to this file would go
                    // unseen by an open through the cached name).
                    let mut admission = state.cache.admit();
                    let (entry_ttl, attr_ttl) = state.entry_time_outs(
                        &mut admission,
                        &lease,
                        parent.0,
                        &name,
                        Some(attr.inode),
                    );
                    admission.held_as(attr.inode, parent.0, &name);
                    reply.created(
                        &attr_ttl.min(entry_ttl),
                        &kernel_attr,
                        Generation(0),
                        open_handle(attr.inode, answer),
                        answer,
                    );
                    drop(admission);
                    let ttl = attr_ttl.min(entry_ttl);
                    state.evict_unleased(attr.kind, parent.0, &name, ttl);
                }
                Err(error) => {
                    state.note_unsure(&[parent.0]);
                    reply.error(errno(&error))
                }
            }
        });
    }

    /// No ioctl is supported: `ENOTTY`, as a local file system answers for a request it
    /// does not know (Python asks `TCGETS` at every `open()`, to see if it is a terminal).
    pub(crate) fn ioctl(
        &self,
        _request: &Caller,
        _inode: INodeNo,
        _handle: FileHandle,
        _flags: IoctlFlags,
        _command: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        reply.error(Errno::ENOTTY);
    }

    pub(crate) fn fallocate(
        &self,
        _request: &Caller,
        inode: INodeNo,
        _handle: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        self.settle(&[inode.0]);
        // The kernel drops the times (and, for an allocation, the size) it holds.
        self.state.cache.touched(inode.0);
        let how = match allocation_of_mode(mode) {
            Ok(how) => how,
            Err(error) => return reply.error(error),
        };
        let Some(handle) = self.state.files.get(inode.0) else {
            return reply.error(bad_handle());
        };
        // Its pages are the cluster's after it (the kernel drops them, `shadow.rs`).
        self.state.shadows.written_directly(inode.0, offset, length);
        let state = self.state.clone();
        self.spawn(async move {
            match handle.allocate(offset, length, how).await {
                Ok(()) => {
                    // The kernel raises its size to the end unless told to keep it (and
                    // the handle's size may hold other hosts' growth, which it has not).
                    if mode & libc::FALLOC_FL_KEEP_SIZE == 0 {
                        state.grown_here(inode.0, offset + length);
                    }
                    reply.ok()
                }
                Err(error) => reply.error(errno(&error)),
            }
        });
    }

    pub(crate) fn copy_file_range(
        &self,
        _request: &Caller,
        source_inode: INodeNo,
        _source_handle: FileHandle,
        source_offset: u64,
        target_inode: INodeNo,
        _target_handle: FileHandle,
        target_offset: u64,
        length: u64,
        flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        // The kernel drops the target's size and times it holds, and the source's access time.
        self.state.cache.touched(source_inode.0);
        self.state.cache.touched(target_inode.0);
        self.settle(&[source_inode.0, target_inode.0]);
        if !flags.is_empty() {
            return reply.error(Errno::EINVAL);
        }
        let (Some(source), Some(target)) = (
            self.state.files.get(source_inode.0),
            self.state.files.get(target_inode.0),
        ) else {
            return reply.error(bad_handle());
        };
        // The reply counts bytes in 32 bits.
        let length = length.min(u64::from(!0xfff_u32));
        self.state
            .shadows
            .written_directly(target_inode.0, target_offset, length);
        let state = self.state.clone();
        self.spawn(async move {
            match target
                .copy_range_from(&source, source_offset, target_offset, length)
                .await
            {
                // At most `length`, which fits u32.
                Ok(copied) => {
                    // The kernel raises its size to the copy's end (the handle's size may
                    // hold other hosts' growth, which it has not).
                    let end = target_offset + copied;
                    state.grown_here(target_inode.0, end);
                    reply.written(copied as u32)
                }
                Err(error) => reply.error(errno(&error)),
            }
        });
    }
}

/// The `fallocate(2)` modes the mount keeps, or `EOPNOTSUPP`.
fn allocation_of_mode(mode: i32) -> Result<Allocation, Errno> {
    const KEEP_SIZE: i32 = libc::FALLOC_FL_KEEP_SIZE;
    const PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE;
    const ZERO_RANGE: i32 = libc::FALLOC_FL_ZERO_RANGE;
    match mode {
        0 => Ok(Allocation::Allocate { keep_size: false }),
        KEEP_SIZE => Ok(Allocation::Allocate { keep_size: true }),
        mode if mode == PUNCH_HOLE | KEEP_SIZE => Ok(Allocation::PunchHole),
        // Linux refuses a hole punched without KEEP_SIZE.
        PUNCH_HOLE => Err(Errno::EOPNOTSUPP),
        ZERO_RANGE => Ok(Allocation::ZeroRange { keep_size: false }),
        mode if mode == ZERO_RANGE | KEEP_SIZE => Ok(Allocation::ZeroRange { keep_size: true }),
        _ => Err(Errno::EOPNOTSUPP),
    }
}

/// Reply to a getxattr or listxattr: the size for a size probe, ERANGE if the caller's
/// buffer is too small, else the bytes.
fn reply_xattr(reply: ReplyXattr, value: &[u8], size: u32) {
    let Ok(length) = u32::try_from(value.len()) else {
        return reply.error(Errno::E2BIG);
    };
    if size == 0 {
        reply.size(length)
    } else if length > size {
        reply.error(Errno::ERANGE)
    } else {
        reply.data(value)
    }
}

/// Create a file and open it for this mount. An existing file (when not `exclusive`) is
/// opened instead, truncated if asked: the kernel checks the caller's access to it after.
async fn create_and_open(
    state: &MountState,
    client: &Client,
    parent: InodeId,
    name: &str,
    mode: u32,
    exclusive: bool,
    truncate: bool,
) -> Result<(Attr, Lease), ClientError> {
    let access = freeflow_client::OpenAccess {
        read: true,
        write: true,
    };
    // Always exclusive at the server: an existing file is opened as root below, not with
    // the caller's read+write (the caller may have asked for less).
    match client
        .create_open_leased(parent, name, mode & 0o7777, true, access)
        .await
    {
        Ok((handle, _created, lease)) => {
            let handle = state.files.adopt(Arc::new(handle)).await?;
            Ok((handle.attr(), lease))
        }
        Err(error) if error.code() == ErrorCode::Exists && !exclusive => {
            let attr = client.lookup(parent, name).await?;
            if attr.kind == FileKind::Directory {
                return Err(ClientError::Inode {
                    inode: attr.inode,
                    code: ErrorCode::IsDirectory,
                    reason: format!("{name:?} is a directory"),
                });
            }
            let handle = state.files.acquire(&state.client, attr.inode).await?;
            if truncate {
                let _truncating = state.begin_truncation(attr.inode);
                state.files.wait_growth(attr.inode).await;
                let changes = SetAttr {
                    size_bytes: Some(0),
                    ..SetAttr::default()
                };
                let through = Some(handle.handle_ref());
                if let Err(error) = client.setattr_through(attr.inode, changes, through).await {
                    let _ = state.files.release(attr.inode, || {}).await;
                    return Err(error);
                }
                state.shadows.truncated(attr.inode, 0);
                state.held.size_is(attr.inode, 0);
            }
            Ok((handle.attr(), Lease::default()))
        }
        Err(error) => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_flags_map_to_modes() {
        assert_eq!(rename_mode(RenameFlags::empty()), Ok(RenameMode::Replace));
        assert_eq!(
            rename_mode(RenameFlags::RENAME_NOREPLACE),
            Ok(RenameMode::NoReplace)
        );
        assert_eq!(
            rename_mode(RenameFlags::RENAME_EXCHANGE),
            Ok(RenameMode::Exchange)
        );
        assert_eq!(
            rename_mode(RenameFlags::RENAME_WHITEOUT),
            Err(Errno::EINVAL)
        );
        assert_eq!(
            rename_mode(RenameFlags::RENAME_NOREPLACE | RenameFlags::RENAME_EXCHANGE),
            Err(Errno::EINVAL)
        );
    }

    #[test]
    fn fallocate_modes_map_to_allocations() {
        use libc::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE};
        assert_eq!(
            allocation_of_mode(0),
            Ok(Allocation::Allocate { keep_size: false })
        );
        assert_eq!(
            allocation_of_mode(FALLOC_FL_KEEP_SIZE),
            Ok(Allocation::Allocate { keep_size: true })
        );
        assert_eq!(
            allocation_of_mode(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE),
            Ok(Allocation::PunchHole)
        );
        assert_eq!(
            allocation_of_mode(FALLOC_FL_PUNCH_HOLE),
            Err(Errno::EOPNOTSUPP)
        );
        assert_eq!(
            allocation_of_mode(FALLOC_FL_ZERO_RANGE),
            Ok(Allocation::ZeroRange { keep_size: false })
        );
        assert_eq!(
            allocation_of_mode(FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE),
            Ok(Allocation::ZeroRange { keep_size: true })
        );
        // Collapse, insert and unshare are not kept.
        assert_eq!(allocation_of_mode(0x08), Err(Errno::EOPNOTSUPP));
        assert_eq!(allocation_of_mode(0x20), Err(Errno::EOPNOTSUPP));
    }
}
