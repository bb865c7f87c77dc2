//! The client against an in-process cluster of fakes: a meta server with an in-memory
//! namespace and I/O servers keeping objects in memory, all behind the real RPC layer.
//! The fakes are small enough to trust, so these tests pin the client's own behaviour:
//! striping, parallel and ordered writes, holes, truncation, fsync, throttling, errors
//! from a server that is down, sessions lost at the meta server, and the path API.
//!
//! The fake meta server does not cut objects on a size change (the real one does, and
//! `real_cluster.rs` checks that end to end); these tests check what the client controls.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use freeflow_client::{
    Attr, Client, ClientConfig, ClusterKey, ErrorCode, FileKind, InodeId, Layout, OpenAccess,
    OpenOptions, SetAttr, TimeSpec, ROOT_INODE,
};
use freeflow_proto::io::{
    ObjectSpace, ReadObject, ReadReply, RemoveObjects, ReserveSpace, SpaceGrant, SyncObjects,
    TruncateObject, WriteObject,
};
use freeflow_proto::meta::*;
use freeflow_proto::{Request, WireError};
use freeflow_rpc::{handle, serve, Frame, PeerInfo, Reply, ServerOptions, Service};
use freeflow_types::{ObjectId, ServerId};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

fn wire(code: ErrorCode, message: &str) -> WireError {
    WireError::new(code, message)
}

/// Run a synchronous typed handler for request type R.
async fn typed<R: Request>(
    frame: Frame,
    f: impl FnOnce(R, Bytes) -> Result<(R::Reply, Bytes), WireError>,
) -> Result<Reply, String> {
    handle::<R, _, _>(frame, |request, payload| {
        let result = f(request, payload);
        async move { result }
    })
    .await
}

// ---------- fake meta server ----------

struct MetaState {
    next_inode: InodeId,
    inodes: HashMap<InodeId, Attr>,
    entries: BTreeMap<(InodeId, String), InodeId>,
    targets: HashMap<InodeId, String>,
    next_handle: u64,
    next_first_server: usize,
    commits: u64,
    /// Sessions the server knows (forgotten all at once by a simulated restart).
    sessions: HashSet<u64>,
    sessions_opened: u64,
}

struct FakeMeta {
    state: Mutex<MetaState>,
    servers: Mutex<Vec<ServerRecord>>,
    stripe_unit_bytes: u32,
    stripe_count: usize,
    /// Every CommitSize sleeps this long before it is applied.
    commit_delay_ms: AtomicU64,
    /// Every GetAttr reads the attributes when it arrives and answers this long after (a
    /// reply overtaken by later changes, as a real server's read may be).
    getattr_delay_ms: AtomicU64,
    /// SetAttributes with a size is refused with NotPermitted.
    refuse_size_changes: AtomicBool,
}

fn new_attr(inode: InodeId, kind: FileKind, permissions: u32, layout: Option<Layout>) -> Attr {
    Attr {
        inode,
        kind,
        permissions,
        link_count: 1,
        user_id: 0,
        group_id: 0,
        size_bytes: 0,
        access_time: TimeSpec::default(),
        modify_time: TimeSpec::default(),
        change_time: TimeSpec::default(),
        birth_time: TimeSpec::default(),
        device: 0,
        layout,
        generation: 1,
        allocated_bytes: 0,
    }
}

impl FakeMeta {
    fn new(stripe_unit_bytes: u32, stripe_count: usize) -> FakeMeta {
        let mut inodes = HashMap::new();
        inodes.insert(
            ROOT_INODE,
            new_attr(ROOT_INODE, FileKind::Directory, 0o755, None),
        );
        FakeMeta {
            state: Mutex::new(MetaState {
                next_inode: 2,
                inodes,
                entries: BTreeMap::new(),
                targets: HashMap::new(),
                next_handle: 1,
                next_first_server: 0,
                commits: 0,
                sessions: HashSet::new(),
                sessions_opened: 0,
            }),
            servers: Mutex::new(Vec::new()),
            stripe_unit_bytes,
            stripe_count,
            commit_delay_ms: AtomicU64::new(0),
            getattr_delay_ms: AtomicU64::new(0),
            refuse_size_changes: AtomicBool::new(false),
        }
    }

    /// What a restart does to sessions: every one is forgotten.
    fn forget_sessions(&self) {
        self.state.lock().unwrap().sessions.clear();
    }

    fn check_session(&self, session_id: u64) -> Result<(), WireError> {
        if self.state.lock().unwrap().sessions.contains(&session_id) {
            Ok(())
        } else {
            Err(wire(ErrorCode::BadHandle, "session does not exist"))
        }
    }

    fn add_entry(
        &self,
        parent: InodeId,
        name: &str,
        kind: FileKind,
        permissions: u32,
    ) -> Result<Attr, WireError> {
        let servers: Vec<ServerId> = self
            .servers
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.server_id)
            .collect();
        let mut state = self.state.lock().unwrap();
        match state.inodes.get(&parent) {
            Some(attr) if attr.kind == FileKind::Directory => {}
            Some(_) => return Err(wire(ErrorCode::NotDirectory, "parent")),
            None => return Err(wire(ErrorCode::NotFound, "parent")),
        }
        if state.entries.contains_key(&(parent, name.to_string())) {
            return Err(wire(ErrorCode::Exists, name));
        }
        let layout = (kind == FileKind::Regular).then(|| {
            let first = state.next_first_server;
            state.next_first_server += 1;
            let chosen = (0..self.stripe_count)
                .map(|i| servers[(first + i) % servers.len()])
                .collect();
            Layout::new(self.stripe_unit_bytes, chosen).unwrap()
        });
        let inode = state.next_inode;
        state.next_inode += 1;
        let attr = new_attr(inode, kind, permissions, layout);
        state.inodes.insert(inode, attr.clone());
        state.entries.insert((parent, name.to_string()), inode);
        Ok(attr)
    }

    fn get(&self, inode: InodeId) -> Result<Attr, WireError> {
        self.state
            .lock()
            .unwrap()
            .inodes
            .get(&inode)
            .cloned()
            .ok_or_else(|| wire(ErrorCode::NotFound, "inode"))
    }

    fn lookup(&self, parent: InodeId, name: &str) -> Result<Attr, WireError> {
        let state = self.state.lock().unwrap();
        let inode = state
            .entries
            .get(&(parent, name.to_string()))
            .ok_or_else(|| wire(ErrorCode::NotFound, name))?;
        Ok(state.inodes[inode].clone())
    }

    fn remove(&self, parent: InodeId, name: &str, directory: bool) -> Result<(), WireError> {
        let mut state = self.state.lock().unwrap();
        let inode = *state
            .entries
            .get(&(parent, name.to_string()))
            .ok_or_else(|| wire(ErrorCode::NotFound, name))?;
        let is_directory = state.inodes[&inode].kind == FileKind::Directory;
        if directory && !is_directory {
            return Err(wire(ErrorCode::NotDirectory, name));
        }
        if !directory && is_directory {
            return Err(wire(ErrorCode::IsDirectory, name));
        }
        if directory && state.entries.keys().any(|(p, _)| *p == inode) {
            return Err(wire(ErrorCode::NotEmpty, name));
        }
        state.entries.remove(&(parent, name.to_string()));
        Ok(())
    }

    fn next_handle(&self) -> u64 {
        let mut state = self.state.lock().unwrap();
        state.next_handle += 1;
        state.next_handle
    }
}

