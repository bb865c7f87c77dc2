//! The path API: what the CLI uses, built on the inode API.
//!
//! Paths are absolute inside the namespace (`/a/b`). Symlinks in intermediate components are
//! followed (at most `limits::SYMLINK_FOLLOW_MAX`, then `Loop`); the final component is
//! followed by `resolve`/`stat`/`open_path` and not by `lstat`, `remove_path` and the other
//! operations on a name itself. Every error is wrapped with the path it concerns.

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt, TryStreamExt};

use freeflow_proto::meta::{DirEntry, OpenAccess, RenameMode, ServerRecord};
use freeflow_proto::ErrorCode;
use freeflow_types::limits::{READDIR_ENTRIES_MAX, SYMLINK_TARGET_LENGTH_MAX};
use freeflow_types::{Attr, FileKind, InodeId, Layout, SetAttr};

use crate::path::{components, split_final, walk, Namespace};
use crate::{Client, ClientError, FileHandle};

/// How many entries `remove_all` removes at once within one directory.
const REMOVE_PARALLEL_MAX: usize = 32;

/// Permissions of directories made by `mkdir_all`.
const MKDIR_ALL_PERMISSIONS: u32 = 0o755;

/// How `open_path` opens a file, as `open(2)`'s flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenOptions {
    pub read: bool,
    pub write: bool,
    /// Open for writing; the caller appends with [`FileHandle::append`].
    pub append: bool,
    /// Create the file if it does not exist (`O_CREAT`).
    pub create: bool,
    /// Cut the file to 0 bytes (`O_TRUNC`); needs write access.
    pub truncate: bool,
    /// With `create`: fail with `Exists` if the name exists (`O_EXCL`).
    pub exclusive: bool,
    /// Permission bits of a created file.
    pub permissions: u32,
}

impl Default for OpenOptions {
    fn default() -> OpenOptions {
        OpenOptions::new()
    }
}

impl OpenOptions {
    /// No access at all yet; permissions 0o644 for a created file.
    pub fn new() -> OpenOptions {
        OpenOptions {
            read: false,
            write: false,
            append: false,
            create: false,
            truncate: false,
            exclusive: false,
            permissions: 0o644,
        }
    }
    pub fn read(mut self, read: bool) -> OpenOptions {
        self.read = read;
        self
    }
    pub fn write(mut self, write: bool) -> OpenOptions {
        self.write = write;
        self
    }
    pub fn append(mut self, append: bool) -> OpenOptions {
        self.append = append;
        self
    }
    pub fn create(mut self, create: bool) -> OpenOptions {
        self.create = create;
        self
    }
    pub fn truncate(mut self, truncate: bool) -> OpenOptions {
        self.truncate = truncate;
        self
    }
    pub fn exclusive(mut self, exclusive: bool) -> OpenOptions {
        self.exclusive = exclusive;
        self
    }
    pub fn permissions(mut self, permissions: u32) -> OpenOptions {
        self.permissions = permissions;
        self
    }

    fn access(&self) -> OpenAccess {
        OpenAccess {
            read: self.read,
            write: self.write || self.append,
        }
    }
}

/// Where each stripe of a file lives: `(stripe index, server, object length in bytes)`.
pub type StripePlacement = (u32, ServerRecord, u64);

impl Namespace for Client {
    async fn lookup(&self, parent: InodeId, name: &str) -> Result<Attr, ClientError> {
        Client::lookup(self, parent, name).await
    }
    async fn getattr(&self, inode: InodeId) -> Result<Attr, ClientError> {
        Client::getattr(self, inode).await
    }
    async fn readlink(&self, inode: InodeId) -> Result<String, ClientError> {
        Client::readlink(self, inode).await
    }
}

fn is_not_found(error: &ClientError) -> bool {
    error.code() == ErrorCode::NotFound
}

impl Client {
    async fn walk_path(&self, path: &str, follow_final: bool) -> Result<Attr, ClientError> {
        let parts = components(path, true)?;
        walk(self, path, parts, follow_final)
            .await
            .map_err(|error| error.at_path(path))
    }

