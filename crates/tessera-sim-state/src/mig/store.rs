//! The MIG state of the machine, kept in `<state>/mig` so every process sees one layout.
//!
//! Text, one item a line: `serial N` (the count of compute instances ever made, which makes
//! each new UUID fresh), `gpu G on`, `gi G ID PROFILE_ID START SIZE`,
//! `ci G GI ID PROFILE START SIZE UUIDHEX`. Readers take a shared `flock` on `<state>/mig.lock`,
//! writers an exclusive one and replace the file by rename, so a reader never sees half a
//! layout. A line that does not parse makes the whole file an error (fail closed: a process
//! must not run on a layout it misread).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::layout::{ComputeInstance, GpuInstance, GpuMig, MigError};

const FILE: &str = "mig";
const LOCK: &str = "mig.lock";
const HEADER: &str = "tessera-sim-mig 1";

/// The MIG state of every GPU of the machine.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigState {
    /// Compute instances ever created (mixed into each new UUID).
    pub serial: u64,
    /// By GPU index; a GPU missing has MIG off and no instances.
    pub gpus: BTreeMap<u32, GpuMig>,
}

impl MigState {
    /// GPU `gpu`'s state (MIG off when never set).
    pub fn gpu(&self, gpu: u32) -> GpuMig {
        self.gpus.get(&gpu).cloned().unwrap_or_default()
    }

    /// GPU `gpu`'s state, to change.
    pub fn gpu_mut(&mut self, gpu: u32) -> &mut GpuMig {
        self.gpus.entry(gpu).or_default()
    }

    /// Whether MIG is on for `gpu`.
    pub fn enabled(&self, gpu: u32) -> bool {
        self.gpus.get(&gpu).is_some_and(|g| g.enabled)
    }

    /// 16 UUID bytes never handed out before on this machine: from the parent's UUID, the
    /// serial and the wall clock (so a wiped state folder does not repeat them either).
    pub fn fresh_uuid(&mut self, parent: &[u8; 16]) -> [u8; 16] {
        self.serial += 1;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let seed = u64::from_be_bytes(parent[..8].try_into().expect("8 bytes"));
        let a = crate::spec::splitmix(seed ^ self.serial.rotate_left(32) ^ nanos);
        let b = crate::spec::splitmix(a ^ nanos);
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&a.to_be_bytes());
        out[8..].copy_from_slice(&b.to_be_bytes());
        out[6] = (out[6] & 0x0F) | 0x40;
        out[8] = (out[8] & 0x3F) | 0x80;
        out
    }

    fn render(&self) -> String {
        let mut s = format!("{HEADER}\nserial {}\n", self.serial);
        for (gpu, g) in &self.gpus {
            if g.enabled {
                s += &format!("gpu {gpu} on\n");
            }
            for gi in &g.gis {
                s += &format!(
                    "gi {gpu} {} {} {} {}\n",
                    gi.id, gi.profile_id, gi.start, gi.size
                );
                for ci in &gi.cis {
                    let hex: String = ci.uuid_bytes.iter().map(|b| format!("{b:02x}")).collect();
                    s += &format!(
                        "ci {gpu} {} {} {} {} {} {hex}\n",
                        gi.id, ci.id, ci.profile, ci.start, ci.size
                    );
                }
            }
        }
        s
    }

    fn parse(text: &str) -> Option<MigState> {
        let mut lines = text.lines();
        if lines.next()? != HEADER {
            return None;
        }
        let mut st = MigState::default();
        for line in lines {
            let f: Vec<&str> = line.split_whitespace().collect();
            let n = |i: usize| f.get(i).and_then(|v| v.parse::<u32>().ok());
            match f.first().copied() {
                Some("serial") => st.serial = f.get(1)?.parse().ok()?,
                Some("gpu") if f.get(2) == Some(&"on") => st.gpu_mut(n(1)?).enabled = true,
                Some("gi") => {
                    let gi = GpuInstance {
                        id: n(2)?,
                        profile_id: n(3)?,
                        start: n(4)?,
                        size: n(5)?,
                        cis: Vec::new(),
                    };
                    st.gpu_mut(n(1)?).gis.push(gi);
                }
                Some("ci") => {
                    let hex = f.get(7)?;
                    if hex.len() != 32 {
                        return None;
                    }
                    let mut uuid_bytes = [0u8; 16];
                    for (i, b) in uuid_bytes.iter_mut().enumerate() {
                        *b = u8::from_str_radix(hex.get(i * 2..i * 2 + 2)?, 16).ok()?;
                    }
                    let ci = ComputeInstance {
                        id: n(3)?,
                        profile: n(4)?,
                        start: n(5)?,
                        size: n(6)?,
                        uuid_bytes,
                    };
                    let gi = n(2)?;
                    st.gpus
                        .get_mut(&n(1)?)?
                        .gis
                        .iter_mut()
                        .find(|g| g.id == gi)?
                        .cis
                        .push(ci);
                }
                Some(_) => return None,
                None => {}
            }
        }
        Some(st)
    }
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> MigError {
    MigError::Io {
        path: path.display().to_string(),
        why: e.to_string(),
    }
}

