//! Requests to the copies of a stripe (DESIGN.md §7; the servers' side is
//! `ioserver/src/replication.rs`). A stripe with one copy goes to its one server as before.
//! For a replicated stripe:
//! - a write or an allocation goes to the first member of the chain the service map gives
//!   (members in service, then those syncing), which passes it down the chain; the reply
//!   means every member has it;
//! - a read goes to the members in service from the tail (which holds only what every
//!   member acknowledged), the next one when one fails; it carries the map version, so a
//!   member back from being out is not read before the client knows it is syncing;
//! - a sync goes to every member at once.
//!
//! When a member fails, the client fetches the map again and sends again, waiting with
//! backoff within the call timeout: the meta server puts a silent server out of its chains
//! within `server_down_after_ms`, and then the chain is the others. The application sees a
//! pause, not an error. A write whose connection to the first member broke with no reply
//! is sent again only once that member is out or is another process (the old one could
//! otherwise still apply it after a newer write of the same bytes' range).

use std::time::Duration;
use tokio::time::Instant;

use bytes::Bytes;
use freeflow_proto::io::{ReadObject, SyncObjects};
use freeflow_proto::meta::{MemberState, ServiceMap};
use freeflow_proto::{ErrorCode, Request};
use freeflow_rpc::RpcError;
use freeflow_types::{InodeId, Layout, ObjectId, ServerId};

use crate::pool::Pool;
use crate::ClientError;

const RETRY_WAIT_MIN_MS: u64 = 20;
const RETRY_WAIT_MAX_MS: u64 = 500;
/// How often a request waiting on a member checks whether the map put that member out.
const HUNG_CHECK_MS: u64 = 500;

/// What to do after a failed attempt on a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Nothing was applied, or applying it again is harmless: send again.
    Again,
    /// The connection broke with no reply: the member may still apply it.
    Unsure,
    /// An answer about the request itself (bad argument, no space): final.
    Final,
}

fn outcome(error: &ClientError) -> Outcome {
    match error {
        ClientError::Io { source, .. } => match source {
            RpcError::Remote(wire) => match wire.code {
                ErrorCode::Stale
                | ErrorCode::Busy
                | ErrorCode::Unreachable
                | ErrorCode::TimedOut => Outcome::Again,
                _ => Outcome::Final,
            },
            RpcError::Connect { .. } | RpcError::Handshake { .. } => Outcome::Again,
            RpcError::Disconnected { .. } | RpcError::TimedOut { .. } => Outcome::Unsure,
            RpcError::Refused { .. } | RpcError::Protocol { .. } => Outcome::Final,
        },
        _ => Outcome::Final,
    }
}

fn no_copy(inode: InodeId, stripe: u32) -> ClientError {
    ClientError::inode(
        inode,
        ErrorCode::Unreachable,
        format!("no copy of stripe {stripe} is in service"),
    )
}

/// The wait between attempts, and when to give up: a call timeout after the last change
/// of the service map (while the cluster moves, a request waits for it).
struct Retry {
    deadline: Instant,
    wait_ms: u64,
    timeout: Duration,
    version: u64,
}

impl Retry {
    fn new(pool: &Pool) -> Retry {
        let timeout = Duration::from_millis(pool.call_timeout_ms());
        Retry {
            deadline: Instant::now() + timeout,
            wait_ms: RETRY_WAIT_MIN_MS,
            timeout,
            version: 0,
        }
    }

    /// The map changed: the cluster is moving, so the wait starts again.
    fn saw(&mut self, map: &ServiceMap) {
        if map.version != self.version {
            self.version = map.version;
            self.deadline = self.deadline.max(Instant::now() + self.timeout);
        }
    }

    /// Wait before the next attempt; false once the call timeout has passed.
    async fn wait(&mut self) -> bool {
        if Instant::now() >= self.deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(self.wait_ms)).await;
        self.wait_ms = (self.wait_ms * 2).min(RETRY_WAIT_MAX_MS);
        true
    }
}

