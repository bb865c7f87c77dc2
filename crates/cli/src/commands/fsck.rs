//! `freeflow fsck [--repair]`: compare what the I/O servers hold with what the meta server
//! says the files are, and report (and with `--repair`, fix) what disagrees.
//!
//! It walks every up I/O server's objects one shard directory page at a time
//! (`ListObjects`, [`PAGE_OBJECTS`] a page) and asks the meta server about the inodes of
//! each page (`InspectInodes`), so its memory is bounded by a page whatever the cluster's
//! size. For each object:
//!
//! | the object | finding | `--repair` |
//! |---|---|---|
//! | its inode does not exist and is not an orphan waiting for the reaper | no inode (or a number never given out) | remove it |
//! | its inode is a directory or a symlink | not a file | remove it |
//! | its stripe is not in the file's layout, or not on this server (chains as the service map makes them: a lost server's stand-in in its place) | outside the layout | remove it |
//! | it is longer than the file's size gives its stripe | past the size | cut it to that length |
//!
//! Objects that may legitimately disagree for a while are counted as waiting, not found:
//! those of orphans (the reaper removes them), of files with a truncation cut still pending
//! (the reaper makes it), of files open for writing (a writer commits its size later), and
//! any written in the last `grace_ms` (a create answered ahead reaches the meta server
//! after its first bytes may have reached an I/O server).
//!
//! A server lost for good (replaced in its chains, `ServiceMap::replacements`) and still
//! out is not checked and not counted as unreachable: its stripes are kept elsewhere.
//!
//! Not checked: an object *missing* for a file (a hole reads as zeros, so a file whose
//! stripe never got a byte has none: without a record of which stripes were written, a lost
//! object cannot be told from a hole), and the namespace's own links (the meta server's
//! transactions keep names, link counts and counters together).

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;

use freeflow_client::{
    Client, FileKind, InodeFacts, InodeId, ListedObject, ObjectId, ServerId, INSPECT_INODES_MAX,
};
use freeflow_proto::meta::ServiceMap;
use indicatif::{ProgressBar, ProgressStyle};

use crate::cluster_file;
use crate::failure::FsckFound;

/// Objects asked for in one `ListObjects`.
pub const PAGE_OBJECTS: u32 = 1024;
/// Shard directories of an I/O server (`ioserver::store::SHARD_COUNT`).
const SHARDS: u32 = 256;
/// Most findings printed one by one; past it only counted.
const FINDINGS_PRINTED_MAX: u64 = 1000;

const _: () = assert!(PAGE_OBJECTS as usize <= INSPECT_INODES_MAX);

pub struct Options {
    pub repair: bool,
    /// Objects written more recently than this are not judged (see the module doc).
    pub grace_ms: u64,
    pub quiet: bool,
}

/// What is wrong with one object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Problem {
    NoInode,
    /// No inode, and its number is past every one given out or reserved.
    NeverGiven,
    NotAFile(FileKind),
    OutsideLayout,
    PastSize {
        expected: u64,
    },
}

/// Why an object that disagrees is left alone for now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Waiting {
    Orphan,
    PendingCut,
    OpenForWriting,
    Young,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Fine,
    Waiting(Waiting),
    Problem(Problem),
}

/// Judge one object of `server` against its inode's `facts`.
/// Chains are as `map` makes them: a lost server's stand-in keeps its stripes, and the
/// lost server's old copies are outside.
pub fn classify(
    map: &ServiceMap,
    server: ServerId,
    listed: &ListedObject,
    facts: &InodeFacts,
    grace_ms: u64,
) -> Verdict {
    let stripe = listed.object.stripe_index;
    let problem = match (facts.kind, &facts.layout) {
        (None, _) if facts.orphan.is_some() => return Verdict::Waiting(Waiting::Orphan),
        (None, _) if facts.not_yet_allocated => Problem::NeverGiven,
        (None, _) => Problem::NoInode,
        (Some(FileKind::Regular), Some(layout)) => {
            if !map.keeps(listed.object, layout, server) {
                Problem::OutsideLayout
            } else {
                let expected = layout.object_length(facts.size_bytes, stripe);
                if listed.length <= expected {
                    return Verdict::Fine;
                }
                if facts.pending_cuts.iter().any(|(cut, _)| *cut == stripe) {
                    return Verdict::Waiting(Waiting::PendingCut);
                }
                if facts.open_for_writing {
                    return Verdict::Waiting(Waiting::OpenForWriting);
                }
                Problem::PastSize { expected }
            }
        }
        (Some(FileKind::Regular), None) => Problem::OutsideLayout,
        (Some(kind), _) => Problem::NotAFile(kind),
    };
    if listed.age_ms < grace_ms {
        return Verdict::Waiting(Waiting::Young);
    }
    Verdict::Problem(problem)
}

fn describe(problem: Problem) -> String {
    match problem {
        Problem::NoInode => "no inode and no orphan record".to_string(),
        Problem::NeverGiven => "a number the meta server never gave out".to_string(),
        Problem::NotAFile(kind) => format!("its inode is a {kind:?}, not a regular file"),
        Problem::OutsideLayout => "outside its file's layout (stripe or server)".to_string(),
        Problem::PastSize { expected } => {
            format!("longer than the file's size gives this stripe ({expected} bytes)")
        }
    }
}

