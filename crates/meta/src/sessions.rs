//! Client sessions and their open handles, in memory.
//!
//! A session lives while its client renews it within the lease; every handle belongs to one
//! session and ends with it. The open count per inode is what keeps an unlinked file's data
//! from the reaper: an orphan is reaped only when no handle is open on it. Nothing here is
//! persisted: after a restart (or on a new leader) clients take their sessions and handles
//! again under their old ids within the recovery window (`ReclaimSession`); orphans from
//! before the restart wait one lease before being reaped (see `reaper.rs`), so a handle
//! reclaimed in that time still finds its data.

use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tokio::time::Instant;

use freeflow_proto::meta::OpenAccess;
use freeflow_proto::{ErrorCode, WireError};
use freeflow_types::InodeId;

/// Bounds of the in-memory tables.
#[derive(Clone, Copy, Debug)]
pub struct SessionLimits {
    pub sessions_max: usize,
    pub handles_max: usize,
    pub lease: Duration,
}

#[derive(Debug)]
struct Session {
    client_name: String,
    /// The client's id from its connection's handshake (0: none).
    client_id: u64,
    renewed_at: Instant,
    handles: HashSet<u64>,
    /// Handles opened again for creates answered from their reply record (a handle id
    /// another server gave -> the one opened here), so a second resend gets the same one.
    reopened: HashMap<u64, u64>,
}

#[derive(Clone, Copy, Debug)]
struct Handle {
    session_id: u64,
    /// None while reserved by a create-and-open whose inode is not chosen yet.
    inode: Option<InodeId>,
    access: OpenAccess,
}

/// What taking a handle again ([`Sessions::reclaim_handle`]) did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reclaimed {
    /// Counted open again: its file must still be checked (and the handle let go if gone).
    Taken,
    /// Already held in the session (a reclaim sent twice).
    Held,
    /// Not taken: issued by this run and since closed, or held by another session.
    Refused,
}

#[derive(Debug)]
pub struct Sessions {
    limits: SessionLimits,
    /// The first session and handle id this run issues after: ids up to it were issued by
    /// an earlier run (before a restart, or by another leader), and only those are taken
    /// again by a reclaim.
    first_id: u64,
    next_session_id: u64,
    next_handle_id: u64,
    sessions: HashMap<u64, Session>,
    handles: HashMap<u64, Handle>,
    open_counts: HashMap<InodeId, u32>,
}

fn bad_session(session_id: u64) -> WireError {
    WireError::new(
        ErrorCode::BadHandle,
        format!("session {session_id} does not exist or its lease expired"),
    )
}

impl Sessions {
    pub fn new(limits: SessionLimits) -> Sessions {
        // Ids start at a time-derived value so ids from before a restart are not reused.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros() as u64;
        Sessions {
            limits,
            first_id: seed << 8,
            next_session_id: seed << 8,
            next_handle_id: seed << 8,
            sessions: HashMap::new(),
            handles: HashMap::new(),
            open_counts: HashMap::new(),
        }
    }

    pub fn open_session(
        &mut self,
        client_name: &str,
        client_id: u64,
        now: Instant,
    ) -> Result<u64, WireError> {
        if self.sessions.len() >= self.limits.sessions_max {
            return Err(WireError::new(
                ErrorCode::Busy,
                format!("{} sessions are open, the limit", self.limits.sessions_max),
            ));
        }
        self.next_session_id += 1;
        let session_id = self.next_session_id;
        let session = Session {
            client_name: client_name.to_string(),
            client_id,
            renewed_at: now,
            handles: HashSet::new(),
            reopened: HashMap::new(),
        };
        self.sessions.insert(session_id, session);
        Ok(session_id)
    }

    /// Make `session_id` of `client_id` again after a restart or a change of leader (held
    /// already: renewed). Refused for an id this run issued (that session ended here) or
    /// a session of another client.
    pub fn reclaim_session(
        &mut self,
        session_id: u64,
        client_name: &str,
        client_id: u64,
        now: Instant,
    ) -> Result<(), WireError> {
        if let Some(session) = self.sessions.get_mut(&session_id) {
            if session.client_id != client_id {
                return Err(bad_session(session_id));
            }
            session.renewed_at = now;
            return Ok(());
        }
        if session_id > self.first_id || session_id == 0 {
            return Err(bad_session(session_id));
        }
        if self.sessions.len() >= self.limits.sessions_max {
            return Err(WireError::new(
                ErrorCode::Busy,
                format!("{} sessions are open, the limit", self.limits.sessions_max),
            ));
        }
        self.sessions.insert(
            session_id,
            Session {
                client_name: client_name.to_string(),
                client_id,
                renewed_at: now,
                handles: HashSet::new(),
                reopened: HashMap::new(),
            },
        );
        Ok(())
    }

