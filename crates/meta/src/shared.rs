//! State shared by the request handlers, the writer thread, the reaper and the session
//! expiry task of one running metadata server.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Instant;

use freeflow_proto::{ErrorCode, WireError};
use tokio::sync::{mpsc, Notify};

use crate::ops::{OpContext, OpError, OpResult, Placement};
use crate::registry::Registry;
use crate::sessions::Sessions;
use crate::store::{MetaStore, RedbRead, RedbStore, RedbWrite};
use crate::writer::{job, AfterCommit, WriterMessage};
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
        self.write_then(operation, None).await
    }

    pub async fn write_then<T, F>(
        &self,
        operation: F,
        after_commit: Option<AfterCommit<T>>,
    ) -> Result<T, WireError>
    where
        T: Send + 'static,
        F: FnOnce(&mut RedbWrite, &mut OpContext<'_>) -> OpResult<T> + Send + 'static,
    {
        if self.closing.load(Ordering::Acquire) {
            return Err(shutting_down());
        }
        let (job, receiver) = job(operation, after_commit);
        self.writer
            .send(WriterMessage::Job(job))
            .await
            .map_err(|_| shutting_down())?;
        receiver.await.map_err(|_| shutting_down())?
    }
}
