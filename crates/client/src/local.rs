//! Local reads: a client on an I/O server's own host reads that server's objects itself,
//! through read-only descriptors the server hands out on its local-reads socket
//! (`freeflow_rpc::local`; the server's side and why it stays correct:
//! `ioserver/src/local_reads.rs`). The bytes come from the page cache the server writes
//! through, with one copy, instead of a request, a copy into the reply, one across the
//! socket and one out of it.
//!
//! A handle asks for a stripe's descriptor at its first read of the stripe and keeps it
//! until it closes (`file.rs`), using it only while the connection that brought it is
//! open: the server closes its connections when it stops serving data, and they close
//! with its process. Every refusal or failure on the way (no local-reads socket, another
//! user, the data gate closed, too many descriptors) sends the read through the RPC path,
//! which is always right; only a failed read of a descriptor is the read's error.

use std::cell::Cell;
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use freeflow_proto::io::{LocalRequest, OpenForReading, OpenedForReading};
use freeflow_proto::WireError;
use freeflow_rpc::local::{local_reads_path, SeqpacketConn};
use freeflow_types::{ObjectId, ServerId};

/// Most object descriptors one client holds for local reads at once, and at most a
/// quarter of its process's descriptor limit (`RLIMIT_NOFILE`), so they never starve its
/// sockets and files; a handle past it reads through the RPC path.
pub const LOCAL_DESCRIPTORS_MAX: usize = 1024;

/// How long a server that could not be reached on its local-reads socket (none there,
/// another user, a failure) is read only through the RPC path before it is tried again.
const UNAVAILABLE_PAUSE: Duration = Duration::from_secs(5);

/// How long an answer on the local-reads socket may take before the read goes through
/// the RPC path (the server answers from its descriptor cache or one `open`).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

thread_local! {
    /// Set while this thread waits for the disk itself ([`reads_in_place`]).
    static IN_PLACE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `work` with the local reads it makes on this thread that miss the page cache
/// waiting for the disk right here, rather than on the runtime's blocking pool: for a
/// caller that is not a runtime worker and would wait for the read anyway (the mount's
/// session thread driving a lone read with `block_on`), this saves two hand-offs between
/// threads, each a wake-up of an idle CPU (a large share of a 4 KiB read from the disk).
/// Reads the work leaves to other tasks still use the pool.
pub fn reads_in_place<R>(work: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            IN_PLACE.with(|flag| flag.set(self.0));
        }
    }
    let _reset = Reset(IN_PLACE.with(|flag| flag.replace(true)));
    work()
}

/// The client's local-reads connections, one per I/O server on this host.
pub(crate) struct LocalReads {
    enabled: bool,
    servers: Mutex<HashMap<ServerId, Arc<LocalServer>>>,
    descriptors: Arc<AtomicUsize>,
    descriptors_max: usize,
}

struct LocalServer {
    /// The local-reads socket.
    path: String,
    state: tokio::sync::Mutex<ServerState>,
}

#[derive(Default)]
struct ServerState {
    connection: Option<Arc<SeqpacketConn>>,
    unavailable_until: Option<Instant>,
}

/// What a server said about an object.
pub(crate) enum Opened {
    Object(Arc<LocalObject>),
    /// No such object yet: it reads as zeros, and a write may make it at any time.
    Missing,
    /// Not through this server's local-reads socket now: use the RPC path.
    Unavailable,
}

