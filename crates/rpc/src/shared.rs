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
//! A client makes one area ([`PayloadArea`]) and shares it on its connection to each
//! server on its host, so a payload can be made in it before anyone knows which server
//! its stripe is on: the mount copies a write out of the kernel's request buffer straight
//! into a place, and that place is what the request refers to.
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
//!   server is done with the bytes when it answers) and nothing of its own still holds
//!   the payload; a request that ended otherwise (timeout, lost connection) leaves its
//!   place unused until the connection is gone and its server has answered a
//!   `ReleaseRegion` (it forgot the region and no request of its own holds a view of it),
//!   as the server may still read it until then (for the area's life when no answer comes);
//! - every server on the host maps the whole area, so each can read the payloads meant
//!   for the others: they are servers of one cluster, run by its own user or root.
//!
//! A client may change the bytes of a request it has in flight: it only changes what it
//! writes itself, as it could by sending other bytes. (The I/O server copies a replicated
//! write's bytes before it writes and passes them on, so the copies of a stripe agree.)

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use freeflow_proto::io::{LocalRequest, RegionReleased, RegionShared, ReleaseRegion, ShareRegion};
use freeflow_proto::WireError;

use crate::local::SeqpacketConn;

/// Payloads at least this long are copied into a place to be shared; shorter ones cost
/// little to copy over the socket. A payload already in the area (a gathered batch, a
/// slice of a larger write) is shared at any length.
pub const SHARED_PAYLOAD_MIN: usize = 32 << 10;
/// One place in a client's region: payloads up to this long are shared (a stripe unit).
pub const REGION_SLOT_BYTES: usize = 1 << 20;
/// Places in the area a connection makes for itself when it is given none
/// (`ConnectOptions::payload_area`): the payloads it may have shared and in flight at once
/// (more go over the socket). Pages are touched only when used, and places are reused
/// most-recent first.
pub const REGION_SLOTS: usize = 32;
/// Places in a client's one area, shared with every I/O server on its host.
pub const AREA_SLOTS: usize = 128;
/// Largest region a server maps.
pub const SHARED_REGION_BYTES_MAX: u64 = 256 << 20;
/// Most regions a server keeps registered at once (one per client connection on its host).
pub const SHARED_REGIONS_MAX: usize = 1024;

/// A server's read-only mapping of a client's region.
pub struct MappedRegion {
    base: *const u8,
    length: usize,
    /// Dropped with the mapping: its receiver ([`SharedRegions::insert`]) learns that the
    /// region can no longer be read here.
    _unmapped: tokio::sync::oneshot::Sender<()>,
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
            _unmapped: tokio::sync::oneshot::channel().0,
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
    /// Register a mapped region under a new random name. The receiver resolves once the
    /// mapping is gone: the region forgotten (`remove`) and every payload taken from it
    /// dropped.
    pub fn insert(
        &self,
        mut region: MappedRegion,
    ) -> Result<(u64, tokio::sync::oneshot::Receiver<()>), String> {
        let (unmapped, receiver) = tokio::sync::oneshot::channel();
        region._unmapped = unmapped;
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
                return Ok((name, receiver));
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

/// A client's memory for write payloads, shared with every I/O server on its host that
/// takes it: one sealed memory file of places, mapped read-write here. A payload made in
/// it ([`PayloadArea::copy_in`], the mount's copy out of the kernel's request) is sent
/// from its place with no further copy, whichever server its stripe is on; any other
/// payload to such a server is copied into a free place when sent ([`WriteRegion::place`]).
/// A place is free again when the last view of its payload is dropped; a request that
/// ended without a reply keeps its place taken until its server released the region
/// (`WriteRegion`'s `Drop`), as it may still read it.
pub struct PayloadArea {
    base: *mut u8,
    length: usize,
    file: OwnedFd,
    /// Places free for a payload, the most recently freed last (taken first: its pages are
    /// the likeliest to be resident).
    free: Mutex<Vec<u32>>,
    /// Places given up (their request ended without a reply).
    abandoned: AtomicUsize,
    /// Some server took the area: payloads made in it can go without a copy.
    shared: AtomicBool,
}

// SAFETY: the mapping lives as long as `self`; a place's bytes are written only while no
// view of them exists (by `copy_in`, or by a `PlaceMut` before its `freeze`), and only read
// after.
unsafe impl Send for PayloadArea {}
// SAFETY: as above.
unsafe impl Sync for PayloadArea {}

impl std::fmt::Debug for PayloadArea {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayloadArea")
            .field("bytes", &self.length)
            .field("free_places", &self.free_places())
            .finish()
    }
}

impl PayloadArea {
    /// An area of `slots` places of [`REGION_SLOT_BYTES`]. Pages are touched only when used.
    pub fn new(slots: usize) -> std::io::Result<Arc<PayloadArea>> {
        let slots = slots.clamp(1, SHARED_REGION_BYTES_MAX as usize / REGION_SLOT_BYTES);
        let length = slots * REGION_SLOT_BYTES;
        let file = sealed_memory_file(length)?;
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
            return Err(std::io::Error::last_os_error());
        }
        Ok(Arc::new(PayloadArea {
            base: base.cast(),
            length,
            file,
            free: Mutex::new((0..slots as u32).rev().collect()),
            abandoned: AtomicUsize::new(0),
            shared: AtomicBool::new(false),
        }))
    }

