//! Replicated metadata (issue 11), with real processes: three metadata servers run the
//! namespace under Raft and two I/O servers hold the data. While two clients create,
//! write, fsync and rename files, the leader is killed with SIGKILL; the other two elect a
//! new one and the clients go on without an error (a pause at most). Every operation the
//! clients were answered is there afterwards, byte for byte; the killed server comes back
//! as a follower and catches up; and all three replicas end identical (digests of their
//! replicated tables at the same applied entry).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::netswitch::NetSwitch;
use common::poll_until;
use common::replicated::{
    start_writers, stop_and_compare, writers_done_and_checked, ReplicatedCluster,
};
use freeflow_client::{Client, ROOT_INODE};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_meta_leader_under_two_writers_loses_nothing_and_replicas_agree() {
    let mut cluster = ReplicatedCluster::start(2);
    let (first, clients, writers) = start_writers(&cluster).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.kill_meta(first);
    let killed_at = Instant::now();
    let second = poll_until(20_000, || async { cluster.leader().await })
        .await
        .unwrap_or_else(|| panic!("no new leader\n{}", cluster.logs()));
    assert_ne!(second, first);
    let elected_after = killed_at.elapsed();
    writers_done_and_checked(&cluster, clients, writers).await;
    // The killed server comes back as a follower and catches up; then all three agree.
    cluster.start_meta(first);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let digests = stop_and_compare(&mut cluster).await;
    eprintln!("new leader elected {elected_after:?} after the kill; replicas {digests:?}");
}

/// A leader that stops answering (SIGSTOP) for longer than an election while two clients
/// write is replaced; when it runs again it finds a newer term, stops leading, takes back
/// what it ran ahead of a commit and follows. The clients see no error, nothing answered
/// is lost, and the three replicas end identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_paused_past_an_election_steps_down_and_replicas_agree() {
    let mut cluster = ReplicatedCluster::start(2);
    let (first, clients, writers) = start_writers(&cluster).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    cluster.signal_meta(first, "STOP");
    // The others elect a leader among themselves (the paused one cannot say it leads).
    leader_other_than(&cluster, first, "paused").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.signal_meta(first, "CONT");
    let log = answered_and_stepped_down(&cluster, first, clients, writers, "paused").await;
    for line in log.lines().filter(|line| {
        line.contains("stopped leading") || line.contains("took back") || line.contains("giving up")
    }) {
        eprintln!("paused leader: {line}");
    }
    let digests = stop_and_compare(&mut cluster).await;
    eprintln!("replicas after the pause: {digests:?}");
}

/// The writers finish without an error, everything they were answered reads back, and
/// the old leader `first` (`what`: paused, cut off) has stepped down and follows. Returns
/// its log.
async fn answered_and_stepped_down(
    cluster: &ReplicatedCluster,
    first: usize,
    clients: Vec<Arc<Client>>,
    writers: Vec<tokio::task::JoinHandle<Vec<(String, usize)>>>,
    what: &str,
) -> String {
    writers_done_and_checked(cluster, clients, writers).await;
    // The old leader follows now.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let log = std::fs::read_to_string(&cluster.metas[first].log).unwrap_or_default();
    assert!(
        log.contains("stopped leading"),
        "the {what} leader did not step down\n{}",
        cluster.logs()
    );
    log
}

/// The member other than `first` that leads, once the other two have elected one.
async fn leader_other_than(cluster: &ReplicatedCluster, first: usize, what: &str) -> usize {
    poll_until(20_000, || async {
        let options = freeflow_rpc::ConnectOptions {
            connect_timeout_ms: 300,
            ..freeflow_rpc::ConnectOptions::default()
        };
        for (index, node) in cluster.metas.iter().enumerate() {
            if index == first {
                continue;
            }
            if let Ok(connection) =
                freeflow_rpc::Connection::connect(&node.address, &cluster.key, &options).await
            {
                if connection.epoch() != 0 {
                    return Some(index);
                }
            }
        }
        None
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "no new leader while the first is {what}\n{}",
            cluster.logs()
        )
    })
}

