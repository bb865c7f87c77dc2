//! Path parsing and resolution for the path API.
//!
//! The meta server only knows `(parent inode, name)` lookups; paths are the client's business.
//! A path is absolute inside the namespace (`/a/b`). Resolution walks it one lookup at a time,
//! keeping the stack of directories walked so that `..` means the parent of the directory
//! actually reached (also after a symlink), and follows symlinks in intermediate components
//! (and in the final one when asked), at most `limits::SYMLINK_FOLLOW_MAX` times per walk, as
//! Linux does. The walk is generic over [`Namespace`] so that it is tested without servers.

use std::collections::VecDeque;
use std::future::Future;

use freeflow_proto::ErrorCode;
use freeflow_types::limits::{NAME_LENGTH_MAX, SYMLINK_FOLLOW_MAX, SYMLINK_TARGET_LENGTH_MAX};
use freeflow_types::{Attr, FileKind, InodeId, ROOT_INODE};

use crate::ClientError;

/// The lookups a path walk needs.
pub(crate) trait Namespace: Sync {
    fn lookup(
        &self,
        parent: InodeId,
        name: &str,
    ) -> impl Future<Output = Result<Attr, ClientError>> + Send;
    fn getattr(&self, inode: InodeId) -> impl Future<Output = Result<Attr, ClientError>> + Send;
    fn readlink(&self, inode: InodeId) -> impl Future<Output = Result<String, ClientError>> + Send;
}

/// Check a path and cut it into its components (`.` and `..` kept, empty ones dropped).
/// `absolute` requires a leading `/` (paths given to the API); symlink targets may be relative.
pub(crate) fn components(path: &str, absolute: bool) -> Result<Vec<String>, ClientError> {
    if path.is_empty() {
        return Err(ClientError::path(path, ErrorCode::NotFound, "empty path"));
    }
    if absolute && !path.starts_with('/') {
        return Err(ClientError::path(
            path,
            ErrorCode::InvalidArgument,
            "path must be absolute inside the namespace (start with /)",
        ));
    }
    if path.len() > SYMLINK_TARGET_LENGTH_MAX {
        return Err(ClientError::path(
            path,
            ErrorCode::NameTooLong,
            format!("path is longer than {SYMLINK_TARGET_LENGTH_MAX} bytes"),
        ));
    }
    if path.contains('\0') {
        return Err(ClientError::path(
            path,
            ErrorCode::InvalidArgument,
            "path contains a NUL byte",
        ));
    }
    let mut parts = Vec::new();
    for part in path.split('/').filter(|part| !part.is_empty()) {
        if part.len() > NAME_LENGTH_MAX {
            return Err(ClientError::path(
                path,
                ErrorCode::NameTooLong,
                format!("component {part:?} is longer than {NAME_LENGTH_MAX} bytes"),
            ));
        }
        parts.push(part.to_string());
    }
    Ok(parts)
}

/// Split a path into the components of its parent directory and its final name, which must
/// be a real name (not `/`, `.` or `..`): the form every operation that creates or removes a
/// name needs.
pub(crate) fn split_final(path: &str) -> Result<(Vec<String>, String), ClientError> {
    let mut parts = components(path, true)?;
    match parts.pop() {
        Some(name) if name != "." && name != ".." => Ok((parts, name)),
        Some(_) => Err(ClientError::path(
            path,
            ErrorCode::InvalidArgument,
            "the final component must be a name, not . or ..",
        )),
        None => Err(ClientError::path(
            path,
            ErrorCode::Busy,
            "the root directory has no name",
        )),
    }
}

/// The lexically normalised form of a path: `.` dropped, `..` applied, no repeated or
/// trailing `/`. Only for display and for building child paths; resolution never uses it
/// (a `..` after a symlink means the symlink target's parent).
pub fn normalize(path: &str) -> Result<String, ClientError> {
    let mut kept: Vec<String> = Vec::new();
    for part in components(path, true)? {
        match part.as_str() {
            "." => {}
            ".." => {
                kept.pop();
            }
            _ => kept.push(part),
        }
    }
    Ok(format!("/{}", kept.join("/")))
}

/// Join a directory path and a name.
pub fn join(directory: &str, name: &str) -> String {
    if directory.ends_with('/') {
        format!("{directory}{name}")
    } else {
        format!("{directory}/{name}")
    }
}

