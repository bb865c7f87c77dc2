//! The client side: one authenticated connection carrying many requests at once.
//!
//! `call` registers a reply slot under a fresh request id, queues the frame to the writer
//! task and waits for the reader task to hand back the reply with that id, in whatever order
//! replies come. Payload bytes in flight are bounded by the connection's window: the hello
//! gives its first size, and every reply (and an unasked ping reply between them) the size
//! the server grants now (`credit.rs`); a request waits for window before it is sent. When the connection fails every
//! waiting call gets `Disconnected` at once; a call whose reply does not come within the
//! call timeout gets `TimedOut`: never a hang.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use freeflow_proto::frame::{
    FLAG_CREDIT, FLAG_REPLY, OPCODE_AUTHENTICATE, OPCODE_HELLO, OPCODE_PING,
    PAYLOAD_LENGTH_MAX_DEFAULT,
};
use freeflow_proto::handshake::{Authenticate, Hello, ServerProof};
use freeflow_proto::{decode, encode, ErrorCode, Request, WireError};
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{mpsc, oneshot};

use crate::codec::{
    payload_checksum_for, read_frame, read_frame_covering, write_frame, write_frame_with,
    write_shared_frame, FrameExtras, RawFrame, SharedRef,
};
use crate::credit::Window;
use crate::net::Network;
use crate::shared::{PayloadArea, SharedPayload, WriteRegion, REGION_SLOTS};
use crate::transport::{ReadHalf, Transport, WriteHalf};
use crate::{ClusterKey, RpcError};

#[derive(Clone, Debug)]
pub struct ConnectOptions {
    pub client_name: String,
    pub call_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    /// Frames queued for the writer before `call` waits.
    pub send_queue_max: usize,
    /// Sent in the handshake (see `Authenticate::client_id`); 0 for none.
    pub client_id: u64,
    /// A connection with calls waiting that has heard nothing from its server for this
    /// long is taken for dead and closed (its calls fail with `Disconnected`, and callers
    /// that retry go elsewhere or reconnect); after a quarter of it, it pings the server,
    /// which answers at once however long its requests take. This is what finds a server
    /// cut off or hung without closing its socket well before a call times out. 0: never;
    /// below [`LIVENESS_TIMEOUT_MS_MIN`], that.
    pub liveness_timeout_ms: u64,
    /// On a Unix-socket connection to a server with a local socket (an I/O server on this
    /// host), share a region of memory with it and place large write payloads there
    /// instead of sending them through the socket (`crate::shared`). If the server does
    /// not take the region, payloads go through the socket as usual.
    pub shared_payloads: bool,
    /// The client's area to share for that (one for all its connections, so payloads made
    /// in it go to any server without a copy); None: each connection makes its own.
    pub payload_area: Option<Arc<PayloadArea>>,
}

impl Default for ConnectOptions {
    fn default() -> ConnectOptions {
        ConnectOptions {
            client_name: format!("pid-{}", std::process::id()),
            call_timeout_ms: 30_000,
            connect_timeout_ms: 5_000,
            send_queue_max: 1024,
            client_id: 0,
            liveness_timeout_ms: LIVENESS_TIMEOUT_MS_DEFAULT,
            shared_payloads: false,
            payload_area: None,
        }
    }
}

/// Default of [`ConnectOptions::liveness_timeout_ms`].
pub const LIVENESS_TIMEOUT_MS_DEFAULT: u64 = 3_000;
/// The shortest liveness timeout taken: a busy server tells it is alive every 200 ms
/// (`server.rs`, `PONG_INTERVAL`), which must come well within it.
pub const LIVENESS_TIMEOUT_MS_MIN: u64 = 1_000;

type ReplySlot = oneshot::Sender<RawFrame>;

struct Shared {
    address: String,
    pending: Mutex<HashMap<u64, ReplySlot>>,
    closed: AtomicBool,
    /// The connection's reader and writer tasks, ended on close so the socket goes too.
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    /// When the connection was made, and milliseconds after that when its last byte
    /// came in (liveness).
    born: tokio::time::Instant,
    heard_ms: AtomicU64,
    /// Payload bytes this connection may have in flight, as the server last said.
    window: Arc<Window>,
}

impl Shared {
    fn heard(&self) {
        let now = self.born.elapsed().as_millis() as u64;
        self.heard_ms.fetch_max(now, Ordering::Relaxed);
    }