impl LocalReads {
    pub(crate) fn new(enabled: bool) -> LocalReads {
        LocalReads {
            enabled,
            servers: Mutex::new(HashMap::new()),
            descriptors: Arc::new(AtomicUsize::new(0)),
            descriptors_max: descriptors_max(),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Ask server `server_id`, at RPC address `address`, for a descriptor of `object`.
    /// Only a server on a Unix socket can be asked.
    pub(crate) async fn open(
        &self,
        server_id: ServerId,
        address: &str,
        object: ObjectId,
    ) -> Opened {
        let Some(socket) = freeflow_rpc::unix_socket_path(address) else {
            return Opened::Unavailable;
        };
        if !self.enabled || self.descriptors.load(Ordering::Relaxed) >= self.descriptors_max {
            return Opened::Unavailable;
        }
        let path = local_reads_path(socket);
        let server = {
            let mut servers = self.servers.lock().expect("not poisoned");
            let entry = servers.entry(server_id).or_insert_with(|| {
                Arc::new(LocalServer {
                    path: path.clone(),
                    state: tokio::sync::Mutex::new(ServerState::default()),
                })
            });
            if entry.path != path {
                // The server moved: a new socket.
                *entry = Arc::new(LocalServer {
                    path,
                    state: tokio::sync::Mutex::new(ServerState::default()),
                });
            }
            Arc::clone(entry)
        };
        let mut state = server.state.lock().await;
        if state
            .unavailable_until
            .is_some_and(|until| Instant::now() < until)
        {
            return Opened::Unavailable;
        }
        // Taken out while a question is on its way: if this future is dropped before the
        // answer is read, the connection is not asked again (its next answer would be
        // this one's).
        let connection = match state.connection.take() {
            Some(connection) if !connection.hung_up() => connection,
            _ => match connect(&server.path) {
                Ok(connection) => Arc::new(connection),
                Err(error) => {
                    tracing::debug!(server_id, path = %server.path, %error, "no local reads from this server for now");
                    state.unavailable_until = Some(Instant::now() + UNAVAILABLE_PAUSE);
                    return Opened::Unavailable;
                }
            },
        };
        let answer = tokio::time::timeout(ANSWER_TIMEOUT, ask(&connection, object)).await;
        if matches!(answer, Ok(Ok(_))) {
            state.connection = Some(Arc::clone(&connection));
        }
        let failure = match answer {
            Ok(Ok(Answer::Exists(descriptor))) => {
                self.descriptors.fetch_add(1, Ordering::Relaxed);
                return Opened::Object(Arc::new(LocalObject {
                    file: std::fs::File::from(descriptor),
                    connection,
                    descriptors: Arc::clone(&self.descriptors),
                }));
            }
            Ok(Ok(Answer::Missing)) => return Opened::Missing,
            // Refused (the data gate closed, another version): the RPC path answers
            // properly, and this connection stays.
            Ok(Ok(Answer::Refused)) => return Opened::Unavailable,
            Ok(Err(reason)) => reason,
            Err(_) => format!("no answer within {ANSWER_TIMEOUT:?}"),
        };
        tracing::warn!(server_id, path = %server.path, "local reads from this server stop for now: {failure}");
        state.unavailable_until = Some(Instant::now() + UNAVAILABLE_PAUSE);
        Opened::Unavailable
    }
}

/// A connection to the local-reads socket at `path`, if what answers there runs as this
/// process's user or as root (another user could hand out any bytes as a file's).
fn connect(path: &str) -> Result<SeqpacketConn, String> {
    let connection =
        SeqpacketConn::connect(std::path::Path::new(path)).map_err(|error| error.to_string())?;
    let peer = connection
        .peer_uid()
        .map_err(|error| format!("cannot tell its user: {error}"))?;
    // SAFETY: geteuid cannot fail.
    let own = unsafe { libc::geteuid() };
    if peer != own && peer != 0 {
        return Err(format!(
            "it runs as user {peer}, neither this process's user {own} nor root"
        ));
    }
    Ok(connection)
}

/// [`LOCAL_DESCRIPTORS_MAX`], or a quarter of this process's descriptor limit if less.
fn descriptors_max() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 0;
    }
    usize::try_from(limit.rlim_cur / 4).map_or(LOCAL_DESCRIPTORS_MAX, |quarter| {
        quarter.min(LOCAL_DESCRIPTORS_MAX)
    })
}