/// Walk `parts` from the root. Symlinks in intermediate components are always followed, a
/// final symlink only if `follow_final`. `path` names the walk in errors.
pub(crate) async fn walk<N: Namespace>(
    namespace: &N,
    path: &str,
    parts: Vec<String>,
    follow_final: bool,
) -> Result<Attr, ClientError> {
    let mut pending: VecDeque<String> = parts.into();
    // The directories walked so far, root first; `..` pops one.
    let mut directories: Vec<InodeId> = vec![ROOT_INODE];
    // The attributes of the last directory pushed, if it is still the top.
    let mut top_attr: Option<Attr> = None;
    let mut links_followed = 0u32;
    while let Some(name) = pending.pop_front() {
        match name.as_str() {
            "." => continue,
            ".." => {
                if directories.len() > 1 {
                    directories.pop();
                }
                top_attr = None;
                continue;
            }
            _ => {}
        }
        let parent = *directories.last().expect("the root is never popped");
        let attr = namespace.lookup(parent, &name).await?;
        let is_final = pending.is_empty();
        if attr.kind == FileKind::Symlink && (follow_final || !is_final) {
            links_followed += 1;
            if links_followed > SYMLINK_FOLLOW_MAX {
                return Err(ClientError::path(
                    path,
                    ErrorCode::Loop,
                    format!("more than {SYMLINK_FOLLOW_MAX} symlinks followed"),
                ));
            }
            let target = namespace.readlink(attr.inode).await?;
            let target_parts = components(&target, false).map_err(|_| {
                ClientError::path(
                    path,
                    ErrorCode::NotFound,
                    format!("symlink {name:?} has an unusable target {target:?}"),
                )
            })?;
            if target.starts_with('/') {
                directories.truncate(1);
            }
            for part in target_parts.into_iter().rev() {
                pending.push_front(part);
            }
            top_attr = None;
            continue;
        }
        if is_final {
            return Ok(attr);
        }
        if attr.kind != FileKind::Directory {
            return Err(ClientError::path(
                path,
                ErrorCode::NotDirectory,
                format!("component {name:?} is not a directory"),
            ));
        }
        directories.push(attr.inode);
        top_attr = Some(attr);
    }
    let top = *directories.last().expect("the root is never popped");
    match top_attr {
        Some(attr) if attr.inode == top => Ok(attr),
        _ => namespace.getattr(top).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Mutex;

    use freeflow_types::TimeSpec;

    /// An in-memory namespace: a map of (parent, name) to inode, and symlink targets.
    #[derive(Default)]
    struct Tree {
        entries: HashMap<(InodeId, String), (InodeId, FileKind)>,
        targets: HashMap<InodeId, String>,
        lookups: Mutex<u32>,
    }

    fn attr(inode: InodeId, kind: FileKind) -> Attr {
        Attr {
            inode,
            kind,
            permissions: 0o755,
            link_count: 1,
            user_id: 0,
            group_id: 0,
            size_bytes: 0,
            access_time: TimeSpec::default(),
            modify_time: TimeSpec::default(),
            change_time: TimeSpec::default(),
            birth_time: TimeSpec::default(),
            device: 0,
            layout: None,
            generation: 1,
            allocated_bytes: 0,
        }
    }

    impl Tree {
        fn add(&mut self, parent: InodeId, name: &str, inode: InodeId, kind: FileKind) {
            self.entries
                .insert((parent, name.to_string()), (inode, kind));
        }
        fn link(&mut self, parent: InodeId, name: &str, inode: InodeId, target: &str) {
            self.add(parent, name, inode, FileKind::Symlink);
            self.targets.insert(inode, target.to_string());
        }
        fn kind_of(&self, inode: InodeId) -> FileKind {
            if inode == ROOT_INODE {
                return FileKind::Directory;
            }
            self.entries
                .values()
                .find(|(i, _)| *i == inode)
                .map(|(_, k)| *k)
                .unwrap()
        }
    }

    impl Namespace for Tree {
        async fn lookup(&self, parent: InodeId, name: &str) -> Result<Attr, ClientError> {
            *self.lookups.lock().unwrap() += 1;
            match self.entries.get(&(parent, name.to_string())) {
                Some((inode, kind)) => Ok(attr(*inode, *kind)),
                None => Err(ClientError::inode(
                    parent,
                    ErrorCode::NotFound,
                    format!("no {name}"),
                )),
            }
        }
        async fn getattr(&self, inode: InodeId) -> Result<Attr, ClientError> {
            Ok(attr(inode, self.kind_of(inode)))
        }
        async fn readlink(&self, inode: InodeId) -> Result<String, ClientError> {
            Ok(self.targets[&inode].clone())
        }
    }

    /// /a (dir 2), /a/b (dir 3), /a/b/f (file 4), /a/up -> .. (5), /a/abs -> /a/b (6),
    /// /a/b/rel -> f (7), /loop1 -> /loop2 (8), /loop2 -> /loop1 (9), /a/fl -> b/f (10),
    /// /dangling -> nowhere (11)
    fn tree() -> Tree {
        let mut tree = Tree::default();
        tree.add(ROOT_INODE, "a", 2, FileKind::Directory);
        tree.add(2, "b", 3, FileKind::Directory);
        tree.add(3, "f", 4, FileKind::Regular);
        tree.link(2, "up", 5, "..");
        tree.link(2, "abs", 6, "/a/b");
        tree.link(3, "rel", 7, "f");
        tree.link(ROOT_INODE, "loop1", 8, "/loop2");
        tree.link(ROOT_INODE, "loop2", 9, "/loop1");
        tree.link(2, "fl", 10, "b/f");
        tree.link(ROOT_INODE, "dangling", 11, "nowhere");
        tree
    }

    async fn resolve(tree: &Tree, path: &str, follow: bool) -> Result<InodeId, ClientError> {
        walk(tree, path, components(path, true)?, follow)
            .await
            .map(|attr| attr.inode)
    }

    #[tokio::test]
    async fn plain_paths_and_dots() {
        let tree = tree();
        assert_eq!(resolve(&tree, "/", true).await.unwrap(), ROOT_INODE);
        assert_eq!(resolve(&tree, "/a/b/f", true).await.unwrap(), 4);
        assert_eq!(resolve(&tree, "//a/./b//", true).await.unwrap(), 3);
        assert_eq!(resolve(&tree, "/a/b/../b/f", true).await.unwrap(), 4);
        assert_eq!(resolve(&tree, "/../../a", true).await.unwrap(), 2);
        assert_eq!(resolve(&tree, "/a/b/..", true).await.unwrap(), 2);
    }

    #[tokio::test]
    async fn symlinks_are_followed_in_the_middle_and_at_the_end_when_asked() {
        let tree = tree();
        assert_eq!(resolve(&tree, "/a/abs/f", false).await.unwrap(), 4);
        assert_eq!(resolve(&tree, "/a/abs", true).await.unwrap(), 3);
        assert_eq!(resolve(&tree, "/a/abs", false).await.unwrap(), 6);
        assert_eq!(resolve(&tree, "/a/b/rel", true).await.unwrap(), 4);
        assert_eq!(resolve(&tree, "/a/fl", true).await.unwrap(), 4);
        // ".." after a symlink is the parent of the directory the link led to.
        assert_eq!(resolve(&tree, "/a/abs/..", true).await.unwrap(), 2);
        // "up" -> ".." from /a is the root; /a/up/a is /a again.
        assert_eq!(resolve(&tree, "/a/up/a/b", true).await.unwrap(), 3);
    }

    #[tokio::test]
    async fn errors_name_the_problem() {
        let tree = tree();
        let error = resolve(&tree, "/loop1/x", true).await.unwrap_err();
        assert_eq!(error.code(), ErrorCode::Loop);
        // A final symlink loop is only an error when following it.
        assert_eq!(resolve(&tree, "/loop1", false).await.unwrap(), 8);
        let error = resolve(&tree, "/a/b/f/g", true).await.unwrap_err();
        assert_eq!(error.code(), ErrorCode::NotDirectory);
        assert!(error.to_string().contains("\"f\""), "{error}");
        let error = resolve(&tree, "/a/missing", true).await.unwrap_err();
        assert_eq!(error.code(), ErrorCode::NotFound);
        let error = resolve(&tree, "/dangling", true).await.unwrap_err();
        assert_eq!(error.code(), ErrorCode::NotFound);
        assert_eq!(resolve(&tree, "/dangling", false).await.unwrap(), 11);
        // The loop is cut after SYMLINK_FOLLOW_MAX lookups of links, not run forever.
        assert!(*tree.lookups.lock().unwrap() < 200);
    }

    #[test]
    fn parsing_checks_paths() {
        assert_eq!(
            components("/a//b/./..", true).unwrap(),
            vec!["a", "b", ".", ".."]
        );
        assert!(components("/", true).unwrap().is_empty());
        assert_eq!(
            components("a/b", true).unwrap_err().code(),
            ErrorCode::InvalidArgument
        );
        assert_eq!(components("a/b", false).unwrap(), vec!["a", "b"]);
        assert_eq!(
            components("", true).unwrap_err().code(),
            ErrorCode::NotFound
        );
        let long = format!("/{}", "x".repeat(NAME_LENGTH_MAX + 1));
        assert_eq!(
            components(&long, true).unwrap_err().code(),
            ErrorCode::NameTooLong
        );
        assert_eq!(
            components("/a\0b", true).unwrap_err().code(),
            ErrorCode::InvalidArgument
        );
    }

    #[test]
    fn final_component_is_split_off() {
        let (parent, name) = split_final("/a/b/c/").unwrap();
        assert_eq!(parent, vec!["a", "b"]);
        assert_eq!(name, "c");
        assert_eq!(split_final("/").unwrap_err().code(), ErrorCode::Busy);
        assert_eq!(
            split_final("/a/..").unwrap_err().code(),
            ErrorCode::InvalidArgument
        );
    }

    #[test]
    fn normalize_and_join() {
        assert_eq!(normalize("/a/./b/../c//").unwrap(), "/a/c");
        assert_eq!(normalize("/..").unwrap(), "/");
        assert_eq!(join("/", "x"), "/x");
        assert_eq!(join("/a", "x"), "/a/x");
    }
}