    /// Milliseconds since a byte last came in.
    fn silent_ms(&self) -> u64 {
        let now = self.born.elapsed().as_millis() as u64;
        now.saturating_sub(self.heard_ms.load(Ordering::Relaxed))
    }

    /// Mark the connection dead and fail every waiting call (dropping a slot wakes its call).
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.pending.lock().expect("not poisoned").clear();
        for task in self.tasks.lock().expect("not poisoned").drain(..) {
            task.abort();
        }
    }
}

struct Outgoing {
    opcode: u16,
    flags: u8,
    request_id: u64,
    header: Vec<u8>,
    payload: Bytes,
    /// A payload placed in a shared region instead (`payload` is then empty): its length
    /// and where it is.
    shared: Option<(u32, SharedRef)>,
}

struct Inner {
    shared: Arc<Shared>,
    identity: String,
    epoch: u64,
    sender: mpsc::Sender<Outgoing>,
    next_request_id: AtomicU64,
    payload_length_max: u32,
    call_timeout_ms: u64,
    /// The region large write payloads are placed in, if one is shared with the server.
    region: Option<Arc<WriteRegion>>,
    /// The service's members as the server named them (`ServerProof::members`).
    members: Vec<String>,
}

/// Most members the followers name that a leader search adds to those it knows.
const NAMED_MEMBERS_MAX: usize = 16;

/// How long the member that led last is asked alone before the others are asked too.
const LEADER_HEAD_START_MS: u64 = 50;

/// The metadata members' addresses (comma separated) and which of them led when last
/// reached, so the next connection tries that one first (`Connection::connect_leader`).
#[derive(Debug)]
pub struct LeaderSearch {
    /// Comma separated; replaced by the members a leader names at each connection (members
    /// are added and removed while clients run).
    addresses: std::sync::RwLock<String>,
    preferred: std::sync::atomic::AtomicUsize,
}

