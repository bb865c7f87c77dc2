//! The inode API of [`Client`], one method per meta server operation (the mount is built
//! on it), with `open` and `create_open` giving a [`FileHandle`] and a `setattr` that keeps
//! this client's open handles right across a size change (`Truncation`).

use std::sync::Arc;

use freeflow_proto::meta::{
    ClusterReport, ClusterStatus, Create, DirPage, FsStats, GetAttr, GetXattr, HandleRef, Link,
    ListXattr, Lookup, LookupEntry, Mkdir, Open, OpenAccess, ReadDir, ReadLink, RemoveXattr,
    Rename, RenameMode, ReserveInodes, Rmdir, ServerRecord, SetAttributes, SetDirLayout, SetXattr,
    StatFs, Symlink, Unlink, XattrSetMode,
};
use freeflow_proto::ErrorCode;
use freeflow_types::limits::FILE_SIZE_MAX;
use freeflow_types::{Attr, FileKind, InodeId, SetAttr};

use super::{is_open_session_unknown, Client, SESSION_REOPENS_MAX};
use crate::error::ClientError;
use crate::file::{FileHandle, Truncation};
use crate::lease::Lease;

impl Client {
    pub async fn lookup(&self, parent: InodeId, name: &str) -> Result<Attr, ClientError> {
        let request = Lookup {
            caller: self.caller.clone(),
            parent,
            name: name.to_string(),
        };
        self.meta(&request, || format!("parent {parent} name {name:?}"))
            .await
    }

    pub async fn getattr(&self, inode: InodeId) -> Result<Attr, ClientError> {
        self.meta(&GetAttr { inode }, || format!("inode {inode}"))
            .await
    }

    /// [`Client::getattr`] with the lease on the attributes (if this client watches
    /// revocations).
    /// Answered without a request while this client holds a lease on the attributes its
    /// own last mutation of the inode returned (a directory it just created a file in).
    pub async fn getattr_leased(&self, inode: InodeId) -> Result<(Attr, Lease), ClientError> {
        if let Some(kept) = self.kept_attributes_leased(inode) {
            return Ok(kept);
        }
        self.shared
            .pool
            .meta_call_leased(&GetAttr { inode }, || format!("inode {inode}"))
            .await
    }

    /// Look a name up: `None` when it does not exist, with the lease on the answer (the
    /// directory's name and the entry's attributes), so that a missing name can be cached
    /// as missing.
    pub async fn lookup_entry(
        &self,
        parent: InodeId,
        name: &str,
    ) -> Result<(Option<Attr>, Lease), ClientError> {
        let request = LookupEntry {
            caller: self.caller.clone(),
            parent,
            name: name.to_string(),
        };
        self.shared
            .pool
            .meta_call_leased(&request, || format!("parent {parent} name {name:?}"))
            .await
    }

    /// [`Client::readdir`] with the lease on the listing (and, with attributes, theirs).
    pub async fn readdir_leased(
        &self,
        inode: InodeId,
        after: Option<&str>,
        limit: u32,
        with_attributes: bool,
    ) -> Result<(DirPage, Lease), ClientError> {
        let request = ReadDir {
            caller: self.caller.clone(),
            inode,
            after: after.map(str::to_string),
            limit,
            with_attributes,
        };
        self.shared
            .pool
            .meta_call_leased(&request, || format!("inode {inode}"))
            .await
    }

    /// A mutation of the namespace with the lease on its result (the new entry).
    pub async fn leased<R: freeflow_proto::Request>(
        &self,
        request: &R,
        target: impl FnOnce() -> String,
    ) -> Result<(R::Reply, Lease), ClientError> {
        self.shared.pool.meta_call_leased(request, target).await
    }

    /// Change attributes. A size change first waits for this client's writes to the file
    /// that started before the call, and holds back its handles' size commits until the meta
    /// server answers (a commit computed before the change must not grow the file back);
    /// then the handles take the new size. The meta server checks permissions and cuts the
    /// objects on the I/O servers itself, before it replies: bytes beyond a shrink never
    /// reappear after a later extension.
    pub async fn setattr(&self, inode: InodeId, changes: SetAttr) -> Result<Attr, ClientError> {
        self.setattr_through(inode, changes, None).await
    }

