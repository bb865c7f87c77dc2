//! Directory listing with a resumable cursor: each page starts after the last name of the
//! previous one, so a listing survives concurrent changes without server-side state.

use std::ops::Bound;

use freeflow_proto::meta::{DirEntry, DirPage, ReadDir};
use freeflow_types::limits::READDIR_ENTRIES_MAX;

use super::{load_directory, load_inode, require_access, OpResult, ACCESS_READ};
use crate::records::{decode_dirent, inode_key, name_of_key, named_key};
use crate::store::{StoreRead, TableId};

/// Encoded bytes one page may take: half the frame's header bound, so a page always fits
/// with room for the reply's framing.
const PAGE_BYTES_MAX: usize = (freeflow_proto::frame::HEADER_LENGTH_MAX / 2) as usize;

/// An upper bound of an entry's encoded size (postcard varints are at most 10 bytes).
fn entry_bytes_bound(name: &str, attr: Option<&freeflow_types::Attr>) -> usize {
    let attr_bytes = attr.map_or(1, |attr| {
        160 + attr
            .layout
            .as_ref()
            .map_or(0, |layout| 10 + 5 * layout.servers.len())
    });
    name.len() + 5 + 10 + 2 + attr_bytes
}

pub fn read_dir<R: StoreRead>(read: &R, request: &ReadDir) -> OpResult<DirPage> {
    let directory = load_directory(read, request.inode)?;
    require_access(&directory.attr, &request.caller, ACCESS_READ)?;
    let limit = request.limit.clamp(1, READDIR_ENTRIES_MAX) as usize;
    let start = match &request.after {
        Some(name) => Bound::Excluded(named_key(request.inode, name.as_bytes())),
        None => Bound::Included(inode_key(request.inode).to_vec()),
    };
    let end = inode_key(request.inode + 1);
    // One more than asked tells whether the listing ends here.
    let pairs = read.range(
        TableId::Dirents,
        start.as_ref().map(|key| key.as_slice()),
        Bound::Excluded(&end),
        limit + 1,
    )?;
    let mut end_reached = pairs.len() <= limit;
    let mut entries = Vec::with_capacity(pairs.len().min(limit));
    let mut page_bytes = 0usize;
    for (key, value) in pairs.into_iter().take(limit) {
        if page_bytes >= PAGE_BYTES_MAX {
            // The reply must fit the frame's header bound whatever the names and layouts.
            end_reached = false;
            break;
        }
        let name = name_of_key(TableId::Dirents, &key)?;
        let (inode, kind) = decode_dirent(&value)?;
        let attr = if request.with_attributes {
            Some(load_inode(read, inode)?.attr)
        } else {
            None
        };
        page_bytes += entry_bytes_bound(&name, attr.as_ref());
        entries.push(DirEntry {
            name,
            inode,
            kind,
            attr,
        });
    }
    Ok(DirPage {
        entries,
        end: end_reached,
    })
}
