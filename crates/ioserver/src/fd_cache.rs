//! A bounded cache of open object files, so hot objects are not reopened per request while
//! the server never holds more than `open_files_max` descriptors in its cache (the machine's
//! hard limit is 20000 open files for everything).
//!
//! Entries are `Arc<File>`: concurrent requests on one object share the descriptor, and an
//! eviction only drops the cache's reference, so a request still using the file keeps it open
//! until it finishes. Eviction is CLOCK (second chance), an LRU approximation that costs
//! O(1) per hit: a hit sets the entry's `referenced` bit; the hand clears bits until it finds
//! an entry without one.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::sync::{Arc, Mutex, MutexGuard};

use freeflow_types::ObjectId;

struct Entry {
    file: Arc<File>,
    referenced: bool,
}

struct CacheState {
    entries: HashMap<ObjectId, Entry>,
    /// The clock. May hold keys no longer in `entries` (removed objects); those are skipped
    /// and the ring is rebuilt when it grows past twice the bound.
    clock: VecDeque<ObjectId>,
}

pub struct FdCache {
    open_files_max: usize,
    state: Mutex<CacheState>,
}

impl FdCache {
    pub fn new(open_files_max: usize) -> FdCache {
        assert!(open_files_max > 0, "validated by the config");
        FdCache {
            open_files_max,
            state: Mutex::new(CacheState {
                entries: HashMap::with_capacity(open_files_max.min(1 << 16)),
                clock: VecDeque::new(),
            }),
        }
    }

    pub fn open_files_max(&self) -> usize {
        self.open_files_max
    }

    /// Descriptors held by the cache now.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, object: ObjectId) -> Option<Arc<File>> {
        let mut state = self.lock();
        let entry = state.entries.get_mut(&object)?;
        entry.referenced = true;
        Some(Arc::clone(&entry.file))
    }

    /// Caches `file` for `object` and returns the cached file: if another task cached one
    /// for this object meanwhile, that one is kept and returned (one descriptor per object).
    pub fn insert(&self, object: ObjectId, file: Arc<File>) -> Arc<File> {
        let mut state = self.lock();
        if let Some(entry) = state.entries.get_mut(&object) {
            entry.referenced = true;
            return Arc::clone(&entry.file);
        }
        while state.entries.len() >= self.open_files_max {
            state.evict_one();
        }
        state.entries.insert(
            object,
            Entry {
                file: Arc::clone(&file),
                referenced: false,
            },
        );
        state.clock.push_back(object);
        if state.clock.len() > 2 * self.open_files_max {
            let CacheState { entries, clock } = &mut *state;
            clock.retain(|key| entries.contains_key(key));
        }
        file
    }

    /// Forgets `object` (it was removed from disk).
    pub fn remove(&self, object: ObjectId) {
        self.lock().entries.remove(&object);
    }

    fn lock(&self) -> MutexGuard<'_, CacheState> {
        // Every update is a single map or queue operation; a poisoned lock is consistent.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl CacheState {
    /// Evicts one entry. The map is non-empty, so within two turns of the clock some entry
    /// has its bit clear.
    fn evict_one(&mut self) {
        while let Some(key) = self.clock.pop_front() {
            let Some(entry) = self.entries.get_mut(&key) else {
                continue;
            };
            if entry.referenced {
                entry.referenced = false;
                self.clock.push_back(key);
            } else {
                self.entries.remove(&key);
                return;
            }
        }
        // Unreachable while every key of `entries` is in `clock`; stay safe regardless.
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(inode: u64) -> ObjectId {
        ObjectId {
            inode,
            stripe_index: 0,
        }
    }

    fn temp_file() -> Arc<File> {
        Arc::new(tempfile::tempfile().unwrap())
    }

    #[test]
    fn the_bound_holds_and_recently_used_entries_stay() {
        let cache = FdCache::new(3);
        for inode in 1..=3 {
            cache.insert(object(inode), temp_file());
        }
        // Touch 1 so it gets a second chance; 2 is the oldest unreferenced entry.
        assert!(cache.get(object(1)).is_some());
        cache.insert(object(4), temp_file());
        assert_eq!(cache.len(), 3);
        assert!(cache.get(object(1)).is_some());
        assert!(cache.get(object(2)).is_none());
        for inode in 5..50 {
            cache.insert(object(inode), temp_file());
            assert!(cache.len() <= 3);
        }
    }

    #[test]
    fn eviction_leaves_users_with_an_open_file() {
        let cache = FdCache::new(1);
        let held = cache.insert(object(1), temp_file());
        cache.insert(object(2), temp_file());
        assert!(cache.get(object(1)).is_none());
        // Still usable: the cache dropped only its own reference.
        assert!(held.metadata().is_ok());
        assert_eq!(Arc::strong_count(&held), 1);
    }

    #[test]
    fn a_second_insert_returns_the_first_file() {
        let cache = FdCache::new(4);
        let first = cache.insert(object(1), temp_file());
        let second = cache.insert(object(1), temp_file());
        assert!(Arc::ptr_eq(&first, &second));
        cache.remove(object(1));
        assert!(cache.is_empty());
        // Removed keys left in the clock do not break later evictions.
        for inode in 2..20 {
            cache.insert(object(inode), temp_file());
        }
        assert_eq!(cache.len(), 4);
    }
}