    /// [`Client::setattr`] through an open handle of this client: a size change is then
    /// authorised by the handle's write access (`ftruncate`, see `HandleRef`).
    pub async fn setattr_through(
        &self,
        inode: InodeId,
        changes: SetAttr,
        through_handle: Option<HandleRef>,
    ) -> Result<Attr, ClientError> {
        self.setattr_leased(inode, changes, through_handle)
            .await
            .map(|(attr, _)| attr)
    }

    /// [`Client::setattr_through`] with the lease on the attributes it returns.
    pub async fn setattr_leased(
        &self,
        inode: InodeId,
        changes: SetAttr,
        through_handle: Option<HandleRef>,
    ) -> Result<(Attr, Lease), ClientError> {
        let request = SetAttributes {
            caller: self.caller.clone(),
            inode,
            changes,
            through_handle,
        };
        let Some(new_size) = request.changes.size_bytes else {
            return self.leased(&request, || format!("inode {inode}")).await;
        };
        if new_size > FILE_SIZE_MAX {
            return Err(ClientError::inode(
                inode,
                ErrorCode::FileTooBig,
                format!("size {new_size} is beyond the largest file size {FILE_SIZE_MAX}"),
            ));
        }
        // On a task of its own: a caller that stops waiting must not leave the handles
        // without the new size while the request may still reach the meta server.
        let client = self.clone();
        let handles = self.open_handles(inode);
        let change = tokio::spawn(async move {
            let truncation = Truncation::begin(handles).await;
            let (attr, lease) = client.leased(&request, || format!("inode {inode}")).await?;
            truncation.finish(&attr);
            Ok((attr, lease))
        });
        match change.await {
            Ok(result) => result,
            // Only if the runtime is shutting down.
            Err(error) => Err(ClientError::inode(
                inode,
                ErrorCode::Io,
                format!("the size change task ended early: {error}"),
            )),
        }
    }

    /// Create a regular file, fifo, socket or device node (not a directory or symlink).
    pub async fn create(
        &self,
        parent: InodeId,
        name: &str,
        kind: FileKind,
        permissions: u32,
        device: u64,
        exclusive: bool,
    ) -> Result<Attr, ClientError> {
        self.create_leased(parent, name, kind, permissions, device, exclusive)
            .await
            .map(|(attr, _)| attr)
    }

    /// [`Client::create`] with the lease on the new entry.
    pub async fn create_leased(
        &self,
        parent: InodeId,
        name: &str,
        kind: FileKind,
        permissions: u32,
        device: u64,
        exclusive: bool,
    ) -> Result<(Attr, Lease), ClientError> {
        let request = Create {
            caller: self.caller.clone(),
            parent,
            name: name.to_string(),
            kind,
            permissions,
            device,
            exclusive,
            open: None,
            inode: None,
        };
        let (reply, lease) = self
            .leased(&request, || format!("parent {parent} name {name:?}"))
            .await?;
        Ok((reply.attr, lease))
    }

    /// Create a regular file and open it in one round trip. Without `exclusive`, an existing
    /// regular file is opened instead (`created` false).
    pub async fn create_open(
        &self,
        parent: InodeId,
        name: &str,
        permissions: u32,
        exclusive: bool,
        access: OpenAccess,
    ) -> Result<(FileHandle, bool), ClientError> {
        self.create_open_leased(parent, name, permissions, exclusive, access)
            .await
            .map(|(handle, created, _)| (handle, created))
    }

    /// [`Client::create_open`] with the lease on the new entry.
    pub async fn create_open_leased(
        &self,
        parent: InodeId,
        name: &str,
        permissions: u32,
        exclusive: bool,
        access: OpenAccess,
    ) -> Result<(FileHandle, bool, Lease), ClientError> {
        self.create_open_as(parent, name, permissions, exclusive, access, None)
            .await
    }

    async fn send_create(
        &self,
        request: &Create,
        patient: bool,
        target: impl FnOnce() -> String,
    ) -> Result<(freeflow_proto::meta::CreateReply, Lease), ClientError> {
        if patient {
            // What the caller answered: the file, with its reserved number.
            let answered = freeflow_proto::meta::CreateReply {
                attr: Attr::new_inode(
                    request.inode.unwrap_or(0),
                    FileKind::Regular,
                    request.permissions,
                    request.caller.user_id,
                    request.caller.group_id,
                    freeflow_types::TimeSpec::default(),
                ),
                created: true,
                handle_id: None,
            };
            let answered = freeflow_proto::encode(&Ok::<_, freeflow_proto::WireError>(answered));
            self.shared
                .pool
                .meta_call_leased_patient(request, target, answered)
                .await
        } else {
            self.shared.pool.meta_call_leased(request, target).await
        }
    }

