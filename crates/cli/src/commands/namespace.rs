//! `freeflow ls | stat | mkdir | rm | mv | cat`: namespace tools over the client library.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use freeflow_client::OpenOptions;
use freeflow_types::{Attr, FileKind, TimeSpec};

use crate::cluster_file;
use crate::paths::cluster_path;

pub async fn ls(cluster: Option<PathBuf>, path: &str, long: bool) -> anyhow::Result<()> {
    cluster_file::with_client(cluster, async |client| {
        let path = cluster_path(path);
        let attr = client
            .lstat(&path)
            .await
            .with_context(|| format!("cannot list ff:{path}"))?;
        let mut out = std::io::stdout().lock();
        if attr.kind != FileKind::Directory {
            print_entry(&mut out, &path, &attr, long)?;
        } else {
            let mut after: Option<String> = None;
            loop {
                let page = client
                    .readdir(
                        attr.inode,
                        after.as_deref(),
                        freeflow_types::limits::READDIR_ENTRIES_MAX,
                        long,
                    )
                    .await
                    .with_context(|| format!("cannot list ff:{path}"))?;
                for entry in &page.entries {
                    match &entry.attr {
                        Some(entry_attr) if long => {
                            print_entry(&mut out, &entry.name, entry_attr, true)?
                        }
                        _ => writeln!(out, "{}", entry.name)?,
                    }
                }
                if page.end || page.entries.is_empty() {
                    break;
                }
                after = page.entries.last().map(|entry| entry.name.clone());
            }
        }
        Ok(())
    })
    .await
}

fn print_entry(out: &mut impl Write, name: &str, attr: &Attr, long: bool) -> std::io::Result<()> {
    if !long {
        return writeln!(out, "{name}");
    }
    writeln!(
        out,
        "{} {:>3} {:>5} {:>5} {:>14} {} {}  (inode {})",
        mode_string(attr),
        attr.link_count,
        attr.user_id,
        attr.group_id,
        attr.size_bytes,
        time_string(attr.modify_time),
        name,
        attr.inode
    )
}

pub async fn stat(cluster: Option<PathBuf>, path: &str) -> anyhow::Result<()> {
    cluster_file::with_client(cluster, async |client| {
        let path = cluster_path(path);
        let attr = client
            .lstat(&path)
            .await
            .with_context(|| format!("cannot stat ff:{path}"))?;
        println!("  File: ff:{path}");
        println!(
            "  Kind: {:?}   Inode: {}   Links: {}   Generation: {}",
            attr.kind, attr.inode, attr.link_count, attr.generation
        );
        println!("  Size: {} bytes", attr.size_bytes);
        println!(
            "  Mode: {:o} ({})   Uid: {}   Gid: {}",
            attr.mode(),
            mode_string(&attr),
            attr.user_id,
            attr.group_id
        );
        println!("Access: {}", time_string(attr.access_time));
        println!("Modify: {}", time_string(attr.modify_time));
        println!("Change: {}", time_string(attr.change_time));
        println!(" Birth: {}", time_string(attr.birth_time));
        if let Some(layout) = &attr.layout {
            println!(
                "Layout: stripe unit {} bytes over servers {:?}",
                layout.stripe_unit_bytes, layout.servers
            );
        }
        Ok(())
    })
    .await
}

pub async fn mkdir(cluster: Option<PathBuf>, path: &str, parents: bool) -> anyhow::Result<()> {
    cluster_file::with_client(cluster, async |client| {
        let path = cluster_path(path);
        let result = if parents {
            client.mkdir_all(&path).await.map(|_| ())
        } else {
            client.mkdir_path(&path, 0o755).await.map(|_| ())
        };
        result.with_context(|| format!("cannot create directory ff:{path}"))?;
        Ok(())
    })
    .await
}

pub async fn rm(cluster: Option<PathBuf>, path: &str, recursive: bool) -> anyhow::Result<()> {
    cluster_file::with_client(cluster, async |client| {
        let path = cluster_path(path);
        let result = if recursive {
            client.remove_all(&path).await
        } else {
            client.remove_path(&path).await
        };
        result.with_context(|| format!("cannot remove ff:{path}"))?;
        Ok(())
    })
    .await
}