    /// Places free for a payload now.
    pub fn free_places(&self) -> usize {
        self.free.lock().expect("not poisoned").len()
    }

    /// Payloads given up and not released yet (requests that ended without a reply, on
    /// connections whose server has not released the region): each keeps its place taken
    /// (two slices of one place count twice).
    pub fn abandoned(&self) -> usize {
        self.abandoned.load(Ordering::Relaxed)
    }

    /// Whether a server took the area, so that a payload made in it goes without a copy.
    pub fn is_shared(&self) -> bool {
        self.shared.load(Ordering::Acquire)
    }

    /// `bytes` copied into a free place, if they are a payload worth sharing (at least
    /// [`SHARED_PAYLOAD_MIN`], at most a place) and a place is free.
    pub fn copy_in(self: &Arc<Self>, bytes: &[u8]) -> Option<Bytes> {
        if bytes.len() < SHARED_PAYLOAD_MIN || bytes.len() > REGION_SLOT_BYTES {
            return None;
        }
        let slot = self.free.lock().expect("not poisoned").pop()?;
        let offset = slot as usize * REGION_SLOT_BYTES;
        debug_assert!(offset + bytes.len() <= self.length);
        // SAFETY: the place is free (no `Place` owns it), so nothing reads or writes it
        // until the `Place` made below, and it is inside the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.add(offset), bytes.len())
        };
        Some(Bytes::from_owner(Place {
            area: Arc::clone(self),
            slot,
            length: bytes.len(),
        }))
    }

    /// `payload` in the area and where: itself if it is there already (no copy), else a
    /// copy in a free place, if it is one to share and a place is free.
    fn place(self: &Arc<Self>, payload: &Bytes) -> Option<(Bytes, u64)> {
        if let Some(offset) = self.offset_of(payload) {
            return Some((payload.clone(), offset));
        }
        let bytes = self.copy_in(payload)?;
        let offset = self.offset_of(&bytes)?;
        Some((bytes, offset))
    }

    /// A free place to fill ([`PlaceMut`]), if one is free: for bytes gathered a little at
    /// a time (small writes), which then go from there without another copy.
    pub fn take(self: &Arc<Self>) -> Option<PlaceMut> {
        let slot = self.free.lock().expect("not poisoned").pop()?;
        Some(PlaceMut {
            place: std::mem::ManuallyDrop::new(Place {
                area: Arc::clone(self),
                slot,
                length: 0,
            }),
        })
    }

    /// Where `bytes` are in the area, if they are all inside it.
    fn offset_of(&self, bytes: &[u8]) -> Option<u64> {
        let start = (bytes.as_ptr() as usize).checked_sub(self.base as usize)?;
        (start.checked_add(bytes.len())? <= self.length).then_some(start as u64)
    }
}

impl Drop for PayloadArea {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once, when no place is held (each
        // `Place` holds the area).
        unsafe { libc::munmap(self.base.cast(), self.length) };
    }
}

/// A payload's place in an area; free again when the last view of the payload is dropped.
struct Place {
    area: Arc<PayloadArea>,
    slot: u32,
    length: usize,
}

impl AsRef<[u8]> for Place {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: inside the mapping (a place's length is at most a slot), which the area
        // this holds keeps; written only while no view of it existed.
        unsafe {
            std::slice::from_raw_parts(
                self.area.base.add(self.slot as usize * REGION_SLOT_BYTES),
                self.length,
            )
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.area.free.lock().expect("not poisoned").push(self.slot);
    }
}

/// A place being filled: appended to, then frozen into the payload it holds. Dropped
/// unfrozen, its place is free again.
pub struct PlaceMut {
    place: std::mem::ManuallyDrop<Place>,
}

impl PlaceMut {
    /// Bytes appended so far.
    pub fn len(&self) -> usize {
        self.place.length
    }

    pub fn is_empty(&self) -> bool {
        self.place.length == 0
    }

    /// Most bytes a place holds.
    pub fn capacity(&self) -> usize {
        REGION_SLOT_BYTES
    }

