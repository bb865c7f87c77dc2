//! Shared payloads: write payloads that cross from a client to an I/O server on the same
//! host through memory both map, instead of through the RPC socket.
//!
//! A write's bytes sent over a Unix socket are copied twice by the kernel: into the socket
//! by the sender, out of it by the receiver. Here the client places the payload in a
//! region of a sealed memory file ([`WriteRegion`]) it shared with the server over the
//! server's local socket (`freeflow_proto::io::ShareRegion`, descriptor attached), and the
//! frame carries the region's name and the offset in place of the bytes
//! (`freeflow_proto::frame::FLAG_SHARED_PAYLOAD`). The server maps the region read-only
//! ([`MappedRegion`]) and hands its write a `Bytes` of the mapping: an O_DIRECT write goes
//! from those pages to the disk, a buffered one copies them once into the page cache.
//! Everything else about the request is unchanged: the server still runs the write
//! (grants, space stamps, replication, the straggler check), and credits and budgets count
//! the payload's length as before.
//!
//! What keeps it safe:
//! - the server maps only an ordinary memory file (tmpfs) sealed against shrinking, so no
//!   client can make its pages vanish under the server's reads (SIGBUS); it maps it
//!   read-only;
//! - a region is known by a random 64-bit name only its client and the server hold, and
//!   is registered only by a peer the local socket accepts (the server's own user or
//!   root); a frame naming another region, or bytes outside it, closes the connection;
//! - the client reuses a payload's place only after the reply to its request came (the
//!   server is done with the bytes when it answers); a request that ended otherwise
//!   (timeout, lost connection) leaves its place unused for the region's life, as the
//!   server may still read it.
//!
//! A client may change the bytes of a request it has in flight: it only changes what it
//! writes itself, as it could by sending other bytes. (The I/O server copies a replicated
//! write's bytes before it writes and passes them on, so the copies of a stripe agree.)

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use freeflow_proto::io::{LocalRequest, RegionShared, ShareRegion};
use freeflow_proto::WireError;

use crate::local::SeqpacketConn;

/// Payloads at least this long are shared; shorter ones cost little to copy over the socket.
pub const SHARED_PAYLOAD_MIN: usize = 32 << 10;
/// One place in a client's region: payloads up to this long are shared (a stripe unit).
pub const REGION_SLOT_BYTES: usize = 1 << 20;
/// Places in a client's region, one per connection to an I/O server on this host: the
/// payloads it may have shared and in flight at once (more go over the socket). Pages are
/// touched only when used, and places are reused most-recent first.
pub const REGION_SLOTS: usize = 32;
/// Largest region a server maps.
pub const SHARED_REGION_BYTES_MAX: u64 = 256 << 20;
/// Most regions a server keeps registered at once (one per client connection on its host).
pub const SHARED_REGIONS_MAX: usize = 1024;

/// A server's read-only mapping of a client's region.
pub struct MappedRegion {
    base: *const u8,
    length: usize,
}

// SAFETY: the mapping is read-only here and lives until the last `Arc` is dropped. Its
// bytes can change under a reader (the client process writes them): the slices handed out
// are formally shared memory another process mutates, which the server only copies out
// (to the disk, a socket, a checksum) and never interprets.
unsafe impl Send for MappedRegion {}
// SAFETY: as above; nothing here mutates through the pointer.
unsafe impl Sync for MappedRegion {}