/// An `flock` on `<dir>/mig.lock`, held while alive.
struct Locked {
    /// Never read: owning the descriptor is what keeps the lock.
    _file: File,
}

impl Locked {
    fn take(dir: &Path, exclusive: bool) -> Result<Locked, MigError> {
        let path = dir.join(LOCK);
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(0o666)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| io_err(&path, e))?;
        let op = if exclusive {
            libc::LOCK_EX
        } else {
            libc::LOCK_SH
        };
        loop {
            // SAFETY: flock on our own open descriptor.
            if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
                return Ok(Locked { _file: file });
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(io_err(&path, e));
            }
        }
    }
}

fn read(dir: &Path) -> Result<MigState, MigError> {
    let path = dir.join(FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => MigState::parse(&text).ok_or_else(|| io_err(&path, "unreadable MIG layout")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(MigState::default()),
        Err(e) => Err(io_err(&path, e)),
    }
}

/// The machine's MIG state (MIG off everywhere when none was ever set).
pub fn load(dir: &Path) -> Result<MigState, MigError> {
    let _lock = Locked::take(dir, false)?;
    read(dir)
}

/// Changes the machine's MIG state with `f`, under the exclusive lock; written only when `f`
/// succeeds and changed something.
pub fn update<T>(
    dir: &Path,
    f: impl FnOnce(&mut MigState) -> Result<T, MigError>,
) -> Result<T, MigError> {
    let _lock = Locked::take(dir, true)?;
    let before = read(dir)?;
    let mut st = before.clone();
    let out = f(&mut st)?;
    if st != before {
        let path = dir.join(FILE);
        let tmp = dir.join(format!(".mig.{}", std::process::id()));
        std::fs::write(&tmp, st.render()).map_err(|e| io_err(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io_err(&path, e))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mig::profiles::GpuModel;

    #[test]
    fn the_layout_round_trips_through_the_file_and_uuids_are_fresh() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load(dir.path()).unwrap(), MigState::default());
        let m = GpuModel::H200;
        let p = m.profile_by_name("1g.18gb").unwrap();
        let first = update(dir.path(), |st| {
            st.gpu_mut(1).set_mode(true, false)?;
            let gi = st.gpu_mut(1).create_gi(m, p, Some(2))?;
            let uuid = st.fresh_uuid(&[7; 16]);
            st.gpu_mut(1).create_ci(m, gi, 0, uuid)?;
            Ok(uuid)
        })
        .unwrap();
        let st = load(dir.path()).unwrap();
        assert!(st.enabled(1) && !st.enabled(0));
        assert_eq!(st.gpu(1).gis[0].start, 2);
        assert_eq!(st.gpu(1).gis[0].cis[0].uuid_bytes, first);
        // A failed change writes nothing.
        let err = update(dir.path(), |st| st.gpu_mut(1).destroy_gi(1)).unwrap_err();
        assert!(matches!(err, MigError::InUse(_)));
        assert_eq!(load(dir.path()).unwrap(), st);
        // Re-created at the same place: another UUID.
        let second = update(dir.path(), |st| {
            st.gpu_mut(1).destroy_ci(1, 0, false)?;
            let uuid = st.fresh_uuid(&[7; 16]);
            st.gpu_mut(1).create_ci(m, 1, 0, uuid)?;
            Ok(uuid)
        })
        .unwrap();
        assert_ne!(first, second);
        // A damaged file is an error, not an empty layout.
        std::fs::write(dir.path().join(FILE), "tessera-sim-mig 1\nbogus\n").unwrap();
        assert!(matches!(load(dir.path()), Err(MigError::Io { .. })));
    }
}
