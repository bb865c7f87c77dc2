//! `freeflow status`: the servers, whether each is up and in its chains, capacity and file
//! count.

use std::path::PathBuf;

use crate::cluster_file;

pub async fn run(cluster: Option<PathBuf>) -> anyhow::Result<()> {
    cluster_file::with_client(cluster, async |client| {
        let report = client.cluster_status().await?;
        // As wide as the longest address (Unix socket paths are long).
        let width = report
            .servers
            .iter()
            .map(|server| server.address.len())
            .max()
            .unwrap_or(0)
            .max(22);
        println!(
            "{:<6} {:<width$} {:<5} {:<11} {:>11} {:>11} {:>9} {:>10}",
            "SERVER", "ADDRESS", "STATE", "CHAIN", "CAPACITY", "FREE", "OBJECTS", "LAST SEEN"
        );
        let (mut capacity, mut free, mut up) = (0u64, 0u64, 0usize);
        for server in &report.servers {
            if server.up {
                up += 1;
                capacity += server.capacity_bytes;
                free += server.free_bytes;
            }
            let seen = match server.last_seen_ms {
                Some(ms) => format!("{:.1} s ago", ms as f64 / 1000.0),
                None => "never".to_string(),
            };
            println!(
                "{:<6} {:<width$} {:<5} {:<11} {:>11} {:>11} {:>9} {:>10}",
                server.server_id,
                server.address,
                if server.up { "up" } else { "DOWN" },
                member_state(server.state),
                human_bytes(server.capacity_bytes),
                human_bytes(server.free_bytes),
                server.object_count,
                seen
            );
        }
        for server in &report.servers {
            if server.state == freeflow_proto::meta::MemberState::Syncing {
                println!("{}", copy_line(server, CopyKind::Resync).await);
            }
        }
        for line in replacement_lines(&report.replacements) {
            println!("{line}");
        }
        for server in &report.servers {
            let filling = report
                .replacements
                .iter()
                .any(|replacement| replacement.filling.contains(&server.server_id));
            if filling {
                println!("{}", copy_line(server, CopyKind::Fill).await);
            }
        }
        println!(
        "{up} of {} I/O servers up; capacity {} ({} free); {} inodes, {} orphans awaiting removal",
        report.servers.len(),
        human_bytes(capacity),
        human_bytes(free),
        report.inode_count,
        report.orphan_count
    );
        if report.meta_members.is_empty() {
            println!(
                "metadata server ready in {} ms, up for {}",
                report.ready_ms,
                human_duration_ms(report.uptime_ms)
            );
        } else {
            println!(
                "metadata leader ready in {} ms, leading for {}",
                report.ready_ms,
                human_duration_ms(report.uptime_ms)
            );
            print_meta_members(&report.meta_members);
        }
        Ok(())
    })
    .await
}

/// The metadata members as the leader sees them, one line each.
pub fn print_meta_members(members: &[freeflow_proto::meta::MetaMember]) {
    println!("META ADDRESS                ROLE      TERM  BEHIND");
    for member in members {
        let role = match (member.leader, member.voter) {
            (true, _) => "leader",
            (false, true) => "follower",
            (false, false) => "learner",
        };
        println!(
            "{:<4} {:<22} {:<9} {:<5} {}",
            member.id,
            member.address,
            role,
            member.term,
            member_behind(member)
        );
    }
}

/// How far a member is behind the leader, as the leader sees it: entries and their bytes,
/// a snapshot on its way, and whether it answers at all (the last index it matched stays
/// as it was while every message to it fails, so that alone is not "in step").
fn member_behind(member: &freeflow_proto::meta::MetaMember) -> String {
    if member.leader {
        return "-".to_string();
    }
    let mut text = match (member.lag_entries, member.lag_bytes) {
        (Some(0), _) => "in step".to_string(),
        (Some(entries), Some(bytes)) => format!("{entries} entries ({})", human_bytes(bytes)),
        (Some(entries), None) => format!("{entries} entries (past the log: a snapshot)"),
        (None, _) => "not heard from".to_string(),
    };
    if let Some((sent, total)) = member.snapshot {
        text = format!(
            "snapshot [{}] {} of {}",
            progress_bar(sent, total, 20),
            human_bytes(sent),
            human_bytes(total)
        );
    }
    match (member.silent_ms, &member.last_error) {
        (_, Some(error)) => text.push_str(&format!("; failing: {error}")),
        (Some(ms), None) if ms >= MEMBER_SILENT_MS => {
            text.push_str(&format!("; silent for {}", human_duration_ms(ms)))
        }
        _ => {}
    }
    text
}

