//! Local reads: clients on this host are handed read-only descriptors of objects and read
//! them from the shared page cache themselves (`freeflow_rpc::local` has the socket and
//! its packets; the client's side is `client/src/local.rs`). A read served this way costs
//! this server nothing: no request, no copy into a reply, no copy across a socket.
//!
//! What keeps such reads as correct as the served ones:
//! - descriptors are handed out only while the data gate is open (`gate.rs`), and every
//!   connection is closed when a registration reply says cuts are owed, and with the
//!   process: a client uses a descriptor only while the connection that brought it is
//!   open, so it never reads past a cut this server has not made;
//! - cuts, writes and removals act on the same files, so a descriptor's reader sees them
//!   as this server's own reads would, through the same page cache;
//! - only unreplicated stripes are read this way (the client's rule): a copy of a chain
//!   may lag its head, which only the served path's version checks handle;
//! - when a drain names this server, every connection is closed and no descriptor of an
//!   object leaving is handed out again (`gate.rs`): its reads go down its chain.
//!
//! Only peers running as this server's user or as root are answered: they could open the
//! objects' files anyway.
//!
//! The same socket takes the regions such clients share for their write payloads
//! (`freeflow_rpc::shared`): a connection that shares one carries nothing else, and the
//! region is forgotten when the client closes it.

use std::os::fd::AsFd;
use std::sync::Arc;

use freeflow_proto::io::{
    LocalRequest, OpenForReading, OpenedForReading, RegionReleased, RegionShared,
};
use freeflow_proto::{ErrorCode, WireError};
use freeflow_rpc::local::{SeqpacketConn, SeqpacketListener, LOCAL_PACKET_BYTES_MAX};
use freeflow_rpc::shared::{MappedRegion, SharedRegions};

use crate::gate::DataGate;
use crate::store::ObjectStore;

/// Most local-reads connections served at once (one per client process on this host);
/// further ones are closed at once and those clients read through the RPC path.
pub const LOCAL_READ_CONNECTIONS_MAX: usize = 256;

/// Serve the local-reads socket until the task is dropped.
pub async fn serve(
    listener: SeqpacketListener,
    store: Arc<ObjectStore>,
    gate: Arc<DataGate>,
    regions: Arc<SharedRegions>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(LOCAL_READ_CONNECTIONS_MAX));
    let mut connections = tokio::task::JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let connection = match listener.accept().await {
            Ok(connection) => connection,
            Err(error) => {
                tracing::warn!(%error, "accept on the local-reads socket failed; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::warn!(
                limit = LOCAL_READ_CONNECTIONS_MAX,
                "closing a local-reads connection: too many"
            );
            continue;
        };
        let (store, gate, regions) = (Arc::clone(&store), Arc::clone(&gate), regions.clone());
        connections.spawn(async move {
            let _slot = slot;
            if let Err(reason) = serve_connection(&connection, &store, &gate, &regions).await {
                tracing::warn!("closing a local-reads connection: {reason}");
            }
        });
    }
}

/// Whether a peer running as `peer_uid` may be handed descriptors by a server running as
/// `own_uid`.
pub fn peer_may_read(peer_uid: u32, own_uid: u32) -> bool {
    peer_uid == own_uid || peer_uid == 0
}

