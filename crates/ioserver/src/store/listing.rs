//! Walking the shard directories: the object count at start and `ListObjects` for fsck.

use std::io;
use std::sync::atomic::Ordering;
use std::time::Instant;

use freeflow_proto::io::ListedObject;
use freeflow_types::ObjectId;

use crate::error::{object_name, StoreError};

use super::files::{blocking, is_object_name, lock, parse_object_name};
use super::ObjectStore;

impl ObjectStore {
    /// Counts the objects on disk, one shard at a time (see the module doc). Blocking: run
    /// it on a blocking thread after the server is ready.
    pub fn count_objects(&self) -> io::Result<u64> {
        let started = Instant::now();
        for (shard, count) in self.shards.iter().enumerate() {
            let directory = self.objects_dir.join(format!("{shard:02x}"));
            let mut count = lock(count);
            if count.scanned {
                continue;
            }
            let mut objects = 0u64;
            for entry in std::fs::read_dir(&directory)? {
                if is_object_name(&entry?.file_name().to_string_lossy()) {
                    objects += 1;
                }
            }
            count.objects = objects;
            count.scanned = true;
        }
        self.count_complete.store(true, Ordering::Release);
        let total = self.object_count().objects;
        tracing::info!(
            server_id = self.server_id,
            objects = total,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "object count ready"
        );
        Ok(total)
    }

    /// The objects of shard directory `shard` after `after`, at most `limit`, in order,
    /// with their lengths and ages; and whether more follow (for `freeflow fsck`). Reads the
    /// whole directory each time (a shard holds a 256th of the objects): blocking, so it
    /// runs on a blocking thread.
    pub async fn list(
        &self,
        shard: usize,
        after: Option<ObjectId>,
        limit: usize,
    ) -> Result<(Vec<ListedObject>, bool), StoreError> {
        let directory = self.objects_dir.join(format!("{shard:02x}"));
        let path = directory.clone();
        let listed = blocking(move || -> io::Result<(Vec<ListedObject>, bool)> {
            let mut objects: Vec<ObjectId> = Vec::new();
            for entry in std::fs::read_dir(&directory)? {
                let name = entry?.file_name();
                if let Some(object) = parse_object_name(&name.to_string_lossy()) {
                    if after.is_none_or(|after| object > after) {
                        objects.push(object);
                    }
                }
            }
            objects.sort_unstable();
            let now = std::time::SystemTime::now();
            let mut listed = Vec::with_capacity(objects.len().min(limit));
            let mut candidates = objects.into_iter().peekable();
            while listed.len() < limit {
                let Some(object) = candidates.next() else {
                    break;
                };
                let path = directory.join(object_name(object));
                let metadata = match std::fs::metadata(&path) {
                    Ok(metadata) => metadata,
                    // Removed since the listing (the reaper, a truncation to nothing).
                    Err(error) if error.kind() == io::ErrorKind::NotFound => continue,
                    Err(error) => return Err(error),
                };
                let age_ms = metadata
                    .modified()
                    .ok()
                    .and_then(|modified| now.duration_since(modified).ok())
                    .map_or(0, |age| age.as_millis() as u64);
                listed.push(ListedObject {
                    object,
                    length: metadata.len(),
                    age_ms,
                });
            }
            // Objects removed since the directory was read are skipped, not counted: a
            // page is short only at the shard's end.
            let more = candidates.peek().is_some();
            Ok((listed, more))
        })
        .await;
        listed.map_err(|error| StoreError::from_io(self.server_id, "list", path, error))
    }
}