impl Service for FakeMeta {
    async fn call(&self, frame: Frame, _peer: &PeerInfo) -> Result<Reply, String> {
        let none = Bytes::new;
        match frame.opcode {
            OpenSession::OPCODE => {
                typed::<OpenSession>(frame, |_, _| {
                    let mut state = self.state.lock().unwrap();
                    state.sessions_opened += 1;
                    let session_id = 100 + state.sessions_opened;
                    state.sessions.insert(session_id);
                    Ok((
                        SessionGrant {
                            session_id,
                            lease_ms: 30_000,
                        },
                        none(),
                    ))
                })
                .await
            }
            RenewSession::OPCODE => {
                typed::<RenewSession>(frame, |r, _| {
                    self.check_session(r.session_id)?;
                    Ok(((), none()))
                })
                .await
            }
            CloseSession::OPCODE => typed::<CloseSession>(frame, |_, _| Ok(((), none()))).await,
            // Nothing is ever revoked here: a poll waits out its time and gets nothing.
            WaitRevocations::OPCODE => {
                handle::<WaitRevocations, _, _>(frame, |request, _| async move {
                    let wait = u64::from(request.wait_ms).min(20_000);
                    tokio::time::sleep(Duration::from_millis(wait)).await;
                    Ok((Vec::new(), Bytes::new()))
                })
                .await
            }
            // Nothing is leased here: nothing to renew.
            RenewLeases::OPCODE => {
                typed::<RenewLeases>(frame, |_, _| {
                    Ok((
                        LeasesRenewed {
                            epoch: 0,
                            renewed: false,
                            lease_ms: 0,
                            revocations_through: 0,
                        },
                        none(),
                    ))
                })
                .await
            }
            // Everything here is durable at once: nothing to do.
            Sync::OPCODE => typed::<Sync>(frame, |_, _| Ok(((), none()))).await,
            ListServers::OPCODE => {
                typed::<ListServers>(frame, |_, _| {
                    Ok((self.servers.lock().unwrap().clone(), none()))
                })
                .await
            }
            Lookup::OPCODE => {
                typed::<Lookup>(frame, |r, _| Ok((self.lookup(r.parent, &r.name)?, none()))).await
            }
            GetAttr::OPCODE => {
                let delay_ms = self.getattr_delay_ms.load(Ordering::Acquire);
                if delay_ms == 0 {
                    return typed::<GetAttr>(frame, |r, _| Ok((self.get(r.inode)?, none()))).await;
                }
                let request: GetAttr =
                    freeflow_proto::decode(&frame.header).map_err(|error| error.to_string())?;
                let attr = self.get(request.inode);
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                typed::<GetAttr>(frame, |_, _| Ok((attr?, none()))).await
            }
            SetAttributes::OPCODE => {
                typed::<SetAttributes>(frame, |r, _| {
                    if r.changes.size_bytes.is_some()
                        && self.refuse_size_changes.load(Ordering::Acquire)
                    {
                        return Err(wire(ErrorCode::NotPermitted, "size change refused"));
                    }
                    let mut state = self.state.lock().unwrap();
                    let attr = state
                        .inodes
                        .get_mut(&r.inode)
                        .ok_or_else(|| wire(ErrorCode::NotFound, "inode"))?;
                    if let Some(size) = r.changes.size_bytes {
                        attr.size_bytes = size;
                    }
                    if let Some(permissions) = r.changes.permissions {
                        attr.permissions = permissions;
                    }
                    Ok((attr.clone(), none()))
                })
                .await
            }
            Create::OPCODE => {
                typed::<Create>(frame, |r, _| {
                    if let Some((session_id, _)) = r.open {
                        self.check_session(session_id)?;
                    }
                    let (attr, created) =
                        match self.add_entry(r.parent, &r.name, r.kind, r.permissions) {
                            Ok(attr) => (attr, true),
                            Err(error) if error.code == ErrorCode::Exists && !r.exclusive => {
                                let attr = self.lookup(r.parent, &r.name)?;
                                if attr.kind != FileKind::Regular {
                                    return Err(error);
                                }
                                (attr, false)
                            }
                            Err(error) => return Err(error),
                        };
                    let handle_id = r.open.map(|_| self.next_handle());
                    Ok((
                        CreateReply {
                            attr,
                            created,
                            handle_id,
                        },
                        none(),
                    ))
                })
                .await
            }
            Mkdir::OPCODE => {
                typed::<Mkdir>(frame, |r, _| {
                    Ok((
                        self.add_entry(r.parent, &r.name, FileKind::Directory, r.permissions)?,
                        none(),
                    ))
                })
                .await
            }
            Symlink::OPCODE => {
                typed::<Symlink>(frame, |r, _| {
                    let attr = self.add_entry(r.parent, &r.name, FileKind::Symlink, 0o777)?;
                    self.state
                        .lock()
                        .unwrap()
                        .targets
                        .insert(attr.inode, r.target);
                    Ok((attr, none()))
                })
                .await
            }
            ReadLink::OPCODE => {
                typed::<ReadLink>(frame, |r, _| {
                    let state = self.state.lock().unwrap();
                    Ok((
                        state
                            .targets
                            .get(&r.inode)
                            .cloned()
                            .ok_or_else(|| wire(ErrorCode::InvalidArgument, "not a link"))?,
                        none(),
                    ))
                })
                .await
            }
            Unlink::OPCODE => {
                typed::<Unlink>(frame, |r, _| {
                    Ok((self.remove(r.parent, &r.name, false)?, none()))
                })
                .await
            }
            Rmdir::OPCODE => {
                typed::<Rmdir>(frame, |r, _| {
                    Ok((self.remove(r.parent, &r.name, true)?, none()))
                })
                .await
            }
            Rename::OPCODE => {
                typed::<Rename>(frame, |r, _| {
                    let mut state = self.state.lock().unwrap();
                    let inode = state
                        .entries
                        .remove(&(r.source_parent, r.source_name.clone()))
                        .ok_or_else(|| wire(ErrorCode::NotFound, &r.source_name))?;
                    state
                        .entries
                        .insert((r.target_parent, r.target_name), inode);
                    Ok(((), none()))
                })
                .await
            }
            ReadDir::OPCODE => {
                typed::<ReadDir>(frame, |r, _| {
                    let state = self.state.lock().unwrap();
                    let all: Vec<DirEntry> = state
                        .entries
                        .iter()
                        .filter(|((parent, name), _)| {
                            *parent == r.inode && r.after.as_ref().is_none_or(|after| name > after)
                        })
                        .map(|((_, name), inode)| DirEntry {
                            name: name.clone(),
                            inode: *inode,
                            kind: state.inodes[inode].kind,
                            attr: None,
                        })
                        .collect();
                    let end = all.len() <= r.limit as usize;
                    let entries = all.into_iter().take(r.limit as usize).collect();
                    Ok((DirPage { entries, end }, none()))
                })
                .await
            }
            Open::OPCODE => {
                typed::<Open>(frame, |r, _| {
                    self.check_session(r.session_id)?;
                    let attr = self.get(r.inode)?;
                    if attr.kind == FileKind::Directory && r.access.write {
                        return Err(wire(ErrorCode::IsDirectory, "open"));
                    }
                    Ok((
                        OpenGrant {
                            handle_id: self.next_handle(),
                            attr,
                        },
                        none(),
                    ))
                })
                .await
            }
            Close::OPCODE => {
                typed::<Close>(frame, |r, _| {
                    self.check_session(r.session_id)?;
                    Ok(((), none()))
                })
                .await
            }
            CommitSize::OPCODE => {
                let delay_ms = self.commit_delay_ms.load(Ordering::Acquire);
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                typed::<CommitSize>(frame, |r, _| {
                    let mut state = self.state.lock().unwrap();
                    state.commits += 1;
                    let attr = state
                        .inodes
                        .get_mut(&r.inode)
                        .ok_or_else(|| wire(ErrorCode::NotFound, "inode"))?;
                    attr.size_bytes = attr.size_bytes.max(r.size_bytes);
                    attr.modify_time = r.modify_time;
                    attr.generation += 1;
                    Ok((attr.clone(), none()))
                })
                .await
            }
            opcode => Err(format!("fake meta does not serve opcode {opcode}")),
        }
    }
}