/// A member the leader has not heard from for this long is shown as silent (heartbeats go
/// every `raft_heartbeat_ms`, 100 ms by default).
const MEMBER_SILENT_MS: u64 = 2_000;

/// Which copy a server makes, as [`copy_line`] reports it.
#[derive(Clone, Copy)]
enum CopyKind {
    /// Back in its chains, it copies what changed while it was out.
    Resync,
    /// In a lost server's place, it copies that server's stripes.
    Fill,
}

/// How far a server's copy is, from its metrics endpoint, with a bar.
async fn copy_line(server: &freeflow_proto::meta::ServerRecord, copy: CopyKind) -> String {
    let (what, metric) = match copy {
        CopyKind::Resync => ("resync", "freeflow_io_resync"),
        CopyKind::Fill => ("fill (re-replication)", "freeflow_io_fill"),
    };
    let prefix = format!("server {} {what}", server.server_id);
    let Some(address) = &server.metrics_address else {
        return format!("{prefix}: progress unknown (no metrics endpoint)");
    };
    let text = match freeflow_metrics::scrape(address, std::time::Duration::from_secs(2)).await {
        Ok(text) => text,
        Err(error) => return format!("{prefix}: progress unknown ({error})"),
    };
    let snapshot = freeflow_metrics::text::Snapshot::parse(&text);
    let value = |name: &str| {
        snapshot
            .value(&format!("{metric}_{name}"), &[])
            .unwrap_or(0.0) as u64
    };
    if value("running") == 0 {
        return format!(
            "{prefix}: waiting for its order (every server in service must hold the map first)"
        );
    }
    let (done, total) = (value("objects_done"), value("objects"));
    format!(
        "{prefix}: [{}] {done}/{total} objects, {} copied",
        progress_bar(done, total, 30),
        human_bytes(value("bytes_total"))
    )
}

/// One line per I/O server lost for good or drained: when, who takes its stripes, and how
/// far the copies are.
fn replacement_lines(replacements: &[freeflow_proto::meta::Replacement]) -> Vec<String> {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64);
    replacements
        .iter()
        .map(|replacement| {
            let copying = if !replacement.filling.is_empty() {
                format!(
                    "[{}] servers {:?} still copying",
                    progress_bar(
                        (replacement.by.len() - replacement.filling.len()) as u64,
                        replacement.by.len() as u64,
                        10
                    ),
                    replacement.filling
                )
            } else if replacement.drain && !replacement.complete {
                "every stripe copied; its chains switch once every server holds the map"
                    .to_string()
            } else if replacement.drains_all() {
                "drain complete".to_string()
            } else if replacement.drain {
                "moved".to_string()
            } else {
                "every copy made again".to_string()
            };
            let what = if replacement.drains_all() {
                "drained".to_string()
            } else if replacement.drain {
                format!(
                    "rebalanced ({:.1}% of its stripes)",
                    f64::from(replacement.share_ppm) / 1e4
                )
            } else {
                "lost for good".to_string()
            };
            format!(
                "server {} {what} {} ago: its {}stripes (inodes below {}) go to servers {:?}; {copying}",
                replacement.server,
                human_duration_ms(now_ms.saturating_sub(replacement.made_ms)),
                if replacement.drain { "" } else { "replicated " },
                replacement.inodes_below,
                replacement.by
            )
        })
        .collect()
}

