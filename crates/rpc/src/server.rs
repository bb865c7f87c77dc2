//! The server side: accept, authenticate, then run each connection's requests concurrently.
//!
//! Per connection there is one reader loop and one writer task. The reader admits at most
//! `requests_in_flight_max` requests at once (the server's credit: past it the reader stops
//! reading and TCP pushes back on the client), and apart from them up to
//! `long_polls_in_flight_max` long polls (requests that wait for an event, such as a lock
//! to be given up, rather than for work: counted with the others, a client's waiting lock
//! requests took every slot and held up its lease renewals until its leases lapsed);
//! each admitted request runs as its own task,
//! and its reply is queued to the writer as soon as it is ready, in whatever order requests
//! finish. A frame that is malformed, an unknown opcode, or a request the service refuses
//! closes that connection alone, with the reason logged.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use freeflow_proto::frame::{
    FLAG_REPLY, FLAG_SHARED_PAYLOAD, OPCODE_AUTHENTICATE, OPCODE_HELLO, OPCODE_PING,
    PAYLOAD_LENGTH_MAX_DEFAULT,
};
use freeflow_proto::handshake::{Authenticate, Hello, ServerProof};
use freeflow_proto::{decode, encode, ErrorCode, Request, WireError};
use tokio::io::{AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, Notify, Semaphore};

use crate::codec::{
    read_fixed_header, read_frame_body, read_shared_frame_body, write_frame, write_frame_with,
    FrameExtras, FrameLimits, FrameReadError,
};
use crate::credit::{Credit, CreditBook, Window};
use crate::metrics::ServerMetrics;
use crate::net::Accept;
use crate::shared::SharedRegions;
use crate::transport::{ReadHalf, WriteHalf};
use crate::ClusterKey;

/// One request as received by a server.
#[derive(Debug)]
pub struct Frame {
    pub opcode: u16,
    /// The frame's flags (`FLAG_RESEND`, `FLAG_REPLAY`; never `FLAG_REPLY` on a request).
    pub flags: u8,
    pub request_id: u64,
    pub header: Bytes,
    pub payload: Bytes,
}

/// A reply: the header section is `encode(&Result<R::Reply, WireError>)`.
#[derive(Debug)]
pub struct Reply {
    pub header: Bytes,
    pub payload: Bytes,
}

impl Reply {
    pub fn error<R: Request>(error: WireError) -> Reply {
        Reply {
            header: encode(&Err::<R::Reply, WireError>(error)).into(),
            payload: Bytes::new(),
        }
    }
}

/// Who sent a request.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    /// `ip:port` of a TCP peer, `unix` for a peer on a Unix socket.
    pub address: String,
    pub client_name: String,
    /// The client's id from its handshake (0: a peer without one).
    pub client_id: u64,
}

/// What a server implements. `Err(reason)` closes the connection with `reason` logged.
pub trait Service: Send + Sync + 'static {
    fn call(
        &self,
        frame: Frame,
        peer: &PeerInfo,
    ) -> impl Future<Output = Result<Reply, String>> + Send;

    /// The most reply payload bytes this request may bring back (a read's length): they
    /// are taken from the connection's window and the server's payload budget before the
    /// request runs and given back once its reply is written, as a request's own payload
    /// is, so replies in memory stay within the budget too. `header` is the request's
    /// encoded message. Default 0: replies without a payload to speak of.
    fn reply_bytes(&self, _opcode: u16, _header: &[u8]) -> u32 {
        0
    }
}

/// A reply on its way to the writer, with the room its payload was given (if any), which
/// goes back once the reply is written.
type Queued = (u16, u64, Reply, Option<ReplyRoom>);

struct ReplyRoom {
    _credit: Credit,
    _budget: tokio::sync::OwnedSemaphorePermit,
}

/// Run a typed handler: decode `R` from the frame, run `f`, encode its result.
pub async fn handle<R, F, Fut>(frame: Frame, f: F) -> Result<Reply, String>
where
    R: Request,
    F: FnOnce(R, Bytes) -> Fut,
    Fut: Future<Output = Result<(R::Reply, Bytes), WireError>>,
{
    let request: R = decode(&frame.header)
        .map_err(|error| format!("undecodable {} request: {}", R::NAME, error.message))?;
    let (header, payload) = match f(request, frame.payload).await {
        Ok((reply, payload)) => (encode(&Ok::<R::Reply, WireError>(reply)), payload),
        Err(error) => (encode(&Err::<R::Reply, WireError>(error)), Bytes::new()),
    };
    Ok(Reply {
        header: header.into(),
        payload,
    })
}

