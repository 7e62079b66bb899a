//! Persistence of allocations, and the random ids and tokens they carry.
//!
//! The state directory holds two files, each rewritten whole when its part changes: written to
//! a temporary file (mode 0600) and renamed over the old one, so a crash of the arbiter leaves
//! either the old or the new file, never a torn one.
//!
//! - `allocations.json`: the allocations no process owns (the operator's, the device plugin's,
//!   DRA's). The file and its directory are fsynced before the rename counts, so they survive
//!   the machine's crash too.
//! - `owned.json`: those owned by a process (`tessera run`'s, see [`crate::owner`]), not
//!   fsynced. Such an allocation lives only as long as its owner, and no owner survives the
//!   machine: what a crash of the machine can lose there was going to be deleted anyway (an
//!   unreadable `owned.json` is then logged and read as empty). Two fsyncs per `tessera run`
//!   were the arbiter's largest cost in a loop of them (issue 36, docs/benchmarks.md).
//!
//! Files written before `owned.json` existed hold owned allocations in `allocations.json`:
//! they are read from there, and the next write moves them. Reserve and Release never touch
//! the disk.
//!
//! One arbiter per state directory: [`Store::open`] takes an exclusive `flock` on its `lock`
//! file, held until the store is dropped (the kernel releases it when the process dies, so a
//! crash leaves nothing to clean up), and writes its pid there for the next one's message. Two
//! arbiters on one directory would each promise the same cards' memory. It also proves the
//! directory writable at once, so an unwritable one stops the start, not the first Create.

// Denied, not forbidden: `flock` (below) is the one call std offers only from Rust 1.89.
#![deny(unsafe_code)]

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Name of the state file inside the state directory.
pub(crate) const STATE_FILE: &str = "allocations.json";
/// Name of the file of process-owned allocations inside the state directory.
pub(crate) const OWNED_FILE: &str = "owned.json";
/// Name of the lock file inside the state directory.
pub(crate) const LOCK_FILE: &str = "lock";
/// Format version of the state file.
pub(crate) const STATE_VERSION: u32 = 1;

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The state directory could not be created or used.
    #[error("state directory {path}: {source}")]
    Dir {
        /// Directory.
        path: PathBuf,
        /// Cause.
        source: io::Error,
    },
    /// Reading or writing the state file failed.
    #[error("state file {path}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        source: io::Error,
    },
    /// The state file exists but cannot be understood; it is left untouched.
    #[error("state file {path} is corrupt ({reason}); fix or move it away, it is not overwritten")]
    Corrupt {
        /// File.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The system's random source failed.
    #[error("random source failed: {0}")]
    Random(#[source] getrandom::Error),
    /// Another arbiter holds the state directory's lock.
    #[error(
        "state directory {path} is in use by another arbiter ({holder}); one arbiter per state \
         directory (give this one its own --state-dir, or stop the other)"
    )]
    Locked {
        /// Directory.
        path: PathBuf,
        /// Who holds it, as far as its lock file tells (`pid N`), else `holder unknown`.
        holder: String,
    },
}

/// One allocation as persisted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AllocationRecord {
    /// Public id (8 hex digits).
    pub id: String,
    /// Secret tenant token (64 hex digits).
    pub token: String,
    /// GPU index when created.
    pub gpu_index: u32,
    /// GPU UUID (authoritative: indexes can change between boots).
    pub gpu_uuid: String,
    /// Memory limit, bytes.
    pub memory_limit: u64,
    /// Compute weight 1..=100.
    pub share: u32,
    /// Compute cap, percent.
    pub cap: Option<u32>,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Creation time, Unix seconds.
    pub created_unix: u64,
    /// The process that owns it (`tessera run`; see [`crate::owner`]). Absent in files written
    /// before owners existed.
    #[serde(default)]
    pub owner: Option<tessera_protocol::ProcessOwner>,
    /// Its service tier, the operator's choice at creation. Absent in files written before
    /// tiers existed (best-effort).
    #[serde(default)]
    pub tier: tessera_protocol::Tier,
    /// The uid that created it (the kernel's word for the socket's peer; see
    /// [`crate::users`]): a user may delete only their own, and their quota counts them. Absent
    /// in files written before owners were recorded (the operator's, then).
    #[serde(default)]
    pub uid: Option<u32>,
}

#[derive(Debug, Serialize, Deserialize)]
struct StateFile {
    version: u32,
    allocations: Vec<AllocationRecord>,
}

/// The allocations file in a state directory.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
    /// The locked lock file (the lock lives as long as this descriptor).
    _lock: std::sync::Arc<File>,
    /// Orders writes that may finish out of order (see [`Store::save_version`]).
    versions: std::sync::Arc<Versions>,
}

