//! The running simulated machine's GPU spec, so that every command of one state folder sees the
//! same GPUs.
//!
//! The simulated libraries read their GPUs from `TESSERA_SIM_GPUS`, so two `tessera sim`
//! commands on one state folder with different specs would disagree about the machine (an
//! arbiter started under `--gpus 2x80GiB` and a `tessera run --gpu 1` under the default one
//! GPU). `tessera sim` therefore writes the spec it runs with to `<dir>/machine` and keeps an
//! open-file-description read lock on that file in the command it execs: the descriptor is left
//! open across `exec` and inherited by the command's children, so the machine *runs* while any
//! process started by `tessera sim` there is alive (the kernel drops a dead process's lock). A
//! later `tessera sim` [`join`]s it: without a spec of its own it takes the running one; with a
//! different one it is refused. Once nothing runs, the next one may choose any spec.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::{DEFAULT_GPUS, SimSpec, SpecError};

/// Errors of [`join`] and [`running_spec`].
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the simulated machine in {dir} is running with GPUs {running} (a process started by \
         `tessera sim` there is alive), and {requested} differs: every command of one simulated \
         machine sees the same GPUs. Drop the spec to join it, or use another --state-dir"
    )]
    Differs {
        dir: PathBuf,
        running: String,
        requested: String,
    },
    #[error("the running machine's spec in {path} is unreadable: {source}")]
    BadRecord { path: PathBuf, source: SpecError },
}

/// A hold on the running machine: its read-only descriptor carries the read lock and stays
/// open across `exec` (no `FD_CLOEXEC`), so the command and its children keep the machine
/// running.
#[derive(Debug)]
pub struct MachineHold {
    /// Never read: owning the descriptor is what keeps the lock.
    _file: File,
}

fn record(dir: &Path) -> PathBuf {
    dir.join("machine")
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> MachineError + '_ {
    move |source| MachineError::Io {
        path: path.to_owned(),
        source,
    }
}

fn ofd_lock(kind: libc::c_int) -> libc::flock {
    // SAFETY: flock is a plain C struct; all-zero is valid (whole file, pid 0 as OFD requires).
    let mut lk: libc::flock = unsafe { std::mem::zeroed() };
    lk.l_type = kind as i16;
    lk.l_whence = libc::SEEK_SET as i16;
    lk
}

/// Whether another open file description (a process of the machine) holds a lock on `file`.
pub(crate) fn running(file: &File) -> std::io::Result<bool> {
    let mut lk = ofd_lock(libc::F_WRLCK);
    // SAFETY: F_OFD_GETLK with a valid, zero-pid flock struct on an open descriptor.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut lk) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(lk.l_type != libc::F_UNLCK as i16)
}

fn read_spec(file: &mut File) -> std::io::Result<String> {
    let mut text = String::new();
    file.rewind()?;
    file.read_to_string(&mut text)?;
    Ok(text.trim().to_string())
}

/// The spec of the machine running in `dir`, if one is.
pub fn running_spec(dir: &Path) -> Result<Option<String>, MachineError> {
    let path = record(dir);
    let mut file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(&path)(e)),
    };
    if !running(&file).map_err(io(&path))? {
        return Ok(None);
    }
    read_spec(&mut file).map(Some).map_err(io(&path))
}

/// Joins the machine of `dir`, or starts it: returns the spec to run with and the hold to keep
/// open into the command. `requested` (the user's `--gpus` or `TESSERA_SIM_GPUS`, already
/// parsed once) must equal the running machine's GPUs, if one runs; without it the running
/// spec, else [`DEFAULT_GPUS`], is used.
pub fn join(dir: &Path, requested: Option<&str>) -> Result<(String, MachineHold), MachineError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = record(dir);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .open(&path)
        .map_err(io(&path))?;
    // One joiner at a time (an flock, apart from the OFD locks on Linux), so two commands
    // starting together cannot both write a spec.
    // SAFETY: flock on our own open descriptor.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io(&path)(std::io::Error::last_os_error()));
    }
    let spec = if running(&file).map_err(io(&path))? {
        let current = read_spec(&mut file).map_err(io(&path))?;
        let current_gpus = SimSpec::parse(&current).map_err(|source| MachineError::BadRecord {
            path: path.clone(),
            source,
        })?;
        if let Some(req) = requested {
            // Compared as machines: `2x80GiB` and `80GiB,80GiB` are the same two GPUs.
            if SimSpec::parse(req).ok().as_ref() != Some(&current_gpus) {
                return Err(MachineError::Differs {
                    dir: dir.to_owned(),
                    running: current,
                    requested: req.to_string(),
                });
            }
        }
        current
    } else {
        let spec = requested.unwrap_or(DEFAULT_GPUS).trim().to_string();
        file.set_len(0).map_err(io(&path))?;
        file.rewind().map_err(io(&path))?;
        file.write_all(format!("{spec}\n").as_bytes())
            .map_err(io(&path))?;
        spec
    };
    // The hold is a second, read-only descriptor: the one the command keeps cannot rewrite the
    // record for later joiners.
    let hold = File::open(&path).map_err(io(&path))?;
    let mut lk = ofd_lock(libc::F_RDLCK);
    // SAFETY: F_OFD_SETLK with a valid, zero-pid flock struct on our own descriptor; then
    // F_SETFD 0 clears FD_CLOEXEC on it (std opens with O_CLOEXEC), so it survives exec.
    let ok = unsafe {
        libc::fcntl(hold.as_raw_fd(), libc::F_OFD_SETLK, &mut lk) == 0
            && libc::fcntl(hold.as_raw_fd(), libc::F_SETFD, 0) == 0
    };
    if !ok {
        return Err(io(&path)(std::io::Error::last_os_error()));
    }
    // Closing `file` drops the flock: the next joiner sees this hold.
    drop(file);
    Ok((spec, MachineHold { _file: hold }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_machine_keeps_its_spec_until_its_last_hold_goes() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(running_spec(dir.path()).unwrap(), None);
        let (spec, a) = join(dir.path(), Some("2x80GiB")).unwrap();
        assert_eq!(spec, "2x80GiB");
        assert_eq!(
            running_spec(dir.path()).unwrap().as_deref(),
            Some("2x80GiB")
        );
        // Without a spec: the running one. The same machine written otherwise: accepted.
        let (spec, b) = join(dir.path(), None).unwrap();
        assert_eq!(spec, "2x80GiB");
        let (_, c) = join(dir.path(), Some("80GiB,80GiB")).unwrap();
        let err = join(dir.path(), Some("1x80GiB")).unwrap_err();
        assert!(matches!(err, MachineError::Differs { .. }), "{err}");
        assert!(
            err.to_string().contains("running with GPUs 2x80GiB"),
            "{err}"
        );
        drop((a, b));
        assert!(join(dir.path(), Some("1x80GiB")).is_err(), "one hold left");
        drop(c);
        assert_eq!(running_spec(dir.path()).unwrap(), None);
        let (spec, _d) = join(dir.path(), None).unwrap();
        assert_eq!(spec, DEFAULT_GPUS, "nothing runs: the default");
    }
}
