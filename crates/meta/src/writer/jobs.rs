//! What the writer thread is sent: a mutation to apply in the next batch (type-erased, with
//! the channel its reply goes back on), a sync, the ticker's flush, and shutdown.

use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::Attr;
use tokio::sync::oneshot;

use crate::ops::{OpContext, OpError, OpResult};
use crate::store::{RedbWrite, StoreError, Touches};

/// One queued mutation, type-erased.
pub trait BatchJob: Send {
    /// The client whose change this is (0: the server itself, which commit on share ignores:
    /// its changes are redone after a crash by the reaper and the cutter).
    fn client(&self) -> u64;
    /// Whether the caller wants the reply only once the change is durable.
    fn wants_durable(&self) -> bool;
    /// Apply in the batch transaction. Err only when the store failed (the batch aborts).
    fn apply(
        &mut self,
        write: &mut RedbWrite,
        context: &mut OpContext<'_>,
    ) -> Result<(), StoreError>;
    /// Whether `apply` changed anything (a refused operation did not).
    fn applied(&self) -> bool;
    /// What `apply` touched, handed back to the caller with the reply, and the changed
    /// inodes' attributes as it left them (None: not gathered, see [`Committed`]).
    fn set_touches(&mut self, touches: Touches, changed: Option<Vec<Attr>>);
    /// Reply once the batch's fate is known.
    fn finish(self: Box<Self>, batch: &Result<u64, WireError>);
}

/// How an applied mutation was committed: its transaction, and what it read and changed
/// (the caller revokes other clients' leases on what changed, `leases.rs`).
#[derive(Clone, Debug, Default)]
pub struct Committed {
    pub txn: u64,
    pub touches: Touches,
    /// The attributes of the inodes it changed, as it left them, read in its own
    /// transaction (so the reply need not wait for the commit): for a client that caches,
    /// when they are few (`CHANGED_ATTRIBUTES_MAX`). An inode it removed is left out.
    pub changed: Option<Vec<Attr>>,
}

pub enum WriterMessage {
    Job(Box<dyn BatchJob>),
    /// Make everything committed so far durable, then answer with the durable transaction.
    Sync(oneshot::Sender<u64>),
    /// The ticker's nudge: make things durable if the interval has passed.
    Flush,
    /// Finish what is queued before this message, make it durable, then stop.
    Shutdown,
}

struct TypedJob<T, F> {
    client: u64,
    durable: bool,
    operation: Option<F>,
    result: Option<Result<T, WireError>>,
    touches: Touches,
    changed: Option<Vec<Attr>>,
    reply: oneshot::Sender<Result<(T, Committed), WireError>>,
}

impl<T, F> BatchJob for TypedJob<T, F>
where
    T: Send + 'static,
    F: FnOnce(&mut RedbWrite, &mut OpContext<'_>) -> OpResult<T> + Send + 'static,
{
    fn client(&self) -> u64 {
        self.client
    }

    fn wants_durable(&self) -> bool {
        self.durable
    }

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

    fn applied(&self) -> bool {
        matches!(self.result, Some(Ok(_)))
    }

    fn set_touches(&mut self, touches: Touches, changed: Option<Vec<Attr>>) {
        self.touches = touches;
        self.changed = changed;
    }

    fn finish(self: Box<Self>, batch: &Result<u64, WireError>) {
        let reply = match (batch, self.result) {
            (Err(error), _) => Err(error.clone()),
            (Ok(txn), Some(Ok(value))) => Ok((
                value,
                Committed {
                    txn: *txn,
                    touches: self.touches,
                    changed: self.changed,
                },
            )),
            (Ok(_), Some(Err(error))) => Err(error),
            (Ok(_), None) => Err(WireError::new(ErrorCode::Io, "operation was not applied")),
        };
        // The caller may have gone away (connection closed): nothing to do then.
        let _ = self.reply.send(reply);
    }
}

/// Build a job of `client` and the receiver of its reply (the value and its transaction).
#[allow(clippy::type_complexity)]
pub fn job<T, F>(
    client: u64,
    durable: bool,
    operation: F,
) -> (
    Box<dyn BatchJob>,
    oneshot::Receiver<Result<(T, Committed), WireError>>,
)
where
    T: Send + 'static,
    F: FnOnce(&mut RedbWrite, &mut OpContext<'_>) -> OpResult<T> + Send + 'static,
{
    let (reply, receiver) = oneshot::channel();
    let job = TypedJob {
        client,
        durable,
        operation: Some(operation),
        result: None,
        touches: Touches::default(),
        changed: None,
        reply,
    };
    (Box::new(job), receiver)
}