impl LeaderSearch {
    pub fn new(addresses: impl Into<String>) -> LeaderSearch {
        LeaderSearch {
            addresses: std::sync::RwLock::new(addresses.into()),
            preferred: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// The members' addresses, comma separated.
    pub fn addresses(&self) -> String {
        self.addresses
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Several members (a replicated metadata cluster) are known.
    pub fn several(&self) -> bool {
        self.addresses().contains(',')
    }

    /// Whether `address` is the member found leading last (the first tried next time).
    pub fn is_preferred(&self, address: &str) -> bool {
        let addresses = self.addresses();
        let list = member_addresses(&addresses);
        if list.len() <= 1 {
            return true;
        }
        list[self.preferred.load(Ordering::Relaxed) % list.len()] == address
    }

    /// The member that led no longer does: the next search starts at the one after it.
    pub fn pass_over(&self) {
        self.preferred.fetch_add(1, Ordering::Relaxed);
    }

    /// Connect to the member that leads, trying first the one that led last time. The
    /// members the leader names replace those known (with the leader first next time).
    pub async fn connect(
        &self,
        key: &ClusterKey,
        options: &ConnectOptions,
    ) -> Result<Connection, RpcError> {
        let first = self.preferred.load(Ordering::Relaxed);
        let addresses = self.addresses();
        let (connection, index) =
            Connection::connect_leader(&addresses, first, key, options).await?;
        self.preferred.store(index, Ordering::Relaxed);
        self.learn(&connection);
        Ok(connection)
    }

    /// Take the members `connection`'s server named, if it named any.
    pub fn learn(&self, connection: &Connection) {
        let named = connection.members();
        if named.is_empty() {
            return;
        }
        let mut addresses = self
            .addresses
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let known: std::collections::BTreeSet<&str> =
            member_addresses(&addresses).into_iter().collect();
        let told: std::collections::BTreeSet<&str> = named.iter().map(String::as_str).collect();
        if known == told {
            return;
        }
        tracing::info!(
            before = %addresses,
            now = %named.join(","),
            "the metadata cluster's members changed"
        );
        let leader = named
            .iter()
            .position(|address| address == connection.address())
            .unwrap_or(0);
        *addresses = named.join(",");
        self.preferred.store(leader, Ordering::Relaxed);
    }
}

/// The members' addresses in a comma-separated list, blanks dropped.
fn member_addresses(addresses: &str) -> Vec<&str> {
    addresses
        .split(',')
        .map(str::trim)
        .filter(|address| !address.is_empty())
        .collect()
}

/// An authenticated, pipelined connection to one server. Clones share it.
#[derive(Clone)]
pub struct Connection {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("address", &self.inner.shared.address)
            .field("identity", &self.inner.identity)
            .finish()
    }
}

impl Connection {
    /// Connect over TCP, or a Unix socket for a `unix:/path` address, and authenticate with
    /// the cluster key.
    pub async fn connect(
        address: &str,
        key: &ClusterKey,
        options: &ConnectOptions,
    ) -> Result<Connection, RpcError> {
        Connection::connect_with(&Network, address, key, options).await
    }

    /// Connect to the metadata server that serves among `addresses` (comma separated,
    /// several for a replicated metadata cluster). A member that does not lead says so
    /// with epoch 0 in its hello and is passed over (with a single address it is taken as
    /// it is). Every member is asked at once, `first` (the one that led last time) a
    /// moment ahead of the others, and the first that answers as leader is taken: a member
    /// cut off or hung costs nothing when another leads, where trying them in turn cost a
    /// whole connect timeout each (a client finding a new leader late can miss the
    /// recovery window in which it replays what the old one answered). Returns the
    /// connection and the index of its address.
    pub async fn connect_leader(
        addresses: &str,
        first: usize,
        key: &ClusterKey,
        options: &ConnectOptions,
    ) -> Result<(Connection, usize), RpcError> {
        Connection::connect_leader_among(addresses, first, key, options, true).await
    }

    /// [`Connection::connect_leader`]; `widen`: when no member leads, ask once more with the
    /// members the followers named (at most `NAMED_MEMBERS_MAX` more), never further.
    async fn connect_leader_among(
        addresses: &str,
        first: usize,
        key: &ClusterKey,
        options: &ConnectOptions,
        widen: bool,
    ) -> Result<(Connection, usize), RpcError> {
        let list = member_addresses(addresses);
        if list.len() <= 1 {
            let connection = Connection::connect(addresses.trim(), key, options).await?;
            return Ok((connection, 0));
        }
        let first = first % list.len();
        let mut asked: futures::stream::FuturesUnordered<_> = list
            .iter()
            .enumerate()
            .map(|(index, address)| async move {
                if index != first {
                    // The last leader usually still leads: let it answer before the others
                    // are troubled with a connection each.
                    tokio::time::sleep(Duration::from_millis(LEADER_HEAD_START_MS)).await;
                }
                (index, Connection::connect(address, key, options).await)
            })
            .collect();
        let mut failures = Vec::new();
        // A member that refuses our key is misconfigured (or not ours): said if no other
        // member leads, but it does not stop the search.
        let mut refused = None;
        // Members the followers named that are not in `list` (added since it was made).
        let mut named: Vec<String> = Vec::new();
        while let Some((index, result)) = futures::StreamExt::next(&mut asked).await {
            match result {
                Ok(connection) if connection.epoch() == 0 => {
                    failures.push(format!("{}: not the leader", list[index]));
                    for member in connection.members() {
                        if named.len() < NAMED_MEMBERS_MAX
                            && !list.contains(&member.as_str())
                            && !named.contains(member)
                        {
                            named.push(member.clone());
                        }
                    }
                }
                Ok(connection) => return Ok((connection, index)),
                Err(error @ RpcError::Refused { .. }) => {
                    failures.push(error.to_string());
                    refused.get_or_insert(error);
                }
                Err(error) => failures.push(error.to_string()),
            }
        }
        if widen && !named.is_empty() {
            // The leader may be among members added since: ask them too, once.
            let mut wider: Vec<String> = list.iter().map(|address| address.to_string()).collect();
            wider.extend(named);
            let wider = wider.join(",");
            let found = Box::pin(Connection::connect_leader_among(
                &wider, first, key, options, false,
            ))
            .await;
            if let Ok((connection, _)) = found {
                let index = member_addresses(addresses)
                    .iter()
                    .position(|address| *address == connection.address())
                    .unwrap_or(0);
                return Ok((connection, index));
            }
        }
        if let Some(error) = refused {
            return Err(error);
        }
        Err(RpcError::Connect {
            address: addresses.to_string(),
            reason: format!("no metadata leader answered ({})", failures.join("; ")),
        })
    }

    pub async fn connect_with(
        transport: &dyn Transport,
        address: &str,
        key: &ClusterKey,
        options: &ConnectOptions,
    ) -> Result<Connection, RpcError> {
        let timeout = Duration::from_millis(options.connect_timeout_ms);
        let (read, write) = match tokio::time::timeout(timeout, transport.connect(address)).await {
            Ok(Ok(halves)) => halves,
            Ok(Err(error)) => {
                return Err(RpcError::Connect {
                    address: address.to_owned(),
                    reason: error.to_string(),
                })
            }
            Err(_) => {
                return Err(RpcError::Connect {
                    address: address.to_owned(),
                    reason: format!("no answer within {} ms", options.connect_timeout_ms),
                })
            }
        };
        let mut reader = BufReader::with_capacity(64 << 10, read);
        let mut writer = BufWriter::with_capacity(64 << 10, write);
        let (hello, members) =
            match tokio::time::timeout(timeout, handshake(&mut reader, &mut writer, key, options))
                .await
            {
                Ok(Ok(answered)) => answered,
                Ok(Err(HandshakeFailure::Refused(reason))) => {
                    return Err(RpcError::Refused {
                        address: address.to_owned(),
                        reason,
                    })
                }
                Ok(Err(HandshakeFailure::Failed(reason))) => {
                    return Err(RpcError::Handshake {
                        address: address.to_owned(),
                        reason,
                    })
                }
                Err(_) => {
                    return Err(RpcError::Handshake {
                        address: address.to_owned(),
                        reason: format!("no handshake within {} ms", options.connect_timeout_ms),
                    })
                }
            };
        let shared = Arc::new(Shared {
            address: address.to_owned(),
            pending: Mutex::default(),
            closed: AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
            born: tokio::time::Instant::now(),
            heard_ms: AtomicU64::new(0),
            // The hello's window first: a ping reply read right after the handshake (the
            // reader starts below) then sets what the server decided since.
            window: Arc::new(Window::new(hello.window_bytes)),
        });
        let (sender, receiver) = mpsc::channel(options.send_queue_max.max(1));
        // Frames on a Unix socket carry no checksum of their payload; the server's Unix
        // listener expects the same.
        let payload_checksum = payload_checksum_for(address);
        let writer_task = tokio::spawn(writer_loop(
            writer,
            receiver,
            shared.clone(),
            payload_checksum,
        ));
        let reply_payload_max = hello.payload_length_max.max(PAYLOAD_LENGTH_MAX_DEFAULT);
        // What the server sent right after its authenticate reply (a ping reply telling the
        // window) may be buffered already: it is read first.
        let early = reader.buffer().to_vec();
        let reader = BufReader::with_capacity(
            64 << 10,
            Heard {
                early,
                inner: reader.into_inner(),
                shared: shared.clone(),
            },
        );
        let reader_task = tokio::spawn(reader_loop(
            reader,
            shared.clone(),
            reply_payload_max,
            payload_checksum,
        ));
        shared
            .tasks
            .lock()
            .expect("not poisoned")
            .extend([writer_task.abort_handle(), reader_task.abort_handle()]);
        // The reader may have failed and closed before its tasks were noted.
        if shared.closed.load(Ordering::Acquire) {
            writer_task.abort();
            reader_task.abort();
        }
        if options.liveness_timeout_ms > 0 {
            tokio::spawn(liveness_loop(
                shared.clone(),
                sender.downgrade(),
                Duration::from_millis(options.liveness_timeout_ms.max(LIVENESS_TIMEOUT_MS_MIN)),
            ));
        }
        let region = match crate::transport::unix_socket_path(address) {
            Some(path) if options.shared_payloads => {
                share_region(path, options.payload_area.clone(), timeout).await
            }
            _ => None,
        };
        Ok(Connection {
            inner: Arc::new(Inner {
                shared,
                identity: hello.identity,
                epoch: hello.epoch,
                sender,
                next_request_id: AtomicU64::new(1),
                payload_length_max: hello.payload_length_max,
                call_timeout_ms: options.call_timeout_ms,
                region,
                members,
            }),
        })
    }

    /// Whether two handles are the same connection.
    pub fn same(a: &Connection, b: &Connection) -> bool {
        std::sync::Arc::ptr_eq(&a.inner, &b.inner)
    }

    pub fn identity(&self) -> &str {
        &self.inner.identity
    }

    /// Where clients reach each member of the service, as the server named them when this
    /// connection was made (empty: a service of one server).
    pub fn members(&self) -> &[String] {
        &self.inner.members
    }

    pub fn address(&self) -> &str {
        &self.inner.shared.address
    }

    pub fn is_closed(&self) -> bool {
        self.inner.shared.closed.load(Ordering::Acquire)
    }

    /// Payload bytes this connection may have in flight now, as its server last granted.
    pub fn window_bytes(&self) -> u32 {
        self.inner.shared.window.size()
    }

    /// Whether large write payloads go through a region of memory shared with the server
    /// (`ConnectOptions::shared_payloads`) rather than through the socket.
    pub fn shares_payloads(&self) -> bool {
        self.inner.region.is_some()
    }

    /// Places of the shared region free for a payload now (None: no region): of the
    /// client's whole payload area when its connections share one.
    pub fn shared_places_free(&self) -> Option<usize> {
        self.inner
            .region
            .as_ref()
            .map(|region| region.free_places())
    }

    /// The largest payload the server accepts in one request.
    pub fn payload_length_max(&self) -> u32 {
        self.inner.payload_length_max
    }

    /// The server's boot epoch from its hello (0: a server without one).
    pub fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    /// Send one request and wait for its reply. Many calls may be in flight at once.
    pub async fn call<R: Request>(
        &self,
        request: &R,
        payload: Bytes,
    ) -> Result<(R::Reply, Bytes), RpcError> {
        let request_id = self.inner.next_request_id.fetch_add(1, Ordering::Relaxed);
        self.call_as(request_id, 0, request, payload).await
    }

    /// [`Connection::call`] under a request id the caller chose and with frame flags: a
    /// client that numbers its requests itself (so that a request sent again on another
    /// connection keeps its number) uses only this on the connection, with ids it never
    /// repeats on it.
    pub async fn call_as<R: Request>(
        &self,
        request_id: u64,
        flags: u8,
        request: &R,
        payload: Bytes,
    ) -> Result<(R::Reply, Bytes), RpcError> {
        let frame = self
            .call_raw(
                R::OPCODE,
                R::NAME,
                request_id,
                flags,
                encode(request),
                payload,
            )
            .await?;
        let inner = &*self.inner;
        let result: Result<R::Reply, WireError> = decode(&frame.header).map_err(|error| {
            // A peer that sends what we cannot decode cannot be trusted with the next reply.
            inner.shared.close();
            RpcError::Protocol {
                address: inner.shared.address.clone(),
                reason: format!("undecodable reply to {}: {}", R::NAME, error.message),
            }
        })?;
        match result {
            Ok(reply) => Ok((reply, frame.payload)),
            Err(error) => Err(RpcError::Remote(error)),
        }
    }

    /// Send an encoded request (`name` is for errors) and return the reply frame as it came:
    /// its header section is the encoded `Result<Reply, WireError>`.
    pub async fn call_raw(
        &self,
        opcode: u16,
        name: &'static str,
        request_id: u64,
        flags: u8,
        header: Vec<u8>,
        payload: Bytes,
    ) -> Result<RawFrame, RpcError> {
        let inner = &*self.inner;
        let address = || inner.shared.address.clone();
        if request_id == 0 {
            return Err(RpcError::Protocol {
                address: address(),
                reason: format!("{name}: request id 0 is the connection's ping"),
            });
        }
        if payload.len() > inner.payload_length_max as usize {
            return Err(RpcError::Remote(WireError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "{name} payload of {} bytes exceeds {}'s bound of {}",
                    payload.len(),
                    address(),
                    inner.payload_length_max
                ),
            )));
        }
        let timeout_ms = inner.call_timeout_ms;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
        let timed_out = || RpcError::TimedOut {
            address: address(),
            request: name,
            timeout_ms,
        };
        // Window credit for the payload; a payload larger than the whole window takes all of
        // it. With no window at all, a ping tells the server credit is wanted.
        let want = || {
            let _ = inner.sender.try_send(Outgoing {
                opcode: OPCODE_PING,
                flags: 0,
                request_id: 0,
                header: Vec::new(),
                payload: Bytes::new(),
                shared: None,
            });
        };
        let window = &inner.shared.window;
        let _credit = match window.try_acquire(payload.len() as u32) {
            Some(credit) => credit,
            None => {
                match tokio::time::timeout_at(deadline, window.acquire(payload.len() as u32, want))
                    .await
                {
                    Ok(credit) => credit,
                    Err(_) => return Err(timed_out()),
                }
            }
        };
        if self.is_closed() {
            return Err(RpcError::Disconnected { address: address() });
        }
        let (slot, reply) = oneshot::channel();
        {
            let mut pending = inner.shared.pending.lock().expect("not poisoned");
            if pending.contains_key(&request_id) {
                return Err(RpcError::Protocol {
                    address: address(),
                    reason: format!("request id {request_id} is already in flight"),
                });
            }
            pending.insert(request_id, slot);
        }
        // Remove the slot however this call ends (timeout, error, or the caller dropping us).
        let _slot_guard = SlotGuard {
            shared: &inner.shared,
            request_id,
        };
        // A large payload for a server on this host goes through the region shared with
        // it, if it has a free place; its place is freed once the reply came.
        let mut placed = inner
            .region
            .as_ref()
            .and_then(|region| region.place(&payload));
        let (payload, shared) = match &placed {
            Some(placed) => (
                Bytes::new(),
                Some((
                    payload.len() as u32,
                    SharedRef {
                        region: placed.region_name(),
                        offset: placed.offset(),
                    },
                )),
            ),
            None => (payload, None),
        };
        let outgoing = Outgoing {
            opcode,
            flags,
            request_id,
            header,
            payload,
            shared,
        };
        // A frame never queued never reached the server: its place is free again.
        let unsent = |placed: &mut Option<SharedPayload>| {
            if let Some(placed) = placed {
                placed.answered();
            }
        };
        match tokio::time::timeout_at(deadline, inner.sender.send(outgoing)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                unsent(&mut placed);
                return Err(RpcError::Disconnected { address: address() });
            }
            Err(_) => {
                unsent(&mut placed);
                return Err(timed_out());
            }
        }
        if self.is_closed() {
            return Err(RpcError::Disconnected { address: address() });
        }
        let frame = match tokio::time::timeout_at(deadline, reply).await {
            Ok(Ok(frame)) => frame,
            Ok(Err(_)) => return Err(RpcError::Disconnected { address: address() }),
            Err(_) => return Err(timed_out()),
        };
        if let Some(placed) = &mut placed {
            placed.answered();
        }
        if frame.fixed.opcode != opcode {
            inner.shared.close();
            return Err(RpcError::Protocol {
                address: address(),
                reason: format!("reply to {name} carries opcode {}", frame.fixed.opcode),
            });
        }
        Ok(frame)
    }
}

