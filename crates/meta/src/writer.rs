//! Group commit: the one task that owns write transactions.
//!
//! Mutations arrive through a bounded channel. The writer takes what is queued (up to
//! `commit_batch_max`), applies the operations one after another in ONE write transaction,
//! persists the counters, commits once (one fsync for the whole batch), then replies to
//! every caller. An operation that is refused wrote nothing (validate, then write), so it
//! does not disturb the others; a store failure aborts the whole batch, every caller gets
//! `Io`, and the writer's in-memory counters are restored to what the store holds.
//!
//! The writer runs on its own OS thread: commits block on fsync.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use freeflow_proto::{ErrorCode, WireError};
use tokio::sync::{mpsc, oneshot};

use crate::ops::{now, OpContext, OpError, OpResult, WriterState};
use crate::shared::Shared;
use crate::store::{MetaStore, RedbWrite, StoreError, StoreWrite};

/// One queued mutation, type-erased.
pub trait BatchJob: Send {
    /// Apply in the batch transaction. Err only when the store failed (the batch aborts).
    fn apply(
        &mut self,
        write: &mut RedbWrite,
        context: &mut OpContext<'_>,
    ) -> Result<(), StoreError>;
    /// Reply once the batch's fate is known.
    fn finish(self: Box<Self>, batch: &Result<(), WireError>);
}

pub enum WriterMessage {
    Job(Box<dyn BatchJob>),
    /// Finish what is queued before this message, then stop.
    Shutdown,
}

struct TypedJob<T, F> {
    operation: Option<F>,
    result: Option<Result<T, WireError>>,
    reply: oneshot::Sender<Result<T, WireError>>,
}

impl<T, F> BatchJob for TypedJob<T, F>
where
    T: Send + 'static,
    F: FnOnce(&mut RedbWrite, &mut OpContext<'_>) -> OpResult<T> + Send + 'static,
{
    fn apply(
        &mut self,
        write: &mut RedbWrite,
        context: &mut OpContext<'_>,
    ) -> Result<(), StoreError> {
        let Some(operation) = self.operation.take() else {
            return Ok(());
        };
        match operation(write, context) {
            Ok(value) => self.result = Some(Ok(value)),
            Err(OpError::Refused(error)) => self.result = Some(Err(error)),
            Err(OpError::Store(error)) => return Err(error),
        }
        Ok(())
    }

    fn finish(self: Box<Self>, batch: &Result<(), WireError>) {
        let reply = match (batch, self.result) {
            (Err(error), _) => Err(error.clone()),
            (Ok(()), Some(Ok(value))) => Ok(value),
            (Ok(()), Some(Err(error))) => Err(error),
            (Ok(()), None) => Err(WireError::new(ErrorCode::Io, "operation was not applied")),
        };
        // The caller may have gone away (connection closed): nothing to do then.
        let _ = self.reply.send(reply);
    }
}

/// Build a job and the receiver of its reply.
pub fn job<T, F>(operation: F) -> (Box<dyn BatchJob>, oneshot::Receiver<Result<T, WireError>>)
where
    T: Send + 'static,
    F: FnOnce(&mut RedbWrite, &mut OpContext<'_>) -> OpResult<T> + Send + 'static,
{
    let (reply, receiver) = oneshot::channel();
    let job = TypedJob {
        operation: Some(operation),
        result: None,
        reply,
    };
    (Box::new(job), receiver)
}

/// The writer thread's loop. Returns when told to shut down or when every sender is gone.
pub fn run(
    shared: Arc<Shared>,
    mut receiver: mpsc::Receiver<WriterMessage>,
    mut state: WriterState,
) {
    let batch_max = shared.config.commit_batch_max.max(1);
    let mut stopping = false;
    while !stopping {
        let Some(first) = receiver.blocking_recv() else {
            break;
        };
        let mut batch = Vec::new();
        match first {
            WriterMessage::Job(job) => batch.push(job),
            WriterMessage::Shutdown => stopping = true,
        }
        while !stopping && batch.len() < batch_max {
            match receiver.try_recv() {
                Ok(WriterMessage::Job(job)) => batch.push(job),
                Ok(WriterMessage::Shutdown) => stopping = true,
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
            run_batch(&shared, &mut state, batch);
        }
    }
    receiver.close();
    let refused = Err(WireError::new(
        ErrorCode::Unreachable,
        "metadata server is shutting down",
    ));
    while let Ok(message) = receiver.try_recv() {
        if let WriterMessage::Job(job) = message {
            job.finish(&refused);
        }
    }
}

fn run_batch(shared: &Shared, state: &mut WriterState, mut batch: Vec<Box<dyn BatchJob>>) {
    let started = std::time::Instant::now();
    let saved = state.clone();
    let orphans_before = saved.orphan_count;
    let placement = shared.placement();
    let outcome = (|| -> Result<(), StoreError> {
        let store = shared.store().map_err(|_| StoreError::Closed)?;
        let mut write = store.begin_write()?;
        let mut context = OpContext {
            now: now(),
            placement: &placement,
            state,
        };
        for job in batch.iter_mut() {
            job.apply(&mut write, &mut context)?;
        }
        state.persist(&mut write)?;
        write.commit()
    })();
    let outcome = match outcome {
        Ok(()) => {
            shared.commit_count.fetch_add(1, Ordering::Relaxed);
            shared
                .inode_count
                .store(state.inode_count, Ordering::Relaxed);
            shared
                .orphan_count
                .store(state.orphan_count, Ordering::Relaxed);
            Ok(())
        }
        Err(error) => {
            tracing::error!(%error, operations = batch.len(), "metadata batch failed; aborted");
            *state = saved;
            Err(WireError::new(
                ErrorCode::Io,
                format!("metadata store: {error}"),
            ))
        }
    };
    shared
        .metrics
        .batch_done(batch.len(), started, outcome.is_ok());
    for job in batch {
        job.finish(&outcome);
    }
    // Handles of create-and-opens and pins of truncates in this batch were registered
    // before the commit, so the reaper cannot take the data of a file opened (or being cut)
    // and unlinked in the same batch.
    if outcome.is_ok() && state.orphan_count > orphans_before {
        shared.reaper_wake.notify_one();
    }
}