/// A server's answer on the local-reads socket.
enum Answer {
    Exists(std::os::fd::OwnedFd),
    Missing,
    Refused,
}

/// One question on the local-reads socket; Err when the connection failed or the answer
/// made no sense.
async fn ask(connection: &SeqpacketConn, object: ObjectId) -> Result<Answer, String> {
    let request = LocalRequest::Open(OpenForReading {
        version: freeflow_proto::PROTOCOL_VERSION,
        object,
    });
    let (packet, descriptor) = connection
        .ask(&freeflow_proto::encode(&request), None)
        .await?;
    let answer = freeflow_proto::decode::<Result<OpenedForReading, WireError>>(&packet)
        .map_err(|error| error.message)?;
    match (answer, descriptor) {
        (Ok(opened), _) if opened.object != object => Err(format!(
            "an answer about {:?} to a question about {object:?}",
            opened.object
        )),
        (Ok(OpenedForReading { exists: true, .. }), Some(descriptor)) => {
            Ok(Answer::Exists(descriptor))
        }
        (Ok(OpenedForReading { exists: false, .. }), None) => Ok(Answer::Missing),
        (Err(error), None) => {
            tracing::debug!(?object, %error.message, "local read refused");
            Ok(Answer::Refused)
        }
        (answer, descriptor) => Err(format!(
            "an answer {answer:?} with {} descriptor",
            if descriptor.is_some() { "a" } else { "no" }
        )),
    }
}

/// A read-only descriptor of one object, usable while the connection that brought it is
/// open.
pub(crate) struct LocalObject {
    file: std::fs::File,
    connection: Arc<SeqpacketConn>,
    descriptors: Arc<AtomicUsize>,
}

impl Drop for LocalObject {
    fn drop(&mut self) {
        self.descriptors.fetch_sub(1, Ordering::Relaxed);
    }
}

impl LocalObject {
    /// Whether the server still stands behind the descriptor.
    pub(crate) fn usable(&self) -> bool {
        !self.connection.hung_up()
    }

    /// Up to `length` bytes at `offset`: fewer when the object ends first. From the page
    /// cache in the caller's task when all is there; otherwise on a blocking thread.
    pub(crate) async fn read(
        self: &Arc<Self>,
        offset: u64,
        length: usize,
    ) -> std::io::Result<Bytes> {
        // The bytes land on a page boundary, as the page cache holds them (the kernel's
        // copy into a buffer a few bytes off one was measured slower here), in a buffer
        // used before where there is one (see `SPARE_BUFFERS`).
        let mut buffer = spare_buffer(length + PAGE_BYTES - 1);
        let lead = (PAGE_BYTES - buffer.as_ptr() as usize % PAGE_BYTES) % PAGE_BYTES;
        buffer.resize(lead, 0);
        let wanted = lead + length;
        match pread(&self.file, &mut buffer, offset, length, libc::RWF_NOWAIT) {
            Ok(done) if done == length => return Ok(ReadBuffer::bytes(buffer, lead)),
            // Short (part not cached, or the end of the object), none cached, or no
            // RWF_NOWAIT (or preadv2) here: the rest waits for the disk.
            Ok(_) => {}
            Err(error)
                if matches!(
                    error.raw_os_error(),
                    Some(libc::EAGAIN) | Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
                ) => {}
            Err(error) => return Err(error),
        }
        let object = Arc::clone(self);
        let rest = move || {
            while buffer.len() < wanted {
                let (at, want) = (offset + (buffer.len() - lead) as u64, wanted - buffer.len());
                if pread(&object.file, &mut buffer, at, want, 0)? == 0 {
                    break;
                }
            }
            Ok(ReadBuffer::bytes(buffer, lead))
        };
        if IN_PLACE.with(Cell::get) {
            return rest();
        }
        tokio::task::spawn_blocking(rest)
            .await
            .map_err(std::io::Error::other)?
    }
}

