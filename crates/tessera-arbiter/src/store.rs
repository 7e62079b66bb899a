//! Persistence of allocations, and the random ids and tokens they carry.
//!
//! The state directory holds one file, `allocations.json`, rewritten whole on every Create
//! and Delete: written to a temporary file (mode 0600), fsynced, renamed over the old one and
//! the directory fsynced, so a crash leaves either the old or the new file, never a torn one.
//! Reserve and Release never touch the disk.
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
    written: parking_lot::Mutex<u64>,
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

    /// Loads every persisted allocation; an absent file means none.
    pub(crate) fn load(&self) -> Result<Vec<AllocationRecord>, StoreError> {
        let path = self.path();
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(StoreError::Io { path, source }),
        };
        let file: StateFile = serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        if file.version != STATE_VERSION {
            return Err(StoreError::Corrupt {
                path,
                reason: format!(
                    "version {} (this arbiter reads {STATE_VERSION})",
                    file.version
                ),
            });
        }
        Ok(file.allocations)
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
        if version <= *written {
            return Ok(());
        }
        self.save(allocations)?;
        *written = version;
        Ok(())
    }

    /// Replaces the persisted allocations atomically.
    pub(crate) fn save(&self, allocations: &[AllocationRecord]) -> Result<(), StoreError> {
        let path = self.path();
        let tmp = self.dir.join(format!(".{STATE_FILE}.tmp"));
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
            f.sync_all().map_err(io_err)?;
        }
        fs::rename(&tmp, &path).map_err(io_err)?;
        // The rename is durable only once the directory entry is.
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err)?;
        Ok(())
    }
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
        assert_eq!(names, [STATE_FILE, LOCK_FILE]);
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
