//! Unit tests of the namespace operations over a real redb store.

use freeflow_proto::meta::{
    Caller, GetAttr, GetXattr, Link, ReadDir, Rename, RenameMode, Rmdir, SetAttributes, SetXattr,
    Unlink, XattrSetMode,
};
use freeflow_proto::ErrorCode;
use freeflow_types::{FileKind, SetAttr, ROOT_INODE};

use super::testing::{user, Harness};
use super::*;
use crate::records::COUNTER_INODE_COUNT;
use crate::store::MetaStore;

fn code<T: std::fmt::Debug>(result: OpResult<T>) -> ErrorCode {
    result.expect_err("operation should fail").code()
}

#[test]
fn inode_ids_are_never_reused_after_reopen() {
    let mut harness = Harness::new();
    let first = harness.create(ROOT_INODE, "a").unwrap().inode;
    let second = harness.create(ROOT_INODE, "b").unwrap().inode;
    assert!(second > first);
    harness.reopen();
    let after = harness.create(ROOT_INODE, "c").unwrap().inode;
    // After a restart ids continue past the whole reserved batch.
    assert!(after > second);
    assert!(
        after >= first + INODE_RESERVE_BATCH,
        "after restart {after}, before {first}"
    );
    assert_eq!(harness.state.inode_count, 4);
}

#[test]
fn start_up_reads_counters_instead_of_counting() {
    let mut harness = Harness::new();
    for index in 0..2000 {
        harness
            .create(ROOT_INODE, &format!("file-{index}"))
            .unwrap();
    }
    harness.reopen();
    assert_eq!(harness.state.inode_count, 2001);
    // Proof that the count is read, not computed: change the stored counter behind the
    // store's back and reopen; a scan would still say 2001.
    let store = harness.store();
    let mut write = store.begin_write().unwrap();
    write
        .put(
            crate::store::TableId::Counters,
            COUNTER_INODE_COUNT,
            &777u64.to_be_bytes(),
        )
        .unwrap();
    write.commit().unwrap();
    harness.reopen();
    assert_eq!(harness.state.inode_count, 777);
}

#[test]
fn readdir_resumes_after_the_last_name_across_pages() {
    let mut harness = Harness::new();
    let directory = harness.mkdir(ROOT_INODE, "d").unwrap().inode;
    let mut expected = Vec::new();
    for index in 0..10 {
        let name = format!("entry-{index:02}");
        harness.create(directory, &name).unwrap();
        expected.push(name);
    }
    let mut listed = Vec::new();
    let mut after = None;
    let mut pages = 0;
    loop {
        let request = ReadDir {
            caller: Caller::root(),
            inode: directory,
            after: after.clone(),
            limit: 3,
            with_attributes: true,
        };
        let page = harness
            .read(|read| readdir::read_dir(read, &request))
            .unwrap();
        pages += 1;
        assert!(page.entries.len() <= 3);
        for entry in &page.entries {
            let attr = entry.attr.as_ref().expect("readdirplus attributes");
            assert_eq!(attr.inode, entry.inode);
            assert_eq!(entry.kind, FileKind::Regular);
        }
        listed.extend(page.entries.iter().map(|entry| entry.name.clone()));
        after = listed.last().cloned();
        if page.end {
            break;
        }
        assert!(pages < 10, "readdir does not end");
    }
    assert_eq!(listed, expected);
    assert_eq!(pages, 4);
    // A listing of another directory does not leak into this one.
    let root_request = ReadDir {
        caller: Caller::root(),
        inode: ROOT_INODE,
        after: None,
        limit: 100,
        with_attributes: false,
    };
    let root_page = harness
        .read(|read| readdir::read_dir(read, &root_request))
        .unwrap();
    assert_eq!(root_page.entries.len(), 1);
    assert!(root_page.end);
}