    /// Take `handle_id` (issued by an earlier run) again in `session_id`, open on `inode`.
    pub fn reclaim_handle(
        &mut self,
        session_id: u64,
        handle_id: u64,
        inode: InodeId,
        access: OpenAccess,
    ) -> Reclaimed {
        if let Some(handle) = self.handles.get(&handle_id) {
            return if handle.session_id == session_id && handle.inode == Some(inode) {
                Reclaimed::Held
            } else {
                Reclaimed::Refused
            };
        }
        if handle_id > self.first_id
            || handle_id == 0
            || self.handles.len() >= self.limits.handles_max
        {
            return Reclaimed::Refused;
        }
        let Some(session) = self.sessions.get_mut(&session_id) else {
            return Reclaimed::Refused;
        };
        session.handles.insert(handle_id);
        self.handles.insert(
            handle_id,
            Handle {
                session_id,
                inode: Some(inode),
                access,
            },
        );
        *self.open_counts.entry(inode).or_default() += 1;
        Reclaimed::Taken
    }

    pub fn renew(&mut self, session_id: u64, now: Instant) -> Result<(), WireError> {
        let session = self
            .sessions
            .get_mut(&session_id)
            .ok_or_else(|| bad_session(session_id))?;
        session.renewed_at = now;
        Ok(())
    }

    pub fn exists(&self, session_id: u64) -> bool {
        self.sessions.contains_key(&session_id)
    }

    /// The handle opened in `session_id` for the recorded handle `original`, opening it
    /// (on `inode`) the first time it is asked for; the session must be `client`'s.
    pub fn open_again(
        &mut self,
        session_id: u64,
        client: u64,
        original: u64,
        inode: InodeId,
        access: OpenAccess,
    ) -> Result<u64, WireError> {
        let session = self
            .sessions
            .get(&session_id)
            .ok_or_else(|| bad_session(session_id))?;
        if session.client_id != client {
            return Err(bad_session(session_id));
        }
        if let Some(opened) = session.reopened.get(&original) {
            if self.holds(session_id, *opened) {
                return Ok(*opened);
            }
        }
        let opened = self.open_handle(session_id, inode, access)?;
        if let Some(session) = self.sessions.get_mut(&session_id) {
            session.reopened.insert(original, opened);
        }
        Ok(opened)
    }

    /// Whether `handle_id` is open in `session_id`.
    pub fn holds(&self, session_id: u64, handle_id: u64) -> bool {
        self.handles
            .get(&handle_id)
            .is_some_and(|handle| handle.session_id == session_id)
    }

    /// Register a handle first, before checking the inode is still linked: an unlink that
    /// commits after that check is then sure to see the handle (see `reaper.rs`).
    pub fn open_handle(
        &mut self,
        session_id: u64,
        inode: InodeId,
        access: OpenAccess,
    ) -> Result<u64, WireError> {
        let handle_id = self.insert_handle(session_id, Some(inode), access)?;
        *self.open_counts.entry(inode).or_default() += 1;
        Ok(handle_id)
    }

    /// Reserve a handle for a create-and-open before its job is queued; the writer binds it
    /// to the inode inside the transaction ([`Sessions::bind_handle`]), so it is counted
    /// open before the commit that could make the file an orphan. Close it if the create
    /// fails.
    pub fn reserve_handle(
        &mut self,
        session_id: u64,
        access: OpenAccess,
    ) -> Result<u64, WireError> {
        self.insert_handle(session_id, None, access)
    }

    /// Whether `handle_id` is open in `session_id` on `inode` with write access: what lets
    /// a size change through that handle go ahead whatever the file's mode bits say.
    pub fn handle_writes(&self, session_id: u64, handle_id: u64, inode: InodeId) -> bool {
        self.handles.get(&handle_id).is_some_and(|handle| {
            handle.session_id == session_id && handle.inode == Some(inode) && handle.access.write
        })
    }

    /// Those of `inodes` that some session (a client's or the server's own) has open for
    /// writing: one pass over the open handles, however many inodes are asked about.
    pub fn open_for_writing(&self, inodes: &[InodeId]) -> HashSet<InodeId> {
        let open: HashSet<InodeId> = inodes
            .iter()
            .copied()
            .filter(|inode| self.open_counts.contains_key(inode))
            .collect();
        if open.is_empty() {
            return open;
        }
        self.handles
            .values()
            .filter(|handle| handle.access.write)
            .filter_map(|handle| handle.inode)
            .filter(|inode| open.contains(inode))
            .collect()
    }