fn object_name(object: ObjectId) -> String {
    format!("{:016x}.{}", object.inode, object.stripe_index)
}

#[derive(Default)]
struct Tally {
    objects: u64,
    bytes: u64,
    problems: u64,
    repaired: u64,
    repair_failed: u64,
    waiting: BTreeMap<Waiting, u64>,
    unreachable: Vec<ServerId>,
}

pub async fn run(cluster: Option<PathBuf>, options: Options) -> anyhow::Result<()> {
    cluster_file::with_client(cluster, async |client| check(client, &options).await).await
}

async fn check(client: &Client, options: &Options) -> anyhow::Result<()> {
    let servers = client.servers().await?;
    let bar = if options.quiet || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new(servers.len() as u64 * u64::from(SHARDS));
        bar.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} shard directories {msg}")
                .expect("static template"),
        );
        bar
    };
    let mut tally = Tally::default();
    let map = client.service_map().await?;
    let mut lost = Vec::new();
    for server in &servers {
        if !server.up && map.replaced_while_out(server.server_id) {
            lost.push(server.server_id);
            bar.inc(u64::from(SHARDS));
            continue;
        }
        if !server.up {
            tally.unreachable.push(server.server_id);
            bar.inc(u64::from(SHARDS));
            continue;
        }
        if let Err(error) =
            check_server(client, &map, server.server_id, options, &mut tally, &bar).await
        {
            bar.suspend(|| eprintln!("server {}: {error}", server.server_id));
            tally.unreachable.push(server.server_id);
        }
    }
    bar.finish_and_clear();
    let waiting: Vec<String> = tally
        .waiting
        .iter()
        .map(|(why, count)| {
            let why = match why {
                Waiting::Orphan => "of unlinked files the reaper has yet to remove",
                Waiting::PendingCut => "of files with a truncation cut pending",
                Waiting::OpenForWriting => "of files open for writing",
                Waiting::Young => "written in the last grace period",
            };
            format!("{count} {why}")
        })
        .collect();
    println!(
        "fsck: {} objects ({}) on {} of {} I/O servers checked{}; {} problems, {} repaired{}",
        tally.objects,
        super::status::human_bytes(tally.bytes),
        servers.len() - tally.unreachable.len() - lost.len(),
        servers.len(),
        if lost.is_empty() {
            String::new()
        } else {
            format!(" (servers {lost:?} lost for good, their stripes kept by others)")
        },
        tally.problems,
        tally.repaired,
        if waiting.is_empty() {
            String::new()
        } else {
            format!("; left for now: {}", waiting.join(", "))
        }
    );
    let left = tally.problems - tally.repaired;
    if left > 0 || !tally.unreachable.is_empty() {
        let mut why = Vec::new();
        if left > 0 {
            why.push(if options.repair {
                format!("{left} problems could not be repaired")
            } else {
                format!("{left} problems found (run with --repair to fix them)")
            });
        }
        if !tally.unreachable.is_empty() {
            why.push(format!(
                "I/O servers {:?} could not be checked",
                tally.unreachable
            ));
        }
        return Err(FsckFound(why.join("; ")).into());
    }
    Ok(())
}

async fn check_server(
    client: &Client,
    map: &ServiceMap,
    server: ServerId,
    options: &Options,
    tally: &mut Tally,
    bar: &ProgressBar,
) -> anyhow::Result<()> {
    for shard in 0..SHARDS {
        let mut after = None;
        loop {
            let listing = client
                .list_objects(server, shard, after, PAGE_OBJECTS)
                .await?;
            let mut inodes: Vec<InodeId> = listing
                .objects
                .iter()
                .map(|listed| listed.object.inode)
                .collect();
            inodes.dedup();
            let facts: BTreeMap<InodeId, InodeFacts> = client
                .inspect_inodes(&inodes)
                .await?
                .into_iter()
                .map(|facts| (facts.inode, facts))
                .collect();
            for listed in &listing.objects {
                tally.objects += 1;
                tally.bytes += listed.length;
                let Some(facts) = facts.get(&listed.object.inode) else {
                    anyhow::bail!("the meta server left inode {} out", listed.object.inode);
                };
                match classify(map, server, listed, facts, options.grace_ms) {
                    Verdict::Fine => {}
                    Verdict::Waiting(why) => *tally.waiting.entry(why).or_default() += 1,
                    Verdict::Problem(problem) => {
                        tally.problems += 1;
                        let outcome = if options.repair {
                            match repair(client, server, listed, problem, options.grace_ms).await {
                                Ok(done) => {
                                    tally.repaired += 1;
                                    done
                                }
                                Err(error) => {
                                    tally.repair_failed += 1;
                                    format!("repair failed: {error}")
                                }
                            }
                        } else {
                            "left as is".to_string()
                        };
                        if tally.problems <= FINDINGS_PRINTED_MAX {
                            bar.suspend(|| {
                                println!(
                                    "server {server}: object {} ({} bytes): {}: {outcome}",
                                    object_name(listed.object),
                                    listed.length,
                                    describe(problem)
                                )
                            });
                        }
                    }
                }
            }
            match listing.objects.last() {
                Some(last) if listing.more => after = Some(last.object),
                _ => break,
            }
        }
        bar.inc(1);
    }
    Ok(())
}