pub async fn mv(cluster: Option<PathBuf>, source: &str, target: &str) -> anyhow::Result<()> {
    cluster_file::with_client(cluster, async |client| {
        let (source, mut target) = (cluster_path(source), cluster_path(target));
        // As mv(1): a target that is a directory receives the source under its own name.
        if let Ok(attr) = client.stat(&target).await {
            let name = source
                .trim_end_matches('/')
                .rsplit('/')
                .next()
                .unwrap_or_default();
            if attr.kind == FileKind::Directory
                && !name.is_empty()
                && source.trim_end_matches('/') != target.trim_end_matches('/')
            {
                target = format!("{}/{name}", target.trim_end_matches('/'));
            }
        }
        client
            .rename_path(&source, &target)
            .await
            .with_context(|| format!("cannot move ff:{source} to ff:{target}"))?;
        Ok(())
    })
    .await
}

pub async fn cat(cluster: Option<PathBuf>, path: &str) -> anyhow::Result<()> {
    cluster_file::with_client(cluster, async |client| {
        let path = cluster_path(path);
        let options = OpenOptions {
            read: true,
            ..OpenOptions::default()
        };
        let file = client
            .open_path(&path, &options)
            .await
            .with_context(|| format!("cannot open ff:{path}"))?;
        let chunk_bytes = 4u64 << 20;
        let mut offset = 0u64;
        let mut out = std::io::stdout().lock();
        'chunks: loop {
            // The servers' replies as they are: no copy of the chunk in one buffer first.
            let parts = file
                .read_parts_at(offset, chunk_bytes)
                .await
                .with_context(|| format!("cannot read ff:{path} at offset {offset}"))?;
            if parts.is_empty() {
                break;
            }
            for part in parts {
                offset += part.len() as u64;
                if let Err(error) = out.write_all(&part) {
                    // A closed pipe (`| head`) ends the copy quietly, as cat does.
                    if error.kind() == std::io::ErrorKind::BrokenPipe {
                        break 'chunks;
                    }
                    return Err(error.into());
                }
            }
        }
        out.flush().ok();
        file.close()
            .await
            .with_context(|| format!("cannot close ff:{path}"))?;
        Ok(())
    })
    .await
}

/// `ls -l` style mode: kind letter and rwx triplets with setuid/setgid/sticky.
pub fn mode_string(attr: &Attr) -> String {
    let kind = match attr.kind {
        FileKind::Regular => '-',
        FileKind::Directory => 'd',
        FileKind::Symlink => 'l',
        FileKind::Fifo => 'p',
        FileKind::Socket => 's',
        FileKind::CharDevice => 'c',
        FileKind::BlockDevice => 'b',
    };
    let bits = attr.permissions;
    let mut text = String::with_capacity(10);
    text.push(kind);
    for (shift, special, set_char, unset_char) in [
        (6, 0o4000, 's', 'S'),
        (3, 0o2000, 's', 'S'),
        (0, 0o1000, 't', 'T'),
    ] {
        let triplet = (bits >> shift) & 7;
        text.push(if triplet & 4 != 0 { 'r' } else { '-' });
        text.push(if triplet & 2 != 0 { 'w' } else { '-' });
        let execute = triplet & 1 != 0;
        text.push(match (bits & special != 0, execute) {
            (true, true) => set_char,
            (true, false) => unset_char,
            (false, true) => 'x',
            (false, false) => '-',
        });
    }
    text
}

/// A UTC time as `YYYY-MM-DD HH:MM:SS.nnnnnnnnn`.
pub fn time_string(time: TimeSpec) -> String {
    let days = time.seconds.div_euclid(86_400);
    let second_of_day = time.seconds.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{:09} UTC",
        second_of_day / 3600,
        (second_of_day % 3600) / 60,
        second_of_day % 60,
        time.nanoseconds
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_modes_print_like_ls() {
        assert_eq!(
            time_string(TimeSpec::new(0, 0)),
            "1970-01-01 00:00:00.000000000 UTC"
        );
        assert_eq!(
            time_string(TimeSpec::new(1_795_225_845, 5)),
            "2026-11-21 01:50:45.000000005 UTC"
        );
        assert_eq!(
            time_string(TimeSpec::new(951_782_400, 0)),
            "2000-02-29 00:00:00.000000000 UTC"
        );
        let attr = Attr {
            inode: 5,
            kind: FileKind::Directory,
            permissions: 0o1777,
            link_count: 2,
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
        };
        assert_eq!(mode_string(&attr), "drwxrwxrwt");
        let file = Attr {
            kind: FileKind::Regular,
            permissions: 0o4644,
            ..attr
        };
        assert_eq!(mode_string(&file), "-rwSr--r--");
    }
}
