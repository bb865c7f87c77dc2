//! What the kernel holds of each inode: the lookups it counts (each entry reply is one,
//! each `FORGET` gives some back), and on a writeback mount the size it keeps of a
//! regular file.
//!
//! Under the writeback cache the kernel takes a regular file's size from the mount only
//! when it makes the inode, from the entry reply that makes it (a lookup, a create, a
//! `READDIRPLUS` entry, while it held none of the inode); replies for an inode it holds
//! leave its size alone. After that only its writes (write-backs, direct writes,
//! `fallocate` without `KEEP_SIZE`, `copy_file_range`: each raises it to its end), its
//! truncations (to the size the reply gives) and this mount's `raise_size` change it, and
//! the mount follows each of them here. So at a write open the meta server may give the file
//! more bytes than the kernel knows of (another client grew it between the lookup and the
//! open, or while the kernel held it open for reading and before its size was raised):
//! the kernel's pages past its own end are then pages it begins without reading, filled
//! with zeros around what is written, and the shadows must start from the kernel's size
//! to take those zeros for filling (`shadow.rs`).
//!
//! Which of several replies made the inode is not known here: the kernel makes it in the
//! thread that asked, after the reply woke it, so of two lookups answered while it held
//! none of the inode either may make it. Until the kernel names the inode in a request
//! of its own (an open, a getattr, a setattr, a link: it holds it then), the smallest
//! size replied is taken. A size too large sends the kernel's filling over other hosts'
//! bytes; one too small leaves the zeros of a page written whole, unread, between the two
//! sizes unsent (over bytes the cluster held there, if any).
//!
//! The table is bounded by the kernel's inode cache: an inode leaves at its last
//! `FORGET`. One race is not followed: a reply that counts a lookup for an inode the
//! kernel is forgetting at that moment (its `FORGET` not read yet) makes a new inode
//! with the reply's size, where this table keeps the older one.

use std::sync::Mutex;

use freeflow_types::InodeId;

struct Held {
    lookups: u64,
    /// The size the kernel keeps (regular files on a writeback mount).
    size: Option<u64>,
    /// The kernel named the inode in a request since it was made: it holds it, and
    /// replies no longer change its size.
    settled: bool,
}

pub struct KernelInodes {
    /// Sizes are followed only on a writeback mount (elsewhere the kernel takes the size
    /// of every reply).
    writeback: bool,
    table: Mutex<foldhash::HashMap<InodeId, Held>>,
}

