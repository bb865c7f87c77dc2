//! `striping`: does striping a file over more I/O servers multiply one client's throughput
//! when each server sits behind a link of its own (seed 004's tables)? Each I/O server runs
//! in a network namespace whose link is capped with tbf; one cluster holds the largest
//! server count, and a directory per subject sets the stripe count new files get (1, 2,
//! 4 servers). One client in this process writes (then fsyncs) and, after the page cache is
//! dropped, reads back a file per run. The ratio to the first subject (1 server) is the
//! scaling. Skipped, with the reason, when namespaces cannot be made (not root, no `ip`).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use freeflow_client::{Client, OpenAccess};

use super::{parameter, parameter_list, Env, Scenario, Subject};
use crate::cluster::{Cluster, Placement};
use crate::error::{SetupError, StepContext, StepError};
use crate::json::Value;
use crate::model::{Better, Measurement, MetricSpec, Target};
use crate::netns::NetLab;
use crate::sizes::Sizes;
use crate::system::{fresh_name, megabytes_per_second, Xorshift};

/// Bytes per write call and per read call of the client.
const WRITE_BYTES: usize = 1 << 20;
const READ_BYTES: u64 = 16 << 20;

pub struct Striping {
    server_counts: Vec<u32>,
    file_bytes: u64,
    rate_mbit: u32,
}

impl Striping {
    pub fn new(sizes: &Sizes) -> Striping {
        let mut server_counts = sizes.striping_servers.clone();
        server_counts.sort_unstable();
        server_counts.dedup();
        Striping {
            server_counts,
            file_bytes: sizes.striping_file_bytes,
            rate_mbit: sizes.striping_rate_mbit,
        }
    }
}

/// The cluster and its namespaces, dropped in that order (servers before their links).
struct Lab {
    cluster: Cluster,
    client: Option<Client>,
    _net: NetLab,
}

impl Drop for Lab {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            self.cluster.shutdown_client(client);
        }
    }
}

impl Scenario for Striping {
    fn name(&self) -> &'static str {
        "striping"
    }

    fn parameters(&self) -> Vec<(String, Value)> {
        vec![
            parameter_list("servers", self.server_counts.iter().map(|&n| u64::from(n))),
            parameter("file_bytes", self.file_bytes),
            parameter("link_rate_mbit", u64::from(self.rate_mbit)),
        ]
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::new("write", "MB/s", Better::Higher),
            MetricSpec::new("read", "MB/s", Better::Higher),
        ]
    }

    fn subjects(
        &mut self,
        _targets: &[Target],
        env: &Env,
    ) -> Result<Vec<Box<dyn Subject>>, SetupError> {
        let largest = self.server_counts.iter().copied().max().unwrap_or(1);
        env.step(&format!("make {largest} network namespaces"));
        let net = NetLab::create(largest, self.rate_mbit).map_err(SetupError::Skip)?;
        let placement = Placement::Namespaces {
            meta_ip: net.meta_ip().unwrap_or("127.0.0.1").to_string(),
            namespaces: net
                .links
                .iter()
                .map(|link| (link.namespace.clone(), link.inner_ip.clone()))
                .collect(),
        };
        let failed = |error| SetupError::Failed {
            subject: "cluster".into(),
            error,
        };
        env.step(&format!(
            "start a cluster with {largest} I/O servers in namespaces"
        ));
        let cluster = Cluster::start(
            env.scratch().join(fresh_name("striping")),
            largest,
            placement,
            &env.freeflow_exe,
            &env.runtime,
        )
        .map_err(failed)?;
        let client = cluster.client("striping").map_err(failed)?;
        let mut directories = Vec::new();
        for &count in &self.server_counts {
            let directory = format!("/stripe-{count}");
            env.runtime
                .block_on(async {
                    client.mkdir_path(&directory, 0o755).await?;
                    client
                        .set_dir_layout_path(&directory, None, Some(count), None)
                        .await
                })
                .step(format!("make {directory} with stripe count {count}"))
                .map_err(failed)?;
            directories.push((count, directory));
        }
        let lab = Arc::new(Lab {
            cluster,
            client: Some(client.clone()),
            _net: net,
        });
        let mut data = vec![0u8; WRITE_BYTES];
        Xorshift::new(9).fill(&mut data);
        let data = Bytes::from(data);
        Ok(directories
            .into_iter()
            .map(|(count, directory)| {
                Box::new(StripingSubject {
                    count,
                    directory,
                    lab: Arc::clone(&lab),
                    client: client.clone(),
                    file_bytes: self.file_bytes,
                    data: data.clone(),
                }) as Box<dyn Subject>
            })
            .collect())
    }

    fn notes(&self) -> Vec<String> {
        vec![format!(
            "each I/O server in its own network namespace behind a veth link capped at {} \
             mbit/s each way (tbf); one client in the root namespace",
            self.rate_mbit
        )]
    }
}