/// Share a region for write payloads with the server whose RPC socket is at `socket`, if
/// it has a local socket that takes one; payloads go through the RPC socket otherwise.
async fn share_region(
    socket: &str,
    area: Option<Arc<PayloadArea>>,
    timeout: Duration,
) -> Option<Arc<WriteRegion>> {
    let local = crate::local::local_reads_path(socket);
    // A server without a local socket (a meta server) costs no memory file.
    if !std::path::Path::new(&local).exists() {
        return None;
    }
    let area = match area {
        Some(area) => area,
        None => match PayloadArea::new(REGION_SLOTS) {
            Ok(area) => area,
            Err(error) => {
                tracing::debug!(%local, %error, "no memory file for payloads: write payloads go through the socket");
                return None;
            }
        },
    };
    let shared = tokio::time::timeout(
        timeout,
        WriteRegion::share(std::path::Path::new(&local), area),
    )
    .await;
    match shared {
        Ok(Ok(region)) => Some(region),
        Ok(Err(reason)) => {
            tracing::debug!(%local, %reason, "no shared region: write payloads go through the socket");
            None
        }
        Err(_) => {
            tracing::debug!(%local, "no shared region in time: write payloads go through the socket");
            None
        }
    }
}

struct SlotGuard<'a> {
    shared: &'a Shared,
    request_id: u64,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        self.shared
            .pending
            .lock()
            .expect("not poisoned")
            .remove(&self.request_id);
    }
}