#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// "meta" or "io:<server id>", sent in the hello.
    pub identity: String,
    /// Payload bytes a client may have in flight on one connection.
    pub window_bytes: u32,
    /// Largest payload accepted in one frame.
    pub payload_length_max: u32,
    /// Requests of one connection being served at once (long polls apart).
    pub requests_in_flight_max: u32,
    /// Opcodes of long polls: requests that may wait for an event as long as the client
    /// asked (a lock wait, a poll for revocations). They take slots of their own.
    pub long_poll_opcodes: Vec<u16>,
    /// Long polls of one connection waiting at once; past it the reader stops reading.
    pub long_polls_in_flight_max: u32,
    /// Request payload bytes held by the whole server at once (all connections); a frame
    /// whose payload does not fit waits before it is read, pushing back on its sender.
    pub payload_bytes_in_flight_max: u64,
    /// Connections served at once; further ones are closed at accept.
    pub connections_max: u32,
    /// Connections still authenticating at once: unauthenticated peers cannot take the
    /// slots of real clients.
    pub handshakes_max: u32,
    /// Time a new connection has to authenticate.
    pub handshake_timeout_ms: u64,
    /// Time a frame has to arrive completely once its first byte is here.
    pub frame_timeout_ms: u64,
    /// Where to count requests, bytes, service times and connections; None counts nothing.
    pub metrics: Option<ServerMetrics>,
    /// Sent in the hello: the server's boot epoch (0: none).
    pub epoch: u64,
    /// Regions clients on this host shared for their write payloads (`crate::shared`);
    /// None: a frame with a shared payload closes its connection.
    pub shared_regions: Option<Arc<SharedRegions>>,
    /// The service's members, sent to each client once it is authenticated (see
    /// `ServerProof::members`); None: none sent.
    pub members: Option<MemberList>,
}

/// Where clients reach each member of a service with several, asked at every handshake.
#[derive(Clone)]
pub struct MemberList(pub Arc<dyn Fn() -> Vec<String> + Send + Sync>);

impl std::fmt::Debug for MemberList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("MemberList").field(&(self.0)()).finish()
    }
}

impl ServerOptions {
    pub fn new(identity: impl Into<String>) -> ServerOptions {
        ServerOptions {
            identity: identity.into(),
            window_bytes: 64 << 20,
            payload_length_max: PAYLOAD_LENGTH_MAX_DEFAULT,
            requests_in_flight_max: 128,
            long_poll_opcodes: Vec::new(),
            long_polls_in_flight_max: 4096,
            payload_bytes_in_flight_max: 512 << 20,
            connections_max: 4096,
            handshakes_max: 128,
            handshake_timeout_ms: 5000,
            frame_timeout_ms: 30_000,
            metrics: None,
            epoch: 0,
            shared_regions: None,
            members: None,
        }
    }
}

/// The longest header section accepted before authentication: the authenticate message
/// is about a hundred bytes, so nothing larger is allocated for an unknown peer.
const HANDSHAKE_HEADER_LENGTH_MAX: u32 = 4096;

/// State shared by all connections of one server.
struct ServerShared {
    options: ServerOptions,
    key: ClusterKey,
    handshakes: Semaphore,
    payload_bytes: Arc<Semaphore>,
    /// Every connection's window (credits), shared out of `payload_bytes`.
    book: Arc<CreditBook>,
}

impl ServerShared {
    fn new(options: ServerOptions, key: ClusterKey, handshakes: usize) -> ServerShared {
        let budget_bytes = options
            .payload_bytes_in_flight_max
            .max(u64::from(options.payload_length_max))
            .min(Semaphore::MAX_PERMITS as u64);
        let payload_bytes = Arc::new(Semaphore::new(budget_bytes as usize));
        let book = CreditBook::new(
            payload_bytes.clone(),
            budget_bytes,
            options.window_bytes.max(1),
            options.metrics.clone(),
        );
        ServerShared {
            handshakes: Semaphore::new(handshakes.max(1)),
            payload_bytes,
            book,
            options,
            key,
        }
    }
}

