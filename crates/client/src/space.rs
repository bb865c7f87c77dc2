//! Space this client holds on the I/O servers (capacity grants, issue 12; the servers'
//! side is `ioserver/src/space.rs`): a write that extends a file takes the bytes it adds
//! from the grants of the servers that will keep them *before* it is acknowledged, so a
//! write with no room fails with `NoSpace` itself, and no write acknowledged earlier is
//! refused later for want of space.
//!
//! Grants are asked for in chunks (`GRANT_CHUNK_BYTES`, less when the server is short) and
//! counted on for `GRANT_TRUST_MS` after the last request that used them was sent; the
//! server keeps them at least that long. They are given back when the client's last
//! handle open for writing closes, and at shutdown. A server that cannot be reached is
//! not asked: its writes fail or go to the rest of their chain as they would anyway.
//!
//! What is taken is an estimate the servers correct: the bytes a write adds past the size
//! this client knows, on every server of each stripe's chain. The servers take from a grant
//! what writes add past their object's end as the writes land.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use freeflow_proto::io::{ReserveSpace, GRANT_TRUST_MS};
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
const UNREACHABLE_MS: u64 = 1_000;
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

    /// The bytes of grant a request of `length` bytes to a stripe kept on `chain` carries
    /// (`WriteObject::charged`): what acknowledged writes took on its first server and no
    /// request carried yet, at most its length; taken off every server of the chain.
    pub fn charge(&self, chain: &[ServerId], length: u64) -> u64 {
        let mut grants = self.lock();
        let Some(head) = chain.first() else {
            return 0;
        };
        let charged = grants
            .by_server
            .get(head)
            .map_or(0, |grant| grant.unsent.min(length));
        for server in chain {
            if let Some(grant) = grants.by_server.get_mut(server) {
                grant.unsent -= charged.min(grant.unsent);
            }
        }
        charged
    }

    /// A request that used the grant on `server` was sent at `sent`.
    pub fn used(&self, server: ServerId, sent: Instant) {
        if let Some(grant) = self.lock().by_server.get_mut(&server) {
            grant.trusted_until = grant
                .trusted_until
                .max(sent + Duration::from_millis(GRANT_TRUST_MS));
        }
    }

    /// Take `needs`, asking the servers for more where the grants held do not cover them.
    /// `NoSpace` (naming the server) when one has no room for the write.
    pub async fn take(
        &self,
        pool: &Pool,
        inode: InodeId,
        needs: &[(ServerId, u64)],
    ) -> Result<(), ClientError> {
        if self.try_take(needs) {
            return Ok(());
        }
        let _asking = self.asking.lock().await;
        for _ in 0..ASK_ROUNDS_MAX {
            if self.try_take(needs) {
                return Ok(());
            }
            for (server, need) in needs {
                let now = Instant::now();
                let (have, give_back) = {
                    let grants = self.lock();
                    if grants
                        .unreachable
                        .get(server)
                        .is_some_and(|until| *until > now)
                    {
                        continue;
                    }
                    match grants.by_server.get(server) {
                        Some(grant) if grant.trusted_until > now => (grant.bytes, 0),
                        // No longer counted on; what the server still keeps of it goes back.
                        Some(grant) => (0, grant.bytes),
                        None => (0, 0),
                    }
                };
                if have >= *need {
                    continue;
                }
                let short = need - have;
                let request = ReserveSpace {
                    grant: self.id,
                    give_back,
                    need: short,
                    want: short.max(GRANT_CHUNK_BYTES),
                };
                let sent = Instant::now();
                let reply = pool
                    .io_call(*server, inode, &request, Bytes::new(), || {
                        format!("space on I/O server {server}")
                    })
                    .await;
                let mut grants = self.lock();
                match reply {
                    Ok((grant, _)) => {
                        let entry = grants.by_server.entry(*server).or_insert(Held {
                            bytes: 0,
                            unsent: 0,
                            trusted_until: sent,
                        });
                        if give_back > 0 {
                            entry.bytes = entry.bytes.saturating_sub(give_back);
                        }
                        entry.bytes = entry.bytes.saturating_add(grant.added);
                        entry.trusted_until = sent + Duration::from_millis(GRANT_TRUST_MS);
                    }
                    Err(error) if error.code() == ErrorCode::NoSpace => {
                        if let Some(entry) = grants.by_server.get_mut(server) {
                            entry.bytes = entry.bytes.saturating_sub(give_back);
                        }
                        return Err(error);
                    }
                    // Not reachable (down, or not answering): left out of the account for
                    // a while; its writes fail or go on without it as they would anyway.
                    Err(error) => {
                        tracing::debug!(server, %error, "space not reserved");
                        grants.unreachable.insert(
                            *server,
                            Instant::now() + Duration::from_millis(UNREACHABLE_MS),
                        );
                    }
                }
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
        // Requests carry what was taken, at most their length, once.
        assert_eq!(grants.charge(&[1, 2], 30), 30);
        assert_eq!(grants.charge(&[1], 30), 20);
        assert_eq!(grants.charge(&[1], 30), 0);
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