async fn repair(
    client: &Client,
    server: ServerId,
    listed: &ListedObject,
    problem: Problem,
    grace_ms: u64,
) -> anyhow::Result<String> {
    // The page's facts may be old by now (repairs before this one took time): a writer may
    // have opened or grown the file since. Asked again right before the repair.
    let object = listed.object;
    let fresh = client.inspect_inodes(&[object.inode]).await?;
    let Some(facts) = fresh.first() else {
        anyhow::bail!("the meta server left inode {} out", object.inode);
    };
    // And the map: a server may have been replaced since the listing.
    let map = client.service_map().await?;
    let problem = match classify(&map, server, listed, facts, grace_ms) {
        Verdict::Problem(now) if now == problem => problem,
        _ => return Ok("changed meanwhile, left as is".to_string()),
    };
    match problem {
        Problem::PastSize { expected } => {
            client.cut_object(server, object, expected).await?;
            Ok(format!("cut to {expected} bytes"))
        }
        // No file of that inode: the server may refuse writes to it from now on.
        Problem::NoInode | Problem::NeverGiven | Problem::NotAFile(_) => {
            client
                .remove_objects(server, object.inode, vec![object.stripe_index])
                .await?;
            Ok("removed".to_string())
        }
        // The file lives: its other objects here must stay writable.
        Problem::OutsideLayout => {
            client.remove_object(server, object).await?;
            Ok("removed".to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use freeflow_client::Layout;

    fn listed(stripe: u32, length: u64, age_ms: u64) -> ListedObject {
        ListedObject {
            object: ObjectId {
                inode: 9,
                stripe_index: stripe,
            },
            length,
            age_ms,
        }
    }

    fn file(size_bytes: u64) -> InodeFacts {
        InodeFacts {
            inode: 9,
            kind: Some(FileKind::Regular),
            size_bytes,
            layout: Some(Layout::new(4096, vec![1, 2]).unwrap()),
            orphan: None,
            pending_cuts: Vec::new(),
            open_for_writing: false,
            not_yet_allocated: false,
        }
    }

    #[test]
    fn each_kind_of_disagreement_is_told_apart() {
        let map = ServiceMap::default();
        let old = 3_600_000;
        // 3 units of 4 KiB: stripe 0 holds units 0 and 2, stripe 1 holds unit 1.
        let size = 3 * 4096;
        assert_eq!(
            classify(&map, 1, &listed(0, 8192, old), &file(size), 60_000),
            Verdict::Fine
        );
        assert_eq!(
            classify(&map, 1, &listed(0, 8193, old), &file(size), 60_000),
            Verdict::Problem(Problem::PastSize { expected: 8192 })
        );
        assert_eq!(
            classify(&map, 2, &listed(0, 10, old), &file(size), 60_000),
            Verdict::Problem(Problem::OutsideLayout),
            "stripe 0 belongs on server 1"
        );
        assert_eq!(
            classify(&map, 1, &listed(5, 10, old), &file(size), 60_000),
            Verdict::Problem(Problem::OutsideLayout),
            "no stripe 5"
        );
        let mut cut = file(size);
        cut.pending_cuts = vec![(0, 100)];
        assert_eq!(
            classify(&map, 1, &listed(0, 9000, old), &cut, 60_000),
            Verdict::Waiting(Waiting::PendingCut)
        );
        let mut open = file(size);
        open.open_for_writing = true;
        assert_eq!(
            classify(&map, 1, &listed(0, 9000, old), &open, 60_000),
            Verdict::Waiting(Waiting::OpenForWriting)
        );
        let mut gone = file(0);
        gone.kind = None;
        gone.layout = None;
        assert_eq!(
            classify(&map, 1, &listed(0, 10, old), &gone, 60_000),
            Verdict::Problem(Problem::NoInode)
        );
        assert_eq!(
            classify(&map, 1, &listed(0, 10, 5), &gone, 60_000),
            Verdict::Waiting(Waiting::Young),
            "a create answered ahead may still be on its way"
        );
        gone.not_yet_allocated = true;
        assert_eq!(
            classify(&map, 1, &listed(0, 10, old), &gone, 60_000),
            Verdict::Problem(Problem::NeverGiven)
        );
        gone.orphan = Some(Layout::new(4096, vec![1, 2]).unwrap());
        assert_eq!(
            classify(&map, 1, &listed(0, 10, old), &gone, 60_000),
            Verdict::Waiting(Waiting::Orphan)
        );
        let mut directory = file(0);
        directory.kind = Some(FileKind::Directory);
        directory.layout = None;
        assert_eq!(
            classify(&map, 1, &listed(0, 10, old), &directory, 60_000),
            Verdict::Problem(Problem::NotAFile(FileKind::Directory))
        );
    }
}
