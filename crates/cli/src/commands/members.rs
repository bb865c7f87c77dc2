//! `freeflow meta add|promote|remove|replace`: the members of a replicated metadata cluster,
//! changed by its leader (`meta/src/raft/members.rs`). A member votes only once it caught up:
//! these commands wait for that, showing how far behind it still is.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::bail;
use freeflow_client::{Client, MetaMember, MetaMemberChange};
use freeflow_proto::meta::PROMOTE_LAG_ENTRIES_MAX;

use super::status::{human_bytes, print_meta_members};
use crate::args::MetaCommand;
use crate::cluster_file;

/// How often the leader is asked how far a catching-up member is.
const POLL: Duration = Duration::from_millis(500);

pub async fn run(cluster: Option<PathBuf>, command: MetaCommand) -> anyhow::Result<()> {
    cluster_file::with_client(cluster, async |client| {
        let members = match command {
            MetaCommand::Add {
                id,
                address,
                raft_address,
                learner,
                wait,
            } => {
                let added = client
                    .change_meta_members(MetaMemberChange::AddLearner {
                        id,
                        address,
                        raft_address,
                        replaces: None,
                    })
                    .await?;
                if learner {
                    added
                } else {
                    caught_up(client, id, Duration::from_secs(wait)).await?;
                    client
                        .change_meta_members(MetaMemberChange::Promote { id })
                        .await?
                }
            }
            MetaCommand::Promote { id, wait } => {
                caught_up(client, id, Duration::from_secs(wait)).await?;
                client
                    .change_meta_members(MetaMemberChange::Promote { id })
                    .await?
            }
            MetaCommand::Remove { id } => {
                client
                    .change_meta_members(MetaMemberChange::Remove { id })
                    .await?
            }
            MetaCommand::Replace {
                old,
                new,
                address,
                raft_address,
                wait,
            } => {
                let members = client.cluster_status().await?.meta_members;
                if !members.iter().any(|member| member.id == new) {
                    let (Some(address), Some(raft_address)) = (address, raft_address) else {
                        bail!(
                            "member {new} is not in the cluster yet: give its --address and \
                             --raft-address to add it"
                        );
                    };
                    client
                        .change_meta_members(MetaMemberChange::AddLearner {
                            id: new,
                            address,
                            raft_address,
                            replaces: Some(old),
                        })
                        .await?;
                }
                caught_up(client, new, Duration::from_secs(wait)).await?;
                client
                    .change_meta_members(MetaMemberChange::Replace { old, new })
                    .await?
            }
        };
        print_meta_members(&members);
        Ok(())
    })
    .await
}

/// Wait until the leader sees member `id` close enough to vote, saying how far it is.
async fn caught_up(client: &Client, id: u64, wait: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + wait;
    let mut said = String::new();
    loop {
        let members = client.cluster_status().await?.meta_members;
        let Some(member) = members.iter().find(|member| member.id == id) else {
            bail!("member {id} is not in the cluster");
        };
        if ready(member) {
            return Ok(());
        }
        let now = progress(member);
        if now != said {
            eprintln!("member {id}: {now}");
            said = now;
        }
        if Instant::now() >= deadline {
            bail!(
                "member {id} did not catch up within {} s ({said}); it stays a learner",
                wait.as_secs()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Close enough to vote: answering, no snapshot on its way, at most
/// `PROMOTE_LAG_ENTRIES_MAX` entries behind.
fn ready(member: &MetaMember) -> bool {
    member.leader
        || (member.snapshot.is_none()
            && member.last_error.is_none()
            && member
                .lag_entries
                .is_some_and(|lag| lag <= PROMOTE_LAG_ENTRIES_MAX))
}

fn progress(member: &MetaMember) -> String {
    if let Some((sent, total)) = member.snapshot {
        return format!(
            "receiving a snapshot, {} of {}",
            human_bytes(sent),
            human_bytes(total)
        );
    }
    let mut text = match member.lag_entries {
        Some(lag) => format!("{lag} entries behind"),
        None => "not heard from yet (is it running, with join = true?)".to_string(),
    };
    if let Some(error) = &member.last_error {
        text.push_str(&format!("; failing: {error}"));
    }
    text
}