/// Accept connections forever. Abort the task running it to stop: that also ends every
/// connection it accepted (they live in its `JoinSet`), so a stopped server holds no
/// sockets and no references to its service.
pub async fn serve<S: Service>(
    listener: impl Accept,
    key: ClusterKey,
    options: ServerOptions,
    service: Arc<S>,
) -> std::io::Result<()> {
    serve_with_unix(listener, None, key, options, service).await
}

/// As [`serve`], accepting on a Unix socket too (peers on this host); the two share the
/// limits (connections, handshakes, payload budget).
pub async fn serve_with_unix<S: Service>(
    listener: impl Accept,
    unix: Option<UnixListener>,
    key: ClusterKey,
    options: ServerOptions,
    service: Arc<S>,
) -> std::io::Result<()> {
    let connections_max = options.connections_max as usize;
    let handshakes = options.handshakes_max as usize;
    let shared = Arc::new(ServerShared::new(options, key, handshakes));
    let _share_out = AbortOnDrop(tokio::spawn(shared.book.clone().run()));
    let mut connections = tokio::task::JoinSet::new();
    // A listener whose accept failed rests a little (running out of descriptors or a reset
    // during accept is transient); the other keeps accepting meanwhile.
    let pause = Duration::from_millis(50);
    let (mut tcp_rests_until, mut unix_rests_until) = (None, None);
    loop {
        while connections.try_join_next().is_some() {}
        let accepted = tokio::select! {
            accepted = accept_after(tcp_rests_until, listener.accept()) => match accepted {
                Ok((read, write, address)) => {
                    tcp_rests_until = None;
                    (read, write, address, true)
                }
                Err(error) => {
                    tracing::warn!(%error, "accept on TCP failed; retrying");
                    tcp_rests_until = Some(tokio::time::Instant::now() + pause);
                    continue;
                }
            },
            accepted = accept_after(unix_rests_until, accept_unix(unix.as_ref())) => match accepted {
                Ok(stream) => {
                    unix_rests_until = None;
                    crate::transport::widen_send_buffer(&stream);
                    let (read, write) = stream.into_split();
                    // Frames on a Unix socket carry no checksum of their payload
                    // (`payload_checksum_for`, the client's side of the same rule).
                    (Box::new(read) as ReadHalf, Box::new(write) as WriteHalf, "unix".to_string(), false)
                }
                Err(error) => {
                    tracing::warn!(%error, "accept on the Unix socket failed; retrying");
                    unix_rests_until = Some(tokio::time::Instant::now() + pause);
                    continue;
                }
            },
        };
        let (read, write, address, payload_checksum) = accepted;
        while connections.try_join_next().is_some() {}
        if connections.len() >= connections_max {
            tracing::warn!(peer = %address, limit = connections_max, "refusing connection: too many connections");
            if let Some(metrics) = &shared.options.metrics {
                metrics.connection_refused();
            }
            continue;
        }
        let (shared, service) = (shared.clone(), service.clone());
        connections.spawn(async move {
            run_connection(read, write, address, payload_checksum, shared, service).await;
        });
    }
}

/// `accept` once `rests_until` has passed.
async fn accept_after<T>(
    rests_until: Option<tokio::time::Instant>,
    accept: impl std::future::Future<Output = T>,
) -> T {
    if let Some(deadline) = rests_until {
        tokio::time::sleep_until(deadline).await;
    }
    accept.await
}

/// The next connection on the Unix socket, or never without one.
async fn accept_unix(unix: Option<&UnixListener>) -> std::io::Result<tokio::net::UnixStream> {
    match unix {
        Some(listener) => listener.accept().await.map(|(stream, _)| stream),
        None => std::future::pending().await,
    }
}

/// Serve one connection of a stream pair accepted elsewhere (another transport), with
/// its own limits. Returns when the connection closes.
pub async fn serve_connection<S: Service>(
    read: ReadHalf,
    write: WriteHalf,
    address: SocketAddr,
    key: ClusterKey,
    options: Arc<ServerOptions>,
    service: Arc<S>,
) {
    let address = address.to_string();
    let options = (*options).clone();
    let shared = Arc::new(ServerShared::new(options, key, 1));
    let _share_out = AbortOnDrop(tokio::spawn(shared.book.clone().run()));
    run_connection(read, write, address, true, shared, service).await;
}