/// A leader cut off by the network (its switch port down: no reset, sockets stay open)
/// while two clients write: the other two elect a leader, the clients' calls stalled at
/// the cut one are found out by the connections' liveness check and go to the new leader,
/// and the writers see no error. The cut-off leader gives up the lead on its own (no
/// majority heard from); back on the network, it takes back what it ran ahead and
/// follows. The I/O servers follow the new leader before it would take them for down.
/// Nothing answered is lost; the replicas end identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_cut_off_by_the_network_steps_down_and_replicas_agree() {
    if !NetSwitch::available() {
        return;
    }
    let switch = NetSwitch::create(3).expect("a switch of network namespaces");
    let mut cluster = ReplicatedCluster::start_on(2, Some(switch));
    let (first, clients, writers) = start_writers(&cluster).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let cut_at = Instant::now();
    cluster.switch.as_ref().expect("a switch").cut(first);
    let second = leader_other_than(&cluster, first, "cut off").await;
    eprintln!("new leader {second} after {:?}", cut_at.elapsed());
    // The writers go on with the new leader while the old one is away.
    tokio::time::sleep(Duration::from_secs(4)).await;
    cluster.switch.as_ref().expect("a switch").heal(first);
    answered_and_stepped_down(&cluster, first, clients, writers, "cut-off").await;
    // The I/O servers found the new leader well within its `server_down_after_ms`: a cut
    // of the metadata leader puts no I/O server out of its chains (before, their link to
    // the cut leader stayed up for 3 s and the new leader put them out).
    let logs = cluster.logs();
    assert!(
        !logs.contains("out of its chains"),
        "an I/O server was put out of its chains by the cut\n{logs}\n{}",
        cluster.io_logs()
    );
    let digests = stop_and_compare(&mut cluster).await;
    eprintln!("replicas after the cut: {digests:?}");
}

/// A follower that loses its disk (killed, its data directory removed) while two clients
/// write: started again under its id it refuses to start (it acknowledged entries and votes
/// it no longer has, and could help elect a leader without them), saying how to come back;
/// rebuilt as a new member (`join = true`, a new id) it is added as a learner, catches up
/// and takes the lost one's vote (`freeflow meta replace`). The writers see nothing, and the
/// three replicas end identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_that_lost_its_disk_comes_back_as_a_new_member() {
    let mut cluster = ReplicatedCluster::start(2);
    let (first, clients, writers) = start_writers(&cluster).await;
    // The leader marks the members that answered it as started.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let wiped = (first + 1) % 3;
    let old_id = cluster.metas[wiped].id;
    cluster.kill_meta(wiped);
    std::fs::remove_dir_all(&cluster.metas[wiped].data).expect("wipe the member's data");
    cluster.start_meta(wiped);
    let mut child = cluster.metas[wiped].child.take().expect("started");
    let refused = common::poll_sync(20_000, || matches!(child.try_wait(), Ok(Some(_))));
    assert!(
        refused,
        "the wiped member started under its old id\n{}",
        cluster.logs()
    );
    let refused = child.wait().expect("reaped");
    assert!(!refused.success());
    let log = std::fs::read_to_string(&cluster.metas[wiped].log).unwrap_or_default();
    assert!(
        log.contains(&format!("meta replace {old_id} NEW_ID")),
        "the refusal does not say how to come back:\n{log}"
    );
    // On the same host and ports, as after a disk is changed: the lost member leaves
    // first (two members may not share an address), then the new one joins and votes.
    let new = cluster.new_member_in_place(4, wiped);
    let raft_address = cluster.raft_address(new);
    let address = cluster.metas[new].address.clone();
    let said = cluster.meta(&[
        "replace",
        &old_id.to_string(),
        "4",
        "--address",
        &address,
        "--raft-address",
        &raft_address,
    ]);
    assert!(
        said.lines()
            .any(|line| line.starts_with("4 ") && line.contains("follower")),
        "member 4 does not vote: {said}"
    );
    assert!(
        !said
            .lines()
            .any(|line| line.starts_with(&format!("{old_id} "))),
        "member {old_id} is still a member: {said}"
    );
    writers_done_and_checked(&cluster, clients, writers).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let digests = stop_and_compare(&mut cluster).await;
    eprintln!("replicas after member {old_id} was replaced by member 4: {digests:?}");
}