// ---------- fake I/O server ----------

#[derive(Default)]
struct FakeIo {
    objects: Mutex<HashMap<ObjectId, Vec<u8>>>,
    syncs: Mutex<Vec<ObjectId>>,
    /// Writes whose payload starts with b'S' sleep this long (to reorder replies).
    slow_write_ms: AtomicU64,
    /// Every write sleeps this long.
    write_delay_ms: AtomicU64,
    /// Write bytes being served by every server of the cluster together (shared), and the
    /// peak of that sum: the per-server peaks summed could exceed the true peak.
    in_flight_bytes: Arc<AtomicU64>,
    in_flight_bytes_peak: Arc<AtomicU64>,
    failing: AtomicBool,
    /// Objects with a write landed since their last sync.
    unsynced: Mutex<HashSet<ObjectId>>,
    writes_received: AtomicU64,
    truncates_received: AtomicU64,
    reads_received: AtomicU64,
    /// The next request with this opcode is carried out, then its connection is closed
    /// without a reply (0: none).
    break_connection_after_opcode: AtomicU64,
}

impl Service for FakeIo {
    async fn call(&self, frame: Frame, _peer: &PeerInfo) -> Result<Reply, String> {
        if self.failing.load(Ordering::Acquire) {
            return Err("the fake server is down".to_string());
        }
        let none = Bytes::new;
        let break_connection = self
            .break_connection_after_opcode
            .compare_exchange(
                u64::from(frame.opcode),
                0,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        let reply = self.serve(frame, none).await;
        if break_connection {
            return Err("the fake server breaks this connection".to_string());
        }
        reply
    }
}

impl FakeIo {
    async fn serve(&self, frame: Frame, none: fn() -> Bytes) -> Result<Reply, String> {
        match frame.opcode {
            WriteObject::OPCODE => {
                self.writes_received.fetch_add(1, Ordering::AcqRel);
                let request: WriteObject =
                    freeflow_proto::decode(&frame.header).map_err(|e| e.message)?;
                let length = frame.payload.len() as u64;
                let now = self.in_flight_bytes.fetch_add(length, Ordering::AcqRel) + length;
                self.in_flight_bytes_peak.fetch_max(now, Ordering::AcqRel);
                let mut delay = self.write_delay_ms.load(Ordering::Acquire);
                if frame.payload.first() == Some(&b'S') {
                    delay += self.slow_write_ms.load(Ordering::Acquire);
                }
                tokio::time::sleep(Duration::from_millis(delay)).await;
                {
                    let mut objects = self.objects.lock().unwrap();
                    let object = objects.entry(request.object).or_default();
                    let end = request.offset as usize + frame.payload.len();
                    if object.len() < end {
                        object.resize(end, 0);
                    }
                    object[request.offset as usize..end].copy_from_slice(&frame.payload);
                }
                self.unsynced.lock().unwrap().insert(request.object);
                self.in_flight_bytes.fetch_sub(length, Ordering::AcqRel);
                typed::<WriteObject>(frame, |_, _| Ok((ObjectSpace::default(), none()))).await
            }
            ReadObject::OPCODE => {
                self.reads_received.fetch_add(1, Ordering::AcqRel);
                typed::<ReadObject>(frame, |r, _| {
                    let objects = self.objects.lock().unwrap();
                    let data = objects.get(&r.object).map(Vec::as_slice).unwrap_or(&[]);
                    let start = (r.offset as usize).min(data.len());
                    let end = (start + r.length as usize).min(data.len());
                    let payload = Bytes::copy_from_slice(&data[start..end]);
                    Ok((
                        ReadReply {
                            length: payload.len() as u32,
                        },
                        payload,
                    ))
                })
                .await
            }
            TruncateObject::OPCODE => {
                self.truncates_received.fetch_add(1, Ordering::AcqRel);
                typed::<TruncateObject>(frame, |r, _| {
                    // Cut only, as the real server: never extend or create an object.
                    let mut objects = self.objects.lock().unwrap();
                    if let Some(object) = objects.get_mut(&r.object) {
                        object.truncate(r.length as usize);
                    }
                    Ok((ObjectSpace::default(), none()))
                })
                .await
            }
            // Room for everything: this fake's disk never fills.
            ReserveSpace::OPCODE => {
                typed::<ReserveSpace>(frame, |r, _| {
                    let added = r.want.max(r.need);
                    Ok((SpaceGrant { added, held: added }, none()))
                })
                .await
            }
            SyncObjects::OPCODE => {
                typed::<SyncObjects>(frame, |r, _| {
                    let mut unsynced = self.unsynced.lock().unwrap();
                    for object in &r.objects {
                        unsynced.remove(object);
                    }
                    self.syncs.lock().unwrap().extend(r.objects);
                    Ok(((), none()))
                })
                .await
            }
            RemoveObjects::OPCODE => typed::<RemoveObjects>(frame, |_, _| Ok(((), none()))).await,
            opcode => Err(format!("fake I/O server does not serve opcode {opcode}")),
        }
    }
}

// ---------- the cluster ----------

struct Cluster {
    key: ClusterKey,
    meta: Arc<FakeMeta>,
    meta_address: String,
    io: Vec<(ServerId, Arc<FakeIo>, JoinHandle<std::io::Result<()>>)>,
    _meta_task: JoinHandle<std::io::Result<()>>,
}

impl Cluster {
    async fn start(io_count: u32, stripe_unit_bytes: u32, stripe_count: usize) -> Cluster {
        let key = ClusterKey::from_bytes([7; 32]);
        let meta = Arc::new(FakeMeta::new(stripe_unit_bytes, stripe_count));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let meta_address = listener.local_addr().unwrap().to_string();
        let meta_task = tokio::spawn(serve(
            listener,
            key.clone(),
            ServerOptions::new("meta"),
            meta.clone(),
        ));
        let mut io = Vec::new();
        let in_flight_bytes = Arc::new(AtomicU64::new(0));
        let in_flight_bytes_peak = Arc::new(AtomicU64::new(0));
        for server_id in 1..=io_count {
            let fake = Arc::new(FakeIo {
                in_flight_bytes: in_flight_bytes.clone(),
                in_flight_bytes_peak: in_flight_bytes_peak.clone(),
                ..FakeIo::default()
            });
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let address = listener.local_addr().unwrap().to_string();
            let task = tokio::spawn(serve(
                listener,
                key.clone(),
                ServerOptions::new(format!("io:{server_id}")),
                fake.clone(),
            ));
            meta.servers.lock().unwrap().push(ServerRecord {
                server_id,
                address,
                up: true,
                capacity_bytes: 1 << 40,
                free_bytes: 1 << 40,
                object_count: 0,
                last_seen_ms: Some(0),
                metrics_address: None,
                state: freeflow_proto::meta::MemberState::InService,
            });
            io.push((server_id, fake, task));
        }
        Cluster {
            key,
            meta,
            meta_address,
            io,
            _meta_task: meta_task,
        }
    }