/// Regression: pages were bounded by entry count alone, so 4096 entries with 255-byte names
/// and attributes encoded to more than the frame's 1 MiB header bound; the client refused
/// the reply and dropped the whole connection.
#[test]
fn a_readdir_page_fits_the_frame_whatever_the_names() {
    let mut harness = Harness::new();
    let directory = harness.mkdir(ROOT_INODE, "long").unwrap().inode;
    let total = 4200;
    for index in 0..total {
        let name = format!("{index:05}{}", "x".repeat(250));
        harness.create(directory, &name).unwrap();
    }
    let mut after: Option<String> = None;
    let mut listed = 0;
    loop {
        let request = ReadDir {
            caller: Caller::root(),
            inode: directory,
            after: after.clone(),
            limit: freeflow_types::limits::READDIR_ENTRIES_MAX,
            with_attributes: true,
        };
        let page = harness
            .read(|read| readdir::read_dir(read, &request))
            .unwrap();
        let encoded = freeflow_proto::encode(&Ok::<_, freeflow_proto::WireError>(page.clone()));
        assert!(
            encoded.len() <= freeflow_proto::frame::HEADER_LENGTH_MAX as usize,
            "page of {} entries encodes to {} bytes",
            page.entries.len(),
            encoded.len()
        );
        listed += page.entries.len();
        after = page.entries.last().map(|entry| entry.name.clone());
        if page.end {
            break;
        }
        assert!(
            !page.entries.is_empty(),
            "a page that is not the end must make progress"
        );
    }
    assert_eq!(listed, total);
}

#[test]
fn bad_arguments_get_their_posix_codes() {
    let mut harness = Harness::new();
    let missing = GetAttr { inode: 999_999 };
    assert_eq!(
        code(harness.read(|read| lookup::get_attr(read, &missing))),
        ErrorCode::NotFound
    );
    assert_eq!(
        code(harness.mkdir(ROOT_INODE, &"x".repeat(256))),
        ErrorCode::NameTooLong
    );
    harness.mkdir(ROOT_INODE, &"x".repeat(255)).unwrap();
    assert_eq!(
        code(harness.mkdir(ROOT_INODE, "")),
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        code(harness.mkdir(ROOT_INODE, ".")),
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        code(harness.mkdir(ROOT_INODE, "..")),
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        code(harness.mkdir(ROOT_INODE, "a/b")),
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        code(harness.mkdir(ROOT_INODE, "a\0b")),
        ErrorCode::InvalidArgument
    );
    assert_eq!(code(harness.mkdir(12345, "a")), ErrorCode::NotFound);
    let file = harness.create(ROOT_INODE, "f").unwrap().inode;
    assert_eq!(code(harness.mkdir(file, "a")), ErrorCode::NotDirectory);
    assert_eq!(code(harness.create(ROOT_INODE, "f")), ErrorCode::Exists);
    assert_eq!(
        code(harness.lookup(ROOT_INODE, "nothing")),
        ErrorCode::NotFound
    );
    let unlink_dir = Unlink {
        caller: Caller::root(),
        parent: ROOT_INODE,
        name: "x".repeat(255),
    };
    assert_eq!(
        code(harness.write(|write, context| remove::unlink(write, context, &unlink_dir))),
        ErrorCode::IsDirectory
    );
    let rmdir_file = Rmdir {
        caller: Caller::root(),
        parent: ROOT_INODE,
        name: "f".into(),
    };
    assert_eq!(
        code(harness.write(|write, context| remove::rmdir(write, context, &rmdir_file))),
        ErrorCode::NotDirectory
    );
    let link_dir = Link {
        caller: Caller::root(),
        inode: ROOT_INODE,
        target_parent: ROOT_INODE,
        target_name: "root-again".into(),
    };
    assert_eq!(
        code(harness.write(|write, context| link::link(write, context, &link_dir))),
        ErrorCode::NotPermitted
    );
}

#[test]
fn a_regular_file_needs_a_registered_server() {
    let mut harness = Harness::new();
    harness.placement.servers.clear();
    let error = harness.create(ROOT_INODE, "f").unwrap_err().to_wire();
    assert_eq!(error.code, ErrorCode::NoSpace);
    assert!(
        error.message.contains("no I/O servers are registered"),
        "{}",
        error.message
    );
    // Nothing was left behind.
    assert_eq!(code(harness.lookup(ROOT_INODE, "f")), ErrorCode::NotFound);
    assert_eq!(harness.state.inode_count, 1);
}

