//! Creating names: regular files and special files (create/mknod), directories and
//! symbolic links, and choosing a new file's layout.
//!
//! New inodes are owned by the caller; their group is the parent's when the parent is
//! setgid (else the caller's), and new subdirectories of a setgid directory are setgid.

use freeflow_proto::meta::{Caller, Create, CreateReply, Mkdir, OpenAccess, Symlink};
use freeflow_proto::ErrorCode;
use freeflow_types::limits::{STRIPE_COUNT_MAX, SYMLINK_TARGET_LENGTH_MAX};
use freeflow_types::{Attr, FileKind, InodeId, Layout, ServerId};

use super::{
    check_name, load_directory, load_inode, lookup_entry, put_entry, refuse, require_access,
    save_inode, touch_directory, OpContext, OpResult, Placement, ACCESS_EXECUTE, ACCESS_READ,
    ACCESS_WRITE, LINK_COUNT_MAX, MODE_SET_GROUP_ID,
};
use crate::records::{inode_key, InodeRecord};
use crate::store::{StoreWrite, TableId};

/// What a create did, and the open the service must register once it is committed.
#[derive(Clone, Debug, PartialEq)]
pub struct CreateOutcome {
    pub reply: CreateReply,
    pub open: Option<(u64, OpenAccess)>,
}

/// The stripe unit, count and copies new files in a directory get: the directory's
/// template if it has one, else the cluster default (count 0: all servers).
pub fn layout_template(placement: &Placement, parent: &Attr) -> (u32, u32, u32) {
    match &parent.layout {
        Some(template) => (
            template.stripe_unit_bytes,
            template.stripe_count(),
            template.replicas(),
        ),
        None => (
            placement.default_stripe_unit_bytes,
            placement.default_stripe_count,
            placement.default_replicas,
        ),
    }
}

/// `count` chains of `replicas` servers each over `servers` (distinct, in order), the first
/// headed by `servers[start]`, each next one by the next server: every member of a chain is
/// a different server, and heads and copies spread evenly. Returns (heads, copies) as
/// [`Layout::replicated`] takes them.
pub fn chains_over(
    servers: &[ServerId],
    start: usize,
    count: usize,
    replicas: usize,
) -> (Vec<ServerId>, Vec<ServerId>) {
    let n = servers.len().max(1);
    let mut heads = Vec::with_capacity(count);
    let mut copies = Vec::with_capacity(count * replicas.saturating_sub(1));
    for stripe in 0..count {
        heads.push(servers[(start + stripe) % n]);
        for further in 1..replicas {
            copies.push(servers[(start + stripe + further) % n]);
        }
    }
    (heads, copies)
}

/// A layout for a new regular file: the template's unit and count over the registered
/// servers, starting at a server that rotates per file so small files spread out.
pub fn choose_layout(placement: &Placement, parent: &Attr, rotation: u64) -> OpResult<Layout> {
    let servers = &placement.servers;
    if servers.is_empty() {
        return Err(refuse(
            ErrorCode::NoSpace,
            "no I/O servers are registered: start at least one I/O server",
        ));
    }
    let (stripe_unit_bytes, wanted_count, wanted_replicas) = layout_template(placement, parent);
    let available = servers.len().min(STRIPE_COUNT_MAX as usize);
    let count = if wanted_count == 0 {
        available
    } else {
        (wanted_count as usize).min(available)
    };
    // Fewer servers up than copies asked for: the spares make up the missing copies, and
    // without enough of them, as many copies as there are servers.
    let wanted_replicas = wanted_replicas.max(1) as usize;
    let replicas = wanted_replicas.min(servers.len());
    let start = (rotation % servers.len() as u64) as usize;
    let (heads, mut copies) = chains_over(servers, start, count, replicas);
    let extra = wanted_replicas
        .saturating_sub(replicas)
        .min(placement.spares.len());
    if extra > 0 {
        let per_chain = replicas - 1;
        let mut filled = Vec::with_capacity(count * (per_chain + extra));
        for stripe in 0..count {
            filled.extend_from_slice(&copies[stripe * per_chain..(stripe + 1) * per_chain]);
            for further in 0..extra {
                filled.push(placement.spares[(stripe + further) % placement.spares.len()]);
            }
        }
        copies = filled;
    }
    Layout::replicated(stripe_unit_bytes, heads, copies)
        .map_err(|error| refuse(ErrorCode::InvalidArgument, format!("layout: {error}")))
}