    /// The directory holding the final name of `path`, and that name.
    async fn resolve_parent(&self, path: &str) -> Result<(Attr, String), ClientError> {
        let (parts, name) = split_final(path)?;
        let parent = walk(self, path, parts, true)
            .await
            .map_err(|error| error.at_path(path))?;
        if parent.kind != FileKind::Directory {
            return Err(ClientError::path(
                path,
                ErrorCode::NotDirectory,
                "the parent is not a directory",
            ));
        }
        Ok((parent, name))
    }

    /// The attributes of what `path` names, following a final symlink.
    pub async fn resolve(&self, path: &str) -> Result<Attr, ClientError> {
        self.walk_path(path, true).await
    }

    /// As [`Client::resolve`].
    pub async fn stat(&self, path: &str) -> Result<Attr, ClientError> {
        self.walk_path(path, true).await
    }

    /// The attributes of `path` itself: a final symlink is not followed.
    pub async fn lstat(&self, path: &str) -> Result<Attr, ClientError> {
        self.walk_path(path, false).await
    }

    pub async fn mkdir_path(&self, path: &str, permissions: u32) -> Result<Attr, ClientError> {
        let (parent, name) = self.resolve_parent(path).await?;
        self.mkdir(parent.inode, &name, permissions)
            .await
            .map_err(|error| error.at_path(path))
    }

    /// Make `path` and every missing directory above it (permissions 0o755). An existing
    /// directory is not an error; an existing non-directory is `Exists`.
    pub async fn mkdir_all(&self, path: &str) -> Result<Attr, ClientError> {
        let parts = components(path, true)?;
        let mut prefix = String::new();
        for part in &parts {
            prefix.push('/');
            prefix.push_str(part);
            if part == "." || part == ".." {
                continue;
            }
            match self.stat(&prefix).await {
                Ok(attr) if attr.kind == FileKind::Directory => continue,
                Ok(_) => {
                    return Err(ClientError::path(
                        &prefix,
                        ErrorCode::Exists,
                        "exists and is not a directory",
                    ))
                }
                Err(error) if is_not_found(&error) => {}
                Err(error) => return Err(error),
            }
            match self.mkdir_path(&prefix, MKDIR_ALL_PERMISSIONS).await {
                Ok(_) => {}
                // Made by someone else meanwhile: fine if it is a directory (checked below).
                Err(error) if error.code() == ErrorCode::Exists => {
                    let attr = self.stat(&prefix).await?;
                    if attr.kind != FileKind::Directory {
                        return Err(ClientError::path(
                            &prefix,
                            ErrorCode::Exists,
                            "exists and is not a directory",
                        ));
                    }
                }
                Err(error) => return Err(error),
            }
        }
        self.stat(path).await
    }

    /// Remove a file, symlink or empty directory.
    pub async fn remove_path(&self, path: &str) -> Result<(), ClientError> {
        let (parent, name) = self.resolve_parent(path).await?;
        let attr = self
            .lookup(parent.inode, &name)
            .await
            .map_err(|error| error.at_path(path))?;
        let result = if attr.kind == FileKind::Directory {
            self.rmdir(parent.inode, &name).await
        } else {
            self.unlink(parent.inode, &name).await
        };
        result.map_err(|error| error.at_path(path))
    }

    /// Remove `path` and, for a directory, everything below it. Symlinks are removed, not
    /// followed.
    pub async fn remove_all(&self, path: &str) -> Result<(), ClientError> {
        let (parent, name) = self.resolve_parent(path).await?;
        let attr = self
            .lookup(parent.inode, &name)
            .await
            .map_err(|error| error.at_path(path))?;
        self.remove_tree(parent.inode, name, attr.inode, attr.kind, path.to_string())
            .await
    }