async fn serve_connection(
    connection: &SeqpacketConn,
    store: &ObjectStore,
    gate: &DataGate,
    regions: &SharedRegions,
) -> Result<(), String> {
    let peer_uid = connection
        .peer_uid()
        .map_err(|error| format!("cannot tell its peer's user: {error}"))?;
    // SAFETY: geteuid cannot fail.
    let own_uid = unsafe { libc::geteuid() };
    if !peer_may_read(peer_uid, own_uid) {
        return Err(format!(
            "its peer runs as user {peer_uid}, neither this server's user {own_uid} nor root"
        ));
    }
    let mut closings = gate.closings();
    closings.mark_unchanged();
    let mut packet = vec![0u8; LOCAL_PACKET_BYTES_MAX];
    loop {
        // The whole exchange races the gate: once cuts are owed, descriptors handed out
        // may show bytes past a cut, so the client must drop them, and it sees that by
        // this connection closing, whatever the exchange was doing.
        let exchanged = tokio::select! {
            exchanged = exchange(connection, &mut packet, store, gate, regions) => exchanged,
            _ = closings.changed() => return Ok(()),
        };
        match exchanged? {
            Exchanged::Answered => {}
            Exchanged::Closed => return Ok(()),
            Exchanged::Shared(registered) => {
                // Payloads may name the region until the client releases it or closes
                // this connection (gate changes do not matter: every write checks the
                // gate itself).
                return keep_region(connection, &mut packet, registered).await;
            }
        }
    }
}

/// How one exchange ended.
enum Exchanged<'a> {
    /// A descriptor (or a refusal) was sent; the next request may come.
    Answered,
    /// The peer closed the connection.
    Closed,
    /// A region was shared: the connection now only keeps it.
    Shared(Registered<'a>),
}

/// A region registered for a connection: forgotten when this goes, however the
/// connection's task ends (an exchange dropped half way by a gate change included).
struct Registered<'a> {
    regions: &'a SharedRegions,
    name: u64,
    /// Resolves once the region is unmapped here (forgotten and no payload view left).
    unmapped: tokio::sync::oneshot::Receiver<()>,
}

/// Keep a shared region until its client closes the connection, or asks to release it:
/// then forget it, wait until no request of this server holds a view of it any more, and
/// say so (the client may then reuse places whose requests it gave up).
async fn keep_region(
    connection: &SeqpacketConn,
    packet: &mut [u8],
    mut registered: Registered<'_>,
) -> Result<(), String> {
    let (length, descriptor) = connection
        .recv(packet)
        .await
        .map_err(|error| format!("receive failed: {error}"))?;
    if length == 0 {
        return Ok(());
    }
    if descriptor.is_some() {
        return Err("its peer sent a descriptor".into());
    }
    let region = match freeflow_proto::decode::<LocalRequest>(&packet[..length]) {
        Ok(LocalRequest::ReleaseRegion(release)) if release.region == registered.name => {
            release.region
        }
        Ok(LocalRequest::ReleaseRegion(release)) => {
            return Err(format!(
                "a release of region {:x} on the connection that shared region {:x}",
                release.region, registered.name
            ))
        }
        Ok(other) => return Err(format!("{other:?} on a connection that shared a region")),
        Err(error) => return Err(error.message),
    };
    registered.regions.remove(region);
    // Each view belongs to a request under way, which ends on its own (a write to the
    // disk, a copy out): no bound of ours is needed, and the connection's close ends the
    // wait if the client stops waiting first.
    tokio::select! {
        _ = &mut registered.unmapped => {}
        _ = connection.closed() => return Ok(()),
    }
    let answer: Result<RegionReleased, WireError> = Ok(RegionReleased { region });
    connection
        .send(&freeflow_proto::encode(&answer), None)
        .await
        .map_err(|error| format!("send failed: {error}"))
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.regions.remove(self.name);
    }
}

