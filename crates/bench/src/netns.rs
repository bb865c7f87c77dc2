//! Network namespaces with rate-capped links, so striping over several I/O servers can be
//! measured on one machine: each I/O server runs in a namespace of its own, joined to this
//! namespace by a veth pair whose two ends are shaped with `tbf` (this kernel has no netem).
//! Addresses are 10.77.x.1 (this side) and 10.77.x.2 (inside), only on links made here, so
//! no traffic leaves the machine. Everything is removed on drop; namespaces left by a bench
//! that was killed (named after its process id) are removed by the next one.

use std::process::Command;

/// Prefix of every namespace made here: `ffbench-<pid>-<index>`.
const NAMESPACE_PREFIX: &str = "ffbench-";

/// One capped link to a namespace.
#[derive(Debug, Clone)]
pub struct Link {
    pub namespace: String,
    pub host_interface: String,
    /// This namespace's end of the link.
    pub host_ip: String,
    /// The address inside the namespace.
    pub inner_ip: String,
}

/// Namespaces made for one run; removed on drop.
#[derive(Debug)]
pub struct NetLab {
    pub links: Vec<Link>,
}

/// Run `ip` (or `tc`) with `arguments`; Err names the command and its stderr.
pub fn run(program: &str, arguments: &[&str]) -> Result<String, String> {
    let output = Command::new(program)
        .args(arguments)
        .output()
        .map_err(|error| format!("{program} {}: {error}", arguments.join(" ")))?;
    if !output.status.success() {
        return Err(format!(
            "{program} {}: {}",
            arguments.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Run a command inside namespace `namespace`.
pub fn run_in(namespace: &str, arguments: &[&str]) -> Result<String, String> {
    let mut all = vec!["netns", "exec", namespace];
    all.extend_from_slice(arguments);
    run("ip", &all)
}

/// Remove namespaces named `ffbench-<pid>-*` whose process is gone.
fn remove_stale() {
    remove_stale_named(NAMESPACE_PREFIX);
}

/// Remove namespaces named `<prefix><pid>-*` whose process is gone (left by a run killed
/// before it could clean up).
pub fn remove_stale_named(prefix: &str) {
    let Ok(listing) = run("ip", &["netns", "list"]) else {
        return;
    };
    for line in listing.lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or("");
        if !pid.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = run("ip", &["netns", "del", name]);
        }
    }
}

impl NetLab {
    /// Make `count` namespaces, each linked to this one at `rate_mbit` in both directions.
    /// Err says why (not root, `ip` missing, an address range in use) so the scenario can
    /// be skipped with that reason.
    pub fn create(count: u32, rate_mbit: u32) -> Result<NetLab, String> {
        if !crate::system::is_root() {
            return Err("not running as root, so network namespaces cannot be made".into());
        }
        remove_stale();
        let pid = std::process::id();
        // A third octet range per process, so two benches at once do not collide.
        let base = (pid % 60) * 4;
        let existing = run("ip", &["-o", "-4", "addr", "show"])?;
        let mut lab = NetLab { links: Vec::new() };
        for index in 0..count {
            let octet = base + index;
            let prefix = format!("10.77.{octet}.");
            if existing.contains(&prefix) {
                return Err(format!("addresses {prefix}0/24 are in use here already"));
            }
            let link = Link {
                namespace: format!("{NAMESPACE_PREFIX}{pid}-{index}"),
                host_interface: format!("ffb{}h{index}", pid % 100_000),
                host_ip: format!("{prefix}1"),
                inner_ip: format!("{prefix}2"),
            };
            let inner_interface = format!("ffb{}n{index}", pid % 100_000);
            // Pushed first so drop removes a half-made namespace too.
            lab.links.push(link.clone());
            let rate = format!("{rate_mbit}mbit");
            run("ip", &["netns", "add", &link.namespace])?;
            run(
                "ip",
                &[
                    "link",
                    "add",
                    &link.host_interface,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &inner_interface,
                ],
            )?;
            run(
                "ip",
                &["link", "set", &inner_interface, "netns", &link.namespace],
            )?;
            run(
                "ip",
                &[
                    "addr",
                    "add",
                    &format!("{}/24", link.host_ip),
                    "dev",
                    &link.host_interface,
                ],
            )?;
            run("ip", &["link", "set", &link.host_interface, "up"])?;
            let ns = link.namespace.as_str();
            run_in(ns, &["ip", "link", "set", "lo", "up"])?;
            run_in(
                ns,
                &[
                    "ip",
                    "addr",
                    "add",
                    &format!("{}/24", link.inner_ip),
                    "dev",
                    &inner_interface,
                ],
            )?;
            run_in(ns, &["ip", "link", "set", &inner_interface, "up"])?;
            // Both directions capped: client-to-server on this side, server-to-client inside.
            let tbf = ["rate", rate.as_str(), "burst", "256kb", "latency", "100ms"];
            let mut host_tbf = vec![
                "qdisc",
                "add",
                "dev",
                link.host_interface.as_str(),
                "root",
                "tbf",
            ];
            host_tbf.extend_from_slice(&tbf);
            run("tc", &host_tbf)?;
            let mut inner_tbf = vec!["tc", "qdisc", "add", "dev", &inner_interface, "root", "tbf"];
            inner_tbf.extend_from_slice(&tbf);
            run_in(ns, &inner_tbf)?;
        }
        // Every namespace reaches the meta server at link 0's address through its own link.
        if let Some(meta_ip) = lab.links.first().map(|link| link.host_ip.clone()) {
            for link in lab.links.iter().skip(1) {
                run_in(
                    &link.namespace,
                    &[
                        "ip",
                        "route",
                        "add",
                        &format!("{meta_ip}/32"),
                        "via",
                        &link.host_ip,
                    ],
                )?;
            }
        }
        Ok(lab)
    }

    /// The address the meta server listens on (this side of link 0).
    pub fn meta_ip(&self) -> Option<&str> {
        self.links.first().map(|link| link.host_ip.as_str())
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        for link in &self.links {
            // Deleting the namespace deletes its veth end, and with it the pair.
            let _ = run("ip", &["netns", "del", &link.namespace]);
            let _ = run("ip", &["link", "del", &link.host_interface]);
        }
    }
}