/// Read buffers given back by the bytes they held, for the next local reads: a fresh
/// buffer costs the kernel a page fault and the zeroing of every page the read lands on,
/// which measured as much as the copy itself (`freeflow cp` out, docs/BENCHMARKS.md).
/// Bounded by [`SPARE_BUFFER_BYTES`] over the process.
static SPARE_BUFFERS: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// Most bytes of capacity kept in [`SPARE_BUFFERS`].
const SPARE_BUFFER_BYTES: usize = 32 << 20;

/// A buffer with room for `capacity` bytes: a spare one if one is large enough.
fn spare_buffer(capacity: usize) -> Vec<u8> {
    let mut spare = SPARE_BUFFERS.lock().expect("not poisoned");
    match spare
        .iter()
        .position(|buffer| buffer.capacity() >= capacity)
    {
        Some(at) => spare.swap_remove(at),
        None => {
            drop(spare);
            Vec::with_capacity(capacity)
        }
    }
}

/// The bytes of a local read (`lead` bytes into `buffer`); the buffer becomes a spare
/// once the last view of them goes.
struct ReadBuffer {
    buffer: Vec<u8>,
    lead: usize,
}

impl ReadBuffer {
    fn bytes(buffer: Vec<u8>, lead: usize) -> Bytes {
        Bytes::from_owner(ReadBuffer { buffer, lead })
    }
}

impl AsRef<[u8]> for ReadBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.buffer[self.lead..]
    }
}

impl Drop for ReadBuffer {
    fn drop(&mut self) {
        let mut buffer = std::mem::take(&mut self.buffer);
        buffer.clear();
        let mut spare = SPARE_BUFFERS.lock().expect("not poisoned");
        let kept: usize = spare.iter().map(Vec::capacity).sum();
        if kept + buffer.capacity() <= SPARE_BUFFER_BYTES {
            spare.push(buffer);
        }
    }
}

/// Reads land on page boundaries (see [`LocalObject::read`]).
const PAGE_BYTES: usize = 4096;