    /// A create that also opens, with a chosen (reserved) inode number or not.
    async fn create_open_as(
        &self,
        parent: InodeId,
        name: &str,
        permissions: u32,
        exclusive: bool,
        access: OpenAccess,
        inode: Option<InodeId>,
    ) -> Result<(FileHandle, bool, Lease), ClientError> {
        let mut session_id = self.session_id();
        let mut request = Create {
            caller: self.caller.clone(),
            parent,
            name: name.to_string(),
            kind: FileKind::Regular,
            permissions,
            device: 0,
            exclusive,
            open: Some((session_id, access)),
            inode,
        };
        let target = || format!("parent {parent} name {name:?}");
        // The meta server checks the session before it creates anything, so the retry
        // cannot find its own file and fail an exclusive create.
        // A create answered ahead must reach the server: it is sent patiently.
        let patient = inode.is_some();
        // The session can be lost again between its reopening and the create (another
        // metadata leader): reopen again, a few times.
        let mut reopened = 0;
        let (reply, lease) = loop {
            match self.send_create(&request, patient, target).await {
                Err(error) if is_open_session_unknown(&error) && reopened < SESSION_REOPENS_MAX => {
                    reopened += 1;
                    session_id = self.shared.reopen_session(session_id).await?;
                    request.open = Some((session_id, access));
                }
                reply => break reply?,
            }
        };
        let handle = match reply.handle_id {
            Some(handle_id) => FileHandle::new(
                Arc::new(self.clone()),
                reply.attr,
                handle_id,
                session_id,
                access,
            ),
            None => self.open(reply.attr.inode, access).await?,
        };
        Ok((handle, reply.created, lease))
    }

    pub async fn mkdir(
        &self,
        parent: InodeId,
        name: &str,
        permissions: u32,
    ) -> Result<Attr, ClientError> {
        self.mkdir_leased(parent, name, permissions)
            .await
            .map(|(attr, _)| attr)
    }

    /// [`Client::mkdir`] with the lease on the new entry.
    pub async fn mkdir_leased(
        &self,
        parent: InodeId,
        name: &str,
        permissions: u32,
    ) -> Result<(Attr, Lease), ClientError> {
        let request = Mkdir {
            caller: self.caller.clone(),
            parent,
            name: name.to_string(),
            permissions,
        };
        let (attr, lease) = self
            .leased(&request, || format!("parent {parent} name {name:?}"))
            .await?;
        if lease.delegated {
            self.shared.delegations.delegate(lease.epoch, attr.inode);
        }
        Ok((attr, lease))
    }

    /// Start a create in `parent` answered before the meta server has it, if `parent` is
    /// delegated to this client and a reserved inode number is left (see `delegation.rs`).
    /// The caller must know that the name is missing (under a lease on `parent`'s names
    /// it still holds), answer with the returned number, then send the create with
    /// [`Client::create_open_reserved`] and finish the returned token with its outcome.
    /// Reserves more numbers in the background, on `runtime`, when few are left.
    pub fn begin_ahead_create(
        &self,
        parent: InodeId,
        name: &str,
        runtime: &tokio::runtime::Handle,
    ) -> Option<crate::delegation::AheadOp> {
        let epoch = self.shared.pool.lease_epoch();
        let (ahead, reserve) = self.shared.delegations.begin(epoch, parent, name);
        if reserve {
            let client = self.clone();
            runtime.spawn(async move {
                let request = ReserveInodes {
                    count: crate::delegation::INODES_PER_RESERVATION,
                };
                let epoch = client.shared.pool.lease_epoch();
                match client.meta(&request, || "inode numbers".to_string()).await {
                    Ok(range) => client
                        .shared
                        .delegations
                        .reserved(epoch, Some((range.first, range.count))),
                    Err(error) => {
                        tracing::debug!(%error, "cannot reserve inode numbers; creates wait for their answers");
                        client.shared.delegations.reserved(epoch, None);
                    }
                }
            });
        }
        ahead
    }