/// Why a handshake failed: the keys differ, or the connection did not carry it through.
enum HandshakeFailure {
    Refused(String),
    Failed(String),
}

impl From<String> for HandshakeFailure {
    fn from(reason: String) -> HandshakeFailure {
        HandshakeFailure::Failed(reason)
    }
}

async fn handshake(
    reader: &mut BufReader<ReadHalf>,
    writer: &mut BufWriter<WriteHalf>,
    key: &ClusterKey,
    options: &ConnectOptions,
) -> Result<(Hello, Vec<String>), HandshakeFailure> {
    let frame = read_frame(reader, 0)
        .await
        .map_err(|error| error.to_string())?;
    if frame.fixed.opcode != OPCODE_HELLO {
        return Err(format!("expected a hello, got opcode {}", frame.fixed.opcode).into());
    }
    let hello: Hello = decode(&frame.header).map_err(|error| error.message)?;
    let client_nonce =
        crate::random_nonce().map_err(|error| format!("no randomness for a nonce: {error}"))?;
    let authenticate = Authenticate {
        proof: crate::proof(key, crate::CLIENT_PROOF_DOMAIN, &hello.nonce),
        client_nonce,
        client_name: options.client_name.clone(),
        client_id: options.client_id,
    };
    write_frame(
        writer,
        0,
        OPCODE_AUTHENTICATE,
        0,
        &encode(&authenticate),
        &[],
    )
    .await
    .map_err(|error| error.to_string())?;
    writer.flush().await.map_err(|error| error.to_string())?;
    let frame = read_frame(reader, 0).await.map_err(|error| match error {
        crate::FrameReadError::Closed | crate::FrameReadError::Truncated => {
            "server closed the connection".to_string()
        }
        other => other.to_string(),
    })?;
    if frame.fixed.opcode != OPCODE_AUTHENTICATE || frame.fixed.flags & FLAG_REPLY == 0 {
        return Err(format!(
            "expected the authenticate reply, got opcode {}",
            frame.fixed.opcode
        )
        .into());
    }
    let outcome: Result<ServerProof, WireError> =
        decode(&frame.header).map_err(|error| error.message)?;
    let server_proof = outcome.map_err(|error| HandshakeFailure::Refused(error.message))?;
    let expected = crate::proof(key, crate::SERVER_PROOF_DOMAIN, &client_nonce);
    if !crate::proofs_equal(&expected, &server_proof.proof) {
        return Err(HandshakeFailure::Refused(
            "the server does not hold this cluster's key".to_string(),
        ));
    }
    Ok((hello, server_proof.members))
}