/// One request and its answer.
async fn exchange<'a>(
    connection: &SeqpacketConn,
    packet: &mut [u8],
    store: &ObjectStore,
    gate: &DataGate,
    regions: &'a SharedRegions,
) -> Result<Exchanged<'a>, String> {
    let (length, descriptor) = connection
        .recv(packet)
        .await
        .map_err(|error| format!("receive failed: {error}"))?;
    if length == 0 {
        return Ok(Exchanged::Closed);
    }
    let request = match freeflow_proto::decode::<LocalRequest>(&packet[..length]) {
        Ok(LocalRequest::ShareRegion(share)) => {
            let Some(descriptor) = descriptor else {
                return Err("a region shared without its descriptor".into());
            };
            let (answer, registered) = match share_region(share.version, &descriptor, regions) {
                Ok((shared, unmapped)) => (
                    Ok(shared),
                    Some(Registered {
                        regions,
                        name: shared.region,
                        unmapped,
                    }),
                ),
                Err(error) => (Err(error), None),
            };
            connection
                .send(&freeflow_proto::encode(&answer), None)
                .await
                .map_err(|error| format!("send failed: {error}"))?;
            return Ok(registered.map_or(Exchanged::Answered, Exchanged::Shared));
        }
        Ok(LocalRequest::Open(request)) => Ok(request),
        Ok(LocalRequest::ReleaseRegion(_)) => {
            return Err("a release of a region this connection did not share".into())
        }
        Err(error) => Err(error),
    };
    if descriptor.is_some() {
        return Err("its peer sent a descriptor".into());
    }
    let answer = match request {
        Ok(request) => open(request, store, gate)
            .await
            .map(|file| (request.object, file)),
        Err(error) => Err(error),
    };
    let sent = match answer {
        Ok((object, file)) => {
            let reply: Result<_, WireError> = Ok(OpenedForReading {
                object,
                exists: file.is_some(),
            });
            let descriptor = file.as_ref().map(|file| file.as_fd());
            connection
                .send(&freeflow_proto::encode(&reply), descriptor)
                .await
        }
        Err(mut error) => {
            // The answer must fit one packet.
            let mut keep = LOCAL_PACKET_BYTES_MAX / 2;
            while !error
                .message
                .is_char_boundary(keep.min(error.message.len()))
            {
                keep -= 1;
            }
            error.message.truncate(keep);
            let reply: Result<OpenedForReading, WireError> = Err(error);
            connection.send(&freeflow_proto::encode(&reply), None).await
        }
    };
    sent.map_err(|error| format!("send failed: {error}"))?;
    Ok(Exchanged::Answered)
}

/// Map and register a region a client shared for its write payloads.
fn share_region(
    version: u8,
    descriptor: &std::os::fd::OwnedFd,
    regions: &SharedRegions,
) -> Result<(RegionShared, tokio::sync::oneshot::Receiver<()>), WireError> {
    check_version(version)?;
    let refused = |reason: String| {
        WireError::new(
            ErrorCode::InvalidArgument,
            format!("region not shared: {reason}"),
        )
    };
    let mapped = MappedRegion::map(descriptor).map_err(refused)?;
    let (region, unmapped) = regions.insert(mapped).map_err(refused)?;
    Ok((RegionShared { region }, unmapped))
}

fn check_version(version: u8) -> Result<(), WireError> {
    if version != freeflow_proto::PROTOCOL_VERSION {
        return Err(WireError::new(
            ErrorCode::Protocol,
            format!(
                "protocol version {} asked, this server speaks {}",
                version,
                freeflow_proto::PROTOCOL_VERSION
            ),
        ));
    }
    Ok(())
}

async fn open(
    request: OpenForReading,
    store: &ObjectStore,
    gate: &DataGate,
) -> Result<Option<std::fs::File>, WireError> {
    check_version(request.version)?;
    gate.check()?;
    if gate.leaving(request.object) {
        return Err(WireError::new(
            ErrorCode::Stale,
            format!(
                "inode {} stripe {} is leaving this server (a drain): read it down its chain",
                request.object.inode, request.object.stripe_index
            ),
        ));
    }
    Ok(store.open_for_reading(request.object).await?)
}

#[cfg(test)]
mod tests {
    use super::peer_may_read;

    #[test]
    fn only_the_servers_own_user_and_root_are_answered() {
        assert!(peer_may_read(1000, 1000));
        assert!(peer_may_read(0, 1000));
        assert!(!peer_may_read(1001, 1000));
        assert!(!peer_may_read(1001, 0));
    }
}