    /// Start an unlink of `name` (file `inode`) in `parent` answered before the meta server
    /// has it, if `parent` is delegated to this client and nothing about the file is on its
    /// way (see `delegation.rs`). The caller must know the name is there, and the kernel
    /// that it is not a directory; it answers, then sends the unlink with
    /// [`Client::unlink_ahead_sent`] and finishes the returned token with its outcome.
    pub fn begin_ahead_unlink(
        &self,
        parent: InodeId,
        name: &str,
        inode: InodeId,
    ) -> Option<crate::delegation::AheadOp> {
        let epoch = self.shared.pool.lease_epoch();
        self.shared
            .delegations
            .begin_unlink(epoch, parent, name, inode)
    }

    /// Send a create answered ahead (see [`Client::begin_ahead_create`]): exclusive, with
    /// the reserved `inode`, opened with `access`.
    pub async fn create_open_reserved(
        &self,
        parent: InodeId,
        name: &str,
        permissions: u32,
        access: OpenAccess,
        inode: InodeId,
    ) -> Result<(FileHandle, Lease), ClientError> {
        self.create_open_as(parent, name, permissions, true, access, Some(inode))
            .await
            .map(|(handle, _, lease)| (handle, lease))
    }

    /// Whether a create answered ahead is still on its way in any of `inodes` (as
    /// directories) or of them (as files).
    pub fn ahead_unsettled(&self, inodes: &[InodeId]) -> bool {
        self.shared.delegations.unsettled(inodes)
    }

    /// Wait until no create answered ahead is on its way in or of `inodes`: before a
    /// request that names them, so the meta server sees what this client answered.
    pub async fn settle_ahead(&self, inodes: &[InodeId]) {
        self.shared.delegations.settle(inodes).await
    }

    /// Whether an unlink of a name of `inode` answered ahead is on its way.
    pub fn ahead_unlinking(&self, inode: InodeId) -> bool {
        self.shared.delegations.unlinking(inode)
    }

    /// Whether creates answered ahead are on their way in `directory`.
    pub fn ahead_creating_in(&self, directory: InodeId) -> bool {
        self.shared.delegations.creating_in(directory)
    }

    /// The attributes of `inode` this client keeps under a lease still good (from the
    /// replies to its own mutations), if any: no request.
    pub fn kept_attributes(&self, inode: InodeId) -> Option<Attr> {
        self.kept_attributes_leased(inode).map(|(attr, _)| attr)
    }

    /// [`Client::kept_attributes`] with their lease: what [`Client::getattr_leased`]
    /// answers without a request.
    pub fn kept_attributes_leased(&self, inode: InodeId) -> Option<(Attr, Lease)> {
        let (attr, lease) = self.shared.pool.kept_attributes(inode)?;
        self.lease_remaining(&lease, &[inode])?;
        Some((attr, lease))
    }

    /// [`Client::kept_attributes_leased`] of each of `inodes`, with the locks taken once
    /// (the entries of a listing answered together).
    pub fn kept_attributes_leased_of(&self, inodes: &[InodeId]) -> Vec<Option<(Attr, Lease)>> {
        let kept = self.shared.pool.kept_attributes_of(inodes);
        let view = self.lease_view();
        inodes
            .iter()
            .zip(kept)
            .map(|(inode, kept)| {
                let (attr, lease) = kept?;
                view.remaining(&lease, &[*inode])?;
                Some((attr, lease))
            })
            .collect()
    }

    pub async fn unlink(&self, parent: InodeId, name: &str) -> Result<(), ClientError> {
        self.unlink_leased(parent, name).await.map(|_| ())
    }

    /// [`Client::unlink`] with the lease on the directory's names it was granted.
    pub async fn unlink_leased(&self, parent: InodeId, name: &str) -> Result<Lease, ClientError> {
        let request = Unlink {
            caller: self.caller.clone(),
            parent,
            name: name.to_string(),
        };
        self.leased(&request, || format!("parent {parent} name {name:?}"))
            .await
            .map(|((), lease)| lease)
    }