/// Attributes of a new inode under `parent`.
fn new_attr(
    inode: InodeId,
    kind: FileKind,
    permissions: u32,
    caller: &Caller,
    parent: &Attr,
    context: &OpContext<'_>,
) -> Attr {
    let parent_setgid = parent.permissions & MODE_SET_GROUP_ID != 0;
    let mut permissions = permissions & 0o7777;
    if kind == FileKind::Directory && parent_setgid {
        permissions |= MODE_SET_GROUP_ID;
    }
    let group_id = if parent_setgid {
        parent.group_id
    } else {
        caller.group_id
    };
    Attr::new_inode(
        inode,
        kind,
        permissions,
        caller.user_id,
        group_id,
        context.now,
    )
}

fn already_exists(parent: InodeId, name: &str) -> super::OpError {
    refuse(
        ErrorCode::Exists,
        format!("{name:?} already exists in directory {parent}"),
    )
}

pub fn create<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    request: &Create,
) -> OpResult<CreateOutcome> {
    check_name(&request.name)?;
    if matches!(request.kind, FileKind::Directory | FileKind::Symlink) {
        return Err(refuse(
            ErrorCode::InvalidArgument,
            "create makes files and special files; use mkdir or symlink",
        ));
    }
    let mut parent = load_directory(write, request.parent)?;
    let caller = &request.caller;
    if let Some((existing, _)) = lookup_entry(write, request.parent, &request.name)? {
        require_access(&parent.attr, caller, ACCESS_EXECUTE)?;
        if request.exclusive {
            return Err(already_exists(request.parent, &request.name));
        }
        let record = load_inode(write, existing)?;
        if record.attr.kind == FileKind::Directory {
            return Err(refuse(
                ErrorCode::IsDirectory,
                format!("{:?} is a directory", request.name),
            ));
        }
        if let Some((_, access)) = request.open {
            let mut mask = 0;
            if access.read {
                mask |= ACCESS_READ;
            }
            if access.write {
                mask |= ACCESS_WRITE;
            }
            require_access(&record.attr, caller, mask)?;
        }
        return Ok(CreateOutcome {
            reply: CreateReply {
                attr: record.attr,
                created: false,
                handle_id: None,
            },
            open: request.open,
        });
    }
    require_access(&parent.attr, caller, ACCESS_WRITE | ACCESS_EXECUTE)?;
    let layout = match (request.kind, context.forced_layout.take()) {
        (FileKind::Regular, Some(layout)) => Some(layout),
        (FileKind::Regular, None) => Some(choose_layout(
            context.placement,
            &parent.attr,
            context.state.placement_counter,
        )?),
        _ => None,
    };
    // Validated: write.
    if layout.is_some() {
        context.state.placement_counter += 1;
    }
    let inode = context.allocate_inode(write)?;
    let mut attr = new_attr(
        inode,
        request.kind,
        request.permissions,
        caller,
        &parent.attr,
        context,
    );
    attr.layout = layout;
    if matches!(request.kind, FileKind::CharDevice | FileKind::BlockDevice) {
        attr.device = request.device;
    }
    save_inode(
        write,
        &InodeRecord {
            attr: attr.clone(),
            parent: 0,
            stripe_space: Vec::new(),
        },
    )?;
    put_entry(write, request.parent, &request.name, inode, request.kind)?;
    touch_directory(&mut parent, context.now);
    save_inode(write, &parent)?;
    Ok(CreateOutcome {
        reply: CreateReply {
            attr,
            created: true,
            handle_id: None,
        },
        open: request.open,
    })
}