/// `width` characters, `#` for the part done.
fn progress_bar(done: u64, total: u64, width: usize) -> String {
    let filled = if total == 0 {
        0
    } else {
        ((done.min(total) as f64 / total as f64) * width as f64).round() as usize
    };
    format!("{}{}", "#".repeat(filled), "-".repeat(width - filled))
}

/// A server's place in the chains of replicated stripes, as `status` and `stripe get` show it.
pub fn member_state(state: freeflow_proto::meta::MemberState) -> &'static str {
    match state {
        freeflow_proto::meta::MemberState::InService => "in service",
        freeflow_proto::meta::MemberState::Out => "OUT",
        freeflow_proto::meta::MemberState::Syncing => "syncing",
        freeflow_proto::meta::MemberState::Removed => "removed",
    }
}

/// Bytes in binary units, three significant digits.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

fn human_duration_ms(ms: u64) -> String {
    let seconds = ms / 1000;
    match seconds {
        0..60 => format!("{seconds} s"),
        60..3600 => format!("{} min {} s", seconds / 60, seconds % 60),
        _ => format!("{} h {} min", seconds / 3600, (seconds % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_member_matched_long_ago_is_not_shown_in_step_while_it_fails() {
        let mut member = freeflow_proto::meta::MetaMember {
            id: 2,
            address: "h:1".into(),
            leader: false,
            term: 4,
            lag_entries: Some(0),
            lag_bytes: Some(0),
            silent_ms: Some(100),
            last_error: None,
            snapshot: None,
            voter: true,
        };
        assert_eq!(super::member_behind(&member), "in step");
        member.last_error = Some("payload of 168032118 bytes exceeds".into());
        member.silent_ms = Some(300_000);
        assert_eq!(
            super::member_behind(&member),
            "in step; failing: payload of 168032118 bytes exceeds"
        );
        member.last_error = None;
        assert!(super::member_behind(&member).starts_with("in step; silent for"));
        member.silent_ms = Some(10);
        member.lag_entries = Some(5_000);
        member.lag_bytes = Some(3 << 20);
        assert!(super::member_behind(&member).starts_with("5000 entries (3"));
        member.snapshot = Some((1 << 20, 4 << 20));
        assert!(super::member_behind(&member).starts_with("snapshot [#####---------------]"));
    }

    #[test]
    fn a_lost_server_and_its_stand_ins() {
        let mut replacement = freeflow_proto::meta::Replacement {
            server: 3,
            inodes_below: 900,
            by: vec![1, 2],
            filling: vec![2],
            made_ms: 0,
            drain: false,
            complete: false,
            share_ppm: freeflow_proto::meta::SHARE_ALL,
        };
        let line = &super::replacement_lines(std::slice::from_ref(&replacement))[0];
        assert!(line.starts_with("server 3 lost for good"), "{line}");
        assert!(
            line.ends_with("go to servers [1, 2]; [#####-----] servers [2] still copying"),
            "{line}"
        );
        replacement.filling.clear();
        let line = &super::replacement_lines(std::slice::from_ref(&replacement))[0];
        assert!(line.ends_with("every copy made again"), "{line}");
        replacement.drain = true;
        let line = &super::replacement_lines(std::slice::from_ref(&replacement))[0];
        assert!(line.starts_with("server 3 drained"), "{line}");
        assert!(line.contains("every stripe copied"), "{line}");
        replacement.complete = true;
        let line = &super::replacement_lines(&[replacement])[0];
        assert!(line.ends_with("drain complete"), "{line}");
    }

    #[test]
    fn progress_bars() {
        assert_eq!(super::progress_bar(0, 0, 4), "----");
        assert_eq!(super::progress_bar(1, 2, 4), "##--");
        assert_eq!(super::progress_bar(9, 4, 4), "####");
    }

    #[test]
    fn human_units() {
        assert_eq!(super::human_bytes(512), "512 B");
        assert_eq!(super::human_bytes(1536), "1.5 KiB");
        assert_eq!(super::human_bytes(1 << 30), "1.0 GiB");
        assert_eq!(super::human_duration_ms(61_000), "1 min 1 s");
    }
}