async fn writer_loop(
    mut writer: BufWriter<WriteHalf>,
    mut receiver: mpsc::Receiver<Outgoing>,
    shared: Arc<Shared>,
    payload_checksum: bool,
) {
    let extras = FrameExtras {
        credit: None,
        payload_checksum,
    };
    let write_one = async |writer: &mut BufWriter<WriteHalf>, outgoing: Outgoing| {
        if let Some((length, at)) = outgoing.shared {
            return write_shared_frame(
                writer,
                outgoing.flags,
                outgoing.opcode,
                outgoing.request_id,
                &outgoing.header,
                length,
                at,
            )
            .await;
        }
        write_frame_with(
            writer,
            extras,
            outgoing.flags,
            outgoing.opcode,
            outgoing.request_id,
            &outgoing.header,
            &outgoing.payload,
        )
        .await
    };
    while let Some(outgoing) = receiver.recv().await {
        let mut result = write_one(&mut writer, outgoing).await;
        // Requests queued together share one flush.
        while result.is_ok() {
            match receiver.try_recv() {
                Ok(outgoing) => result = write_one(&mut writer, outgoing).await,
                Err(_) => break,
            }
        }
        if result.is_err() || writer.flush().await.is_err() {
            shared.close();
            return;
        }
    }
    // Every Connection clone is gone: end the stream so the server closes its side.
    let _ = writer.shutdown().await;
}