impl MappedRegion {
    /// Map the memory file `fd` read-only, if it is one sealed against shrinking and not
    /// larger than [`SHARED_REGION_BYTES_MAX`].
    pub fn map(fd: &OwnedFd) -> Result<MappedRegion, String> {
        let raw = fd.as_raw_fd();
        // SAFETY: F_GET_SEALS takes no argument and only reads the file's seals.
        let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(format!(
                "not a sealable memory file: {}",
                std::io::Error::last_os_error()
            ));
        }
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err("the memory file is not sealed against shrinking".into());
        }
        // Ordinary shared memory only: a huge-page file can lose a page to a punched hole
        // and fault it back with none free (SIGBUS in this process).
        // SAFETY: statfs is plain data; fstatfs fills it or fails.
        let mut statfs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and a pointer to a statfs of our own.
        if unsafe { libc::fstatfs(raw, &mut statfs) } != 0 {
            return Err(format!("fstatfs: {}", std::io::Error::last_os_error()));
        }
        if statfs.f_type != libc::TMPFS_MAGIC {
            return Err(format!(
                "not an ordinary memory file (file system type {:#x})",
                statfs.f_type
            ));
        }
        let file = std::fs::File::from(fd.try_clone().map_err(|error| error.to_string())?);
        let length = file.metadata().map_err(|error| error.to_string())?.len();
        if length == 0 || length > SHARED_REGION_BYTES_MAX {
            return Err(format!(
                "a region of {length} bytes (between 1 and {SHARED_REGION_BYTES_MAX} are mapped)"
            ));
        }
        // SAFETY: a fresh shared read-only mapping of the whole file; its length cannot
        // shrink (sealed), so every page stays backed while it is mapped.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                length as usize,
                libc::PROT_READ,
                libc::MAP_SHARED,
                raw,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(format!("mmap failed: {}", std::io::Error::last_os_error()));
        }
        Ok(MappedRegion {
            base: base.cast(),
            length: length as usize,
        })
    }

    /// The bytes at `offset`, `length` long, while they are mapped; `None` if they are not
    /// all inside the region.
    pub fn payload(self: &Arc<Self>, offset: u64, length: u32) -> Option<Bytes> {
        let end = offset.checked_add(u64::from(length))?;
        if end > self.length as u64 {
            return None;
        }
        Some(Bytes::from_owner(RegionBytes {
            region: Arc::clone(self),
            offset: offset as usize,
            length: length as usize,
        }))
    }
}

impl Drop for MappedRegion {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once, after its last user.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.length) };
    }
}

/// A payload in a mapped region; keeps the mapping alive.
struct RegionBytes {
    region: Arc<MappedRegion>,
    offset: usize,
    length: usize,
}

impl AsRef<[u8]> for RegionBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: inside the mapping (checked in `payload`), which outlives `self`.
        unsafe { std::slice::from_raw_parts(self.region.base.add(self.offset), self.length) }
    }
}

/// The regions a server's clients on its host shared, by name.
#[derive(Default)]
pub struct SharedRegions {
    regions: Mutex<HashMap<u64, Arc<MappedRegion>>>,
}

impl std::fmt::Debug for SharedRegions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedRegions")
            .field("regions", &self.len())
            .finish()
    }
}

impl SharedRegions {
    /// Register a mapped region under a new random name.
    pub fn insert(&self, region: MappedRegion) -> Result<u64, String> {
        let mut regions = self.regions.lock().expect("not poisoned");
        if regions.len() >= SHARED_REGIONS_MAX {
            return Err(format!(
                "{SHARED_REGIONS_MAX} regions are shared with this server already"
            ));
        }
        loop {
            let name =
                crate::random_client_id().map_err(|error| format!("no random name: {error}"))?;
            if let std::collections::hash_map::Entry::Vacant(entry) = regions.entry(name) {
                entry.insert(Arc::new(region));
                return Ok(name);
            }
        }
    }

    /// Forget a region (its client closed the connection it came on); payloads already
    /// taken from it keep its mapping until they are dropped.
    pub fn remove(&self, name: u64) {
        self.regions.lock().expect("not poisoned").remove(&name);
    }

    /// A payload of a registered region, if the region is known and holds those bytes.
    pub fn payload(&self, name: u64, offset: u64, length: u32) -> Option<Bytes> {
        let region = self
            .regions
            .lock()
            .expect("not poisoned")
            .get(&name)
            .cloned()?;
        region.payload(offset, length)
    }

