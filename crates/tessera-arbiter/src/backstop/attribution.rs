//! Whom each GPU process belongs to (the rules of the module map, in order).

#[allow(unused_imports)]
use super::*;

/// A file by device and inode: what a bind mount of it shows too, whatever its path.
pub(crate) type FileKey = (u64, u64);

/// Where a process runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Origin {
    /// In the host's mount namespace.
    Host,
    /// In a container; `token` from its identity file, if it has a valid one.
    Container {
        /// The token its identity file names.
        token: Option<String>,
    },
}

/// What the backstop learns about processes from the system (`/proc` in production).
pub(crate) trait ProcView {
    /// The parent of `pid`.
    fn parent(&self, pid: i32) -> Option<i32>;
    /// Where `pid` runs.
    fn origin(&self, pid: i32) -> Origin;
    /// The start time of the process `pid` names now; `None` when there is none.
    fn start_time(&self, pid: i32) -> Option<u64>;
    /// The cgroup v2 path of `pid` (the `0::` line of `/proc/<pid>/cgroup`).
    fn cgroup(&self, pid: i32) -> Option<String>;
    /// The file at the identity path in `pid`'s root when it reads as an identity, read-only
    /// or not (see [`Origin`] for the token it counts only from a read-only one).
    fn identity_file(&self, _pid: i32) -> Option<FileKey> {
        None
    }
    /// True when `pid`'s mount table has a mount at the identity path: its container was
    /// given an identity, whatever covers it now (a mount a process inherits into a user
    /// namespace of its own is locked: it can cover it, not remove it).
    fn identity_mounted(&self, _pid: i32) -> bool {
        false
    }
    /// The name of `pid`'s executable (the last part of `/proc/<pid>/exe`).
    fn exe_name(&self, _pid: i32) -> Option<String> {
        None
    }
}

/// The executables of NVIDIA's MPS: the control daemon and the server it starts per GPU and
/// user. The server holds GPU memory of its own (and, before Volta, its clients') and belongs
/// to no allocation; killing it breaks every client on that GPU until MPS restarts.
pub(crate) const MPS_DAEMONS: [&str; 2] = ["nvidia-cuda-mps-server", "nvidia-cuda-mps-control"];

/// The identity files the kubelet plugins wrote, by inode, each with the allocation it was
/// written for (the file name's prefix): only one of them proves a container's identity. A
/// tenant that mounts a file of its own over the path (it may, in a user namespace of its
/// own) shows another inode, whatever the file names. `any()`: no folder to check against
/// (no plugin on this node); a read-only file naming a live allocation counts.
#[derive(Debug, Default)]
pub(crate) struct IdentityFiles {
    index: Option<HashMap<FileKey, String>>,
}

impl IdentityFiles {
    /// No folder: the file's inode is not checked.
    pub(crate) fn any() -> Self {
        Self { index: None }
    }

    /// The files of one folder: (inode, allocation id) pairs.
    pub(crate) fn from_entries(entries: impl IntoIterator<Item = (FileKey, String)>) -> Self {
        Self {
            index: Some(entries.into_iter().collect()),
        }
    }

    /// True when the file `file` proves allocation `id`.
    pub(super) fn vouches(&self, file: Option<FileKey>, id: &str) -> bool {
        match &self.index {
            None => true,
            Some(index) => file.and_then(|k| index.get(&k)).is_some_and(|a| a == id),
        }
    }
}

/// True when `id` still names a live process: the process at its pid started when it did.
pub(crate) fn is_live(id: &ProcId, view: &dyn ProcView) -> bool {
    view.start_time(id.pid) == Some(id.start)
}

/// Drops, from every allocation's connected processes, those that exited (or whose pid names
/// another process now), so the rules after attribution see only live connected processes.
pub(crate) fn forget_exited(watched: &mut [Watched], view: &dyn ProcView) {
    for w in watched {
        w.pids.retain(|p| is_live(p, view));
    }
}

/// Container cgroups learnt from identity files, each bound to the allocation whose identity
/// its first attributed process showed (see the module map, rule 2). Bounded; an entry goes
/// with its allocation.
#[derive(Debug, Default)]
pub(crate) struct Cgroups {
    by_path: HashMap<String, CgroupOwner>,
    /// Cgroups never learnt: the root, and the arbiter's own (processes a container shares
    /// with the host, e.g. without a cgroup namespace or on cgroup v1's `0::/`).
    never: HashSet<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum CgroupOwner {
    /// The allocation with this id.
    Allocation(String),
    /// Processes of two allocations were seen in it: it attributes nobody.
    Shared,
}

/// Most cgroups remembered at once (a node runs far fewer containers).
pub(crate) const CGROUPS_MAX: usize = 4096;

impl Cgroups {
    /// A book that never learns `never` (nor the root cgroup).
    pub(crate) fn new(never: impl IntoIterator<Item = String>) -> Self {
        let mut never: HashSet<String> = never.into_iter().collect();
        never.insert("/".to_owned());
        Self {
            by_path: HashMap::new(),
            never,
        }
    }