/// Issue 42: a member rebuilt from an empty disk while the cluster made more than one
/// message may carry is sent a snapshot (a file, in chunks) and then its entries in parts
/// under the message bound (256 KiB here; each `SetXattr` of 24 KiB is an entry of its own,
/// so the 64 entries openraft sends at once would be 1.5 MiB), and ends identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_rebuilt_from_empty_gets_a_snapshot_and_its_entries_in_bounded_messages() {
    let mut cluster = ReplicatedCluster::start_configured(
        1,
        None,
        "raft_message_bytes_max = 262144\nraft_snapshot_entries = 100\nraft_log_kept_entries = 10\n",
    );
    let leader = poll_until(20_000, || async { cluster.leader().await })
        .await
        .unwrap_or_else(|| panic!("no leader\n{}", cluster.logs()));
    let client = poll_until(20_000, || async {
        Client::connect(cluster.client_config("xattrs")).await.ok()
    })
    .await
    .expect("a client connects");
    poll_until(20_000, || async {
        let servers = client.servers().await.ok()?;
        servers.iter().any(|server| server.up).then_some(())
    })
    .await
    .expect("the I/O server registered");
    let wiped = (leader + 1) % 3;
    cluster.kill_meta(wiped);
    std::fs::remove_dir_all(&cluster.metas[wiped].data).expect("wipe the member's data");
    let value = |index: usize| -> Vec<u8> {
        (0..24 << 10)
            .map(|offset: usize| (offset ^ index.wrapping_mul(131)) as u8)
            .collect()
    };
    let directory = client
        .mkdir(ROOT_INODE, "big", 0o755)
        .await
        .expect("mkdir")
        .inode;
    let mut inodes = Vec::new();
    for index in 0..300 {
        let attr = client
            .create(
                directory,
                &format!("f{index}"),
                freeflow_client::FileKind::Regular,
                0o644,
                0,
                true,
            )
            .await
            .expect("create");
        client
            .set_xattr(
                attr.inode,
                "user.big",
                &value(index),
                freeflow_client::XattrSetMode::Any,
            )
            .await
            .expect("set_xattr");
        inodes.push(attr.inode);
    }
    // Rebuilt as a new member (`join = true`), added as a learner: a snapshot first.
    let old_id = cluster.metas[wiped].id;
    let new = cluster.new_member(4, Some(wiped));
    let raft_address = cluster.raft_address(new);
    let address = cluster.metas[new].address.clone();
    cluster.meta(&[
        "add",
        "4",
        "--learner",
        "--address",
        &address,
        "--raft-address",
        &raft_address,
    ]);
    // Caught up: the leader sees it with no entry to send.
    let caught_up = poll_until(60_000, || async {
        let report = client.cluster_status().await.ok()?;
        let member = report.meta_members.iter().find(|member| member.id == 4)?;
        (member.lag_entries == Some(0)).then_some(())
    })
    .await;
    let log = std::fs::read_to_string(&cluster.metas[wiped].log).unwrap_or_default();
    assert!(
        caught_up.is_some(),
        "the rebuilt member did not catch up\n{}",
        cluster.logs()
    );
    assert!(
        log.contains("installed a snapshot from the leader"),
        "the rebuilt member was not sent a snapshot\n{log}"
    );
    for (index, inode) in inodes.iter().enumerate() {
        let read = client
            .get_xattr(*inode, "user.big")
            .await
            .expect("get_xattr");
        assert_eq!(read, value(index), "inode {inode}");
    }
    cluster.meta(&["replace", &old_id.to_string(), "4"]);
    client.shutdown().await;
    let digests = stop_and_compare(&mut cluster).await;
    eprintln!("replicas after member {old_id} was rebuilt as member 4: {digests:?}");
}
