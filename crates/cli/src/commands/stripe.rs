//! `freeflow stripe get | set`: a file's layout and where its stripes live; a directory's
//! layout policy for new files.

use std::path::PathBuf;

use anyhow::Context;
use freeflow_types::FileKind;

use crate::cluster_file;
use crate::commands::status::human_bytes;
use crate::failure::ConfigError;
use crate::paths::{cluster_path, parse_size};

pub async fn get(cluster: Option<PathBuf>, path: &str) -> anyhow::Result<()> {
    cluster_file::with_client(cluster, async |client| {
        let path = cluster_path(path);
        let attr = client
            .stat(&path)
            .await
            .with_context(|| format!("cannot stat ff:{path}"))?;
        if attr.kind == FileKind::Directory {
            match &attr.layout {
                Some(layout) => println!(
                    "ff:{path}: directory; new files get stripe unit {} over {} servers, {} {}",
                    human_bytes(u64::from(layout.stripe_unit_bytes)),
                    layout.stripe_count(),
                    layout.replicas(),
                    copies(layout.replicas())
                ),
                None => {
                    println!("ff:{path}: directory; new files get the cluster's default layout")
                }
            }
        } else {
            let (attr, layout, stripes) = client
                .stripe_map(&path)
                .await
                .with_context(|| format!("cannot read the layout of ff:{path}"))?;
            println!(
                "ff:{path}: {} bytes, stripe unit {}, {} stripes, {} {} of each",
                attr.size_bytes,
                human_bytes(u64::from(layout.stripe_unit_bytes)),
                layout.stripe_count(),
                layout.replicas(),
                copies(layout.replicas())
            );
            let width = stripes
                .iter()
                .map(|(_, server, _)| server.address.len())
                .max()
                .unwrap_or(0)
                .max(22);
            println!(
                "{:<7} {:<7} {:<width$} {:<5} {:<11} {:>14}",
                "STRIPE", "SERVER", "ADDRESS", "STATE", "CHAIN", "OBJECT BYTES"
            );
            for (stripe_index, server, object_bytes) in stripes {
                println!(
                    "{:<7} {:<7} {:<width$} {:<5} {:<11} {:>14}",
                    stripe_index,
                    server.server_id,
                    server.address,
                    if server.up { "up" } else { "DOWN" },
                    crate::commands::status::member_state(server.state),
                    object_bytes
                );
            }
        }
        Ok(())
    })
    .await
}

fn copies(replicas: u32) -> &'static str {
    if replicas == 1 {
        "copy"
    } else {
        "copies"
    }
}

pub async fn set(
    cluster: Option<PathBuf>,
    path: &str,
    unit: Option<String>,
    count: Option<u32>,
    replicas: Option<u32>,
) -> anyhow::Result<()> {
    let unit = match unit {
        Some(text) => {
            let bytes = parse_size(&text).ok_or_else(|| {
                ConfigError(format!(
                    "--unit {text:?} is not a size like 65536, 64K or 1M"
                ))
            })?;
            Some(
                u32::try_from(bytes)
                    .map_err(|_| ConfigError(format!("--unit {text} is too large")))?,
            )
        }
        None => None,
    };
    if unit.is_none() && count.is_none() && replicas.is_none() {
        return Err(
            ConfigError("nothing to set: give --unit, --count and/or --replicas".into()).into(),
        );
    }
    cluster_file::with_client(cluster, async |client| {
        let path = cluster_path(path);
        let attr = client
            .set_dir_layout_path(&path, unit, count, replicas)
            .await
            .with_context(|| format!("cannot set the layout of ff:{path}"))?;
        if let Some(layout) = attr.layout {
            println!(
                "ff:{path}: new files get stripe unit {} over {} servers, {} {} of each stripe",
                human_bytes(u64::from(layout.stripe_unit_bytes)),
                layout.stripe_count(),
                layout.replicas(),
                copies(layout.replicas())
            );
        }
        Ok(())
    })
    .await
}