    pub fn len(&self) -> usize {
        self.regions.lock().expect("not poisoned").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A client's region for one connection to an I/O server on its host: a sealed memory
/// file mapped read-write here and shared with the server.
pub struct WriteRegion {
    base: *mut u8,
    length: usize,
    name: u64,
    /// Places free for a payload, the most recently freed last (taken first).
    free: Mutex<Vec<u32>>,
    /// Places given up (their request ended without a reply).
    abandoned: AtomicUsize,
    /// The local connection the region was shared on: the server keeps the region while
    /// it is open.
    _connection: SeqpacketConn,
}

// SAFETY: the mapping lives as long as `self`; each place is written only by the one
// `SharedPayload` that holds it.
unsafe impl Send for WriteRegion {}
// SAFETY: as above.
unsafe impl Sync for WriteRegion {}

impl WriteRegion {
    /// Make a region of `slots` places and share it with the server whose local socket is
    /// at `local_path`. Must be called inside a Tokio runtime.
    pub async fn share(local_path: &Path, slots: usize) -> Result<Arc<WriteRegion>, String> {
        let length = slots.max(1) * REGION_SLOT_BYTES;
        // Connected first: a server without a local socket (a meta server) costs no file.
        let connection = SeqpacketConn::connect(local_path)
            .map_err(|error| format!("connect to {}: {error}", local_path.display()))?;
        let file = sealed_memory_file(length).map_err(|error| format!("memory file: {error}"))?;
        let request = LocalRequest::ShareRegion(ShareRegion {
            version: freeflow_proto::PROTOCOL_VERSION,
        });
        let (packet, descriptor) = connection
            .ask(&freeflow_proto::encode(&request), Some(file.as_fd()))
            .await?;
        if descriptor.is_some() {
            return Err("the server sent a descriptor".into());
        }
        let answer: Result<RegionShared, WireError> =
            freeflow_proto::decode(&packet).map_err(|error| error.message)?;
        let shared = answer.map_err(|error| error.message)?;
        // SAFETY: a fresh shared read-write mapping of the whole file, which is sealed
        // against shrinking.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                length,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        Ok(Arc::new(WriteRegion {
            base: base.cast(),
            length,
            name: shared.region,
            free: Mutex::new((0..slots.max(1) as u32).rev().collect()),
            abandoned: AtomicUsize::new(0),
            _connection: connection,
        }))
    }

    /// The name the server gave the region.
    pub fn name(&self) -> u64 {
        self.name
    }

    /// Places free for a payload now.
    pub fn free_places(&self) -> usize {
        self.free.lock().expect("not poisoned").len()
    }

    /// Places given up so far (requests that ended without a reply).
    pub fn abandoned(&self) -> usize {
        self.abandoned.load(Ordering::Relaxed)
    }

    /// Copy `payload` into a free place, if it is one to share and a place is free.
    pub fn place(self: &Arc<Self>, payload: &[u8]) -> Option<SharedPayload> {
        if payload.len() < SHARED_PAYLOAD_MIN || payload.len() > REGION_SLOT_BYTES {
            return None;
        }
        let slot = self.free.lock().expect("not poisoned").pop()?;
        let offset = slot as usize * REGION_SLOT_BYTES;
        debug_assert!(offset + payload.len() <= self.length);
        // SAFETY: the place is this payload's alone until it is given back, and inside the
        // mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(payload.as_ptr(), self.base.add(offset), payload.len())
        };
        Some(SharedPayload {
            region: Arc::clone(self),
            slot,
            answered: false,
        })
    }
}

impl Drop for WriteRegion {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `share`, unmapped once, when no place is held.
        unsafe { libc::munmap(self.base.cast(), self.length) };
    }
}