    /// A process of `cgroup` showed the identity of allocation `id`.
    pub(super) fn learn(&mut self, cgroup: Option<String>, id: &str) {
        let Some(cg) = cgroup else { return };
        if self.never.contains(&cg) {
            return;
        }
        let full = self.by_path.len() >= CGROUPS_MAX;
        match self.by_path.entry(cg) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                if !matches!(e.get(), CgroupOwner::Allocation(a) if a == id) {
                    e.insert(CgroupOwner::Shared);
                }
            }
            // Full: the identity file still attributes its processes, poll after poll.
            std::collections::hash_map::Entry::Vacant(_) if full => {}
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(CgroupOwner::Allocation(id.to_owned()));
            }
        }
    }

    /// The allocation id `cgroup` was learnt for.
    pub(super) fn owner(&self, cgroup: &str) -> Option<&str> {
        match self.by_path.get(cgroup)? {
            CgroupOwner::Allocation(id) => Some(id),
            CgroupOwner::Shared => None,
        }
    }

    /// Forgets the cgroups of allocations no longer live.
    pub(crate) fn retain(&mut self, live: &HashSet<&str>) {
        self.by_path.retain(|_, o| match o {
            CgroupOwner::Allocation(id) => live.contains(id.as_str()),
            CgroupOwner::Shared => true,
        });
    }

    /// Cgroups remembered.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_path.len()
    }

    /// True when none is remembered.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.by_path.is_empty()
    }
}

/// Whom a GPU process belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Owner {
    /// The allocation at this index of the watched list.
    Allocation(usize),
    /// Nobody, and it runs on the host.
    UnknownHost,
    /// Nobody, and it runs in a container.
    UnknownContainer,
    /// Nobody: an MPS daemon ([`MPS_DAEMONS`]) that no allocation's rule names (run by the
    /// node's MPS setup, NVIDIA's DRA driver or a user): left alone, reported once. A tenant's
    /// process of that name is its allocation's, or a forger, like any other.
    Mps,
    /// Nobody, and it runs in a container while claiming an identity it does not have: an
    /// identity file no plugin wrote, or one naming no allocation, or a plugin's mount
    /// covered by something else. Not a pod of another plugin: stopped whatever
    /// `--unknown-processes` says.
    Forged,
}

/// [`attribute_with`] where any read-only identity file naming a live allocation counts.
#[cfg(test)]
pub(crate) fn attribute(
    watched: &[Watched],
    pids: &[i32],
    view: &dyn ProcView,
    cgroups: &mut Cgroups,
) -> HashMap<i32, Owner> {
    attribute_with(watched, pids, view, cgroups, &IdentityFiles::any())
}

/// Attributes every pid in `pids` (see the module map for the order), learning container
/// cgroups into `cgroups` on the way; `files` says which identity files prove anything.
pub(crate) fn attribute_with(
    watched: &[Watched],
    pids: &[i32],
    view: &dyn ProcView,
    cgroups: &mut Cgroups,
    files: &IdentityFiles,
) -> HashMap<i32, Owner> {
    let mut by_proc: HashMap<ProcId, usize> = HashMap::new();
    for (i, w) in watched.iter().enumerate() {
        for p in &w.pids {
            // A process connected for two allocations is the first one's.
            by_proc.entry(*p).or_insert(i);
        }
    }
    let by_token: HashMap<&str, usize> = watched
        .iter()
        .enumerate()
        .map(|(i, w)| (w.token.as_str(), i))
        .collect();
    let by_id: HashMap<&str, usize> = watched
        .iter()
        .enumerate()
        .map(|(i, w)| (w.id.as_str(), i))
        .collect();
    // The allocation a process's own identity proves: a read-only file, one of the plugins'
    // (by inode), naming a live allocation. Anything less is no identity at all.
    let genuine = |pid: i32, origin: &Origin| -> Option<usize> {
        let Origin::Container { token: Some(t) } = origin else {
            return None;
        };
        let &i = by_token.get(t.as_str())?;
        files
            .vouches(view.identity_file(pid), &watched[i].id)
            .then_some(i)
    };
    let mut out = HashMap::new();
    for &pid in pids {
        let origin = view.origin(pid);
        // 1. Its own identity file: nothing a connection claims overrides it.
        if let Some(i) = genuine(pid, &origin) {
            cgroups.learn(view.cgroup(pid), &watched[i].id);
            out.insert(pid, Owner::Allocation(i));
            continue;
        }
        let container = matches!(origin, Origin::Container { .. });
        // 2. Its container's cgroup (a container process only: a host process is never
        // taken for a container's).
        let by_cgroup = container
            .then(|| view.cgroup(pid))
            .flatten()
            .and_then(|cg| cgroups.owner(&cg).and_then(|id| by_id.get(id)).copied());
        // 3. The nearest ancestor in a container whose own identity is genuine (a process
        // that covered its identity in a mount namespace of its own is still its parent's).
        let by_parent = || {
            if !container {
                return None;
            }
            let (a, i) = identity_ancestor(pid, view, &genuine)?;
            cgroups.learn(view.cgroup(a), &watched[i].id);
            Some(i)
        };
        // 4. A live connected process, or a descendant of one; not for a process that shows
        // an identity that proved nothing (a token it connected with may be a neighbour's,
        // stolen: charged there, it would get the neighbour's processes killed).
        let claims = container && claims_identity(pid, &origin, view);
        let by_connection = || {
            if claims {
                return None;
            }
            connected_ancestor(pid, &by_proc, view)
        };
        let owner = match by_cgroup.or_else(by_parent).or_else(by_connection) {
            Some(i) => Owner::Allocation(i),
            None if claims => Owner::Forged,
            None if view
                .exe_name(pid)
                .is_some_and(|n| MPS_DAEMONS.contains(&n.as_str())) =>
            {
                Owner::Mps
            }
            None if !container => Owner::UnknownHost,
            None => Owner::UnknownContainer,
        };
        out.insert(pid, owner);
    }
    out
}