/// `payload_checksum`: whether frames' checksums cover their payloads both ways (the
/// client decides the same from the address it dialled: `payload_checksum_for`).
async fn run_connection<S: Service>(
    read: ReadHalf,
    write: WriteHalf,
    address: String,
    payload_checksum: bool,
    shared: Arc<ServerShared>,
    service: Arc<S>,
) {
    let options = &shared.options;
    let metrics = options.metrics.clone();
    let timeout = Duration::from_millis(options.handshake_timeout_ms);
    // Many clients connecting at once (a job starting on many nodes) wait their turn for a
    // handshake slot, at most one handshake timeout, holding nothing but their socket;
    // peers that never authenticate hold a slot for one timeout at most.
    let Ok(Ok(handshake_slot)) = tokio::time::timeout(timeout, shared.handshakes.acquire()).await
    else {
        tracing::warn!(peer = %address, limit = options.handshakes_max, "closing connection: no handshake slot came free within handshake_timeout_ms");
        if let Some(metrics) = &metrics {
            metrics.connection_refused();
        }
        return;
    };
    let mut reader = BufReader::with_capacity(64 << 10, read);
    let mut writer = BufWriter::with_capacity(64 << 10, write);
    let (client_name, client_id) = match tokio::time::timeout(
        timeout,
        handshake(
            &mut reader,
            &mut writer,
            &shared.key,
            options,
            shared.book.window_min(),
        ),
    )
    .await
    {
        Ok(Ok(client)) => client,
        Ok(Err(reason)) => {
            tracing::warn!(peer = %address, "closing connection during handshake: {reason}");
            if let Some(metrics) = &metrics {
                metrics.handshake_failed();
            }
            return;
        }
        Err(_) => {
            tracing::warn!(peer = %address, "closing connection: no handshake within {} ms", options.handshake_timeout_ms);
            if let Some(metrics) = &metrics {
                metrics.handshake_failed();
            }
            return;
        }
    };
    drop(handshake_slot);
    let account = shared.book.open(shared.book.window_min());
    let _open = metrics.clone().map(OpenConnection::new);
    let peer = Arc::new(PeerInfo {
        address: address.clone(),
        client_name,
        client_id,
    });

    let in_flight_max = options.requests_in_flight_max.max(1) as usize;
    let (reply_sender, reply_receiver) = mpsc::channel::<Queued>(in_flight_max);
    // Aborted if this connection's task is aborted (server shutdown), so the socket closes.
    let mut writer_task = AbortOnDrop(tokio::spawn(writer_loop(
        writer,
        reply_receiver,
        account.window.clone(),
        payload_checksum,
    )));
    // A window changed between replies reaches the client in an unasked ping reply.
    let _tell_credit = AbortOnDrop(tokio::spawn(tell_credit(
        account.changed.clone(),
        reply_sender.downgrade(),
    )));
    let in_flight = Arc::new(Semaphore::new(in_flight_max));
    let long_polls = Arc::new(Semaphore::new(
        options.long_polls_in_flight_max.max(1) as usize
    ));
    let close = Arc::new(Notify::new());
    let close_reason: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let frame_timeout = Duration::from_millis(options.frame_timeout_ms);
    let limits = FrameLimits {
        header_length_max: freeflow_proto::frame::HEADER_LENGTH_MAX,
        payload_length_max: options.payload_length_max,
        header_timeout: Some(frame_timeout),
        payload_checksum,
    };
    // Requests belong to their connection: when it ends, those still running are dropped.
    let mut requests = tokio::task::JoinSet::new();
    let take_reason = || close_reason.lock().expect("not poisoned").take();

    let reason = loop {
        while requests.try_join_next().is_some() {}
        // An idle connection may wait for its next request as long as it likes.
        let fixed = tokio::select! {
            fixed = read_fixed_header(&mut reader, &limits) => fixed,
            () = close.notified() => break take_reason(),
        };
        let fixed = match fixed {
            Ok(fixed) => fixed,
            Err(FrameReadError::Closed) => break None,
            Err(error) => break Some(error.to_string()),
        };
        let header = fixed.header;
        if header.flags & FLAG_REPLY != 0 {
            break Some(format!(
                "client sent a reply frame (opcode {})",
                header.opcode
            ));
        }
        if header.opcode == OPCODE_HELLO || header.opcode == OPCODE_AUTHENTICATE {
            break Some("handshake frame after the handshake".to_string());
        }
        if header.opcode == OPCODE_PING {
            // Answered here, outside the request limits: it asks whether this connection
            // is alive, not whether the service is idle.
            // A client with no window at all pings to say it wants credit.
            if account.window.size() == 0 {
                account.want();
            }
            if header.header_length != 0 || header.payload_length != 0 {
                break Some("ping frame with a body".to_string());
            }
            let pong = Reply {
                header: Bytes::new(),
                payload: Bytes::new(),
            };
            if reply_sender
                .send((OPCODE_PING, header.request_id, pong, None))
                .await
                .is_err()
            {
                break None;
            }
            continue;
        }
        let rooms = Rooms {
            metrics: &metrics,
            replies: &reply_sender,
            close: &close,
        };
        // This connection's credit for the payload (its window, which the client keeps to;
        // a client that overran a shrink waits here), a request slot, then room in the
        // server-wide budget, all before the body is read.
        let credit = if header.payload_length == 0 {
            None
        } else {
            let length = header.payload_length;
            account.want();
            let wait = || account.window.acquire(length, || account.want());
            let free = account.window.try_acquire(length);
            match rooms.take(free, wait, ServerMetrics::window_wait).await {
                Some(credit) => Some(credit),
                None => break take_reason(),
            }
        };
        let slots = if options.long_poll_opcodes.contains(&header.opcode) {
            &long_polls
        } else {
            &in_flight
        };
        let Some(permit) = rooms
            .take(
                slots.clone().try_acquire_owned().ok(),
                || acquire_owned(slots, 1),
                ServerMetrics::credit_wait,
            )
            .await
        else {
            break take_reason();
        };
        let Some(payload_permit) = rooms
            .take(
                (shared.payload_bytes.clone())
                    .try_acquire_many_owned(header.payload_length)
                    .ok(),
                || acquire_owned(&shared.payload_bytes, header.payload_length),
                ServerMetrics::budget_wait,
            )
            .await
        else {
            break take_reason();
        };
        // Once a frame has begun, all of it must come within the frame timeout.
        let shared_payload = header.flags & FLAG_SHARED_PAYLOAD != 0;
        let body = async {
            if !shared_payload {
                return read_frame_body(&mut reader, fixed)
                    .await
                    .map_err(|error| error.to_string());
            }
            // Only a Unix-socket peer on this host can have shared a region.
            let regions = match &options.shared_regions {
                Some(regions) if !payload_checksum => regions,
                _ => return Err("a shared payload where none can be".to_string()),
            };
            let (mut frame, at) = read_shared_frame_body(&mut reader, fixed)
                .await
                .map_err(|error| error.to_string())?;
            frame.payload = regions
                .payload(at.region, at.offset, header.payload_length)
                .ok_or_else(|| {
                    format!(
                        "a shared payload of {} bytes at {} of a region not shared or not that long",
                        header.payload_length, at.offset
                    )
                })?;
            Ok(frame)
        };
        let frame = match tokio::time::timeout(frame_timeout, body).await {
            Ok(Ok(frame)) => {
                if let (true, Some(metrics)) = (shared_payload, &metrics) {
                    metrics.shared_payload(u64::from(header.payload_length));
                }
                frame
            }
            Ok(Err(reason)) => break Some(reason),
            Err(_) => {
                break Some(format!(
                    "frame not completed within {} ms",
                    options.frame_timeout_ms
                ))
            }
        };
        // Room for what the reply brings back (reads), from the window and the budget.
        let reply_bytes = service
            .reply_bytes(header.opcode, &frame.header)
            .min(options.payload_length_max);
        let reply_room = if reply_bytes == 0 {
            None
        } else {
            account.want();
            let wait = || account.window.acquire(reply_bytes, || account.want());
            let free = account.window.try_acquire(reply_bytes);
            let Some(credit) = rooms.take(free, wait, ServerMetrics::window_wait).await else {
                break take_reason();
            };
            let Some(budget) = rooms
                .take(
                    (shared.payload_bytes.clone())
                        .try_acquire_many_owned(reply_bytes)
                        .ok(),
                    || acquire_owned(&shared.payload_bytes, reply_bytes),
                    ServerMetrics::budget_wait,
                )
                .await
            else {
                break take_reason();
            };
            Some(ReplyRoom {
                _credit: credit,
                _budget: budget,
            })
        };
        let request = Frame {
            opcode: header.opcode,
            flags: header.flags,
            request_id: header.request_id,
            header: frame.header,
            payload: frame.payload,
        };
        let (service, peer, sender) = (service.clone(), peer.clone(), reply_sender.clone());
        let (close, close_reason) = (close.clone(), close_reason.clone());
        let mut timer = metrics
            .as_ref()
            .map(|metrics| metrics.request_started(header.opcode, request.payload.len() as u64));
        requests.spawn(async move {
            let (opcode, request_id) = (request.opcode, request.request_id);
            let outcome = service.call(request, &peer).await;
            drop(payload_permit);
            drop(credit);
            if let (Some(timer), Ok(reply)) = (&mut timer, &outcome) {
                timer.replied(reply.payload.len() as u64);
            }
            drop(timer);
            match outcome {
                Ok(reply) => {
                    let _ = sender.send((opcode, request_id, reply, reply_room)).await;
                }
                Err(reason) => {
                    close_reason
                        .lock()
                        .expect("not poisoned")
                        .get_or_insert(reason);
                    close.notify_one();
                }
            }
            drop(permit);
        });
    };
    if let Some(reason) = reason {
        tracing::warn!(peer = %address, client = %peer.client_name, "closing connection: {reason}");
    }
    drop(requests);
    drop(reply_sender);
    let _ = (&mut writer_task.0).await;
}