    /// Send an unlink answered ahead (see [`Client::begin_ahead_unlink`]): patiently, since
    /// its caller was told it is done.
    pub async fn unlink_ahead_sent(
        &self,
        parent: InodeId,
        name: &str,
    ) -> Result<Lease, ClientError> {
        let request = Unlink {
            caller: self.caller.clone(),
            parent,
            name: name.to_string(),
        };
        let answered = freeflow_proto::encode(&Ok::<(), freeflow_proto::WireError>(()));
        self.shared
            .pool
            .meta_call_leased_patient(
                &request,
                || format!("parent {parent} name {name:?} (answered ahead)"),
                answered,
            )
            .await
            .map(|((), lease)| lease)
    }

    pub async fn rmdir(&self, parent: InodeId, name: &str) -> Result<(), ClientError> {
        let request = Rmdir {
            caller: self.caller.clone(),
            parent,
            name: name.to_string(),
        };
        self.meta(&request, || format!("parent {parent} name {name:?}"))
            .await
    }

    pub async fn rename(
        &self,
        source_parent: InodeId,
        source_name: &str,
        target_parent: InodeId,
        target_name: &str,
        mode: RenameMode,
    ) -> Result<(), ClientError> {
        let request = Rename {
            caller: self.caller.clone(),
            source_parent,
            source_name: source_name.to_string(),
            target_parent,
            target_name: target_name.to_string(),
            mode,
        };
        self.meta(&request, || {
            format!("parent {source_parent} name {source_name:?} to parent {target_parent} name {target_name:?}")
        })
        .await
    }

    /// A new name `target_name` in `target_parent` for `inode`.
    pub async fn link(
        &self,
        inode: InodeId,
        target_parent: InodeId,
        target_name: &str,
    ) -> Result<Attr, ClientError> {
        self.link_leased(inode, target_parent, target_name)
            .await
            .map(|(attr, _)| attr)
    }

    /// [`Client::link`] with the lease on the new entry.
    pub async fn link_leased(
        &self,
        inode: InodeId,
        target_parent: InodeId,
        target_name: &str,
    ) -> Result<(Attr, Lease), ClientError> {
        let request = Link {
            caller: self.caller.clone(),
            inode,
            target_parent,
            target_name: target_name.to_string(),
        };
        self.leased(&request, || {
            format!("inode {inode} as parent {target_parent} name {target_name:?}")
        })
        .await
    }

    /// A symlink `name` in `parent` pointing at `target`.
    pub async fn symlink(
        &self,
        parent: InodeId,
        name: &str,
        target: &str,
    ) -> Result<Attr, ClientError> {
        self.symlink_leased(parent, name, target)
            .await
            .map(|(attr, _)| attr)
    }

    /// [`Client::symlink`] with the lease on the new entry.
    pub async fn symlink_leased(
        &self,
        parent: InodeId,
        name: &str,
        target: &str,
    ) -> Result<(Attr, Lease), ClientError> {
        let request = Symlink {
            caller: self.caller.clone(),
            parent,
            name: name.to_string(),
            target: target.to_string(),
        };
        self.leased(&request, || format!("parent {parent} name {name:?}"))
            .await
    }

    pub async fn readlink(&self, inode: InodeId) -> Result<String, ClientError> {
        self.meta(&ReadLink { inode }, || format!("inode {inode}"))
            .await
    }

    /// One page of a directory, in name order, after the name `after`.
    pub async fn readdir(
        &self,
        inode: InodeId,
        after: Option<&str>,
        limit: u32,
        with_attributes: bool,
    ) -> Result<DirPage, ClientError> {
        let request = ReadDir {
            caller: self.caller.clone(),
            inode,
            after: after.map(str::to_string),
            limit,
            with_attributes,
        };
        self.meta(&request, || format!("inode {inode}")).await
    }

    pub async fn statfs(&self) -> Result<FsStats, ClientError> {
        self.meta(&StatFs {}, || "of the file system".to_string())
            .await
    }

    pub async fn set_xattr(
        &self,
        inode: InodeId,
        name: &str,
        value: &[u8],
        mode: XattrSetMode,
    ) -> Result<(), ClientError> {
        let request = SetXattr {
            caller: self.caller.clone(),
            inode,
            name: name.to_string(),
            value: value.to_vec(),
            mode,
        };
        self.meta(&request, || format!("inode {inode} attribute {name:?}"))
            .await
    }