impl Pool {
    /// Run `attempt`, a request to `member`, but give it up (None) once the map says the
    /// member is out or another process: a member that hangs must not hold the caller for
    /// a whole call timeout when the meta server already put it out.
    async fn attempt_while_in<T>(
        &self,
        member: ServerId,
        map: &ServiceMap,
        attempt: impl std::future::Future<Output = Result<T, ClientError>>,
    ) -> Option<Result<T, ClientError>> {
        let incarnation = map.member(member).map_or(0, |member| member.incarnation);
        let mut seen = map.version;
        tokio::pin!(attempt);
        loop {
            tokio::select! {
                result = &mut attempt => return Some(result),
                () = tokio::time::sleep(Duration::from_millis(HUNG_CHECK_MS)) => {
                    if let Ok(fresh) = self.fetch_service_map(seen).await {
                        seen = fresh.version;
                        let gone = fresh.member(member).is_none_or(|now| {
                            now.state == MemberState::Out || now.incarnation != incarnation
                        });
                        if gone {
                            return None;
                        }
                    }
                }
            }
        }
    }

    /// The one server a request for `object` (a stripe of `layout` kept on `chain`) goes
    /// to straight, without a map version: a stripe with one copy whose server the held
    /// map does not drain (or no map is held yet: the server refuses what it must not
    /// take). None: down the chain as the map makes it.
    pub(crate) fn direct(
        &self,
        layout: &Layout,
        object: ObjectId,
        chain: &[ServerId],
    ) -> Option<ServerId> {
        if layout.replicas() >= 2 {
            return None;
        }
        let map = self.held_service_map();
        (!map.moved(object, chain)).then(|| chain[0])
    }

    /// Whether a request sent straight to a stripe's one server was refused because a
    /// drain moves the stripe (its server said `Stale`, and the map fetched now moves
    /// it): it goes down the chain then. Any other failure stands.
    pub(crate) async fn drained_meanwhile(
        &self,
        error: &ClientError,
        object: ObjectId,
        chain: &[ServerId],
    ) -> bool {
        let stale = matches!(
            error,
            ClientError::Io {
                source: RpcError::Remote(wire),
                ..
            } if wire.code == ErrorCode::Stale
        );
        if !stale {
            return false;
        }
        let held = self.held_service_map().version;
        match self.fetch_service_map(held).await {
            Ok(map) => map.moved(object, chain),
            Err(_) => false,
        }
    }

    /// A write-like request (`WriteObject`, `AllocateObject`) to stripe `stripe` of
    /// `layout`; `make(map_version, forward)` builds it for the chain in effect.
    pub(crate) async fn chain_write<R: Request>(
        &self,
        layout: &Layout,
        stripe: u32,
        inode: InodeId,
        make: impl Fn(u64, Vec<ServerId>) -> R,
        payload: Bytes,
        target: impl Fn() -> String,
    ) -> Result<(R::Reply, Bytes), ClientError> {
        let chain = layout.chain(stripe);
        let object = ObjectId {
            inode,
            stripe_index: stripe,
        };
        if let Some(server) = self.direct(layout, object, &chain) {
            match self
                .io_call(
                    server,
                    inode,
                    &make(0, Vec::new()),
                    payload.clone(),
                    &target,
                )
                .await
            {
                Err(error) if self.drained_meanwhile(&error, object, &chain).await => {}
                done => return done,
            }
        }
        let mut retry = Retry::new(self);
        let mut map = self.service_map().await?;
        let mut unsure: Option<(ServerId, u64)> = None;
        let mut last_error: Option<ClientError> = None;
        loop {
            let settled = unsure.is_none_or(|(head, incarnation)| {
                map.member(head).is_none_or(|member| {
                    member.state == MemberState::Out || member.incarnation != incarnation
                })
            });
            if settled {
                unsure = None;
                let members = map.write_chain(object, &chain);
                // No member in service: wait for one (the freshest copy may be away).
                if let Some((&head, rest)) = members.split_first() {
                    let request = make(map.version, rest.to_vec());
                    let attempt = self.io_attempt(head, inode, &request, payload.clone(), &target);
                    match self.attempt_while_in(head, &map, attempt).await {
                        // The head was put out while it held the request: it cannot apply
                        // it any more (its partners refuse its map), so send it again.
                        None => {}
                        Some(Ok(reply)) => return Ok(reply),
                        Some(Err(error)) => match outcome(&error) {
                            Outcome::Final => return Err(error),
                            Outcome::Again => last_error = Some(error),
                            Outcome::Unsure => {
                                let incarnation =
                                    map.member(head).map_or(0, |member| member.incarnation);
                                unsure = Some((head, incarnation));
                                last_error = Some(error);
                            }
                        },
                    }
                }
            }
            if !retry.wait().await {
                return Err(last_error.unwrap_or_else(|| no_copy(inode, stripe)));
            }
            if let Ok(fresh) = self.fetch_service_map(map.version).await {
                map = fresh;
            }
            retry.saw(&map);
        }
    }