    /// The clients with a handle open for writing on `inode` (each once).
    pub fn writing_clients(&self, inode: InodeId) -> Vec<u64> {
        if !self.open_counts.contains_key(&inode) {
            return Vec::new();
        }
        let mut clients: Vec<u64> = self
            .handles
            .values()
            .filter(|handle| handle.inode == Some(inode) && handle.access.write)
            .filter_map(|handle| self.sessions.get(&handle.session_id))
            .map(|session| session.client_id)
            .filter(|client| *client != 0)
            .collect();
        clients.sort_unstable();
        clients.dedup();
        clients
    }

    /// Bind a reserved handle to its inode. Err if the handle is gone (its session ended)
    /// or already bound.
    pub fn bind_handle(&mut self, handle_id: u64, inode: InodeId) -> Result<(), WireError> {
        match self.handles.get_mut(&handle_id) {
            Some(handle) if handle.inode.is_none() => {
                handle.inode = Some(inode);
                *self.open_counts.entry(inode).or_default() += 1;
                Ok(())
            }
            _ => Err(WireError::new(
                ErrorCode::BadHandle,
                format!("handle {handle_id} is not reserved (its session ended?)"),
            )),
        }
    }

    fn insert_handle(
        &mut self,
        session_id: u64,
        inode: Option<InodeId>,
        access: OpenAccess,
    ) -> Result<u64, WireError> {
        if self.handles.len() >= self.limits.handles_max {
            return Err(WireError::new(
                ErrorCode::Busy,
                format!("{} handles are open, the limit", self.limits.handles_max),
            ));
        }
        let session = self
            .sessions
            .get_mut(&session_id)
            .ok_or_else(|| bad_session(session_id))?;
        self.next_handle_id += 1;
        let handle_id = self.next_handle_id;
        session.handles.insert(handle_id);
        self.handles.insert(
            handle_id,
            Handle {
                session_id,
                inode,
                access,
            },
        );
        Ok(handle_id)
    }

    /// Close a handle; returns the inode if this was its last open handle.
    pub fn close_handle(
        &mut self,
        session_id: u64,
        handle_id: u64,
    ) -> Result<Option<InodeId>, WireError> {
        match self.handles.get(&handle_id) {
            Some(handle) if handle.session_id == session_id => {}
            _ => {
                return Err(WireError::new(
                    ErrorCode::BadHandle,
                    format!("handle {handle_id} is not open in session {session_id}"),
                ))
            }
        }
        if let Some(session) = self.sessions.get_mut(&session_id) {
            session.handles.remove(&handle_id);
        }
        Ok(self.forget_handle(handle_id))
    }

    fn forget_handle(&mut self, handle_id: u64) -> Option<InodeId> {
        let inode = self.handles.remove(&handle_id)?.inode?;
        let count = self.open_counts.get_mut(&inode)?;
        *count -= 1;
        if *count == 0 {
            self.open_counts.remove(&inode);
            return Some(inode);
        }
        None
    }

    /// The client id a session was opened with.
    pub fn client_of(&self, session_id: u64) -> Option<u64> {
        self.sessions
            .get(&session_id)
            .map(|session| session.client_id)
    }

    /// Whether `client_id` has a session left.
    pub fn has_sessions_of(&self, client_id: u64) -> bool {
        self.sessions
            .values()
            .any(|session| session.client_id == client_id)
    }

    /// End a session and its handles; returns the inodes that have no open handle left.
    pub fn close_session(&mut self, session_id: u64) -> Result<Vec<InodeId>, WireError> {
        let session = self
            .sessions
            .remove(&session_id)
            .ok_or_else(|| bad_session(session_id))?;
        Ok(session
            .handles
            .into_iter()
            .filter_map(|handle| self.forget_handle(handle))
            .collect())
    }

    /// End the sessions whose lease ran out; returns the inodes left without handles, the
    /// clients left without a session, and the sessions ended.
    pub fn expire(&mut self, now: Instant) -> (Vec<InodeId>, Vec<u64>, Vec<u64>) {
        let lease = self.limits.lease;
        let expired: Vec<u64> = self
            .sessions
            .iter()
            .filter(|(_, session)| now.saturating_duration_since(session.renewed_at) > lease)
            .map(|(id, _)| *id)
            .collect();
        let mut closed = Vec::new();
        let mut clients = Vec::new();
        for session_id in expired.iter().copied() {
            if let Some(session) = self.sessions.get(&session_id) {
                tracing::info!(session_id, client = %session.client_name, "session lease expired");
                clients.push(session.client_id);
            }
            closed.extend(self.close_session(session_id).unwrap_or_default());
        }
        clients.retain(|client| *client != 0 && !self.has_sessions_of(*client));
        clients.sort_unstable();
        clients.dedup();
        (closed, clients, expired)
    }