#[test]
fn new_files_start_on_rotating_servers() {
    let mut harness = Harness::new();
    let first = harness.create(ROOT_INODE, "a").unwrap().layout.unwrap();
    let second = harness.create(ROOT_INODE, "b").unwrap().layout.unwrap();
    let third = harness.create(ROOT_INODE, "c").unwrap().layout.unwrap();
    assert_eq!(first.servers, vec![10, 11, 12]);
    assert_eq!(second.servers, vec![11, 12, 10]);
    assert_eq!(third.servers, vec![12, 10, 11]);
    assert_eq!(first.stripe_unit_bytes, 1 << 20);
}

#[test]
fn directory_layout_template_is_inherited() {
    let mut harness = Harness::new();
    let directory = harness.mkdir(ROOT_INODE, "d").unwrap().inode;
    let request = freeflow_proto::meta::SetDirLayout {
        caller: Caller::root(),
        inode: directory,
        stripe_unit_bytes: Some(65536),
        stripe_count: Some(2),
        replicas: None,
    };
    harness
        .write(|write, context| size::set_dir_layout(write, context, &request))
        .unwrap();
    let layout = harness.create(directory, "f").unwrap().layout.unwrap();
    assert_eq!(layout.stripe_unit_bytes, 65536);
    assert_eq!(layout.servers.len(), 2);
    let too_many = freeflow_proto::meta::SetDirLayout {
        stripe_count: Some(4),
        ..request.clone()
    };
    assert_eq!(
        code(harness.write(|write, context| size::set_dir_layout(write, context, &too_many))),
        ErrorCode::InvalidArgument
    );
    let bad_unit = freeflow_proto::meta::SetDirLayout {
        stripe_unit_bytes: Some(5000),
        ..request
    };
    assert_eq!(
        code(harness.write(|write, context| size::set_dir_layout(write, context, &bad_unit))),
        ErrorCode::InvalidArgument
    );
}

#[test]
fn permissions_and_sticky_directories() {
    let mut harness = Harness::new();
    let alice = user(1000, 1000);
    let bob = user(1001, 1001);
    // Root's directory is 0755: others may not create in it.
    assert_eq!(
        code(harness.create_as(alice.clone(), ROOT_INODE, "f", 0o644)),
        ErrorCode::PermissionDenied
    );
    let shared = harness.mkdir(ROOT_INODE, "tmp").unwrap().inode;
    let chmod = SetAttributes {
        caller: Caller::root(),
        inode: shared,
        changes: SetAttr {
            permissions: Some(0o1777),
            ..SetAttr::default()
        },
        through_handle: None,
    };
    harness
        .write(|write, context| setattr::set_attributes(write, context, &chmod, false))
        .unwrap();
    harness
        .create_as(alice.clone(), shared, "mine", 0o644)
        .unwrap();
    let bob_unlinks = Unlink {
        caller: bob.clone(),
        parent: shared,
        name: "mine".into(),
    };
    assert_eq!(
        code(harness.write(|write, context| remove::unlink(write, context, &bob_unlinks))),
        ErrorCode::NotPermitted
    );
    let bob_renames = Rename {
        caller: bob,
        source_parent: shared,
        source_name: "mine".into(),
        target_parent: shared,
        target_name: "his".into(),
        mode: RenameMode::Replace,
    };
    assert_eq!(
        code(harness.write(|write, context| rename::rename(write, context, &bob_renames))),
        ErrorCode::NotPermitted
    );
    let alice_unlinks = Unlink {
        caller: alice,
        parent: shared,
        name: "mine".into(),
    };
    harness
        .write(|write, context| remove::unlink(write, context, &alice_unlinks))
        .unwrap();
}

