//! The handlers of directory listings: opendir, readdir, readdirplus, releasedir and
//! fsyncdir, with the gathering of `READDIRPLUS` entries and their attributes
//! ([`PlusEntry`], `answer_plus`) and the listings this mount knows whole
//! (`take_known_listing`, `listing_read`).

use std::time::Duration;

use freeflow_client::{Attr, FileKind, InodeId, Lease};
use fuser::{Errno, FileHandle, FileType, FopenFlags, Generation, INodeNo, OpenFlags};

use super::{bad_handle, regular_size, FreeflowFs, MountState};
use crate::cache::Admission;
use crate::convert::{self, errno};
use crate::handles::DirectoryListing;
use crate::reply::{Caller, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyOpen};

/// Most entries fetched for one `readdirplus` reply (the kernel's buffer holds ~200 of
/// 32 KiB; what does not fit is answered from the listing at the next call).
const READDIRPLUS_GATHER_MAX: usize = 256;

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

impl MountState {
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
}

/// The handlers of directory listings, with the operations' arguments as the kernel gives
/// them (hence their many parameters); `dev.rs` and `ring/dispatch.rs` call them.
#[allow(clippy::too_many_arguments)]
impl FreeflowFs {
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
}