    /// Append `bytes`. Panics past [`PlaceMut::capacity`]: callers bound what they gather.
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        let length = self.place.length;
        assert!(
            bytes.len() <= REGION_SLOT_BYTES - length,
            "{} bytes appended to a place holding {length}",
            bytes.len()
        );
        let at = self.place.slot as usize * REGION_SLOT_BYTES + length;
        // SAFETY: this place is taken by `self` alone and nothing has a view of it yet
        // (views come from `freeze`, which consumes `self`); the range is inside it.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.place.area.base.add(at), bytes.len())
        };
        self.place.length += bytes.len();
    }

    /// The payload: sent from its place, which is free again when its last view drops.
    pub fn freeze(mut self) -> Bytes {
        // SAFETY: taken once, here; `self` is forgotten so its `Drop` does not free it.
        let place = unsafe { std::mem::ManuallyDrop::take(&mut self.place) };
        std::mem::forget(self);
        Bytes::from_owner(place)
    }
}

impl Drop for PlaceMut {
    fn drop(&mut self) {
        // SAFETY: dropped once, here (`freeze` forgets `self` after taking the place).
        unsafe { std::mem::ManuallyDrop::drop(&mut self.place) };
    }
}

/// A client's area as shared on one connection to an I/O server on its host.
pub struct WriteRegion {
    area: Arc<PayloadArea>,
    name: u64,
    /// The local connection the area was shared on: the server keeps the region while
    /// it is open. Taken when the region is dropped, to release it.
    connection: Option<SeqpacketConn>,
    /// Payloads of requests on this connection that ended without a reply: their places
    /// stay taken until the server says it can no longer read the region (`Drop`).
    given_up: Mutex<Vec<Bytes>>,
}

/// Longest a dropped region waits for its server to release it before its given-up
/// places are kept for the area's life.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

impl Drop for WriteRegion {
    /// Places given up on this connection come back once the server answers a
    /// `ReleaseRegion` (it has forgotten the region and no request of its own still holds
    /// a view of it); without an answer (no runtime here, the server gone or refusing)
    /// they stay taken, as the server might still read them.
    fn drop(&mut self) {
        let given_up = std::mem::take(
            self.given_up
                .get_mut()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        let Some(connection) = self.connection.take() else {
            return;
        };
        if given_up.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            std::mem::forget(given_up);
            return;
        };
        let (area, name) = (Arc::clone(&self.area), self.name);
        runtime.spawn(async move {
            let request = LocalRequest::ReleaseRegion(ReleaseRegion { region: name });
            let asked = tokio::time::timeout(
                RELEASE_WAIT,
                connection.ask(&freeflow_proto::encode(&request), None),
            )
            .await;
            let released = match asked {
                Ok(Ok((packet, None))) => matches!(
                    freeflow_proto::decode::<Result<RegionReleased, WireError>>(&packet),
                    Ok(Ok(RegionReleased { region })) if region == name
                ),
                _ => false,
            };
            if released {
                area.abandoned.fetch_sub(given_up.len(), Ordering::Relaxed);
                drop(given_up);
            } else {
                tracing::debug!(
                    region = name,
                    places = given_up.len(),
                    "the server did not release the region: its given-up places stay taken"
                );
                std::mem::forget(given_up);
            }
        });
    }
}

impl WriteRegion {
    /// Share `area` with the server whose local socket is at `local_path`. Must be called
    /// inside a Tokio runtime.
    pub async fn share(
        local_path: &Path,
        area: Arc<PayloadArea>,
    ) -> Result<Arc<WriteRegion>, String> {
        let connection = SeqpacketConn::connect(local_path)
            .map_err(|error| format!("connect to {}: {error}", local_path.display()))?;
        let request = LocalRequest::ShareRegion(ShareRegion {
            version: freeflow_proto::PROTOCOL_VERSION,
        });
        let (packet, descriptor) = connection
            .ask(&freeflow_proto::encode(&request), Some(area.file.as_fd()))
            .await?;
        if descriptor.is_some() {
            return Err("the server sent a descriptor".into());
        }
        let answer: Result<RegionShared, WireError> =
            freeflow_proto::decode(&packet).map_err(|error| error.message)?;
        let shared = answer.map_err(|error| error.message)?;
        area.shared.store(true, Ordering::Release);
        Ok(Arc::new(WriteRegion {
            area,
            name: shared.region,
            connection: Some(connection),
            given_up: Mutex::new(Vec::new()),
        }))
    }

    /// The name the server gave the region.
    pub fn name(&self) -> u64 {
        self.name
    }

    /// Places of the area free for a payload now: the client's whole area, which its
    /// other connections share.
    pub fn free_places(&self) -> usize {
        self.area.free_places()
    }

