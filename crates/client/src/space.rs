//! Space this client holds on the I/O servers (capacity grants, issue 12; the servers'
//! side is `ioserver/src/space.rs`): a write that extends a file takes the bytes it adds
//! from the grants of the servers that will keep them *before* it is acknowledged, so a
//! write with no room fails with `NoSpace` itself, and no write acknowledged earlier is
//! refused later for want of space.
//!
//! Grants are asked for in chunks (`GRANT_CHUNK_BYTES`, less when the server is short) and
//! counted on for `GRANT_TRUST_MS` after the last request that used them was sent; the
//! server keeps them at least that long. They are given back a second after the client's
//! last handle open for writing closes, and at shutdown. A server that does not answer a
//! reservation within `ASK_TIMEOUT_MS`, or is out of its chains, is left out of the account
//! for `UNREACHABLE_MS`: its writes fail or go to the rest of their chain as they would
//! anyway, and the writes to the others do not wait for it.
//!
//! What is taken at the write and what the requests carry (`WriteObject::charged`) add up
//! to the same per server: a write takes the bytes it adds past the size the handle knows,
//! on every server of each stripe's chain; each request carries the bytes of its object
//! range past what its handle charged on that stripe before (`HandleState::charged_through`),
//! the same number for every server of the chain, and the client subtracts it from what was
//! taken there (or, past that, from what is held), as the server takes it from the grant.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use bytes::Bytes;
use freeflow_proto::io::{ReserveSpace, GRANT_TRUST_MS};
use freeflow_proto::meta::MemberState;
use freeflow_proto::ErrorCode;
use freeflow_types::{InodeId, Layout, ServerId};

use crate::pool::Pool;
use crate::ClientError;

/// Bytes asked for at once beyond a write's need.
pub const GRANT_CHUNK_BYTES: u64 = 64 << 20;

#[derive(Debug)]
struct Held {
    /// Bytes of the grant not taken yet.
    bytes: u64,
    /// Bytes taken for acknowledged writes and not yet charged to a request sent.
    unsent: u64,
    trusted_until: Instant,
}

/// This client's grants, by server.
#[derive(Debug)]
pub(crate) struct SpaceGrants {
    /// The grant id sent with every write (random per client, never 0).
    pub id: u64,
    held: Mutex<Grants>,
    /// One reservation round at a time.
    asking: tokio::sync::Mutex<()>,
}

#[derive(Debug, Default)]
struct Grants {
    by_server: HashMap<ServerId, Held>,
    /// Servers that could not be asked, not asked again before the instant.
    unreachable: HashMap<ServerId, Instant>,
}

/// How long a server that could not be asked is left out of the account.
const UNREACHABLE_MS: u64 = 5_000;
/// How long a reservation may take before its server is left out of the account.
const ASK_TIMEOUT_MS: u64 = 2_000;
/// Rounds of asking before a write is refused (each round asks every server short).
const ASK_ROUNDS_MAX: usize = 8;

/// The bytes `[from, to)` of a file with `layout` take on each server keeping them.
pub(crate) fn needs(layout: &Layout, from: u64, to: u64) -> Vec<(ServerId, u64)> {
    let mut by_server: Vec<(ServerId, u64)> = Vec::new();
    if to <= from {
        return by_server;
    }
    for chunk in layout.chunks(from, to - from) {
        for server in layout.chain(chunk.stripe_index) {
            match by_server.iter_mut().find(|(id, _)| *id == server) {
                Some((_, bytes)) => *bytes += chunk.length,
                None => by_server.push((server, chunk.length)),
            }
        }
    }
    by_server
}