/// True when a container process shows an identity (a file that reads as one, read-only or
/// not) or its mount table shows the plugin's mount, whatever covers it: called only for a
/// process whose identity proved nothing.
fn claims_identity(pid: i32, origin: &Origin, view: &dyn ProcView) -> bool {
    matches!(origin, Origin::Container { token: Some(_) })
        || view.identity_file(pid).is_some()
        || view.identity_mounted(pid)
}

/// Most parents a walk up `/proc` parentage visits: a pid cycle (a reused pid read mid-change)
/// cannot loop forever.
const WALK_MAX: usize = 64;

/// The parents of `pid`, nearest first, up to [`WALK_MAX`]; ends at init (pid 1), a process
/// that is its own parent, or one whose parent cannot be read.
fn parents(pid: i32, view: &dyn ProcView) -> impl Iterator<Item = i32> + '_ {
    std::iter::successors(Some(pid), move |&p| match view.parent(p) {
        Some(pp) if pp > 1 && pp != p => Some(pp),
        _ => None,
    })
    .skip(1)
    .take(WALK_MAX)
}

/// The nearest ancestor of `pid` (itself excluded) whose identity `genuine` proves, with the
/// allocation: the walk stops at the first host process (a container's processes descend
/// from its runtime's, which are the host's).
fn identity_ancestor(
    pid: i32,
    view: &dyn ProcView,
    genuine: &dyn Fn(i32, &Origin) -> Option<usize>,
) -> Option<(i32, usize)> {
    for p in parents(pid, view) {
        let origin = view.origin(p);
        if origin == Origin::Host {
            return None;
        }
        if let Some(i) = genuine(p, &origin) {
            return Some((p, i));
        }
    }
    None
}

/// `pid` itself or its nearest ancestor connected for an allocation, each checked against the
/// live process at its pid (a connection whose process exited names nobody, and a process
/// given its pid later, or that one's children, are not its).
fn connected_ancestor(
    pid: i32,
    by_proc: &HashMap<ProcId, usize>,
    view: &dyn ProcView,
) -> Option<usize> {
    for p in std::iter::once(pid).chain(parents(pid, view).take(WALK_MAX - 1)) {
        let start = view.start_time(p)?;
        if let Some(&i) = by_proc.get(&ProcId { pid: p, start }) {
            return Some(i);
        }
    }
    None
}

/// The last attribution step, which needs the arbiter: processes under `tessera run`.
impl Backstop {
    /// The last attribution step, kept apart from [`attribute`]: a process nothing else names
    /// that runs under a live `tessera run` (its owner, pid and start time; see
    /// [`crate::owner`]), or was found under one before, is that allocation's, connected or
    /// not (a double-forked child without `LD_PRELOAD`, a `dlmopen`-first process).
    pub(super) fn attribute_owned(&self, watched: &[Watched], owners: &mut HashMap<i32, Owner>) {
        let owned = self.arb.owned();
        if owned.is_empty() {
            return;
        }
        let proc = std::path::Path::new("/proc");
        let index: HashMap<&str, usize> = watched
            .iter()
            .enumerate()
            .map(|(i, w)| (w.id.as_str(), i))
            .collect();
        let list: Vec<_> = owned.iter().map(|(_, o, ..)| *o).collect();
        let parent = |p: i32| self.procfs.parent(p);
        let start = |p: i32| crate::owner::start_time(proc, p);
        let mut members = self.arb.members();
        for (&pid, owner) in owners.iter_mut() {
            if matches!(owner, Owner::Allocation(_)) {
                continue;
            }
            let Some(start_time) = start(pid) else {
                continue;
            };
            let me = tessera_protocol::ProcessOwner { pid, start_time };
            let id = match members.of(me) {
                Some(id) => Some(id.to_owned()),
                None => crate::owner::owned_ancestor(pid, &list, &parent, &start)
                    .map(|i| owned[i].0.clone()),
            };
            if let Some(id) = id
                && let Some(&i) = index.get(id.as_str())
            {
                *owner = Owner::Allocation(i);
                members.note(&id, me);
            }
        }
    }
}