#[test]
fn setattr_follows_posix_ownership_rules() {
    let mut harness = Harness::new();
    let alice = Caller {
        user_id: 1000,
        group_id: 1000,
        groups: vec![50],
    };
    let directory = harness.mkdir(ROOT_INODE, "home").unwrap().inode;
    let chmod = SetAttributes {
        caller: Caller::root(),
        inode: directory,
        changes: SetAttr {
            permissions: Some(0o777),
            ..SetAttr::default()
        },
        through_handle: None,
    };
    harness
        .write(|write, context| setattr::set_attributes(write, context, &chmod, false))
        .unwrap();
    let file = harness
        .create_as(alice.clone(), directory, "f", 0o644)
        .unwrap();
    assert_eq!((file.user_id, file.group_id), (1000, 1000));
    let set = |caller: Caller, changes: SetAttr| SetAttributes {
        caller,
        inode: file.inode,
        changes,
        through_handle: None,
    };
    let mut apply = |request: SetAttributes| {
        harness.write(|write, context| setattr::set_attributes(write, context, &request, false))
    };
    // Another user may not chmod; the owner may not give the file away.
    let chmod_other = set(
        user(7, 7),
        SetAttr {
            permissions: Some(0o777),
            ..SetAttr::default()
        },
    );
    assert_eq!(code(apply(chmod_other)), ErrorCode::NotPermitted);
    let give_away = set(
        alice.clone(),
        SetAttr {
            user_id: Some(7),
            ..SetAttr::default()
        },
    );
    assert_eq!(code(apply(give_away)), ErrorCode::NotPermitted);
    let foreign_group = set(
        alice.clone(),
        SetAttr {
            group_id: Some(99),
            ..SetAttr::default()
        },
    );
    assert_eq!(code(apply(foreign_group)), ErrorCode::NotPermitted);
    // The owner may change the group to one of its groups.
    let own_group = set(
        alice.clone(),
        SetAttr {
            group_id: Some(50),
            ..SetAttr::default()
        },
    );
    assert_eq!(apply(own_group).unwrap().group_id, 50);
    // Root gives the file to group 99; the owner's chmod +setgid then loses setgid.
    let root_chgrp = set(
        Caller::root(),
        SetAttr {
            group_id: Some(99),
            ..SetAttr::default()
        },
    );
    apply(root_chgrp).unwrap();
    let setgid = set(
        alice.clone(),
        SetAttr {
            permissions: Some(0o2755),
            ..SetAttr::default()
        },
    );
    assert_eq!(apply(setgid).unwrap().permissions, 0o755);
    // Truncate needs write permission and sets the size.
    let truncate_other = set(
        user(7, 7),
        SetAttr {
            size_bytes: Some(10),
            ..SetAttr::default()
        },
    );
    assert_eq!(code(apply(truncate_other)), ErrorCode::PermissionDenied);
    let truncate = set(
        alice,
        SetAttr {
            size_bytes: Some(10),
            ..SetAttr::default()
        },
    );
    let attr = apply(truncate).unwrap();
    assert_eq!(attr.size_bytes, 10);
    assert!(attr.change_time > file.change_time);
}

#[test]
fn setgid_directories_pass_their_group_on() {
    let mut harness = Harness::new();
    let directory = harness.mkdir(ROOT_INODE, "project").unwrap().inode;
    let chmod = SetAttributes {
        caller: Caller::root(),
        inode: directory,
        changes: SetAttr {
            permissions: Some(0o2777),
            group_id: Some(300),
            ..SetAttr::default()
        },
        through_handle: None,
    };
    harness
        .write(|write, context| setattr::set_attributes(write, context, &chmod, false))
        .unwrap();
    let file = harness
        .create_as(user(1000, 1000), directory, "f", 0o644)
        .unwrap();
    assert_eq!(file.group_id, 300);
    let sub = harness.mkdir(directory, "sub").unwrap();
    assert_eq!(sub.group_id, 300);
    assert_eq!(sub.permissions & MODE_SET_GROUP_ID, MODE_SET_GROUP_ID);
}

#[test]
fn rename_refuses_a_move_into_its_own_subtree_and_keeps_link_counts() {
    let mut harness = Harness::new();
    let a = harness.mkdir(ROOT_INODE, "a").unwrap().inode;
    let b = harness.mkdir(a, "b").unwrap().inode;
    let c = harness.mkdir(ROOT_INODE, "c").unwrap().inode;
    let mut rename = |source_parent, source_name: &str, target_parent, target_name: &str| {
        let request = Rename {
            caller: Caller::root(),
            source_parent,
            source_name: source_name.into(),
            target_parent,
            target_name: target_name.into(),
            mode: RenameMode::Replace,
        };
        harness.write(|write, context| rename::rename(write, context, &request))
    };
    assert_eq!(
        code(rename(ROOT_INODE, "a", b, "a")),
        ErrorCode::InvalidArgument
    );
    rename(a, "b", c, "b").unwrap();
    assert_eq!(harness.attr(a).unwrap().link_count, 2);
    assert_eq!(harness.attr(c).unwrap().link_count, 3);
    assert_eq!(harness.attr(ROOT_INODE).unwrap().link_count, 4);
    // b's parent pointer moved too: now moving c into b is refused.
    let mut rename_again = |source_name: &str, target_parent, target_name: &str| {
        let request = Rename {
            caller: Caller::root(),
            source_parent: ROOT_INODE,
            source_name: source_name.into(),
            target_parent,
            target_name: target_name.into(),
            mode: RenameMode::Replace,
        };
        harness.write(|write, context| rename::rename(write, context, &request))
    };
    assert_eq!(code(rename_again("c", b, "c")), ErrorCode::InvalidArgument);
    rename_again("a", b, "a").unwrap();
}