/// How often a connection whose reading waits for room (its requests at their limit, or
/// the server's payload budget used up) tells its client it is alive: the pings behind the
/// waiting frame are not read meanwhile. Well under any client's liveness timeout.
const PONG_INTERVAL: Duration = Duration::from_millis(200);

/// What a connection's reading waits on before it takes the next request: where to count a
/// wait, where pings go meanwhile, and the connection's close.
struct Rooms<'a> {
    metrics: &'a Option<ServerMetrics>,
    replies: &'a mpsc::Sender<Queued>,
    close: &'a Notify,
}

impl Rooms<'_> {
    /// `free` if it is there (taken without waiting); else count the wait with `count` and
    /// wait for `wait()`, pinging the client meanwhile. None: the connection is closing.
    async fn take<T, F: Future<Output = T>>(
        &self,
        free: Option<T>,
        wait: impl FnOnce() -> F,
        count: fn(&ServerMetrics),
    ) -> Option<T> {
        if free.is_some() {
            return free;
        }
        if let Some(metrics) = self.metrics {
            count(metrics);
        }
        tokio::select! {
            room = with_pongs(wait(), self.replies) => Some(room),
            () = self.close.notified() => None,
        }
    }
}

/// `permits` of a semaphore that is never closed, owned.
async fn acquire_owned(
    semaphore: &Arc<Semaphore>,
    permits: u32,
) -> tokio::sync::OwnedSemaphorePermit {
    semaphore
        .clone()
        .acquire_many_owned(permits)
        .await
        .expect("semaphore never closed")
}