    /// A read of stripe `stripe` of `layout`.
    pub(crate) async fn chain_read(
        &self,
        layout: &Layout,
        stripe: u32,
        inode: InodeId,
        request: &ReadObject,
        target: impl Fn() -> String,
    ) -> Result<(freeflow_proto::io::ReadReply, Bytes), ClientError> {
        let chain = layout.chain(stripe);
        let object = ObjectId {
            inode,
            stripe_index: stripe,
        };
        if let Some(server) = self.direct(layout, object, &chain) {
            match self
                .io_call(server, inode, request, Bytes::new(), &target)
                .await
            {
                Err(error) if self.drained_meanwhile(&error, object, &chain).await => {}
                done => return done,
            }
        }
        let mut retry = Retry::new(self);
        let mut map = self.service_map().await?;
        loop {
            let mut last_error = None;
            let request = ReadObject {
                map_version: map.version,
                ..request.clone()
            };
            for member in map.read_chain(object, &chain) {
                let attempt = self.io_attempt(member, inode, &request, Bytes::new(), &target);
                match self.attempt_while_in(member, &map, attempt).await {
                    None => {}
                    Some(Ok(reply)) => return Ok(reply),
                    Some(Err(error)) if outcome(&error) == Outcome::Final => return Err(error),
                    Some(Err(error)) => last_error = Some(error),
                }
            }
            if !retry.wait().await {
                return Err(last_error.unwrap_or_else(|| no_copy(inode, stripe)));
            }
            if let Ok(fresh) = self.fetch_service_map(map.version).await {
                map = fresh;
            }
            retry.saw(&map);
        }
    }

    /// Make stripe `stripe` of `layout` durable on every copy that takes writes.
    pub(crate) async fn chain_sync(
        &self,
        layout: &Layout,
        stripe: u32,
        inode: InodeId,
        request: &SyncObjects,
        target: impl Fn() -> String,
    ) -> Result<(), ClientError> {
        let chain = layout.chain(stripe);
        let object = ObjectId {
            inode,
            stripe_index: stripe,
        };
        if let Some(server) = self.direct(layout, object, &chain) {
            self.io_call(server, inode, request, Bytes::new(), target)
                .await?;
            return Ok(());
        }
        let mut retry = Retry::new(self);
        let mut map = self.service_map().await?;
        loop {
            let members = map.write_chain(object, &chain);
            let syncs = members.iter().map(|member| {
                let attempt = self.io_attempt(*member, inode, request, Bytes::new(), &target);
                self.attempt_while_in(*member, &map, attempt)
            });
            // No member in service: wait for one.
            let mut last_error = members.is_empty().then(|| no_copy(inode, stripe));
            for result in futures::future::join_all(syncs).await {
                match result {
                    Some(Ok(_)) => {}
                    Some(Err(error)) if outcome(&error) == Outcome::Final => return Err(error),
                    Some(Err(error)) => last_error = Some(error),
                    // Put out while syncing: its copy no longer counts; the others must.
                    None => last_error = Some(no_copy(inode, stripe)),
                }
            }
            let Some(error) = last_error else {
                return Ok(());
            };
            if !retry.wait().await {
                return Err(error);
            }
            if let Ok(fresh) = self.fetch_service_map(map.version).await {
                map = fresh;
            }
            retry.saw(&map);
        }
    }
}

/// Whether a server-side copy between these two stripes can stand for a read and a write:
/// only when both have one copy on the same server (a replicated target must get the bytes
/// down its chain).
pub(crate) fn same_single_server(
    source: &Layout,
    source_stripe: u32,
    target: &Layout,
    target_stripe: u32,
) -> bool {
    source.replicas() == 1
        && target.replicas() == 1
        && source.servers.get(source_stripe as usize) == target.servers.get(target_stripe as usize)
}
