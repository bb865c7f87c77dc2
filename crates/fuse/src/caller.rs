//! Who is asking: the uid and gid the kernel puts in each request, plus the supplementary
//! groups of the calling process read from `/proc/<pid>/status`, so the meta server's own
//! permission checks (DESIGN.md §8) agree with the kernel's `default_permissions`.
//!
//! Reading `/proc` costs a few microseconds, so the groups are cached per process for
//! [`GROUPS_CACHE_TTL_MS`], in a cache of at most [`GROUPS_CACHE_ENTRIES_MAX`] entries.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use freeflow_client::Caller;

/// How long the supplementary groups of one process are reused.
pub const GROUPS_CACHE_TTL_MS: u64 = 2_000;
/// Most processes whose groups are cached; the cache is emptied when it is full.
pub const GROUPS_CACHE_ENTRIES_MAX: usize = 4096;
/// Most supplementary groups taken from one process (Linux's NGROUPS_MAX is 65536; the
/// wire request stays small).
pub const GROUPS_PER_CALLER_MAX: usize = 256;

/// (process id, user id) → when the groups were read, and the groups.
type GroupsByProcess = HashMap<(u32, u32), (Instant, Vec<u32>)>;

pub struct GroupsCache {
    entries: Mutex<GroupsByProcess>,
}

impl GroupsCache {
    pub fn new() -> GroupsCache {
        GroupsCache {
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// The caller of a request from process `pid` as user `uid`, group `gid`.
    pub fn caller(&self, uid: u32, gid: u32, pid: u32) -> Caller {
        // Root passes every check; pid 0 means the kernel itself (no process to ask).
        if uid == 0 || pid == 0 {
            return Caller {
                user_id: uid,
                group_id: gid,
                groups: Vec::new(),
            };
        }
        let ttl = Duration::from_millis(GROUPS_CACHE_TTL_MS);
        let key = (pid, uid);
        {
            let entries = self.entries.lock().expect("groups cache not poisoned");
            if let Some((when, groups)) = entries.get(&key) {
                if when.elapsed() < ttl {
                    return Caller {
                        user_id: uid,
                        group_id: gid,
                        groups: groups.clone(),
                    };
                }
            }
        }
        let groups = read_groups(pid);
        {
            let mut entries = self.entries.lock().expect("groups cache not poisoned");
            if entries.len() >= GROUPS_CACHE_ENTRIES_MAX {
                entries.clear();
            }
            entries.insert(key, (Instant::now(), groups.clone()));
        }
        Caller {
            user_id: uid,
            group_id: gid,
            groups,
        }
    }
}

/// The `Groups:` line of `/proc/<pid>/status`; empty if the process is gone.
fn read_groups(pid: u32) -> Vec<u32> {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return Vec::new();
    };
    parse_groups(&status)
}

fn parse_groups(status: &str) -> Vec<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("Groups:"))
        .map(|groups| {
            groups
                .split_whitespace()
                .filter_map(|group| group.parse().ok())
                .take(GROUPS_PER_CALLER_MAX)
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_line_is_parsed() {
        let status = "Name:\tbash\nUid:\t1000\t1000\t1000\t1000\nGroups:\t4 24 1000 \nVmPeak:\t1\n";
        assert_eq!(parse_groups(status), vec![4, 24, 1000]);
        assert_eq!(parse_groups("Name:\tx\n"), Vec::<u32>::new());
        assert_eq!(parse_groups("Groups:\n"), Vec::<u32>::new());
    }

    #[test]
    fn own_process_groups_are_read() {
        let cache = GroupsCache::new();
        let caller = cache.caller(1234, 1234, std::process::id());
        assert_eq!(caller.user_id, 1234);
        // This test process's status has a Groups line (maybe empty); reading it must not
        // fail, and root short-cuts to no groups.
        assert!(cache.caller(0, 0, std::process::id()).groups.is_empty());
    }
}

/// Whether thread `tid` (a request's caller) has a signal to take that makes the kernel
/// end its system call: a signal pending for the thread itself and not blocked (a fatal
/// signal to its process puts SIGKILL there for every thread), or, in a process of one
/// thread, one pending for the process and not blocked. A signal another thread of the
/// process may take does not count: answering EINTR to a thread that has no signal to
/// take would give the program the kernel's restart code (512) instead of an error.
/// False when `/proc` does not say (pid 0, a caller in another pid namespace).
pub fn signal_waits(tid: u32) -> bool {
    if tid == 0 {
        return false;
    }
    std::fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()
        .is_some_and(|status| signal_waits_in(&status))
}

/// [`signal_waits`] from the text of `/proc/<tid>/status`.
fn signal_waits_in(status: &str) -> bool {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    let mask = |name: &str| field(name).and_then(|hex| u64::from_str_radix(hex, 16).ok());
    let (Some(own), Some(shared), Some(blocked)) = (mask("SigPnd"), mask("ShdPnd"), mask("SigBlk"))
    else {
        return false;
    };
    let alone = field("Threads") == Some("1");
    own & !blocked != 0 || (alone && shared & !blocked != 0)
}

#[cfg(test)]
mod signal_tests {
    use super::*;

    fn status(threads: u32, own: u64, shared: u64, blocked: u64) -> String {
        format!(
            "Name:\tflock\nThreads:\t{threads}\nSigQ:\t1/95000\nSigPnd:\t{own:016x}\n\
             ShdPnd:\t{shared:016x}\nSigBlk:\t{blocked:016x}\nSigIgn:\t0000000000000000\n"
        )
    }

    const TERM: u64 = 1 << (libc::SIGTERM - 1);
    const KILL: u64 = 1 << (libc::SIGKILL - 1);

    #[test]
    fn only_a_signal_this_thread_will_take_counts() {
        assert!(!signal_waits_in(&status(1, 0, 0, 0)), "nothing pending");
        assert!(
            signal_waits_in(&status(1, 0, TERM, 0)),
            "a process of one thread"
        );
        assert!(!signal_waits_in(&status(1, 0, TERM, TERM)), "blocked");
        assert!(
            !signal_waits_in(&status(4, 0, TERM, 0)),
            "another thread may take it"
        );
        assert!(
            signal_waits_in(&status(4, KILL, TERM, 0)),
            "fatal: every thread's"
        );
        assert!(
            signal_waits_in(&status(4, TERM, 0, 0)),
            "sent to this thread"
        );
        assert!(!signal_waits_in("Name:\tx\n"), "no masks: nothing known");
        assert!(!signal_waits(0), "the kernel's own requests");
    }

    #[test]
    fn this_processs_own_status_parses() {
        let own = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
        assert!(!signal_waits_in(&own), "no signal waits for the test");
    }
}