#[test]
fn unlinked_files_become_orphans_until_forgotten() {
    let mut harness = Harness::new();
    let file = harness.create(ROOT_INODE, "f").unwrap();
    let request = Unlink {
        caller: Caller::root(),
        parent: ROOT_INODE,
        name: "f".into(),
    };
    harness
        .write(|write, context| remove::unlink(write, context, &request))
        .unwrap();
    assert_eq!(code(harness.lookup(ROOT_INODE, "f")), ErrorCode::NotFound);
    // The inode stays for open handles, with no links.
    assert_eq!(harness.attr(file.inode).unwrap().link_count, 0);
    let orphans = harness
        .read(|read| orphan::list_orphans(read, None, 10))
        .unwrap();
    assert_eq!(orphans.len(), 1);
    assert_eq!(orphans[0].0, file.inode);
    assert_eq!(Some(orphans[0].1.layout.clone()), file.layout);
    assert_eq!(harness.state.orphan_count, 1);
    // Survives a restart.
    harness.reopen();
    assert_eq!(harness.state.orphan_count, 1);
    let inode = file.inode;
    assert!(harness
        .write(|write, context| orphan::forget_orphan(write, context, inode))
        .unwrap());
    assert!(!harness
        .write(|write, context| orphan::forget_orphan(write, context, inode))
        .unwrap());
    assert_eq!(code(harness.attr(inode)), ErrorCode::NotFound);
    assert_eq!(
        (harness.state.orphan_count, harness.state.inode_count),
        (0, 1)
    );
}

#[test]
fn xattr_modes_and_bounds() {
    let mut harness = Harness::new();
    let file = harness.create(ROOT_INODE, "f").unwrap().inode;
    let set = |name: &str, value: &[u8], mode| SetXattr {
        caller: Caller::root(),
        inode: file,
        name: name.into(),
        value: value.to_vec(),
        mode,
    };
    let mut apply = |request: SetXattr| {
        harness.write(|write, context| xattr::set_xattr(write, context, &request))
    };
    assert_eq!(
        code(apply(set("user.a", b"1", XattrSetMode::ReplaceOnly))),
        ErrorCode::NoData
    );
    apply(set("user.a", b"1", XattrSetMode::CreateOnly)).unwrap();
    assert_eq!(
        code(apply(set("user.a", b"2", XattrSetMode::CreateOnly))),
        ErrorCode::Exists
    );
    apply(set("user.a", b"3", XattrSetMode::ReplaceOnly)).unwrap();
    let long_name = "u".repeat(256);
    assert_eq!(
        code(apply(set(&long_name, b"", XattrSetMode::Any))),
        ErrorCode::OutOfRange
    );
    let big = vec![0u8; 65537];
    assert_eq!(
        code(apply(set("user.big", &big, XattrSetMode::Any))),
        ErrorCode::OutOfRange
    );
    let get = GetXattr {
        caller: Caller::root(),
        inode: file,
        name: "user.a".into(),
    };
    assert_eq!(
        harness.read(|read| xattr::get_xattr(read, &get)).unwrap(),
        b"3"
    );
}

fn resize(
    harness: &mut Harness,
    caller: Caller,
    inode: InodeId,
    size_bytes: u64,
    open: bool,
) -> OpResult<setattr::SetAttrOutcome> {
    let request = SetAttributes {
        caller,
        inode,
        changes: SetAttr {
            size_bytes: Some(size_bytes),
            ..SetAttr::default()
        },
        through_handle: None,
    };
    harness.write(|write, context| {
        setattr::set_attributes_recording_cuts(write, context, &request, |_| open, false)
    })
}