/// The versions of the allocations handed out for writing, and the newest one written.
#[derive(Debug, Default)]
struct Versions {
    next: std::sync::atomic::AtomicU64,
    /// Held across a write, so two writes never interleave.
    written: parking_lot::Mutex<Written>,
}

/// What the files hold, as far as this store wrote them (`None`: not written yet).
#[derive(Debug, Default)]
struct Written {
    version: u64,
    durable: Option<Vec<AllocationRecord>>,
    owned: Option<Vec<AllocationRecord>>,
}

impl Store {
    /// Opens (creating with mode 0700 if needed) the state directory, takes its lock and checks
    /// that it can be written.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let dir_err = |source| StoreError::Dir {
            path: dir.to_owned(),
            source,
        };
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(dir_err)?;
        let mut lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(dir.join(LOCK_FILE))
            .map_err(dir_err)?;
        match try_lock_exclusive(&lock) {
            Ok(true) => {}
            Ok(false) => {
                let text = fs::read_to_string(dir.join(LOCK_FILE)).unwrap_or_default();
                let holder = match text.trim().parse::<u32>() {
                    Ok(pid) => format!("pid {pid}"),
                    Err(_) => "holder unknown".to_owned(),
                };
                return Err(StoreError::Locked {
                    path: dir.to_owned(),
                    holder,
                });
            }
            Err(e) => return Err(dir_err(e)),
        }
        lock.set_len(0).map_err(dir_err)?;
        writeln!(lock, "{}", std::process::id()).map_err(dir_err)?;
        // A Create renames a new file into the directory: prove that works now.
        let probe = dir.join(format!(".{STATE_FILE}.probe"));
        File::create(&probe).map_err(dir_err)?;
        fs::remove_file(&probe).map_err(dir_err)?;
        Ok(Self {
            dir: dir.to_owned(),
            _lock: std::sync::Arc::new(lock),
            versions: std::sync::Arc::default(),
        })
    }

    /// Path of the state file.
    pub(crate) fn path(&self) -> PathBuf {
        self.dir.join(STATE_FILE)
    }

    /// Path of the file that holds `r`.
    pub(crate) fn path_of(&self, r: &AllocationRecord) -> PathBuf {
        if r.owner.is_some() {
            self.dir.join(OWNED_FILE)
        } else {
            self.path()
        }
    }

    /// Loads every persisted allocation; an absent file means none. An unreadable
    /// `owned.json` is logged and read as empty (see the module's docs); an id in both files
    /// (a crash between the two writes that moved it) is read once.
    pub(crate) fn load(&self) -> Result<Vec<AllocationRecord>, StoreError> {
        let mut records = read_file(&self.path())?;
        let owned = self.dir.join(OWNED_FILE);
        match read_file(&owned) {
            Ok(more) => {
                for r in more {
                    if !records.iter().any(|o| o.id == r.id) {
                        records.push(r);
                    }
                }
            }
            Err(e) => tracing::error!(
                "{e}: its allocations (owned by processes, which a machine's crash ends) are \
                 not restored"
            ),
        }
        Ok(records)
    }

    /// A version for the next [`Store::save_version`]: taken where the allocations change
    /// (under the state's admin lock), so versions follow the order of the changes.
    pub(crate) fn next_version(&self) -> u64 {
        self.versions
            .next
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1
    }

    /// [`Store::save`] of the allocations as of `version`, unless a newer version was written
    /// already: a write that finishes late (written behind, see `state/admin.rs`) never puts
    /// back an older list.
    pub(crate) fn save_version(
        &self,
        version: u64,
        allocations: &[AllocationRecord],
    ) -> Result<(), StoreError> {
        let mut written = self.versions.written.lock();
        if version <= written.version {
            return Ok(());
        }
        self.write(&mut written, allocations)?;
        written.version = version;
        Ok(())
    }

    /// Replaces the persisted allocations atomically.
    #[cfg(test)]
    pub(crate) fn save(&self, allocations: &[AllocationRecord]) -> Result<(), StoreError> {
        self.write(&mut self.versions.written.lock(), allocations)
    }

    /// Writes the file of each part that changed since `written`: the owned part first, so a
    /// crash between the two writes that move an allocation out of `allocations.json` (files
    /// of older arbiters) leaves it in both, never in neither.
    fn write(
        &self,
        written: &mut Written,
        allocations: &[AllocationRecord],
    ) -> Result<(), StoreError> {
        let (owned, durable): (Vec<_>, Vec<_>) =
            allocations.iter().cloned().partition(|r| r.owner.is_some());
        if written.owned.as_ref() != Some(&owned) {
            written.owned = None;
            self.write_file(OWNED_FILE, &owned, false)?;
            written.owned = Some(owned);
        }
        if written.durable.as_ref() != Some(&durable) {
            written.durable = None;
            self.write_file(STATE_FILE, &durable, true)?;
            written.durable = Some(durable);
        }
        Ok(())
    }

    /// Replaces file `name` with `allocations` (temporary file, rename); `durable`: the file
    /// and the directory are fsynced, so the rename survives the machine's crash.
    fn write_file(
        &self,
        name: &str,
        allocations: &[AllocationRecord],
        durable: bool,
    ) -> Result<(), StoreError> {
        let path = self.dir.join(name);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        let io_err = |source| StoreError::Io {
            path: path.clone(),
            source,
        };
        let body = serde_json::to_vec_pretty(&StateFile {
            version: STATE_VERSION,
            allocations: allocations.to_vec(),
        })
        .map_err(|e| io_err(io::Error::other(e)))?;
        {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io_err)?;
            // A leftover temp file from an older run may have other permissions.
            f.set_permissions(fs::Permissions::from_mode(0o600))
                .map_err(io_err)?;
            f.write_all(&body).map_err(io_err)?;
            f.write_all(b"\n").map_err(io_err)?;
            if durable {
                f.sync_all().map_err(io_err)?;
            }
        }
        fs::rename(&tmp, &path).map_err(io_err)?;
        if durable {
            // The rename is durable only once the directory entry is.
            File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(io_err)?;
        }
        Ok(())
    }
}