impl KernelInodes {
    pub fn new(writeback: bool) -> KernelInodes {
        KernelInodes {
            writeback,
            table: Mutex::new(foldhash::HashMap::default()),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, foldhash::HashMap<InodeId, Held>> {
        self.table.lock().expect("kernel inodes not poisoned")
    }

    /// The kernel takes a reference to each inode from an entry reply giving it the size
    /// with it (a regular file's): the size it keeps, if this reply makes the inode.
    pub fn remember(&self, inodes: &[(InodeId, Option<u64>)]) {
        let mut table = self.table();
        for &(inode, size) in inodes {
            let size = size.filter(|_| self.writeback);
            let held = table.entry(inode).or_insert(Held {
                lookups: 0,
                size,
                settled: false,
            });
            held.lookups += 1;
            if !held.settled {
                held.size = match (held.size, size) {
                    (Some(kept), Some(replied)) => Some(kept.min(replied)),
                    (kept, replied) => kept.or(replied),
                };
            }
        }
    }

    /// The kernel gives back `count` lookups of `inode`: whether it forgot the inode.
    pub fn forget(&self, inode: InodeId, count: u64) -> bool {
        let mut table = self.table();
        let Some(held) = table.get_mut(&inode) else {
            return false;
        };
        held.lookups = held.lookups.saturating_sub(count);
        if held.lookups > 0 {
            return false;
        }
        table.remove(&inode);
        true
    }

    /// The size the kernel keeps of `inode` (writeback mounts), if it holds it.
    #[cfg(test)]
    pub fn size(&self, inode: InodeId) -> Option<u64> {
        self.table().get(&inode).and_then(|held| held.size)
    }

    /// The kernel keeps `size` for `inode` now (it truncated the file, or the mount raised
    /// its size), if it holds the inode.
    pub fn size_is(&self, inode: InodeId, size: u64) {
        if !self.writeback {
            return;
        }
        if let Some(held) = self.table().get_mut(&inode) {
            held.size = Some(size);
            held.settled = true;
        }
    }

    /// The kernel's writes or allocations raised its size of `inode` to at least `end`.
    pub fn grown_to(&self, inode: InodeId, end: u64) {
        if !self.writeback {
            return;
        }
        if let Some(held) = self.table().get_mut(&inode) {
            held.settled = true;
            if let Some(size) = held.size.as_mut() {
                *size = (*size).max(end);
            }
        }
    }

    /// The kernel names `inode` in a request (an open, a getattr...): it holds the inode,
    /// made by a reply counted already.
    pub fn opened(&self, inode: InodeId) {
        if !self.writeback {
            return;
        }
        if let Some(held) = self.table().get_mut(&inode) {
            held.settled = true;
        }
    }

    /// Where a file's shadows start at its first write open, when the meta server gives
    /// it `size` bytes: no further than the size the kernel keeps.
    pub fn writing_from(&self, inode: InodeId, size: u64) -> u64 {
        let mut table = self.table();
        let Some(held) = table.get_mut(&inode) else {
            return size;
        };
        held.settled = true;
        held.size.map_or(size, |kept| kept.min(size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_keeps_the_size_of_the_reply_that_made_the_inode() {
        let held = KernelInodes::new(true);
        held.remember(&[(7, Some(4_000))]);
        // Two replies before the kernel named the inode: either made it.
        held.remember(&[(7, Some(3_000))]);
        assert_eq!(held.size(7), Some(3_000));
        held.opened(7);
        // Another client grew the file: a later lookup says so, and an open finds it
        // larger still; the kernel kept its size.
        held.remember(&[(7, Some(9_000))]);
        held.remember(&[(7, Some(2_000))]);
        assert_eq!(held.size(7), Some(3_000));
        assert!(!held.forget(7, 2));
        assert_eq!(held.writing_from(7, 12_000), 3_000);
        // Shrunk elsewhere: the cluster's size is the lower.
        assert_eq!(held.writing_from(7, 1_000), 1_000);
        // Forgotten in two steps; remade by the next reply, with its size.
        assert!(!held.forget(7, 1));
        assert_eq!(held.size(7), Some(3_000));
        assert!(held.forget(7, 1));
        assert_eq!(held.size(7), None);
        assert_eq!(held.writing_from(7, 12_000), 12_000);
        held.remember(&[(7, Some(12_000))]);
        assert_eq!(held.size(7), Some(12_000));
    }

    #[test]
    fn truncations_raises_and_write_backs_set_the_size_of_a_held_inode_only() {
        let held = KernelInodes::new(true);
        held.remember(&[(3, Some(100)), (4, None)]);
        held.size_is(3, 0);
        assert_eq!(held.size(3), Some(0));
        held.size_is(3, 70_000);
        assert_eq!(held.writing_from(3, 80_000), 70_000);
        // Writes raise it, never lower it.
        held.grown_to(3, 90_000);
        held.grown_to(3, 10);
        assert_eq!(held.size(3), Some(90_000));
        // A directory keeps no size until told one; an inode not held is not added.
        assert_eq!(held.size(4), None);
        held.size_is(5, 10);
        assert_eq!(held.size(5), None);
        assert!(!held.forget(5, 1));
    }

    #[test]
    fn without_the_writeback_cache_no_size_is_followed() {
        let held = KernelInodes::new(false);
        held.remember(&[(9, Some(4_096))]);
        held.size_is(9, 10);
        assert_eq!(held.size(9), None);
        assert_eq!(held.writing_from(9, 8_192), 8_192);
        assert!(held.forget(9, 1));
    }
}
