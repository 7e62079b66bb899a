//! XID events: injected by tests or `tessera sim --inject-xid`, read by the simulated NVML.
//!
//! `events` in the state folder is an append-only text file, one `GPU CODE` line per event;
//! readers remember the byte offset they have consumed.

#![forbid(unsafe_code)]

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Errors of the event file.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    #[error("events file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One XID error event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidEvent {
    pub gpu: u32,
    pub code: u64,
}

fn events_path(dir: &Path) -> PathBuf {
    dir.join("events")
}

/// Appends an XID event for device `gpu` (one write, atomic with O_APPEND).
pub fn inject_xid(dir: &Path, gpu: u32, code: u64) -> Result<(), EventsError> {
    let path = events_path(dir);
    let err = |source| EventsError::Io {
        path: path.clone(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(err)?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(err)?;
    f.write_all(format!("{gpu} {code}\n").as_bytes())
        .map_err(err)
}

/// Events appended after byte `offset`, and the offset to pass next time. Pass the offset
/// returned with no events (`read_xid_events(dir, u64::MAX)` answers the current end) to
/// ignore history.
pub fn read_xid_events(dir: &Path, offset: u64) -> (Vec<XidEvent>, u64) {
    let Ok(data) = std::fs::read(events_path(dir)) else {
        return (Vec::new(), 0);
    };
    let len = data.len() as u64;
    if offset >= len {
        return (Vec::new(), len);
    }
    let tail = &data[offset as usize..];
    // Only whole lines: a writer may be mid-append.
    let complete = tail.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1);
    let events = String::from_utf8_lossy(&tail[..complete])
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some(XidEvent {
                gpu: it.next()?.parse().ok()?,
                code: it.next()?.parse().ok()?,
            })
        })
        .collect();
    (events, offset + complete as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn injected_events_are_read_once() {
        let dir = tempfile::tempdir().unwrap();
        let (none, start) = read_xid_events(dir.path(), u64::MAX);
        assert!(none.is_empty());
        inject_xid(dir.path(), 1, 79).unwrap();
        inject_xid(dir.path(), 0, 48).unwrap();
        let (ev, next) = read_xid_events(dir.path(), start);
        assert_eq!(
            ev,
            vec![XidEvent { gpu: 1, code: 79 }, XidEvent { gpu: 0, code: 48 }]
        );
        assert!(read_xid_events(dir.path(), next).0.is_empty());
    }
}