impl SpaceGrants {
    pub fn new() -> SpaceGrants {
        // RandomState is seeded from the operating system's randomness.
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        SpaceGrants {
            id: hasher.finish().max(1),
            held: Mutex::new(Grants::default()),
            asking: tokio::sync::Mutex::new(()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Grants> {
        self.held.lock().expect("space grants lock not poisoned")
    }

    /// Take `needs` from the grants held, all or nothing, without asking anyone. Servers
    /// left out of the account (unreachable) need nothing.
    pub fn try_take(&self, needs: &[(ServerId, u64)]) -> bool {
        let now = Instant::now();
        let mut grants = self.lock();
        let counted = |grants: &Grants, server: &ServerId| {
            grants
                .unreachable
                .get(server)
                .is_none_or(|until| *until <= now)
        };
        let covered = needs.iter().all(|(server, bytes)| {
            *bytes == 0
                || !counted(&grants, server)
                || grants
                    .by_server
                    .get(server)
                    .is_some_and(|grant| grant.trusted_until > now && grant.bytes >= *bytes)
        });
        if covered {
            for (server, bytes) in needs {
                if !counted(&grants, server) {
                    continue;
                }
                if let Some(grant) = grants.by_server.get_mut(server) {
                    grant.bytes -= (*bytes).min(grant.bytes);
                    grant.unsent += bytes;
                }
            }
        }
        covered
    }

    /// Put back what `try_take` took for a write that was then not made.
    pub fn put_back(&self, needs: &[(ServerId, u64)]) {
        let mut grants = self.lock();
        for (server, bytes) in needs {
            if let Some(grant) = grants.by_server.get_mut(server) {
                let back = (*bytes).min(grant.unsent);
                grant.unsent -= back;
                grant.bytes += back;
            }
        }
    }

    /// A request carrying `charged` bytes of grant to the servers of `chain` is sent at
    /// `sent`: each subtracts them from what acknowledged writes took there, then from
    /// what it holds, as the server takes them from the grant; and counts on its grant
    /// for `GRANT_TRUST_MS` from `sent`.
    pub fn charge(&self, chain: &[ServerId], charged: u64, sent: Instant) {
        let mut grants = self.lock();
        for server in chain {
            if let Some(grant) = grants.by_server.get_mut(server) {
                let from_unsent = charged.min(grant.unsent);
                grant.unsent -= from_unsent;
                grant.bytes -= (charged - from_unsent).min(grant.bytes);
                grant.trusted_until = grant
                    .trusted_until
                    .max(sent + Duration::from_millis(GRANT_TRUST_MS));
            }
        }
    }

    /// Take `needs`, asking the servers for more where the grants held do not cover them
    /// (all at once). `NoSpace` (naming the server) when one has no room for the write.
    pub async fn take(
        &self,
        pool: &Pool,
        inode: InodeId,
        needs: &[(ServerId, u64)],
        replicated: bool,
    ) -> Result<(), ClientError> {
        if self.try_take(needs) {
            return Ok(());
        }
        let _asking = self.asking.lock().await;
        // Servers out of their chains take no writes of replicated files: nothing to
        // reserve there.
        let map = if replicated {
            pool.service_map().await.ok()
        } else {
            None
        };
        for _ in 0..ASK_ROUNDS_MAX {
            if self.try_take(needs) {
                return Ok(());
            }
            let now = Instant::now();
            let mut asks = Vec::new();
            {
                let mut grants = self.lock();
                for (server, need) in needs {
                    if grants
                        .unreachable
                        .get(server)
                        .is_some_and(|until| *until > now)
                    {
                        continue;
                    }
                    if map
                        .as_ref()
                        .is_some_and(|map| map.state(*server) == MemberState::Out)
                    {
                        grants
                            .unreachable
                            .insert(*server, now + Duration::from_millis(UNREACHABLE_MS));
                        continue;
                    }
                    let (have, give_back) = match grants.by_server.get(server) {
                        Some(grant) if grant.trusted_until > now => (grant.bytes, 0),
                        // No longer counted on; what the server still keeps of it goes back.
                        Some(grant) => (0, grant.bytes),
                        None => (0, 0),
                    };
                    if have < *need {
                        asks.push((*server, need - have, give_back));
                    }
                }
            }
            let replies =
                futures::future::join_all(asks.iter().map(|(server, short, give_back)| {
                    let request = ReserveSpace {
                        grant: self.id,
                        give_back: *give_back,
                        need: *short,
                        want: (*short).max(GRANT_CHUNK_BYTES),
                    };
                    let server = *server;
                    async move {
                        let sent = Instant::now();
                        let call = pool.io_call(server, inode, &request, Bytes::new(), || {
                            format!("space on I/O server {server}")
                        });
                        let reply =
                            tokio::time::timeout(Duration::from_millis(ASK_TIMEOUT_MS), call).await;
                        (sent, reply)
                    }
                }))
                .await;
            let mut refused = None;
            let mut grants = self.lock();
            for ((server, _, give_back), (sent, reply)) in asks.iter().zip(replies) {
                match reply {
                    Ok(Ok((grant, _))) => {
                        let entry = grants.by_server.entry(*server).or_insert(Held {
                            bytes: 0,
                            unsent: 0,
                            trusted_until: sent,
                        });
                        entry.bytes = entry.bytes.saturating_sub(*give_back);
                        entry.bytes = entry.bytes.saturating_add(grant.added);
                        entry.trusted_until = sent + Duration::from_millis(GRANT_TRUST_MS);
                    }
                    Ok(Err(error)) if error.code() == ErrorCode::NoSpace => {
                        if let Some(entry) = grants.by_server.get_mut(server) {
                            entry.bytes = entry.bytes.saturating_sub(*give_back);
                        }
                        refused.get_or_insert(error);
                    }
                    // Not answering, unreachable, or an older server: left out of the
                    // account for a while.
                    failed => {
                        if let Ok(Err(error)) = &failed {
                            tracing::debug!(server, %error, "space not reserved");
                        } else {
                            tracing::debug!(server, "space not reserved in time");
                        }
                        grants.unreachable.insert(
                            *server,
                            Instant::now() + Duration::from_millis(UNREACHABLE_MS),
                        );
                    }
                }
            }
            if let Some(error) = refused {
                return Err(error);
            }
        }
        Err(ClientError::inode(
            inode,
            ErrorCode::NoSpace,
            "other writes of this client kept taking the space granted for this one",
        ))
    }

    /// Give the bytes held and not taken back (the client stopped writing, or shuts down).
    pub async fn give_back(&self, pool: &Pool) {
        let _asking = self.asking.lock().await;
        let grants: Vec<(ServerId, u64)> = self
            .lock()
            .by_server
            .iter_mut()
            .map(|(server, grant)| (*server, std::mem::take(&mut grant.bytes)))
            .filter(|(_, bytes)| *bytes > 0)
            .collect();
        for (server, bytes) in grants {
            let request = ReserveSpace {
                grant: self.id,
                give_back: bytes,
                need: 0,
                want: 0,
            };
            // Lost only until the grant lapses at the server.
            let _ = pool
                .io_call(server, 0, &request, Bytes::new(), || {
                    format!("space on I/O server {server}")
                })
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needs_count_every_copy_of_each_stripe() {
        // Two stripes of 64 KiB units, each on a chain of two servers.
        let layout = Layout::replicated(64 << 10, vec![0, 1], vec![2, 3]).unwrap();
        let mut needs = needs(&layout, 32 << 10, 160 << 10);
        needs.sort();
        // [32K, 64K) and [128K, 160K) on stripe 0, [64K, 128K) on stripe 1.
        assert_eq!(
            needs,
            vec![(0, 64 << 10), (1, 64 << 10), (2, 64 << 10), (3, 64 << 10)]
        );
        assert!(super::needs(&layout, 10, 10).is_empty());
    }

    #[test]
    fn grants_are_taken_all_or_nothing_and_only_while_trusted() {
        let grants = SpaceGrants::new();
        assert_ne!(grants.id, 0);
        let later = Instant::now() + Duration::from_secs(60);
        grants.lock().by_server.insert(
            1,
            Held {
                bytes: 100,
                unsent: 0,
                trusted_until: later,
            },
        );
        assert!(
            !grants.try_take(&[(1, 60), (2, 1)]),
            "server 2 holds nothing"
        );
        assert_eq!(grants.lock().by_server[&1].bytes, 100, "nothing taken");
        assert!(grants.try_take(&[(1, 60), (2, 0)]));
        assert!(!grants.try_take(&[(1, 60)]), "40 left");
        grants.put_back(&[(1, 10)]);
        assert_eq!(grants.lock().by_server[&1].unsent, 50);
        assert_eq!(grants.lock().by_server[&1].bytes, 50);
        // Requests carry what was taken; past it, what is held goes.
        grants.charge(&[1, 2], 30, Instant::now());
        assert_eq!(grants.lock().by_server[&1].unsent, 20);
        grants.charge(&[1], 30, Instant::now());
        let held = {
            let grants = grants.lock();
            (grants.by_server[&1].unsent, grants.by_server[&1].bytes)
        };
        assert_eq!(held, (0, 40));
        // A server left out of the account needs nothing.
        grants
            .lock()
            .unreachable
            .insert(2, Instant::now() + Duration::from_secs(60));
        assert!(grants.try_take(&[(1, 10), (2, 1 << 40)]));
        grants.lock().by_server.get_mut(&1).unwrap().trusted_until = Instant::now();
        assert!(!grants.try_take(&[(1, 1)]), "no longer trusted");
    }
}