pub fn mkdir<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    request: &Mkdir,
) -> OpResult<Attr> {
    check_name(&request.name)?;
    let mut parent = load_directory(write, request.parent)?;
    require_access(&parent.attr, &request.caller, ACCESS_WRITE | ACCESS_EXECUTE)?;
    if lookup_entry(write, request.parent, &request.name)?.is_some() {
        return Err(already_exists(request.parent, &request.name));
    }
    if parent.attr.link_count >= LINK_COUNT_MAX {
        return Err(refuse(
            ErrorCode::TooManyLinks,
            format!("directory {} has {LINK_COUNT_MAX} links", request.parent),
        ));
    }
    // Validated: write.
    let inode = context.allocate_inode(write)?;
    let attr = new_attr(
        inode,
        FileKind::Directory,
        request.permissions,
        &request.caller,
        &parent.attr,
        context,
    );
    save_inode(
        write,
        &InodeRecord {
            attr: attr.clone(),
            parent: request.parent,
            stripe_space: Vec::new(),
        },
    )?;
    put_entry(
        write,
        request.parent,
        &request.name,
        inode,
        FileKind::Directory,
    )?;
    parent.attr.link_count += 1;
    touch_directory(&mut parent, context.now);
    save_inode(write, &parent)?;
    // Read back (empty): a client that polls is leased the new directory's names with the
    // reply, so it may answer lookups in it from what it made there itself.
    let empty = super::directory_is_empty(write, inode)?;
    debug_assert!(empty, "a new directory has no entries");
    Ok(attr)
}

pub fn symlink<W: StoreWrite>(
    write: &mut W,
    context: &mut OpContext<'_>,
    request: &Symlink,
) -> OpResult<Attr> {
    check_name(&request.name)?;
    if request.target.is_empty() {
        return Err(refuse(ErrorCode::NotFound, "empty symlink target"));
    }
    if request.target.len() > SYMLINK_TARGET_LENGTH_MAX {
        return Err(refuse(
            ErrorCode::NameTooLong,
            format!(
                "symlink target of {} bytes is longer than {SYMLINK_TARGET_LENGTH_MAX}",
                request.target.len()
            ),
        ));
    }
    if request.target.contains('\0') {
        return Err(refuse(
            ErrorCode::InvalidArgument,
            "symlink target contains NUL",
        ));
    }
    let mut parent = load_directory(write, request.parent)?;
    require_access(&parent.attr, &request.caller, ACCESS_WRITE | ACCESS_EXECUTE)?;
    if lookup_entry(write, request.parent, &request.name)?.is_some() {
        return Err(already_exists(request.parent, &request.name));
    }
    // Validated: write.
    let inode = context.allocate_inode(write)?;
    let mut attr = new_attr(
        inode,
        FileKind::Symlink,
        0o777,
        &request.caller,
        &parent.attr,
        context,
    );
    attr.size_bytes = request.target.len() as u64;
    save_inode(
        write,
        &InodeRecord {
            attr: attr.clone(),
            parent: 0,
            stripe_space: Vec::new(),
        },
    )?;
    write.put(
        TableId::Symlinks,
        &inode_key(inode),
        request.target.as_bytes(),
    )?;
    put_entry(
        write,
        request.parent,
        &request.name,
        inode,
        FileKind::Symlink,
    )?;
    touch_directory(&mut parent, context.now);
    save_inode(write, &parent)?;
    Ok(attr)
}

#[cfg(test)]
mod tests {
    use freeflow_types::TimeSpec;

    use super::*;

    fn root() -> Attr {
        Attr::new_inode(1, FileKind::Directory, 0o755, 0, 0, TimeSpec::new(0, 0))
    }

    fn placement(servers: Vec<ServerId>, spares: Vec<ServerId>) -> Placement {
        Placement {
            servers,
            spares,
            default_stripe_unit_bytes: 1 << 20,
            default_stripe_count: 0,
            default_replicas: 2,
        }
    }

    /// One server up and another silent but not out: the silent one makes up the second
    /// copy (before, such a file kept one copy for good); heads stay on servers up.
    #[test]
    fn a_silent_server_not_yet_out_makes_up_a_missing_copy() {
        let layout = choose_layout(&placement(vec![1], vec![2, 3]), &root(), 0).unwrap();
        assert_eq!(layout.replicas(), 2);
        assert_eq!(layout.stripe_count(), 1);
        assert_eq!(layout.chain(0), vec![1, 2]);
        // Enough servers up: spares are not used.
        let layout = choose_layout(&placement(vec![1, 2, 3], vec![4]), &root(), 1).unwrap();
        assert_eq!(layout.replicas(), 2);
        for stripe in 0..layout.stripe_count() {
            assert!(!layout.chain(stripe).contains(&4));
        }
        // No spare: as many copies as servers up.
        let layout = choose_layout(&placement(vec![1], Vec::new()), &root(), 0).unwrap();
        assert_eq!(layout.replicas(), 1);
    }
}