    pub async fn get_xattr(&self, inode: InodeId, name: &str) -> Result<Vec<u8>, ClientError> {
        let request = GetXattr {
            caller: self.caller.clone(),
            inode,
            name: name.to_string(),
        };
        self.meta(&request, || format!("inode {inode} attribute {name:?}"))
            .await
    }

    pub async fn list_xattr(&self, inode: InodeId) -> Result<Vec<String>, ClientError> {
        self.meta(
            &ListXattr {
                caller: self.caller.clone(),
                inode,
            },
            || format!("inode {inode}"),
        )
        .await
    }

    pub async fn remove_xattr(&self, inode: InodeId, name: &str) -> Result<(), ClientError> {
        let request = RemoveXattr {
            caller: self.caller.clone(),
            inode,
            name: name.to_string(),
        };
        self.meta(&request, || format!("inode {inode} attribute {name:?}"))
            .await
    }

    /// Set the layout new files in directory `inode` inherit (None keeps that part).
    pub async fn set_dir_layout(
        &self,
        inode: InodeId,
        stripe_unit_bytes: Option<u32>,
        stripe_count: Option<u32>,
        replicas: Option<u32>,
    ) -> Result<Attr, ClientError> {
        let request = SetDirLayout {
            caller: self.caller.clone(),
            inode,
            stripe_unit_bytes,
            stripe_count,
            replicas,
        };
        self.meta(&request, || format!("inode {inode}")).await
    }

    /// Open a file. The attributes (and so the size) come fresh from the meta server.
    pub async fn open(
        &self,
        inode: InodeId,
        access: OpenAccess,
    ) -> Result<FileHandle, ClientError> {
        let mut request = Open {
            caller: self.caller.clone(),
            session_id: self.session_id(),
            inode,
            access,
        };
        let mut reopened = 0;
        let grant = loop {
            match self.meta(&request, || format!("inode {inode}")).await {
                Err(error) if is_open_session_unknown(&error) && reopened < SESSION_REOPENS_MAX => {
                    reopened += 1;
                    request.session_id = self.shared.reopen_session(request.session_id).await?;
                }
                grant => break grant?,
            }
        };
        let handle = FileHandle::new(
            Arc::new(self.clone()),
            grant.attr,
            grant.handle_id,
            request.session_id,
            access,
        );
        if handle.attr().kind == FileKind::Directory && access.write {
            // The meta server should have refused; do not leave the handle open.
            let _ = handle.close().await;
            return Err(ClientError::inode(
                inode,
                ErrorCode::IsDirectory,
                "cannot open a directory for writing",
            ));
        }
        Ok(handle)
    }

    /// The I/O servers as the meta server lists them (also refreshes the client's addresses).
    pub async fn servers(&self) -> Result<Vec<ServerRecord>, ClientError> {
        self.shared.pool.refresh_servers().await
    }

    /// The service map as the meta server has it now: each I/O server's place in the
    /// chains of replicated stripes, and who took the place of servers lost for good.
    pub async fn service_map(&self) -> Result<freeflow_proto::meta::ServiceMap, ClientError> {
        self.meta(&freeflow_proto::meta::GetServiceMap {}, || {
            "of the cluster".to_string()
        })
        .await
    }

    pub async fn cluster_status(&self) -> Result<ClusterReport, ClientError> {
        self.meta(&ClusterStatus {}, || "of the cluster".to_string())
            .await
    }

    /// Change the metadata cluster's members (`freeflow meta add|promote|remove|replace`);
    /// the members after the change.
    pub async fn change_meta_members(
        &self,
        change: freeflow_proto::meta::MetaMemberChange,
    ) -> Result<Vec<freeflow_proto::meta::MetaMember>, ClientError> {
        self.meta(&freeflow_proto::meta::ChangeMetaMembers { change }, || {
            "of the metadata members".to_string()
        })
        .await
    }

    /// Drain or remove an I/O server (`freeflow server drain|remove`); the servers after
    /// the change.
    pub async fn change_io_server(
        &self,
        server_id: freeflow_types::ServerId,
        change: freeflow_proto::meta::IoServerChange,
    ) -> Result<Vec<ServerRecord>, ClientError> {
        self.meta(
            &freeflow_proto::meta::ChangeIoServer { server_id, change },
            || format!("of I/O server {server_id}"),
        )
        .await
    }
}
