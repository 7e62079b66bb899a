//! Whom a token-less connection is counted with: its pod, as the kernel says, never as the
//! tenant says.
//!
//! The arbiter knows a peer by `SO_PEERCRED` (pid, uid) and reads the pid's cgroup from
//! `/proc/<pid>/cgroup` (the host's `/proc`: the DaemonSet shares the host's pid namespace, so
//! the pid is the host's and the paths are the host's). Nothing the tenant sends is used.
//!
//! **Granularity: the pod.** Under `kubepods` the group is the pod-level ancestor
//! (`/kubepods/burstable/pod<uid>` with the cgroupfs driver,
//! `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice` with systemd's),
//! not the container's own cgroup: a pod's containers share the pod's budget, and a container
//! given a delegated cgroup (it can `mkdir` sub-cgroups) cannot multiply its budget by making
//! sub-cgroups, which all sit under its pod. The pod is also what Kubernetes gives resources
//! to. Outside `kubepods` (a workstation, a systemd service): a user's session and services
//! (`user-<uid>.slice`, where systemd delegates to the user) count as one group; anything else
//! by its full path (only root or a unit systemd delegated to can create cgroups there).
//!
//! **A peer whose cgroup cannot be read** ([`Group::Unknown`]): one shared bucket, not one
//! per pid and not its uid's. The arbiter runs as root in the host's pid namespace, so the
//! cgroup of a live peer is always readable; it is not only when the kernel gave no pid (a
//! peer in a pid namespace the arbiter cannot see: a misdeployed arbiter, where every tenant
//! would share the bucket; see docs/arbiter.md) or when the process exited before its
//! connection was accepted (a connect-and-exit flooder; an honest tenant waits for its answer).
//! A bucket per pid would be unbounded (pids are cheap); a uid's would be shared with every pod
//! that runs as that uid (root in most): a neighbour's. Fail closed: the shared bucket has the
//! same small budget as any pod.

use std::path::PathBuf;

/// Whom the per-container caps and budgets count a peer with.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Group {
    /// The peer's pod-level cgroup path (see the module docs).
    Cgroup(String),
    /// A peer whose cgroup could not be read (see the module docs): one shared group.
    Unknown,
}

/// The kernel's word on a process's cgroups: the text of `/proc/<pid>/cgroup`. A trait so the
/// rules are tested with a fake.
pub(crate) trait CgroupSource {
    /// The cgroup file of `pid`, or `None` when it cannot be read (the process is gone).
    fn cgroup_text(&self, pid: i32) -> Option<String>;
}

/// [`CgroupSource`] reading `<root>/<pid>/cgroup` (root: `/proc`).
#[derive(Debug, Clone)]
pub(crate) struct ProcCgroups {
    root: PathBuf,
}

impl ProcCgroups {
    /// The host's `/proc`.
    pub(crate) fn host() -> Self {
        Self {
            root: PathBuf::from("/proc"),
        }
    }

    /// Another `/proc`-like folder (tests).
    #[cfg(test)]
    pub(crate) fn at(root: &std::path::Path) -> Self {
        Self {
            root: root.to_owned(),
        }
    }
}

impl CgroupSource for ProcCgroups {
    fn cgroup_text(&self, pid: i32) -> Option<String> {
        if pid <= 0 {
            return None;
        }
        tessera_protocol::process::read_proc_file(&self.root.join(format!("{pid}/cgroup")))
            .ok()
            .filter(|t| !t.trim().is_empty())
    }
}

/// The group of peer `pid` (from `SO_PEERCRED`; `None` when the kernel gave none).
pub(crate) fn group_of(src: &impl CgroupSource, pid: Option<i32>) -> Group {
    pid.and_then(|p| src.cgroup_text(p))
        .and_then(|text| cgroup_path(&text).map(|p| pod_level(p).to_owned()))
        .map_or(Group::Unknown, Group::Cgroup)
}

/// The path that names the peer's container in a `/proc/<pid>/cgroup` text: the cgroup v2 line
/// (`0::<path>`), unless only a v1 line names a Kubernetes pod (a hybrid host whose kubelet
/// uses v1 controllers leaves every pod at the same v2 path); on a v1-only host the first line
/// naming `kubepods`, else the first line's path.
fn cgroup_path(text: &str) -> Option<&str> {
    let paths = || {
        text.lines()
            .filter_map(|l| l.splitn(3, ':').nth(2))
            .filter(|p| !p.is_empty())
    };
    let v2 = text.lines().find_map(|l| l.strip_prefix("0::"));
    let pod = paths().find(|p| is_kubepods(p));
    match (v2, pod) {
        (Some(v2), _) if is_kubepods(v2) => Some(v2),
        (_, Some(pod)) => Some(pod),
        (Some(v2), None) => Some(v2),
        (None, None) => paths().next(),
    }
}

fn is_kubepods(path: &str) -> bool {
    path.split('/').any(is_kubepods_dir)
}