/// The read half, noting when bytes come in (a large reply arriving slowly is alive), after
/// the bytes read past the handshake.
struct Heard {
    early: Vec<u8>,
    inner: ReadHalf,
    shared: Arc<Shared>,
}

impl tokio::io::AsyncRead for Heard {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        context: &mut std::task::Context<'_>,
        buffer: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if !self.early.is_empty() {
            let length = self.early.len().min(buffer.remaining());
            buffer.put_slice(&self.early[..length]);
            self.early.drain(..length);
            return std::task::Poll::Ready(Ok(()));
        }
        let before = buffer.filled().len();
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(context, buffer);
        if buffer.filled().len() > before {
            self.shared.heard();
        }
        polled
    }
}

/// While calls wait: ping a server that has been silent for a quarter of `timeout`, and
/// close the connection once it has been silent for all of it. Ends with the connection.
async fn liveness_loop(shared: Arc<Shared>, sender: mpsc::WeakSender<Outgoing>, timeout: Duration) {
    let timeout_ms = timeout.as_millis() as u64;
    let quarter = (timeout / 4).max(Duration::from_millis(1));
    let mut tick = tokio::time::interval(quarter);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Silence before the first call does not count.
    let mut waiting_since: Option<tokio::time::Instant> = None;
    let mut last_tick = tokio::time::Instant::now();
    loop {
        tick.tick().await;
        // This process itself stalled (stopped, starved): replies may sit unread in the
        // socket. Count the silence afresh rather than blame the server.
        let gap = last_tick.elapsed();
        last_tick = tokio::time::Instant::now();
        if gap > quarter * 2 {
            waiting_since = None;
        }
        if shared.closed.load(Ordering::Acquire) {
            return;
        }
        let Some(sender) = sender.upgrade() else {
            return;
        };
        if shared.pending.lock().expect("not poisoned").is_empty() {
            waiting_since = None;
            continue;
        }
        let since = *waiting_since.get_or_insert_with(tokio::time::Instant::now);
        let silent_ms = shared.silent_ms().min(since.elapsed().as_millis() as u64);
        if silent_ms >= timeout_ms {
            tracing::info!(address = %shared.address, silent_ms, "server silent with calls waiting; closing the connection");
            shared.close();
            return;
        }
        if silent_ms >= quarter.as_millis() as u64 {
            let ping = Outgoing {
                opcode: OPCODE_PING,
                flags: 0,
                request_id: 0,
                header: Vec::new(),
                payload: Bytes::new(),
                shared: None,
            };
            // A full queue means calls are being written: no ping needed.
            let _ = sender.try_send(ping);
        }
    }
}