    pub fn is_open(&self, inode: InodeId) -> bool {
        self.open_counts.contains_key(&inode)
    }

    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Handles open (or reserved by a create in flight), over all sessions.
    pub fn handle_count(&self) -> usize {
        self.handles.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sessions() -> Sessions {
        Sessions::new(SessionLimits {
            sessions_max: 2,
            handles_max: 3,
            lease: Duration::from_millis(100),
        })
    }

    #[test]
    fn last_close_reports_the_inode() {
        let mut table = sessions();
        let now = Instant::now();
        let session = table.open_session("a", 0, now).unwrap();
        let first = table
            .open_handle(session, 7, OpenAccess::default())
            .unwrap();
        let second = table
            .open_handle(session, 7, OpenAccess::default())
            .unwrap();
        assert!(table.is_open(7));
        assert_eq!(table.close_handle(session, first).unwrap(), None);
        assert_eq!(table.close_handle(session, second).unwrap(), Some(7));
        assert!(!table.is_open(7));
        assert_eq!(
            table.close_handle(session, second).unwrap_err().code,
            ErrorCode::BadHandle
        );
    }

    #[test]
    fn a_session_and_handles_of_an_earlier_run_are_taken_again_once() {
        let now = Instant::now();
        let mut before = sessions();
        let session = before.open_session("a", 5, now).unwrap();
        let handle = before
            .open_handle(session, 7, OpenAccess::default())
            .unwrap();
        std::thread::sleep(Duration::from_millis(2));
        // A later run (a restart, a new leader) takes them again.
        let mut table = sessions();
        assert!(!table.is_open(7));
        assert_eq!(
            table
                .reclaim_session(session, "a", 5, now)
                .map_err(|e| e.code),
            Ok(())
        );
        let access = OpenAccess::default();
        assert_eq!(
            table.reclaim_handle(session, handle, 7, access),
            Reclaimed::Taken
        );
        assert_eq!(
            table.reclaim_handle(session, handle, 7, access),
            Reclaimed::Held
        );
        assert!(table.is_open(7));
        // Another client cannot take the session; ids this run issued are not taken again.
        assert_eq!(
            table
                .reclaim_session(session, "b", 6, now)
                .unwrap_err()
                .code,
            ErrorCode::BadHandle
        );
        let own = table.open_session("c", 6, now).unwrap();
        table.close_session(own).unwrap();
        assert_eq!(
            table.reclaim_session(own, "c", 6, now).unwrap_err().code,
            ErrorCode::BadHandle
        );
        let fresh = table.open_handle(session, 8, access).unwrap();
        table.close_handle(session, fresh).unwrap();
        assert_eq!(
            table.reclaim_handle(session, fresh, 8, access),
            Reclaimed::Refused
        );
        // A reclaimed handle closes as any other.
        assert_eq!(table.close_handle(session, handle).unwrap(), Some(7));
        assert!(!table.is_open(7));
    }

    #[test]
    fn a_reserved_handle_counts_once_bound() {
        let mut table = sessions();
        let session = table.open_session("a", 0, Instant::now()).unwrap();
        let reserved = table
            .reserve_handle(session, OpenAccess::default())
            .unwrap();
        assert!(!table.is_open(9));
        table.bind_handle(reserved, 9).unwrap();
        assert!(table.is_open(9));
        assert_eq!(
            table.bind_handle(reserved, 9).unwrap_err().code,
            ErrorCode::BadHandle
        );
        assert_eq!(table.close_handle(session, reserved).unwrap(), Some(9));
        // A reserved handle never bound closes without reporting an inode.
        let unbound = table
            .reserve_handle(session, OpenAccess::default())
            .unwrap();
        assert_eq!(table.close_handle(session, unbound).unwrap(), None);
        assert!(!table.is_open(9));
        assert_eq!(
            table.bind_handle(unbound, 9).unwrap_err().code,
            ErrorCode::BadHandle
        );
    }

    #[test]
    fn expiry_closes_handles_and_bounds_hold() {
        let mut table = sessions();
        let start = Instant::now();
        let old = table.open_session("old", 0, start).unwrap();
        let fresh = table.open_session("fresh", 0, start).unwrap();
        assert_eq!(
            table.open_session("third", 0, start).unwrap_err().code,
            ErrorCode::Busy
        );
        table.open_handle(old, 5, OpenAccess::default()).unwrap();
        table.open_handle(fresh, 6, OpenAccess::default()).unwrap();
        let later = start + Duration::from_millis(150);
        table.renew(fresh, later).unwrap();
        assert_eq!(table.expire(later).0, vec![5]);
        assert!(!table.exists(old));
        assert!(table.is_open(6));
        assert_eq!(
            table.renew(old, later).unwrap_err().code,
            ErrorCode::BadHandle
        );
    }
}