/// The allocations in state file `path`; an absent file holds none.
fn read_file(path: &Path) -> Result<Vec<AllocationRecord>, StoreError> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(StoreError::Io {
                path: path.to_owned(),
                source,
            });
        }
    };
    let file: StateFile = serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    if file.version != STATE_VERSION {
        return Err(StoreError::Corrupt {
            path: path.to_owned(),
            reason: format!(
                "version {} (this arbiter reads {STATE_VERSION})",
                file.version
            ),
        });
    }
    Ok(file.allocations)
}

/// `flock(LOCK_EX | LOCK_NB)`: true when taken, false when another open file holds it.
#[allow(unsafe_code)]
fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock takes a descriptor (open for as long as `file` is borrowed) and flags;
    // no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

fn random_hex(bytes: usize) -> Result<String, StoreError> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(StoreError::Random)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// A new secret token: 256 random bits, 64 hex digits.
pub(crate) fn new_token() -> Result<String, StoreError> {
    random_hex(32)
}

/// A new public id: 32 random bits, 8 hex digits (callers re-draw on a collision).
pub(crate) fn new_id() -> Result<String, StoreError> {
    random_hex(4)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> AllocationRecord {
        AllocationRecord {
            id: id.into(),
            token: new_token().unwrap(),
            gpu_index: 0,
            gpu_uuid: "GPU-0".into(),
            memory_limit: 1 << 30,
            share: 30,
            cap: Some(30),
            labels: BTreeMap::from([("k".into(), "v".into())]),
            created_unix: 1,
            owner: None,
            tier: tessera_protocol::Tier::Latency,
            uid: Some(61001),
        }
    }

    fn owned(id: &str) -> AllocationRecord {
        AllocationRecord {
            owner: Some(tessera_protocol::ProcessOwner {
                pid: 4242,
                start_time: 17,
            }),
            ..record(id)
        }
    }

    fn ids(path: &Path) -> Vec<String> {
        read_file(path).unwrap().into_iter().map(|r| r.id).collect()
    }

    #[test]
    fn owned_allocations_have_their_own_file_and_their_changes_leave_the_durable_one_alone() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let (d, o, o2) = (record("d1"), owned("o1"), owned("o2"));
        store.save(&[d.clone(), o.clone()]).unwrap();
        assert_eq!(ids(&store.path()), ["d1"]);
        assert_eq!(ids(&dir.path().join(OWNED_FILE)), ["o1"]);
        assert_eq!(store.load().unwrap(), vec![d.clone(), o.clone()]);
        // `tessera run`s come and go: the durable file (fsynced) is not written again. (A
        // mark added to it by hand stays.)
        let marked = format!("{}\n", fs::read_to_string(store.path()).unwrap());
        fs::write(store.path(), &marked).unwrap();
        store.save(&[d.clone(), o.clone(), o2.clone()]).unwrap();
        store.save(&[d.clone(), o2.clone()]).unwrap();
        assert_eq!(
            fs::read_to_string(store.path()).unwrap(),
            marked,
            "rewritten"
        );
        assert_eq!(ids(&dir.path().join(OWNED_FILE)), ["o2"]);
        // A durable change writes the durable file, and both files keep mode 0600.
        store.save(std::slice::from_ref(&o2)).unwrap();
        assert_eq!(ids(&store.path()), Vec::<String>::new());
        for f in [STATE_FILE, OWNED_FILE] {
            let mode = fs::metadata(dir.path().join(f))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{f}");
        }
        // A new store (the arbiter restarted) reads both.
        drop(store);
        let again = Store::open(dir.path()).unwrap();
        assert_eq!(again.load().unwrap(), vec![o2]);
    }

    #[test]
    fn an_older_single_file_is_read_and_moved_and_a_torn_owned_file_loses_only_owned_ones() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let (d, o) = (record("d1"), owned("o1"));
        let file = |allocations: Vec<AllocationRecord>| {
            serde_json::to_vec(&StateFile {
                version: STATE_VERSION,
                allocations,
            })
            .unwrap()
        };
        // An older arbiter's file: owned allocations in `allocations.json`.
        fs::write(store.path(), file(vec![d.clone(), o.clone()])).unwrap();
        let all = store.load().unwrap();
        assert_eq!(all, vec![d.clone(), o.clone()]);
        store.save(&all).unwrap();
        assert_eq!(ids(&store.path()), ["d1"]);
        assert_eq!(ids(&dir.path().join(OWNED_FILE)), ["o1"]);
        // A crash between the two writes of the move: the owned one in both, read once.
        fs::write(store.path(), file(vec![d.clone(), o.clone()])).unwrap();
        assert_eq!(store.load().unwrap(), vec![d.clone(), o]);
        // The machine crashed before the unsynced owned file reached the disk: the durable
        // allocations are all there; the owned ones (their owners died with the machine) not.
        fs::write(dir.path().join(OWNED_FILE), b"").unwrap();
        fs::write(store.path(), file(vec![d.clone()])).unwrap();
        assert_eq!(store.load().unwrap(), vec![d]);
        // A torn durable file still stops the load (it is the operator's to fix).
        fs::write(store.path(), b"{ torn").unwrap();
        assert!(matches!(store.load(), Err(StoreError::Corrupt { .. })));
    }

    #[test]
    fn one_store_per_directory_and_the_second_names_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let first = Store::open(dir.path()).unwrap();
        let clone = first.clone();
        match Store::open(dir.path()) {
            Err(StoreError::Locked { path, holder }) => {
                assert_eq!(path, dir.path());
                assert_eq!(holder, format!("pid {}", std::process::id()));
            }
            other => panic!("{other:?}"),
        }
        drop(first);
        assert!(
            matches!(Store::open(dir.path()), Err(StoreError::Locked { .. })),
            "a clone keeps the lock"
        );
        drop(clone);
        Store::open(dir.path()).expect("free again once the holder is gone");
    }

    #[test]
    fn an_unwritable_directory_is_found_at_open() {
        // procfs refuses new files even to root.
        let err = Store::open(Path::new("/proc/self")).unwrap_err();
        assert!(matches!(err, StoreError::Dir { .. }), "{err:?}");
    }

    #[test]
    fn a_late_write_of_an_older_version_never_replaces_a_newer_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("state")).unwrap();
        let (old, new) = (store.next_version(), store.next_version());
        let newer = vec![record("aaaa0001"), record("aaaa0002")];
        store.save_version(new, &newer).unwrap();
        store.save_version(old, &newer[..1]).unwrap();
        assert_eq!(store.load().unwrap(), newer);
        let newest = store.next_version();
        store.save_version(newest, &newer[..1]).unwrap();
        assert_eq!(store.load().unwrap(), newer[..1]);
    }

    #[test]
    fn save_then_load_round_trips_with_private_mode() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("state")).unwrap();
        assert!(store.load().unwrap().is_empty());
        let recs = vec![record("aaaa0001"), record("aaaa0002")];
        store.save(&recs).unwrap();
        assert_eq!(store.load().unwrap(), recs);
        let mode = fs::metadata(store.path()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dmode = fs::metadata(dir.path().join("state"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dmode, 0o700);
        store.save(&recs[..1]).unwrap();
        assert_eq!(store.load().unwrap(), recs[..1]);
        // No temp file (nor the open's probe) is left behind: the state file and the lock.
        let mut names: Vec<_> = fs::read_dir(dir.path().join("state"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(names, [STATE_FILE, LOCK_FILE, OWNED_FILE]);
    }

    #[test]
    fn corrupt_file_is_reported_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        fs::write(store.path(), b"{ not json").unwrap();
        let err = store.load().unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
        assert_eq!(fs::read(store.path()).unwrap(), b"{ not json");
        fs::write(store.path(), br#"{"version": 99, "allocations": []}"#).unwrap();
        assert!(store.load().unwrap_err().to_string().contains("version 99"));
    }

    #[test]
    fn tokens_and_ids_are_random_hex_of_the_right_length() {
        let a = new_token().unwrap();
        let b = new_token().unwrap();
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        let id = new_id().unwrap();
        assert_eq!(id.len(), 8);
        assert!(id.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
