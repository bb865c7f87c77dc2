//! Network namespaces on one switch, for tests that cut a server off the network: a bridge
//! in a namespace of its own; this namespace on it at `10.78.N.1`; and one namespace per
//! server at `10.78.N.(10 + i)`, each on a bridge port of its own. Cutting a server sets
//! its port down: nothing passes either way and every socket stays open, as when a cable
//! is pulled (no reset, no close). Healing sets the port up again. Needs root and `ip`;
//! everything is removed on drop, and namespaces left by a killed test process are removed
//! by the next one.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

const PREFIX: &str = "ffsw-";

/// Switches made by this process so far (names and addresses differ per switch).
static MADE: AtomicU32 = AtomicU32::new(0);

#[derive(Debug)]
pub struct NetSwitch {
    /// `10.78.N.`
    prefix: String,
    switch: String,
    hosts: Vec<String>,
    /// The switch-side end of each host's link.
    ports: Vec<String>,
}

/// `ip ARGUMENTS` (the bench's namespace helpers run it).
fn run(arguments: &[&str]) -> Result<String, String> {
    freeflow_bench::netns::run("ip", arguments)
}

/// `ip ARGUMENTS` inside `namespace`.
fn run_in(namespace: &str, arguments: &[&str]) -> Result<String, String> {
    let mut all = vec!["ip"];
    all.extend_from_slice(arguments);
    freeflow_bench::netns::run_in(namespace, &all)
}

/// Remove `ffsw-<pid>-*` namespaces whose process is gone.
fn remove_stale() {
    freeflow_bench::netns::remove_stale_named(PREFIX);
}

impl NetSwitch {
    /// Whether namespaces can be made here; says why not when they cannot.
    pub fn available() -> bool {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping: network namespaces need root");
            return false;
        }
        // Root is not enough in a container without CAP_NET_ADMIN: make one to see.
        let probe = format!("{PREFIX}{}-probe", std::process::id());
        if let Err(error) = run(&["netns", "add", &probe]) {
            eprintln!("skipping: cannot make a network namespace here ({error})");
            return false;
        }
        let _ = run(&["netns", "del", &probe]);
        true
    }

    /// A switch with `hosts` namespaces on it besides this one.
    pub fn create(hosts: usize) -> Result<NetSwitch, String> {
        remove_stale();
        let pid = std::process::id();
        let serial = MADE.fetch_add(1, Ordering::Relaxed);
        let octet = (pid.wrapping_mul(7) + serial * 13) % 250 + 1;
        let tag = format!("{}{serial}", pid % 100_000);
        let mut switch = NetSwitch {
            prefix: format!("10.78.{octet}."),
            switch: format!("{PREFIX}{pid}-{serial}-s"),
            hosts: Vec::new(),
            ports: Vec::new(),
        };
        if run(&["-o", "-4", "addr", "show"])?.contains(&switch.prefix) {
            return Err(format!("addresses {}0/24 are in use here", switch.prefix));
        }
        run(&["netns", "add", &switch.switch])?;
        run_in(&switch.switch, &["link", "add", "br0", "type", "bridge"])?;
        run_in(&switch.switch, &["link", "set", "br0", "up"])?;
        // This namespace's link.
        let (here, here_port) = (format!("fs{tag}h"), format!("fs{tag}H"));
        run(&[
            "link", "add", &here, "type", "veth", "peer", "name", &here_port,
        ])?;
        run(&["link", "set", &here_port, "netns", &switch.switch])?;
        run_in(
            &switch.switch,
            &["link", "set", &here_port, "master", "br0"],
        )?;
        run_in(&switch.switch, &["link", "set", &here_port, "up"])?;
        run(&[
            "addr",
            "add",
            &format!("{}1/24", switch.prefix),
            "dev",
            &here,
        ])?;
        run(&["link", "set", &here, "up"])?;
        for index in 0..hosts {
            let namespace = format!("{PREFIX}{pid}-{serial}-{index}");
            let (inside, port) = (format!("fs{tag}m{index}"), format!("fs{tag}p{index}"));
            run(&["netns", "add", &namespace])?;
            switch.hosts.push(namespace.clone());
            run(&[
                "link", "add", &inside, "type", "veth", "peer", "name", &port,
            ])?;
            run(&["link", "set", &inside, "netns", &namespace])?;
            run(&["link", "set", &port, "netns", &switch.switch])?;
            run_in(&switch.switch, &["link", "set", &port, "master", "br0"])?;
            run_in(&switch.switch, &["link", "set", &port, "up"])?;
            switch.ports.push(port);
            run_in(&namespace, &["link", "set", "lo", "up"])?;
            run_in(
                &namespace,
                &[
                    "addr",
                    "add",
                    &format!("{}{}/24", switch.prefix, 10 + index),
                    "dev",
                    &inside,
                ],
            )?;
            run_in(&namespace, &["link", "set", &inside, "up"])?;
        }
        Ok(switch)
    }

    /// This namespace's address on the switch (servers that stay here listen on it, so
    /// the hosts can reach them).
    pub fn here_ip(&self) -> String {
        format!("{}1", self.prefix)
    }

    /// How many hosts the switch has besides this namespace.
    pub fn hosts(&self) -> usize {
        self.hosts.len()
    }

    /// Host `index`'s address.
    pub fn ip(&self, index: usize) -> String {
        format!("{}{}", self.prefix, 10 + index)
    }

    /// `program` to be run inside host `index`'s namespace.
    pub fn command(&self, index: usize, program: &str) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.hosts[index]])
            .arg(program);
        command
    }

    /// Cut host `index` off: its port goes down.
    pub fn cut(&self, index: usize) {
        run_in(&self.switch, &["link", "set", &self.ports[index], "down"])
            .expect("set a switch port down");
    }

    /// Put host `index` back on the switch.
    pub fn heal(&self, index: usize) {
        run_in(&self.switch, &["link", "set", &self.ports[index], "up"])
            .expect("set a switch port up");
    }
}

impl Drop for NetSwitch {
    fn drop(&mut self) {
        // A namespace's deletion takes its veth ends, and with them their peers.
        for namespace in &self.hosts {
            let _ = run(&["netns", "del", namespace]);
        }
        let _ = run(&["netns", "del", &self.switch]);
    }
}