/// `preadv2` of up to `length` bytes at `offset` appended to `buffer` (which has room:
/// its capacity is at least its length plus `length`). Interrupted calls are retried.
fn pread(
    file: &std::fs::File,
    buffer: &mut Vec<u8>,
    offset: u64,
    length: usize,
    flags: libc::c_int,
) -> std::io::Result<usize> {
    buffer.reserve(length);
    let position = libc::off_t::try_from(offset).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "offset beyond off_t")
    })?;
    loop {
        let spare = buffer.spare_capacity_mut();
        let vector = libc::iovec {
            iov_base: spare.as_mut_ptr().cast(),
            iov_len: length.min(spare.len()),
        };
        // SAFETY: the iovec covers spare capacity of `buffer`, which outlives the call;
        // the kernel writes at most `iov_len` bytes into it.
        let done = unsafe {
            if flags == 0 {
                libc::preadv(file.as_raw_fd(), &vector, 1, position)
            } else {
                libc::preadv2(file.as_raw_fd(), &vector, 1, position, flags)
            }
        };
        if done < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        let done = done as usize;
        // SAFETY: the kernel initialized `done` bytes after the buffer's length.
        unsafe { buffer.set_len(buffer.len() + done) };
        return Ok(done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use freeflow_rpc::local::SeqpacketListener;
    use std::os::fd::AsFd;

    fn object(inode: u64) -> ObjectId {
        ObjectId {
            inode,
            stripe_index: 0,
        }
    }

    /// A fake server's answer to the next question on `connection`: about `about`, with
    /// `file`'s descriptor.
    async fn answer(connection: &SeqpacketConn, about: ObjectId, file: &std::fs::File) {
        let mut packet = vec![0u8; freeflow_rpc::local::LOCAL_PACKET_BYTES_MAX];
        let (length, _) = connection.recv(&mut packet).await.unwrap();
        assert!(length > 0);
        let reply: Result<_, WireError> = Ok(OpenedForReading {
            object: about,
            exists: true,
        });
        connection
            .send(&freeflow_proto::encode(&reply), Some(file.as_fd()))
            .await
            .unwrap();
    }

    /// A read's buffer is used again once the last view of its bytes goes, empty, and the
    /// spares stay within their bound. (Capacities of 3 MiB: no other test here reads
    /// that much, so none takes these.)
    #[test]
    fn a_read_buffer_comes_back_once_its_bytes_go_and_spares_are_bounded() {
        const CAPACITY: usize = (3 << 20) + 1;
        let mut buffer = spare_buffer(CAPACITY);
        buffer.extend_from_slice(&[7u8; 100]);
        let address = buffer.as_ptr();
        let bytes = ReadBuffer::bytes(buffer, 10);
        assert_eq!(&bytes[..], &[7u8; 90][..]);
        let view = bytes.slice(5..20);
        drop(bytes);
        // A view still holds the buffer.
        let other = spare_buffer(CAPACITY);
        assert_ne!(other.as_ptr(), address);
        drop(other);
        drop(view);
        let again = spare_buffer(CAPACITY);
        assert_eq!(again.as_ptr(), address, "the buffer came back");
        assert!(again.is_empty(), "a spare comes back empty");
        drop(again);

        let many: Vec<Bytes> = (0..16)
            .map(|_| ReadBuffer::bytes(spare_buffer(CAPACITY), 0))
            .collect();
        drop(many);
        let kept: usize = SPARE_BUFFERS
            .lock()
            .unwrap()
            .iter()
            .map(Vec::capacity)
            .sum();
        assert!(kept <= SPARE_BUFFER_BYTES, "{kept} bytes of spares");
    }

    /// An answer about another object than the one asked about is refused, and a
    /// question dropped before its answer closes its connection: the next question goes
    /// on a new one, so it can never take the dropped one's answer.
    #[tokio::test]
    async fn an_answer_is_taken_only_for_its_own_question() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("io.sock");
        let address = format!("unix:{}", socket.display());
        let listener = SeqpacketListener::bind(std::path::Path::new(&local_reads_path(
            &socket.to_string_lossy(),
        )))
        .unwrap();
        let file_path = dir.path().join("object");
        std::fs::write(&file_path, b"bytes").unwrap();
        let file = std::fs::File::open(&file_path).unwrap();
        let local = LocalReads::new(true);

        // A question dropped before its answer.
        let first = {
            let asking = local.open(1, &address, object(7));
            let accepted = listener.accept();
            tokio::pin!(asking);
            let connection = tokio::select! {
                connection = accepted => connection.unwrap(),
                _ = &mut asking => panic!("answered without a server"),
            };
            let dropped = tokio::time::timeout(Duration::from_millis(100), &mut asking).await;
            assert!(dropped.is_err(), "no answer was sent");
            connection
        };
        // The client let go of that connection (closed it): a late answer cannot reach
        // the next question.
        tokio::time::timeout(Duration::from_secs(5), first.closed())
            .await
            .expect("the dropped question's connection closed");
        let asking = local.open(1, &address, object(8));
        let serving = async {
            let second = listener.accept().await.unwrap();
            answer(&second, object(8), &file).await;
            second
        };
        let (opened, _second) = tokio::join!(asking, serving);
        assert!(
            matches!(opened, Opened::Object(_)),
            "answered on a new connection"
        );

        // A server answering about another object is not believed.
        let local = LocalReads::new(true);
        let asking = local.open(1, &address, object(9));
        let serving = async {
            let connection = listener.accept().await.unwrap();
            answer(&connection, object(10), &file).await;
            connection
        };
        let (opened, _connection) = tokio::join!(asking, serving);
        assert!(matches!(opened, Opened::Unavailable));
        assert_eq!(local.descriptors.load(Ordering::Relaxed), 0);
    }
}