    fn remove_tree(
        &self,
        parent: InodeId,
        name: String,
        inode: InodeId,
        kind: FileKind,
        path: String,
    ) -> BoxFuture<'_, Result<(), ClientError>> {
        async move {
            if kind != FileKind::Directory {
                return self
                    .unlink(parent, &name)
                    .await
                    .map_err(|error| error.at_path(&path));
            }
            let mut after: Option<String> = None;
            loop {
                let page = self
                    .readdir(inode, after.as_deref(), READDIR_ENTRIES_MAX, false)
                    .await
                    .map_err(|error| error.at_path(&path))?;
                after = page.entries.last().map(|entry| entry.name.clone());
                let end = page.end || page.entries.is_empty();
                futures::stream::iter(page.entries)
                    .map(|entry| {
                        let child_path = crate::path::join(&path, &entry.name);
                        self.remove_tree(inode, entry.name, entry.inode, entry.kind, child_path)
                    })
                    .buffer_unordered(REMOVE_PARALLEL_MAX)
                    .try_collect::<Vec<()>>()
                    .await?;
                if end {
                    break;
                }
            }
            self.rmdir(parent, &name)
                .await
                .map_err(|error| error.at_path(&path))
        }
        .boxed()
    }

    /// Rename `from` to `to`, replacing an existing `to` (as `rename(2)`).
    pub async fn rename_path(&self, from: &str, to: &str) -> Result<(), ClientError> {
        let (source_parent, source_name) = self.resolve_parent(from).await?;
        let (target_parent, target_name) = self.resolve_parent(to).await?;
        self.rename(
            source_parent.inode,
            &source_name,
            target_parent.inode,
            &target_name,
            RenameMode::Replace,
        )
        .await
        .map_err(|error| error.at_path(from))
    }

    async fn read_dir_pages(
        &self,
        path: &str,
        with_attributes: bool,
    ) -> Result<Vec<DirEntry>, ClientError> {
        let directory = self.resolve(path).await?;
        if directory.kind != FileKind::Directory {
            return Err(ClientError::path(
                path,
                ErrorCode::NotDirectory,
                "not a directory",
            ));
        }
        let mut entries: Vec<DirEntry> = Vec::new();
        loop {
            let after = entries.last().map(|entry| entry.name.as_str());
            let page = self
                .readdir(directory.inode, after, READDIR_ENTRIES_MAX, with_attributes)
                .await
                .map_err(|error| error.at_path(path))?;
            let end = page.end || page.entries.is_empty();
            entries.extend(page.entries);
            if end {
                return Ok(entries);
            }
        }
    }

    /// Every entry of a directory in name order ("." and ".." not included).
    pub async fn read_dir_all(&self, path: &str) -> Result<Vec<DirEntry>, ClientError> {
        self.read_dir_pages(path, false).await
    }

    /// As [`Client::read_dir_all`], with each entry's attributes (readdirplus).
    pub async fn read_dir_all_plus(&self, path: &str) -> Result<Vec<DirEntry>, ClientError> {
        self.read_dir_pages(path, true).await
    }

    /// Open (and maybe create or truncate) the file at `path`, following a final symlink.
    pub async fn open_path(
        &self,
        path: &str,
        options: &OpenOptions,
    ) -> Result<FileHandle, ClientError> {
        let access = options.access();
        if !access.read && !access.write {
            return Err(ClientError::path(
                path,
                ErrorCode::InvalidArgument,
                "open asks for neither read nor write",
            ));
        }
        if options.truncate && !access.write {
            return Err(ClientError::path(
                path,
                ErrorCode::InvalidArgument,
                "truncate needs write access",
            ));
        }
        let handle = if options.create {
            let (parent, name) = self.resolve_parent(path).await?;
            match self
                .create_open(
                    parent.inode,
                    &name,
                    options.permissions,
                    options.exclusive,
                    access,
                )
                .await
            {
                Ok((handle, _created)) => handle,
                // The name exists but is not a regular file (a symlink to one, a directory):
                // open what it names, as open(2) with O_CREAT does.
                Err(error) if !options.exclusive && error.code() == ErrorCode::Exists => {
                    let attr = self.resolve(path).await?;
                    self.open(attr.inode, access)
                        .await
                        .map_err(|error| error.at_path(path))?
                }
                Err(error) => return Err(error.at_path(path)),
            }
        } else {
            let attr = self.resolve(path).await?;
            self.open(attr.inode, access)
                .await
                .map_err(|error| error.at_path(path))?
        };
        if options.truncate {
            // Always, even at size 0 here: another client's writes not committed yet may
            // lie beyond the size this client knows; the cut removes them.
            handle
                .set_size(0)
                .await
                .map_err(|error| error.at_path(path))?;
        }
        Ok(handle)
    }

    /// Make a symlink at `link_path` pointing at `target`.
    pub async fn symlink_path(&self, target: &str, link_path: &str) -> Result<Attr, ClientError> {
        if target.is_empty() || target.len() > SYMLINK_TARGET_LENGTH_MAX {
            return Err(ClientError::path(
                link_path,
                ErrorCode::InvalidArgument,
                format!("a symlink target must be 1..={SYMLINK_TARGET_LENGTH_MAX} bytes"),
            ));
        }
        let (parent, name) = self.resolve_parent(link_path).await?;
        self.symlink(parent.inode, &name, target)
            .await
            .map_err(|error| error.at_path(link_path))
    }

    /// A new name `new_path` for what `existing_path` names (a final symlink is linked itself).
    pub async fn link_path(
        &self,
        existing_path: &str,
        new_path: &str,
    ) -> Result<Attr, ClientError> {
        let existing = self.lstat(existing_path).await?;
        let (parent, name) = self.resolve_parent(new_path).await?;
        self.link(existing.inode, parent.inode, &name)
            .await
            .map_err(|error| error.at_path(new_path))
    }

    /// Set the size of the file at `path` (cutting its objects as [`Client::setattr`] does).
    pub async fn truncate_path(&self, path: &str, size_bytes: u64) -> Result<Attr, ClientError> {
        let attr = self.resolve(path).await?;
        let changes = SetAttr {
            size_bytes: Some(size_bytes),
            ..SetAttr::default()
        };
        self.setattr(attr.inode, changes)
            .await
            .map_err(|error| error.at_path(path))
    }

    /// Set the layout new files in the directory at `path` inherit.
    pub async fn set_dir_layout_path(
        &self,
        path: &str,
        stripe_unit_bytes: Option<u32>,
        stripe_count: Option<u32>,
        replicas: Option<u32>,
    ) -> Result<Attr, ClientError> {
        let attr = self.resolve(path).await?;
        if attr.kind != FileKind::Directory {
            return Err(ClientError::path(
                path,
                ErrorCode::NotDirectory,
                "a layout is set on a directory",
            ));
        }
        self.set_dir_layout(attr.inode, stripe_unit_bytes, stripe_count, replicas)
            .await
            .map_err(|error| error.at_path(path))
    }

    /// Where the data of the file at `path` lives: its layout and, per copy of each stripe
    /// (chain order), the server and how long that stripe's object is for the current size. A server the meta server does
    /// not list appears with address "unknown" and `up` false.
    pub async fn stripe_map(
        &self,
        path: &str,
    ) -> Result<(Attr, Layout, Vec<StripePlacement>), ClientError> {
        let attr = self.resolve(path).await?;
        let layout = match (&attr.layout, attr.kind) {
            (Some(layout), FileKind::Regular) => layout.clone(),
            _ => {
                return Err(ClientError::path(
                    path,
                    ErrorCode::InvalidArgument,
                    "only a regular file has stripes",
                ))
            }
        };
        let servers = self.servers().await?;
        let placements = layout
            .placements()
            .into_iter()
            .map(|(stripe_index, server_id)| {
                let server = servers
                    .iter()
                    .find(|server| server.server_id == server_id)
                    .cloned()
                    .unwrap_or(ServerRecord {
                        server_id,
                        address: "unknown".to_string(),
                        up: false,
                        capacity_bytes: 0,
                        free_bytes: 0,
                        object_count: 0,
                        last_seen_ms: None,
                        metrics_address: None,
                        state: freeflow_proto::meta::MemberState::InService,
                    });
                (
                    stripe_index,
                    server,
                    layout.object_length(attr.size_bytes, stripe_index),
                )
            })
            .collect();
        Ok((attr, layout, placements))
    }
}
