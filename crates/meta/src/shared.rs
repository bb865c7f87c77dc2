//! State shared by the request handlers, the writer thread, the reaper and the session
//! expiry task of one running metadata server.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Instant;

use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::InodeId;
use tokio::sync::{mpsc, Notify, OwnedMutexGuard};

use crate::io_peers::IoConnections;

use crate::ops::{OpContext, OpError, OpResult, Placement};
use crate::registry::Registry;
use crate::sessions::Sessions;
use crate::store::{MetaStore, RedbRead, RedbStore, RedbWrite};
use crate::writer::{job, WriterMessage};
use crate::MetaConfig;

pub struct Shared {
    pub config: MetaConfig,
    /// None once shut down; handlers then answer `Unreachable`.
    pub store: RwLock<Option<Arc<RedbStore>>>,
    pub writer: mpsc::Sender<WriterMessage>,
    pub sessions: Mutex<Sessions>,
    pub registry: Mutex<Registry>,
    pub inode_count: AtomicU64,
    pub orphan_count: AtomicU64,
    /// Write transactions committed by the writer (one per batch).
    pub commit_count: AtomicU64,
    pub boot_epoch: u64,
    pub started: Instant,
    pub ready_ms: AtomicU64,
    pub reaper_wake: Notify,
    pub closing: AtomicBool,
    /// Connections to the I/O servers (reaper removals, truncation cuts).
    pub io: IoConnections,
    /// Inodes whose objects may be being cut, see [`CutPin`]. One entry per set-attributes
    /// with a size in flight, plus the reaper's one: bounded by the requests in flight.
    pub cut_gates: Mutex<HashMap<InodeId, CutGate>>,
    /// Counted by the writer; the rest of the metrics are read at each scrape.
    pub metrics: crate::metrics::MetaMetrics,
    /// The metrics endpoint, for `ClusterStatus` (None: off).
    pub metrics_address: Option<String>,
}

/// Per inode: how many pins are held, and the lock that lets one pin-holder at a time send
/// cuts for it.
pub struct CutGate {
    pins: u32,
    lock: Arc<tokio::sync::Mutex<()>>,
}

/// Held from before a size change is queued until its cuts are over. While any pin is held
/// the reaper neither removes the inode's objects (a cut after the removal would re-create
/// an object nobody removes) nor retries its pending cuts (a late retry could cut data
/// written after the set-attributes replied). As for an open handle, it is taken before the
/// job is queued, so an unlink committed in the same batch cannot be reaped under it.
pub struct CutPin<'a> {
    shared: &'a Shared,
    inode: InodeId,
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl CutPin<'_> {
    /// Wait until no other pin-holder is sending cuts for this inode.
    pub async fn exclusive(&self) -> OwnedMutexGuard<()> {
        self.lock.clone().lock_owned().await
    }
}

impl Drop for CutPin<'_> {
    fn drop(&mut self) {
        let mut gates = self.shared.cut_gates();
        if let Some(gate) = gates.get_mut(&self.inode) {
            gate.pins = gate.pins.saturating_sub(1);
            if gate.pins == 0 {
                gates.remove(&self.inode);
            }
        }
    }
}

fn shutting_down() -> WireError {
    WireError::new(ErrorCode::Unreachable, "metadata server is shutting down")
}

impl Shared {
    pub fn store(&self) -> Result<Arc<RedbStore>, WireError> {
        let guard = self
            .store
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        guard.clone().ok_or_else(shutting_down)
    }

    pub fn sessions(&self) -> MutexGuard<'_, Sessions> {
        self.sessions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn cut_gates(&self) -> MutexGuard<'_, HashMap<InodeId, CutGate>> {
        self.cut_gates
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Pin `inode` against the reaper (see [`CutPin`]).
    pub fn pin_cuts(&self, inode: InodeId) -> CutPin<'_> {
        let mut gates = self.cut_gates();
        let gate = gates.entry(inode).or_insert_with(|| CutGate {
            pins: 0,
            lock: Arc::new(tokio::sync::Mutex::new(())),
        });
        gate.pins += 1;
        CutPin {
            shared: self,
            inode,
            lock: gate.lock.clone(),
        }
    }

    /// Pin `inode` only if nobody else holds a pin (the reaper's way: it leaves pinned
    /// inodes to their set-attributes).
    pub fn try_pin_cuts(&self, inode: InodeId) -> Option<CutPin<'_>> {
        let mut gates = self.cut_gates();
        if gates.contains_key(&inode) {
            return None;
        }
        let lock = Arc::new(tokio::sync::Mutex::new(()));
        let gate = CutGate {
            pins: 1,
            lock: lock.clone(),
        };
        gates.insert(inode, gate);
        Some(CutPin {
            shared: self,
            inode,
            lock,
        })
    }

    pub fn is_pinned(&self, inode: InodeId) -> bool {
        self.cut_gates().contains_key(&inode)
    }

    pub fn placement(&self) -> Placement {
        Placement {
            servers: self.registry().placement_servers(Instant::now()),
            default_stripe_unit_bytes: self.config.stripe_unit_bytes,
            default_stripe_count: self.config.stripe_count,
        }
    }

    /// Run a read-only operation in its own read transaction (MVCC: concurrent with the
    /// writer).
    pub fn read<T>(
        &self,
        operation: impl FnOnce(&RedbRead) -> OpResult<T>,
    ) -> Result<T, WireError> {
        let store = self.store()?;
        let read = store
            .begin_read()
            .map_err(|error| OpError::Store(error).to_wire())?;
        operation(&read).map_err(|error| error.to_wire())
    }

    /// Queue a mutation for the writer and wait until it is committed (or refused).
    pub async fn write<T, F>(&self, operation: F) -> Result<T, WireError>
    where
        T: Send + 'static,
        F: FnOnce(&mut RedbWrite, &mut OpContext<'_>) -> OpResult<T> + Send + 'static,
    {
        if self.closing.load(Ordering::Acquire) {
            return Err(shutting_down());
        }
        let (job, receiver) = job(operation);
        self.writer
            .send(WriterMessage::Job(job))
            .await
            .map_err(|_| shutting_down())?;
        receiver.await.map_err(|_| shutting_down())?
    }
}