#[test]
fn shrinks_record_the_smallest_pending_cut_per_stripe() {
    let mut harness = Harness::new();
    let file = harness.create(ROOT_INODE, "f").unwrap();
    let inode = file.inode;
    let stripe_count = file.layout.as_ref().unwrap().stripe_count() as usize;
    assert_eq!(stripe_count, 3);
    let grown = resize(&mut harness, Caller::root(), inode, 5000, false).unwrap();
    assert_eq!(grown.truncation, None, "growing cuts nothing");
    let same = resize(&mut harness, Caller::root(), inode, 5000, false).unwrap();
    assert_eq!(same.truncation, None, "same size cuts nothing");
    assert_eq!(
        code(resize(&mut harness, user(1000, 1000), inode, 10, false)),
        ErrorCode::PermissionDenied
    );
    let pending = |harness: &Harness| {
        harness
            .read(|read| Ok(truncate::load_truncation(read, inode)?))
            .unwrap()
    };
    assert_eq!(pending(&harness), None, "a refused shrink records nothing");

    let first = resize(&mut harness, Caller::root(), inode, 10, false)
        .unwrap()
        .truncation
        .expect("a shrink records cuts");
    assert_eq!(first.cuts, vec![(0, 10), (1, 10), (2, 10)]);
    assert_eq!(pending(&harness), Some(first.clone()));
    // Stripes 0 and 1 confirmed; stripe 2 stays pending, across a restart.
    let generation = first.generation;
    let left = harness
        .write(|write, _| truncate::settle_truncation(write, inode, generation, &[0, 1]))
        .unwrap();
    assert_eq!(left, 1);
    harness.reopen();
    assert_eq!(pending(&harness).unwrap().cuts, vec![(2, 10)]);

    // Grow, then shrink to 100: stripe 2 must still be cut at 10 (bytes 10..100 are zeros).
    resize(&mut harness, Caller::root(), inode, 5000, false).unwrap();
    let second = resize(&mut harness, Caller::root(), inode, 100, false)
        .unwrap()
        .truncation
        .unwrap();
    assert_eq!(second.cuts, vec![(0, 100), (1, 100), (2, 10)]);
    assert_eq!(harness.attr(inode).unwrap().size_bytes, 100);
    assert_ne!(second.generation, generation);
    // The first shrink's late settle must not drop the second one's cuts.
    let left = harness
        .write(|write, _| truncate::settle_truncation(write, inode, generation, &[2]))
        .unwrap();
    assert_eq!(left, 3);
    let generation = second.generation;
    let left = harness
        .write(|write, _| truncate::settle_truncation(write, inode, generation, &[0, 1, 2]))
        .unwrap();
    assert_eq!(left, 0);
    assert_eq!(pending(&harness), None);
    let listed = harness
        .read(|read| truncate::list_truncations(read, None, 10))
        .unwrap();
    assert!(listed.is_empty());
}

#[test]
fn an_unlinked_file_is_cut_only_while_open_and_its_cuts_go_with_it() {
    let mut harness = Harness::new();
    let file = harness.create(ROOT_INODE, "f").unwrap();
    let inode = file.inode;
    resize(&mut harness, Caller::root(), inode, 5000, false).unwrap();
    let request = Unlink {
        caller: Caller::root(),
        parent: ROOT_INODE,
        name: "f".into(),
    };
    harness
        .write(|write, context| remove::unlink(write, context, &request))
        .unwrap();
    let unopened = resize(&mut harness, Caller::root(), inode, 4000, false).unwrap();
    assert_eq!(unopened.truncation, None, "left to the reaper's removal");
    let open = resize(&mut harness, Caller::root(), inode, 3000, true).unwrap();
    assert!(
        open.truncation.is_some(),
        "readers through a handle see the cut"
    );
    harness
        .write(|write, context| orphan::forget_orphan(write, context, inode))
        .unwrap();
    let listed = harness
        .read(|read| truncate::list_truncations(read, None, 10))
        .unwrap();
    assert!(listed.is_empty(), "forgetting the inode forgets its cuts");
}