    /// `payload` in the area: where it is already (made there by
    /// [`PayloadArea::copy_in`]: no copy), else copied into a free place, if it is one to
    /// share and a place is free.
    pub fn place(self: &Arc<Self>, payload: &Bytes) -> Option<SharedPayload> {
        let (bytes, offset) = self.area.place(payload)?;
        Some(SharedPayload {
            region: Arc::clone(self),
            offset,
            bytes: Some(bytes),
            answered: false,
        })
    }
}

/// A payload placed in a region. Its place stays taken at least until this is dropped;
/// dropped before [`SharedPayload::answered`], until the server releases the region
/// (`WriteRegion`'s `Drop`), as it may still read it.
pub struct SharedPayload {
    region: Arc<WriteRegion>,
    offset: u64,
    bytes: Option<Bytes>,
    answered: bool,
}

impl SharedPayload {
    pub fn region_name(&self) -> u64 {
        self.region.name
    }

    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The server replied to the request: it is done with the bytes.
    pub fn answered(&mut self) {
        self.answered = true;
    }
}

impl Drop for SharedPayload {
    fn drop(&mut self) {
        if !self.answered {
            if let Some(bytes) = self.bytes.take() {
                self.region.area.abandoned.fetch_add(1, Ordering::Relaxed);
                // Kept by the region until its server releases it.
                self.region
                    .given_up
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .push(bytes);
            }
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
    fn a_payload_made_in_the_area_is_placed_where_it_is_and_others_are_copied() {
        let area = PayloadArea::new(2).expect("area");
        let bytes: Vec<u8> = (0..REGION_SLOT_BYTES).map(|at| (at % 251) as u8).collect();
        assert!(
            area.copy_in(&bytes[..SHARED_PAYLOAD_MIN - 1]).is_none(),
            "too short"
        );
        let made = area.copy_in(&bytes).expect("a place");
        assert_eq!(made.as_ref(), &bytes[..]);
        assert_eq!(area.free_places(), 1);
        let base = area.offset_of(&made).expect("inside");
        // A slice of it (a write split across stripe units): where it is, no place taken.
        let (placed, offset) = area.place(&made.slice(4096..)).expect("placed");
        assert_eq!(offset, base + 4096);
        assert_eq!(placed.as_ref(), &bytes[4096..]);
        assert_eq!(area.free_places(), 1, "no copy was made");
        // Bytes made elsewhere are copied into the free place, held while their copy is.
        let elsewhere = Bytes::from(bytes[..SHARED_PAYLOAD_MIN].to_vec());
        let (copy, copied_at) = area.place(&elsewhere).expect("copied");
        assert_ne!(copied_at, base);
        assert_eq!(copy, elsewhere);
        assert_eq!(area.free_places(), 0);
        assert!(area.place(&elsewhere).is_none(), "no place is free");
        drop(copy);
        assert_eq!(area.free_places(), 1);
        // A place is free only when the last view of its payload is gone.
        drop(made);
        assert_eq!(area.free_places(), 1);
        drop(placed);
        assert_eq!(area.free_places(), 2);
    }

    #[test]
    fn a_place_filled_bit_by_bit_is_one_payload_and_free_again_when_dropped() {
        let area = PayloadArea::new(1).expect("area");
        let mut place = area.take().expect("a place");
        assert!(area.take().is_none(), "the only place is taken");
        assert!(place.is_empty());
        place.extend_from_slice(b"gathered ");
        place.extend_from_slice(b"bytes");
        assert_eq!(place.len(), 14);
        let payload = place.freeze();
        assert_eq!(payload.as_ref(), b"gathered bytes");
        // Sent from where it is: no second place is needed.
        let (placed, offset) = area.place(&payload).expect("placed");
        assert_eq!(offset, 0);
        assert_eq!(placed, payload);
        drop((placed, payload));
        assert_eq!(area.free_places(), 1);
        // A place dropped unfilled is free again too.
        let mut unfinished = area.take().expect("a place");
        unfinished.extend_from_slice(&[7; 4096]);
        drop(unfinished);
        assert_eq!(area.free_places(), 1);
        let mut full = area.take().expect("a place");
        full.extend_from_slice(&vec![1; REGION_SLOT_BYTES]);
        assert_eq!(full.len(), full.capacity());
        let overfull = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            full.extend_from_slice(&[1])
        }));
        assert!(overfull.is_err(), "a place never takes more than it holds");
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
        let (name, mut unmapped) = regions
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
        assert!(unmapped
            .try_recv()
            .is_err_and(|error| error == tokio::sync::oneshot::error::TryRecvError::Empty));
        // The last view gone, the mapping is, and the receiver learns it.
        drop(held);
        assert!(unmapped
            .try_recv()
            .is_err_and(|error| error == tokio::sync::oneshot::error::TryRecvError::Closed));
    }
}