fn is_kubepods_dir(c: &str) -> bool {
    c == "kubepods" || c.starts_with("kubepods.") || c.starts_with("kubepods-")
}

/// `path` cut after its pod-level component under `kubepods`, or after a `user-<uid>.slice`;
/// else `path` itself (see the module docs).
fn pod_level(path: &str) -> &str {
    let mut end = 0;
    let mut in_kubepods = false;
    for c in path.split('/') {
        // `end` is where `c` ends in `path`: components are joined by one '/'.
        end += c.len();
        if in_kubepods && is_pod_dir(c) {
            return &path[..end];
        }
        in_kubepods |= is_kubepods_dir(c);
        if !in_kubepods && is_user_slice(c) {
            return &path[..end];
        }
        end += 1;
    }
    path
}

/// `pod<uid>` (cgroupfs driver) or `kubepods-<class>-pod<uid>.slice` (systemd driver).
fn is_pod_dir(c: &str) -> bool {
    c.starts_with("pod") || (c.contains("-pod") && c.ends_with(".slice"))
}

/// `user-<uid>.slice`.
fn is_user_slice(c: &str) -> bool {
    c.strip_prefix("user-")
        .and_then(|r| r.strip_suffix(".slice"))
        .is_some_and(|uid| !uid.is_empty() && uid.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A fake `/proc`: the cgroup text of each pid.
    #[derive(Default)]
    pub(crate) struct FakeCgroups(pub(crate) HashMap<i32, String>);

    impl CgroupSource for FakeCgroups {
        fn cgroup_text(&self, pid: i32) -> Option<String> {
            self.0.get(&pid).cloned()
        }
    }

    fn g(p: &str) -> Group {
        Group::Cgroup(p.into())
    }

    #[test]
    fn containers_and_sub_cgroups_of_a_pod_share_the_pod_level_group() {
        let mut f = FakeCgroups::default();
        let cases = [
            (
                1,
                "0::/kubepods/burstable/podA/ctr1\n",
                "/kubepods/burstable/podA",
            ),
            (
                2,
                "0::/kubepods/burstable/podA/ctr2/sub/deeper\n",
                "/kubepods/burstable/podA",
            ),
            (3, "0::/kubepods/podG/ctr\n", "/kubepods/podG"),
            (
                4,
                "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podB.slice/\
                 cri-containerd-1.scope\n",
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podB.slice",
            ),
            // A kind node: the node's own cgroup first.
            (
                5,
                "0::/kubelet.slice/x/kubepods/podK/c\n",
                "/kubelet.slice/x/kubepods/podK",
            ),
            // Hybrid host, kubelet on v1: the v2 line says nothing of the pod.
            (
                6,
                "4:memory:/kubepods/burstable/podH/c\n1:cpu:/kubepods/burstable/podH/c\n0::/\n",
                "/kubepods/burstable/podH",
            ),
            (
                7,
                "0::/user.slice/user-1000.slice/user@1000.service/app.scope\n",
                "/user.slice/user-1000.slice",
            ),
            (
                8,
                "0::/system.slice/docker-abc.scope\n",
                "/system.slice/docker-abc.scope",
            ),
            // A process directly in a QoS class (no pod level): its path.
            (9, "0::/kubepods/burstable\n", "/kubepods/burstable"),
            // v1 only.
            (10, "3:cpu,cpuacct:/docker/abc\n", "/docker/abc"),
        ];
        for (pid, text, _) in &cases {
            f.0.insert(*pid, (*text).to_owned());
        }
        for (pid, _, want) in cases {
            assert_eq!(group_of(&f, Some(pid)), g(want), "pid {pid}");
        }
    }

    #[test]
    fn an_unreadable_peer_is_unknown_never_a_neighbours_group() {
        let mut f = FakeCgroups::default();
        f.0.insert(1, "0::/kubepods/podA/c\n".into());
        assert_eq!(group_of(&f, Some(2)), Group::Unknown);
        assert_eq!(group_of(&f, None), Group::Unknown);
        f.0.insert(3, "garbage without colons\n".into());
        assert_eq!(group_of(&f, Some(3)), Group::Unknown);
    }

    #[test]
    fn the_proc_source_reads_the_cgroup_file_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("42")).unwrap();
        std::fs::write(dir.path().join("42/cgroup"), "0::/kubepods/pod1/ctr\n").unwrap();
        std::fs::create_dir(dir.path().join("43")).unwrap();
        std::fs::write(dir.path().join("43/cgroup"), "\n").unwrap();
        let src = ProcCgroups::at(dir.path());
        assert_eq!(group_of(&src, Some(42)), g("/kubepods/pod1"));
        assert_eq!(group_of(&src, Some(43)), Group::Unknown);
        assert_eq!(group_of(&src, Some(44)), Group::Unknown);
        assert_eq!(group_of(&src, Some(0)), Group::Unknown);
        // Our own process on this host: some group, never unknown.
        let me = std::process::id() as i32;
        assert_ne!(group_of(&ProcCgroups::host(), Some(me)), Group::Unknown);
    }
}