/// A payload placed in a region. Its place is free again when this is dropped after
/// [`SharedPayload::answered`]; dropped before, it stays taken (the server may still read it).
pub struct SharedPayload {
    region: Arc<WriteRegion>,
    slot: u32,
    answered: bool,
}

impl SharedPayload {
    pub fn region_name(&self) -> u64 {
        self.region.name
    }

    pub fn offset(&self) -> u64 {
        self.slot as u64 * REGION_SLOT_BYTES as u64
    }

    /// The server replied to the request: it is done with the bytes.
    pub fn answered(&mut self) {
        self.answered = true;
    }
}

impl Drop for SharedPayload {
    fn drop(&mut self) {
        if self.answered {
            self.region
                .free
                .lock()
                .expect("not poisoned")
                .push(self.slot);
        } else {
            self.region.abandoned.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A memory file of `length` bytes that can neither shrink nor grow.
fn sealed_memory_file(length: usize) -> std::io::Result<OwnedFd> {
    // SAFETY: a valid NUL-terminated name; the flags are documented ones.
    let raw = unsafe {
        libc::memfd_create(
            c"freeflow-payloads".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor just made and owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: plain calls on a descriptor we own.
    unsafe {
        if libc::ftruncate(raw, length as libc::off_t) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        if libc::fcntl(raw, libc::F_ADD_SEALS, seals) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory_file(length: usize, seal: bool) -> OwnedFd {
        // SAFETY: as in `sealed_memory_file`.
        let raw = unsafe {
            libc::memfd_create(
                c"test".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        assert!(raw >= 0);
        // SAFETY: owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain calls on our descriptor.
        unsafe {
            assert_eq!(libc::ftruncate(raw, length as libc::off_t), 0);
            if seal {
                assert_eq!(libc::fcntl(raw, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
            }
        }
        fd
    }

    #[test]
    fn only_a_memory_file_sealed_against_shrinking_is_mapped() {
        let unsealed = memory_file(1 << 16, false);
        let error = MappedRegion::map(&unsealed).err().expect("refused");
        assert!(error.contains("not sealed"), "{error}");
        let file = tempfile::tempfile().expect("temp file");
        let error = MappedRegion::map(&OwnedFd::from(file))
            .err()
            .expect("refused");
        assert!(error.contains("not a sealable memory file"), "{error}");
        let empty = memory_file(0, true);
        assert!(MappedRegion::map(&empty).is_err());
        let sealed = memory_file(1 << 16, true);
        assert!(MappedRegion::map(&sealed).is_ok());
    }

    #[test]
    fn a_payload_is_what_the_file_holds_and_never_past_its_end() {
        let fd = memory_file(1 << 16, true);
        let file = std::fs::File::from(fd.try_clone().expect("clone"));
        std::os::unix::fs::FileExt::write_all_at(&file, b"shared bytes", 100).expect("write");
        let region = Arc::new(MappedRegion::map(&fd).expect("mapped"));
        let regions = SharedRegions::default();
        let name = regions
            .insert(MappedRegion::map(&fd).expect("mapped"))
            .expect("registered");
        assert_eq!(
            regions.payload(name, 100, 12).expect("inside").as_ref(),
            b"shared bytes"
        );
        // A change by the owner shows through the mapping.
        std::os::unix::fs::FileExt::write_all_at(&file, b"S", 100).expect("write");
        assert_eq!(region.payload(100, 1).expect("inside").as_ref(), b"S");
        assert!(region.payload(1 << 16, 1).is_none());
        assert!(region.payload((1 << 16) - 1, 2).is_none());
        assert!(region.payload(u64::MAX, 2).is_none());
        assert!(regions.payload(name ^ 1, 100, 12).is_none());
        // Taken payloads keep the mapping after the region is forgotten.
        let held = regions.payload(name, 100, 12).expect("inside");
        regions.remove(name);
        assert!(regions.payload(name, 100, 12).is_none());
        assert_eq!(held.as_ref(), b"Shared bytes");
    }
}
