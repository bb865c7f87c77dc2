//! `freeflow init`: the cluster key and a config file per server for a deployment on many
//! hosts. Nothing is started; the operator copies each file to its host.

use std::path::Path;

use anyhow::Context;
use freeflow_ioserver::IoConfig;
use freeflow_meta::{MetaConfig, MetaPeer};
use freeflow_rpc::ClusterKey;

use crate::cluster_file::{self, ClientFile, IoFile, MetaFile};

pub const META_PORT: u16 = 7700;
pub const IO_PORT_BASE: u16 = 7710;
/// First Raft port of the members of a replicated metadata cluster.
pub const RAFT_PORT: u16 = 7774;

pub fn run(
    out: &Path,
    meta_hosts: &[String],
    io_hosts: &[String],
    key_path: &Path,
    data_root: &Path,
    replicas: u32,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        replicas as usize <= io_hosts.len(),
        "--replicas {replicas} needs at least {replicas} I/O servers (--io-hosts names {}): each copy of a stripe is on another server",
        io_hosts.len()
    );
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let key_file = out.join("cluster.key");
    ClusterKey::generate()
        .context("no randomness for a cluster key")?
        .write_new(&key_file)
        .with_context(|| {
            format!(
                "cannot write a new cluster key at {} (is there one already?)",
                key_file.display()
            )
        })?;
    anyhow::ensure!(
        matches!(meta_hosts.len(), 1 | 3 | 5),
        "--meta-host names {} hosts: give one, or three or five for a replicated metadata cluster",
        meta_hosts.len()
    );
    let mut meta_files = Vec::new();
    let meta_address = if meta_hosts.len() == 1 {
        let meta = MetaConfig {
            listen_address: format!("0.0.0.0:{META_PORT}"),
            data_dir: data_root.join("meta"),
            replicas,
            ..MetaConfig::default()
        };
        cluster_file::write(
            &out.join("meta.toml"),
            &MetaFile {
                key_file: key_path.to_owned(),
                meta,
            },
            false,
        )?;
        meta_files.push(("meta.toml".to_string(), meta_hosts[0].clone()));
        format!("{}:{META_PORT}", meta_hosts[0])
    } else {
        // Members sharing a host get consecutive ports (clients from META_PORT, Raft from
        // RAFT_PORT).
        let mut on_host = std::collections::HashMap::<&str, u16>::new();
        let peers: Vec<MetaPeer> = meta_hosts
            .iter()
            .enumerate()
            .map(|(index, host)| {
                let k = on_host.entry(host.as_str()).or_insert(0);
                let peer = MetaPeer {
                    id: index as u64 + 1,
                    address: format!("{host}:{}", META_PORT + *k),
                    raft_address: format!("{host}:{}", RAFT_PORT + *k),
                };
                *k += 1;
                peer
            })
            .collect();
        for peer in &peers {
            let port = peer.address.rsplit_once(':').map_or("", |(_, port)| port);
            let meta = MetaConfig {
                listen_address: format!("0.0.0.0:{port}"),
                data_dir: data_root.join(format!("meta-{}", peer.id)),
                replicas,
                node_id: peer.id,
                peers: peers.clone(),
                ..MetaConfig::default()
            };
            let name = format!("meta-{}.toml", peer.id);
            cluster_file::write(
                &out.join(&name),
                &MetaFile {
                    key_file: key_path.to_owned(),
                    meta,
                },
                false,
            )?;
            let host = peer.address.rsplit_once(':').map_or("", |(host, _)| host);
            meta_files.push((name, host.to_string()));
        }
        peers
            .iter()
            .map(|peer| peer.address.clone())
            .collect::<Vec<_>>()
            .join(",")
    };
    // Servers sharing a host get consecutive ports.
    let mut next_port_on_host = std::collections::HashMap::<&str, u16>::new();
    for (server_id, host) in io_hosts.iter().enumerate() {
        let port = next_port_on_host
            .entry(host.as_str())
            .or_insert(IO_PORT_BASE);
        let io = IoConfig {
            server_id: server_id as u32,
            listen_address: format!("0.0.0.0:{port}"),
            advertise_address: Some(format!("{host}:{port}")),
            data_dir: data_root.join(format!("io-{server_id}")),
            meta_address: meta_address.clone(),
            ..IoConfig::default()
        };
        *port += 1;
        let path = out.join(format!("io-{server_id}.toml"));
        cluster_file::write(
            &path,
            &IoFile {
                key_file: key_path.to_owned(),
                io,
            },
            false,
        )?;
    }
    let client = ClientFile {
        meta_address,
        key_file: key_path.to_owned(),
        call_timeout_ms: 30_000,
    };
    cluster_file::write(&out.join("client.toml"), &client, false)?;
    println!("Wrote {}:", out.display());
    println!(
        "  cluster.key   copy to {} on every host (mode 600, owner only)",
        key_path.display()
    );
    for (name, host) in &meta_files {
        println!("  {name:<13} on {host}: freeflow meta --config {name}");
    }
    for (server_id, host) in io_hosts.iter().enumerate() {
        println!("  io-{server_id}.toml   on {host}: freeflow io --config io-{server_id}.toml");
    }
    println!("  client.toml   on every client: freeflow --cluster client.toml status");
    Ok(())
}