    fn config(&self) -> ClientConfig {
        let mut config = ClientConfig::new(self.meta_address.clone(), self.key.clone());
        config.call_timeout_ms = 5_000;
        config.connect_timeout_ms = 2_000;
        config
    }

    async fn client(&self) -> Client {
        Client::connect(self.config()).await.unwrap()
    }

    fn io(&self, server_id: ServerId) -> &FakeIo {
        &self
            .io
            .iter()
            .find(|(id, _, _)| *id == server_id)
            .unwrap()
            .1
    }

    fn object(&self, server_id: ServerId, object: ObjectId) -> Option<Vec<u8>> {
        self.io(server_id)
            .objects
            .lock()
            .unwrap()
            .get(&object)
            .cloned()
    }
}

/// Deterministic test data: byte i is a function of i and a seed.
fn pattern(length: usize, seed: u8) -> Vec<u8> {
    (0..length)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

const READ_WRITE: OpenAccess = OpenAccess {
    read: true,
    write: true,
};

#[tokio::test]
async fn striped_write_lands_where_the_layout_says_and_reads_back() {
    let cluster = Cluster::start(3, 64 << 10, 3).await;
    let client = cluster.client().await;
    let (file, created) = client
        .create_open(ROOT_INODE, "data", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    assert!(created);
    let data = pattern(1_000_000, 1);
    file.write_at(0, Bytes::from(data.clone())).await.unwrap();
    // Unaligned overwrite across unit boundaries.
    let patch = pattern(200_000, 2);
    file.write_at(100_001, Bytes::from(patch.clone()))
        .await
        .unwrap();
    let mut expected = data.clone();
    expected[100_001..300_001].copy_from_slice(&patch);
    assert_eq!(file.size(), 1_000_000);
    // The handle reads its own writes.
    assert_eq!(
        file.read_at(0, 2_000_000).await.unwrap(),
        Bytes::from(expected.clone())
    );
    assert_eq!(
        file.read_at(65_530, 70_000).await.unwrap(),
        Bytes::copy_from_slice(&expected[65_530..135_530])
    );
    let inode = file.inode();
    let layout = file.attr().layout.unwrap();
    file.close().await.unwrap();

    // Each object holds exactly its stripe's bytes.
    for stripe_index in 0..3u32 {
        let server_id = layout.servers[stripe_index as usize];
        let object = cluster
            .object(
                server_id,
                ObjectId {
                    inode,
                    stripe_index,
                },
            )
            .unwrap();
        assert_eq!(
            object.len() as u64,
            layout.object_length(1_000_000, stripe_index)
        );
        for (object_offset, byte) in object.iter().enumerate().step_by(997) {
            let file_offset = layout.file_offset(stripe_index, object_offset as u64);
            assert_eq!(
                *byte, expected[file_offset as usize],
                "stripe {stripe_index} offset {object_offset}"
            );
        }
    }
    // Close committed the size; a new open sees it and the data.
    assert_eq!(client.getattr(inode).await.unwrap().size_bytes, 1_000_000);
    let reader = client
        .open(
            inode,
            OpenAccess {
                read: true,
                write: false,
            },
        )
        .await
        .unwrap();
    assert_eq!(
        reader.read_at(999_990, 100).await.unwrap(),
        Bytes::copy_from_slice(&expected[999_990..])
    );
    assert_eq!(reader.read_at(1_000_000, 10).await.unwrap().len(), 0);
    let error = reader
        .write_at(0, Bytes::from_static(b"x"))
        .await
        .unwrap_err();
    assert_eq!(error.code(), ErrorCode::BadHandle);
    reader.close().await.unwrap();
    client.shutdown().await;
}

#[tokio::test]
async fn holes_read_as_zeros_and_truncate_does_not_regrow_from_own_handles() {
    let cluster = Cluster::start(2, 4096, 2).await;
    let client = cluster.client().await;
    let (file, _) = client
        .create_open(ROOT_INODE, "sparse", 0o644, false, READ_WRITE)
        .await
        .unwrap();
    file.write_at(0, Bytes::from(vec![1u8; 10])).await.unwrap();
    file.write_at(50_000, Bytes::from(vec![2u8; 10]))
        .await
        .unwrap();
    file.flush().await.unwrap();
    let all = file.read_at(0, 50_010).await.unwrap();
    assert_eq!(all.len(), 50_010);
    assert!(all[..10].iter().all(|&b| b == 1));
    assert!(all[10..50_000].iter().all(|&b| b == 0));
    assert!(all[50_000..].iter().all(|&b| b == 2));

    // Shrink to 5 bytes, then extend to 60000. The meta server cuts the objects (the fake
    // does not; real_cluster.rs checks that the cut bytes read as zeros): here, the handle
    // must take each new size and never grow the file back to what it wrote before.
    let inode = file.inode();
    client
        .setattr(
            inode,
            SetAttr {
                size_bytes: Some(5),
                ..SetAttr::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(file.size(), 5);
    client
        .setattr(
            inode,
            SetAttr {
                size_bytes: Some(60_000),
                ..SetAttr::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(file.size(), 60_000);
    file.refresh().await.unwrap();
    assert_eq!(file.size(), 60_000);
    file.flush().await.unwrap();
    assert_eq!(client.getattr(inode).await.unwrap().size_bytes, 60_000);
    let all = file.read_at(0, 60_000).await.unwrap();
    assert_eq!(all.len(), 60_000);
    assert!(all[..5].iter().all(|&b| b == 1));
    // A close after the truncate must not grow the file back to the old written end.
    file.write_at(0, Bytes::from_static(b"z")).await.unwrap();
    client
        .setattr(
            inode,
            SetAttr {
                size_bytes: Some(3),
                ..SetAttr::default()
            },
        )
        .await
        .unwrap();
    file.close().await.unwrap();
    assert_eq!(client.getattr(inode).await.unwrap().size_bytes, 3);
}

#[tokio::test]
async fn a_later_overlapping_write_wins_even_if_the_earlier_is_slow() {
    let cluster = Cluster::start(1, 4096, 1).await;
    cluster.io(1).slow_write_ms.store(200, Ordering::Release);
    let client = cluster.client().await;
    let (file, _) = client
        .create_open(ROOT_INODE, "order", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    file.write_at(0, Bytes::from(vec![b'S'; 3000]))
        .await
        .unwrap();
    file.write_at(1000, Bytes::from(vec![b'F'; 1000]))
        .await
        .unwrap();
    file.fsync().await.unwrap();
    let inode = file.inode();
    file.close().await.unwrap();
    let object = cluster
        .object(
            1,
            ObjectId {
                inode,
                stripe_index: 0,
            },
        )
        .unwrap();
    assert!(object[..1000].iter().all(|&b| b == b'S'));
    assert!(
        object[1000..2000].iter().all(|&b| b == b'F'),
        "the earlier write overtook the later one"
    );
    assert!(object[2000..].iter().all(|&b| b == b'S'));
}

#[tokio::test]
async fn fsync_syncs_every_written_object_and_commits_the_size() {
    let cluster = Cluster::start(4, 4096, 4).await;
    let client = cluster.client().await;
    let (file, _) = client
        .create_open(ROOT_INODE, "durable", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    // Units 0, 1 and 3: stripe 2 is never written.
    file.write_at(0, Bytes::from(vec![9u8; 8192]))
        .await
        .unwrap();
    file.write_at(3 * 4096, Bytes::from(vec![9u8; 100]))
        .await
        .unwrap();
    let inode = file.inode();
    assert_eq!(
        client.getattr(inode).await.unwrap().size_bytes,
        0,
        "size is committed lazily"
    );
    file.fsync().await.unwrap();
    assert_eq!(
        client.getattr(inode).await.unwrap().size_bytes,
        3 * 4096 + 100
    );
    let layout = file.attr().layout.unwrap();
    for stripe_index in 0..4u32 {
        let server_id = layout.servers[stripe_index as usize];
        let synced = cluster
            .io(server_id)
            .syncs
            .lock()
            .unwrap()
            .contains(&ObjectId {
                inode,
                stripe_index,
            });
        assert_eq!(synced, stripe_index != 2, "stripe {stripe_index}");
    }
    // A second fsync with nothing new written syncs nothing.
    let syncs_before: usize = cluster
        .io
        .iter()
        .map(|(_, io, _)| io.syncs.lock().unwrap().len())
        .sum();
    file.fsync().await.unwrap();
    let syncs_after: usize = cluster
        .io
        .iter()
        .map(|(_, io, _)| io.syncs.lock().unwrap().len())
        .sum();
    assert_eq!(syncs_before, syncs_after);
    file.close().await.unwrap();
}

#[tokio::test]
async fn writes_go_to_all_servers_at_once_within_the_dirty_bound() {
    let cluster = Cluster::start(4, 1 << 20, 4).await;
    for (_, io, _) in &cluster.io {
        io.write_delay_ms.store(30, Ordering::Release);
    }
    let mut config = cluster.config();
    config.dirty_bytes_max = 8 << 20;
    let client = Client::connect(config).await.unwrap();
    let (file, _) = client
        .create_open(ROOT_INODE, "wide", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    let data = Bytes::from(pattern(32 << 20, 3));
    let started = Instant::now();
    file.write_at(0, data.clone()).await.unwrap();
    file.flush().await.unwrap();
    let elapsed = started.elapsed();
    // 32 requests of 1 MiB at 30 ms each: sequentially ~1 s; 8 at a time ~120 ms.
    assert!(
        elapsed < Duration::from_millis(900),
        "writes were not parallel: {elapsed:?}"
    );
    let peak = cluster.io(1).in_flight_bytes_peak.load(Ordering::Acquire);
    assert!(
        peak <= 8 << 20,
        "more than dirty_bytes_max in flight: {peak}"
    );
    assert_eq!(file.read_at(0, 32 << 20).await.unwrap(), data);
    file.close().await.unwrap();
}

#[tokio::test]
async fn a_down_server_gives_an_error_naming_it_and_the_handle_keeps_it() {
    let cluster = Cluster::start(2, 4096, 2).await;
    let client = cluster.client().await;
    let (file, _) = client
        .create_open(ROOT_INODE, "doomed", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    let layout = file.attr().layout.unwrap();
    let down = layout.servers[1];
    let (_, io, task) = cluster.io.iter().find(|(id, _, _)| *id == down).unwrap();
    io.failing.store(true, Ordering::Release);
    task.abort();
    let started = Instant::now();
    file.write_at(0, Bytes::from(vec![1u8; 8192]))
        .await
        .unwrap();
    let error = file.fsync().await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(error.code(), ErrorCode::Unreachable, "{error}");
    let message = error.to_string();
    assert!(message.contains(&format!("I/O server {down}")), "{message}");
    // The failure is not lost: later calls report it too.
    assert!(file.write_at(0, Bytes::from_static(b"x")).await.is_err());
    assert!(file.flush().await.is_err());
    assert!(file.close().await.is_err());
}

#[tokio::test]
async fn path_api_walks_creates_and_removes() {
    let cluster = Cluster::start(1, 4096, 1).await;
    let client = cluster.client().await;
    client.mkdir_all("/a/b/c").await.unwrap();
    assert_eq!(
        client.mkdir_all("/a/b/c").await.unwrap().kind,
        FileKind::Directory
    );
    client.symlink_path("/a/b", "/link").await.unwrap();
    let options = OpenOptions::new().write(true).create(true);
    let file = client.open_path("/link/c/f", &options).await.unwrap();
    file.append(Bytes::from_static(b"hello ")).await.unwrap();
    assert_eq!(file.append(Bytes::from_static(b"world")).await.unwrap(), 6);
    file.close().await.unwrap();
    assert_eq!(client.stat("/a/b/c/f").await.unwrap().size_bytes, 11);
    assert_eq!(client.lstat("/link").await.unwrap().kind, FileKind::Symlink);
    assert_eq!(
        client.stat("/link").await.unwrap().kind,
        FileKind::Directory
    );

    // Truncate on open.
    let options = OpenOptions::new().read(true).write(true).truncate(true);
    let file = client.open_path("/a/b/c/f", &options).await.unwrap();
    assert_eq!(file.size(), 0);
    file.close().await.unwrap();
    assert_eq!(client.stat("/a/b/c/f").await.unwrap().size_bytes, 0);

    let error = client
        .open_path("/a/b", &OpenOptions::new().write(true))
        .await
        .unwrap_err();
    assert_eq!(error.code(), ErrorCode::IsDirectory);
    let error = client
        .open_path("/a/missing", &OpenOptions::new().read(true))
        .await
        .unwrap_err();
    assert_eq!(error.code(), ErrorCode::NotFound);
    assert!(error.to_string().starts_with("/a/missing"), "{error}");

    client.rename_path("/a/b/c/f", "/a/g").await.unwrap();
    let names: Vec<String> = client
        .read_dir_all("/a")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, vec!["b", "g"]);
    let error = client.remove_path("/a").await.unwrap_err();
    assert_eq!(error.code(), ErrorCode::NotEmpty);
    client.remove_all("/a").await.unwrap();
    assert_eq!(
        client.stat("/a").await.unwrap_err().code(),
        ErrorCode::NotFound
    );
    client.remove_path("/link").await.unwrap();
    assert!(client.read_dir_all("/").await.unwrap().is_empty());
    assert!(cluster.meta.state.lock().unwrap().commits > 0);
}

/// Spawn a size change of `inode` to `size_bytes` in the background.
fn spawn_truncate(
    client: &Client,
    inode: InodeId,
    size_bytes: u64,
) -> JoinHandle<Result<Attr, freeflow_client::ClientError>> {
    let client = client.clone();
    tokio::spawn(async move {
        client
            .setattr(
                inode,
                SetAttr {
                    size_bytes: Some(size_bytes),
                    ..SetAttr::default()
                },
            )
            .await
    })
}

#[tokio::test]
async fn fsync_syncs_a_write_acknowledged_after_another_fsync_took_the_set() {
    // Bug: a write put its stripe in the handle's unsynced set when it started. An fsync
    // (T2) could take the set while another write (T1's) was still in flight and sync
    // before that write landed; T1's own fsync then found an empty set and returned OK for
    // a write never synced.
    let cluster = Cluster::start(1, 4096, 1).await;
    cluster.io(1).slow_write_ms.store(300, Ordering::Release);
    let client = cluster.client().await;
    let (file, _) = client
        .create_open(ROOT_INODE, "race", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    let file = Arc::new(file);
    let inode = file.inode();
    // T2's write, slow; T2's fsync waits for it (and only for it).
    file.write_at(0, Bytes::from(vec![b'S'; 100]))
        .await
        .unwrap();
    let other = file.clone();
    let first_fsync = tokio::spawn(async move { other.fsync().await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    // T1's write starts while T2's fsync waits, and lands ~50 ms after T2 syncs.
    file.write_at(8192, Bytes::from(vec![b'S'; 100]))
        .await
        .unwrap();
    first_fsync.await.unwrap().unwrap();
    file.fsync().await.unwrap();
    let object = ObjectId {
        inode,
        stripe_index: 0,
    };
    assert!(
        !cluster.io(1).unsynced.lock().unwrap().contains(&object),
        "fsync returned OK but a write landed after the last sync of its object"
    );
    file.close_shared().await.unwrap();
}

#[tokio::test]
async fn a_write_whose_connection_broke_is_not_sent_again() {
    // Bug: io_call sent any request again after Disconnected. The server may still be
    // running the first copy of a write, which can land after a newer overlapping write:
    // a write (or truncate) must fail instead, the failure sticking on the handle.
    let cluster = Cluster::start(1, 4096, 1).await;
    let client = cluster.client().await;
    let (file, _) = client
        .create_open(ROOT_INODE, "once", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    let io = cluster.io(1);
    io.break_connection_after_opcode
        .store(u64::from(WriteObject::OPCODE), Ordering::Release);
    file.write_at(0, Bytes::from(vec![1u8; 100])).await.unwrap();
    let error = file.flush().await.unwrap_err();
    assert_eq!(error.code(), ErrorCode::Unreachable, "{error}");
    assert_eq!(io.writes_received.load(Ordering::Acquire), 1);
    assert!(file.write_at(0, Bytes::from_static(b"x")).await.is_err());
    drop(file);

    // A read changes nothing: it is sent again on a new connection.
    let (reader, _) = client
        .create_open(ROOT_INODE, "again", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    reader
        .write_at(0, Bytes::from(vec![2u8; 100]))
        .await
        .unwrap();
    reader.flush().await.unwrap();
    io.break_connection_after_opcode
        .store(u64::from(ReadObject::OPCODE), Ordering::Release);
    let reads_before = io.reads_received.load(Ordering::Acquire);
    assert_eq!(
        reader.read_at(0, 100).await.unwrap(),
        Bytes::from(vec![2u8; 100])
    );
    assert_eq!(io.reads_received.load(Ordering::Acquire), reads_before + 2);
    reader.close().await.unwrap();
}

#[tokio::test]
async fn flush_fsync_and_setattr_do_not_wait_for_writes_started_after_them() {
    // Bug: flush, fsync, close and setattr waited until the handle had no write in flight
    // at all, so a writer that kept the handle busy held them up forever.
    let cluster = Cluster::start(1, 4096, 1).await;
    cluster.io(1).write_delay_ms.store(200, Ordering::Release);
    let client = cluster.client().await;
    let (file, _) = client
        .create_open(ROOT_INODE, "busy", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    let file = Arc::new(file);
    let inode = file.inode();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (file, stop) = (file.clone(), stop.clone());
        tokio::spawn(async move {
            // A new write every 50 ms, each taking 200 ms: never idle while this runs.
            let mut offset = 0;
            while !stop.load(Ordering::Acquire) {
                file.write_at(offset, Bytes::from(vec![3u8; 100]))
                    .await
                    .unwrap();
                offset += 100;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let bound = Duration::from_millis(1_500);
    tokio::time::timeout(bound, file.flush())
        .await
        .expect("flush waited for writes started after it")
        .unwrap();
    tokio::time::timeout(bound, file.fsync())
        .await
        .expect("fsync waited for writes started after it")
        .unwrap();
    tokio::time::timeout(bound, spawn_truncate(&client, inode, 1 << 30))
        .await
        .expect("setattr waited for writes started after it")
        .unwrap()
        .unwrap();
    stop.store(true, Ordering::Release);
    writer.await.unwrap();
    file.close_shared().await.unwrap();
}

#[tokio::test]
async fn a_size_commit_computed_before_a_truncate_does_not_grow_the_file_back() {
    // Bug: a size commit computed before a truncate could reach the meta server after it;
    // CommitSize keeps the maximum, so the truncated file grew back to the old size.
    let cluster = Cluster::start(1, 4096, 1).await;
    let client = cluster.client().await;
    let (file, _) = client
        .create_open(ROOT_INODE, "shrink", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    let file = Arc::new(file);
    let inode = file.inode();
    file.write_at(0, Bytes::from(vec![4u8; 10_000]))
        .await
        .unwrap();
    cluster.meta.commit_delay_ms.store(300, Ordering::Release);
    let flushing = {
        let file = file.clone();
        tokio::spawn(async move { file.flush().await })
    };
    // The flush's commit of 10000 is on its way (and slow) when the truncate starts.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let attr = spawn_truncate(&client, inode, 5).await.unwrap().unwrap();
    assert_eq!(attr.size_bytes, 5);
    flushing.await.unwrap().unwrap();
    cluster.meta.commit_delay_ms.store(0, Ordering::Release);
    assert_eq!(client.getattr(inode).await.unwrap().size_bytes, 5);
    assert_eq!(file.size(), 5);
    file.close_shared().await.unwrap();
    assert_eq!(client.getattr(inode).await.unwrap().size_bytes, 5);
}

#[tokio::test]
async fn a_refresh_answered_before_a_size_commit_does_not_shrink_the_handle() {
    // A refresh whose reply predates this handle's own size commit (the meta server read
    // the attributes before the commit, the reply came after it) set the handle's size
    // back, so its reads stopped short of bytes it had written and committed (through a
    // writeback mount: zeros in their place).
    let cluster = Cluster::start(1, 4096, 1).await;
    let client = cluster.client().await;
    let (file, _) = client
        .create_open(ROOT_INODE, "late", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    let file = Arc::new(file);
    file.write_at(0, Bytes::from(vec![7u8; 10_000]))
        .await
        .unwrap();
    cluster.meta.getattr_delay_ms.store(300, Ordering::Release);
    let refreshing = {
        let file = file.clone();
        tokio::spawn(async move { file.refresh().await })
    };
    // The refresh's GetAttr has read size 0 and waits; the commit of 10000 lands first.
    tokio::time::sleep(Duration::from_millis(100)).await;
    file.flush().await.unwrap();
    assert_eq!(file.size(), 10_000);
    let attr = refreshing.await.unwrap().unwrap();
    cluster.meta.getattr_delay_ms.store(0, Ordering::Release);
    assert_eq!(attr.size_bytes, 10_000, "the refresh's answer");
    assert_eq!(file.size(), 10_000, "the handle's size after the refresh");
    assert_eq!(file.read_at(0, 20_000).await.unwrap().len(), 10_000);
    file.close_shared().await.unwrap();
}

#[tokio::test]
async fn an_open_after_the_meta_server_forgot_the_session_reopens_it_once() {
    // Bug: after a meta server restart, opens failed with BadHandle until the background
    // renewer (every lease/3) noticed and opened a new session.
    let cluster = Cluster::start(1, 4096, 1).await;
    let client = cluster.client().await;
    let attr = client
        .create(ROOT_INODE, "f", FileKind::Regular, 0o644, 0, true)
        .await
        .unwrap();
    let old_session = client.session_id();
    cluster.meta.forget_sessions();
    let opens = (0..8).map(|_| client.open(attr.inode, READ_WRITE));
    let handles = futures::future::try_join_all(opens).await.unwrap();
    assert_ne!(client.session_id(), old_session);
    // One new session for all the callers that found the old one gone.
    assert_eq!(cluster.meta.state.lock().unwrap().sessions_opened, 2);
    for handle in handles {
        handle.close().await.unwrap();
    }
    cluster.meta.forget_sessions();
    let (file, created) = client
        .create_open(ROOT_INODE, "g", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    assert!(created);
    assert_eq!(cluster.meta.state.lock().unwrap().sessions_opened, 3);
    file.close().await.unwrap();
}

#[tokio::test]
async fn closing_a_handle_of_a_replaced_session_succeeds_after_flushing() {
    // Bug: after the session was replaced (meta restart), close flushed the data fine but
    // then reported the meta server's BadHandle for the old session's handle as a failure.
    let cluster = Cluster::start(1, 4096, 1).await;
    let client = cluster.client().await;
    let (file, _) = client
        .create_open(ROOT_INODE, "old", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    let inode = file.inode();
    file.write_at(0, Bytes::from(vec![5u8; 1234]))
        .await
        .unwrap();
    cluster.meta.forget_sessions();
    // An open notices and replaces the session.
    let other = client.open(inode, READ_WRITE).await.unwrap();
    file.close().await.unwrap();
    assert_eq!(client.getattr(inode).await.unwrap().size_bytes, 1234);
    other.close().await.unwrap();
    // A handle of the current session closed twice at the meta server still fails.
    let third = client.open(inode, READ_WRITE).await.unwrap();
    cluster.meta.forget_sessions();
    assert_eq!(
        third.close().await.unwrap_err().code(),
        ErrorCode::BadHandle
    );
}

#[tokio::test]
async fn setattr_leaves_cutting_the_objects_to_the_meta_server() {
    // Bug: setattr sent TruncateObject to the I/O servers itself, before the meta server
    // checked permissions (a refused truncate still cut the data), and on an extension cut
    // other clients' acknowledged writes beyond the size this client knew.
    let cluster = Cluster::start(2, 4096, 2).await;
    let client = cluster.client().await;
    let (file, _) = client
        .create_open(ROOT_INODE, "kept", 0o644, true, READ_WRITE)
        .await
        .unwrap();
    let inode = file.inode();
    let layout = file.attr().layout.unwrap();
    let data = pattern(10_000, 6);
    file.write_at(0, Bytes::from(data.clone())).await.unwrap();
    file.fsync().await.unwrap();
    cluster
        .meta
        .refuse_size_changes
        .store(true, Ordering::Release);
    let error = spawn_truncate(&client, inode, 0)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(error.code(), ErrorCode::NotPermitted);
    assert_eq!(file.size(), 10_000, "a refused truncate changed the handle");
    for stripe_index in 0..2u32 {
        let object = cluster
            .object(
                layout.servers[stripe_index as usize],
                ObjectId {
                    inode,
                    stripe_index,
                },
            )
            .unwrap();
        assert_eq!(
            object.len() as u64,
            layout.object_length(10_000, stripe_index),
            "a refused truncate cut stripe {stripe_index}"
        );
    }
    cluster
        .meta
        .refuse_size_changes
        .store(false, Ordering::Release);
    spawn_truncate(&client, inode, 100).await.unwrap().unwrap();
    spawn_truncate(&client, inode, 50_000)
        .await
        .unwrap()
        .unwrap();
    let truncates: u64 = cluster
        .io
        .iter()
        .map(|(_, io, _)| io.truncates_received.load(Ordering::Acquire))
        .sum();
    assert_eq!(truncates, 0, "the client cut objects itself");
    assert_eq!(
        file.read_at(0, 100).await.unwrap(),
        Bytes::from(data[..100].to_vec())
    );
    file.close().await.unwrap();
    assert_eq!(client.getattr(inode).await.unwrap().size_bytes, 50_000);
}