struct StripingSubject {
    count: u32,
    directory: String,
    /// Keeps the cluster and the namespaces up while any subject lives.
    lab: Arc<Lab>,
    client: Client,
    file_bytes: u64,
    data: Bytes,
}

impl StripingSubject {
    async fn write(&self, path: &str) -> Result<f64, StepError> {
        let parent = self
            .client
            .resolve(&self.directory)
            .await
            .step(format!("resolve {}", self.directory))?;
        let name = path.rsplit('/').next().unwrap_or(path);
        let access = OpenAccess {
            read: false,
            write: true,
        };
        let started = Instant::now();
        let (handle, _) = self
            .client
            .create_open(parent.inode, name, 0o644, true, access)
            .await
            .step(format!("create {path}"))?;
        let layout_count = handle.attr().layout.map_or(0, |l| l.stripe_count());
        if layout_count != self.count {
            return Err(StepError::new(
                format!("create {path}"),
                format!("striped over {layout_count} servers, wanted {}", self.count),
            ));
        }
        let mut offset = 0u64;
        while offset < self.file_bytes {
            let length = (self.file_bytes - offset).min(self.data.len() as u64) as usize;
            handle
                .write_at(offset, self.data.slice(..length))
                .await
                .step(format!("write {path} at {offset}"))?;
            offset += length as u64;
        }
        handle.fsync().await.step(format!("fsync {path}"))?;
        handle.close().await.step(format!("close {path}"))?;
        Ok(megabytes_per_second(
            self.file_bytes,
            started.elapsed().as_secs_f64(),
        ))
    }

    async fn read(&self, path: &str) -> Result<f64, StepError> {
        let access = OpenAccess {
            read: true,
            write: false,
        };
        let started = Instant::now();
        let attr = self
            .client
            .resolve(path)
            .await
            .step(format!("resolve {path}"))?;
        let handle = self
            .client
            .open(attr.inode, access)
            .await
            .step(format!("open {path}"))?;
        let mut offset = 0u64;
        while offset < self.file_bytes {
            let length = (self.file_bytes - offset).min(READ_BYTES);
            let data = handle
                .read_at(offset, length)
                .await
                .step(format!("read {path} at {offset}"))?;
            if data.len() as u64 != length {
                return Err(StepError::new(
                    format!("read {path} at {offset}"),
                    format!("{} bytes, wanted {length}", data.len()),
                ));
            }
            offset += length;
        }
        handle.close().await.step(format!("close {path}"))?;
        Ok(megabytes_per_second(
            self.file_bytes,
            started.elapsed().as_secs_f64(),
        ))
    }
}

impl Subject for StripingSubject {
    fn name(&self) -> String {
        format!(
            "{} server{}",
            self.count,
            if self.count == 1 { "" } else { "s" }
        )
    }

    fn run_once(&mut self, _repeat: u32, env: &Env) -> Result<Vec<Measurement>, StepError> {
        let _ = &self.lab;
        let path = format!("{}/{}", self.directory, fresh_name("file"));
        env.step("write");
        let write = env.runtime.block_on(self.write(&path))?;
        env.drop_caches();
        env.step("read");
        let read = env.runtime.block_on(self.read(&path));
        let removed = env
            .runtime
            .block_on(self.client.remove_path(&path))
            .step(format!("remove {path}"));
        let read = read?;
        removed?;
        Ok(vec![
            Measurement::new("write", write),
            Measurement::new("read", read),
        ])
    }
}