/// Wait for `room`, sending the client an unasked ping reply every [`PONG_INTERVAL`]
/// meanwhile (a busy server is alive; the client ignores these replies).
async fn with_pongs<T>(room: impl Future<Output = T>, replies: &mpsc::Sender<Queued>) -> T {
    tokio::pin!(room);
    loop {
        tokio::select! {
            ready = &mut room => return ready,
            () = tokio::time::sleep(PONG_INTERVAL) => {
                let pong = Reply {
                    header: Bytes::new(),
                    payload: Bytes::new(),
                };
                // A full queue is replies on their way: the client hears those.
                let _ = replies.try_send((OPCODE_PING, 0, pong, None));
            }
        }
    }
}

/// Counts an authenticated connection as open until dropped.
struct OpenConnection(ServerMetrics);

impl OpenConnection {
    fn new(metrics: ServerMetrics) -> OpenConnection {
        metrics.connection_opened();
        OpenConnection(metrics)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.connection_closed();
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Send an unasked ping reply (it carries the window, as every reply does) each time the
/// connection's window changes; ends with the connection.
async fn tell_credit(changed: Arc<Notify>, replies: mpsc::WeakSender<Queued>) {
    loop {
        changed.notified().await;
        let Some(replies) = replies.upgrade() else {
            return;
        };
        let pong = Reply {
            header: Bytes::new(),
            payload: Bytes::new(),
        };
        // A full queue is replies on their way: they carry the new window.
        let _ = replies.try_send((OPCODE_PING, 0, pong, None));
    }
}

async fn writer_loop<W: AsyncWrite + Unpin>(
    mut writer: BufWriter<W>,
    mut replies: mpsc::Receiver<Queued>,
    window: Arc<Window>,
    payload_checksum: bool,
) {
    while let Some(first) = replies.recv().await {
        // Replies that finish together share one flush: write every one that is ready.
        let mut next = Some(first);
        while let Some((opcode, request_id, reply, _room)) = next {
            let extras = FrameExtras {
                credit: Some(window.size()),
                payload_checksum,
            };
            let written = write_frame_with(
                &mut writer,
                extras,
                FLAG_REPLY,
                opcode,
                request_id,
                &reply.header,
                &reply.payload,
            )
            .await;
            if written.is_err() {
                return;
            }
            next = replies.try_recv().ok();
        }
        if writer.flush().await.is_err() {
            return;
        }
    }
    let _ = writer.shutdown().await;
}

/// Server half of the handshake; returns the client's name and id.
async fn handshake(
    reader: &mut BufReader<ReadHalf>,
    writer: &mut BufWriter<WriteHalf>,
    key: &ClusterKey,
    options: &ServerOptions,
    window_bytes: u32,
) -> Result<(String, u64), String> {
    let nonce =
        crate::random_nonce().map_err(|error| format!("no randomness for a nonce: {error}"))?;
    let hello = Hello {
        nonce,
        identity: options.identity.clone(),
        window_bytes,
        payload_length_max: options.payload_length_max,
        epoch: options.epoch,
    };
    write_frame(writer, 0, OPCODE_HELLO, 0, &encode(&hello), &[])
        .await
        .map_err(|error| error.to_string())?;
    writer.flush().await.map_err(|error| error.to_string())?;
    let limits = FrameLimits {
        header_length_max: HANDSHAKE_HEADER_LENGTH_MAX,
        payload_length_max: 0,
        header_timeout: None,
        // Handshake frames have no payload.
        payload_checksum: true,
    };
    let fixed = read_fixed_header(reader, &limits)
        .await
        .map_err(|error| error.to_string())?;
    let frame = read_frame_body(reader, fixed)
        .await
        .map_err(|error| error.to_string())?;
    if frame.fixed.opcode != OPCODE_AUTHENTICATE || frame.fixed.flags & FLAG_REPLY != 0 {
        return Err(format!(
            "expected the authenticate frame, got opcode {}",
            frame.fixed.opcode
        ));
    }
    let authenticate: Authenticate = decode(&frame.header).map_err(|error| error.message)?;
    let expected = crate::proof(key, crate::CLIENT_PROOF_DOMAIN, &nonce);
    let outcome = if crate::proofs_equal(&expected, &authenticate.proof) {
        Ok(ServerProof {
            proof: crate::proof(key, crate::SERVER_PROOF_DOMAIN, &authenticate.client_nonce),
            members: options
                .members
                .as_ref()
                .map(|members| (members.0)())
                .unwrap_or_default(),
        })
    } else {
        Err(WireError::new(
            ErrorCode::PermissionDenied,
            "wrong cluster key",
        ))
    };
    let refused = outcome.is_err();
    write_frame(
        writer,
        FLAG_REPLY,
        OPCODE_AUTHENTICATE,
        frame.fixed.request_id,
        &encode(&outcome),
        &[],
    )
    .await
    .map_err(|error| error.to_string())?;
    writer.flush().await.map_err(|error| error.to_string())?;
    if refused {
        return Err(format!(
            "client {:?} presented a wrong cluster key",
            authenticate.client_name
        ));
    }
    Ok((authenticate.client_name, authenticate.client_id))
}