async fn reader_loop(
    mut reader: BufReader<Heard>,
    shared: Arc<Shared>,
    payload_length_max: u32,
    payload_checksum: bool,
) {
    loop {
        let frame =
            match read_frame_covering(&mut reader, payload_length_max, payload_checksum).await {
                Ok(frame) => frame,
                Err(error) => {
                    if !matches!(error, crate::FrameReadError::Closed)
                        && !shared.closed.load(Ordering::Acquire)
                    {
                        tracing::debug!(address = %shared.address, %error, "connection failed");
                    }
                    shared.close();
                    return;
                }
            };
        if frame.fixed.flags & FLAG_REPLY == 0 {
            tracing::warn!(address = %shared.address, opcode = frame.fixed.opcode, "server sent a non-reply frame; closing");
            shared.close();
            return;
        }
        if frame.fixed.flags & FLAG_CREDIT != 0 {
            shared.window.resize(frame.fixed.credit);
        }
        if frame.fixed.opcode == OPCODE_PING {
            continue;
        }
        let slot = shared
            .pending
            .lock()
            .expect("not poisoned")
            .remove(&frame.fixed.request_id);
        // No slot: the call timed out or was dropped; its late reply is discarded.
        if let Some(slot) = slot {
            let _ = slot.send(frame);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LeaderSearch;

    #[test]
    fn the_preferred_member_is_the_one_found_leading_last() {
        let search = LeaderSearch::new("10.0.0.1:7000, 10.0.0.2:7000,10.0.0.3:7000");
        assert!(search.is_preferred("10.0.0.1:7000"));
        assert!(!search.is_preferred("10.0.0.2:7000"));
        search.pass_over();
        assert!(search.is_preferred("10.0.0.2:7000"));
        search.pass_over();
        search.pass_over();
        assert!(search.is_preferred("10.0.0.1:7000"), "wraps around");
        // A single member is always the one to use.
        assert!(LeaderSearch::new("10.0.0.9:7000").is_preferred("anything"));
    }
}
