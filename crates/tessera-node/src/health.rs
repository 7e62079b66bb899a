//! The node's GPUs and their health, published as a [`Snapshot`] on a watch channel.
//!
//! Two sources:
//! - NVML (preferred): a dedicated thread enumerates devices, waits on XID events and marks a
//!   GPU unhealthy on an XID that means the card failed; a device that stops answering (or
//!   disappears from the count) is withdrawn. Enumeration is repeated every poll interval.
//! - The arbiter's `ListGpus`, polled (no health events): for nodes where NVML cannot be
//!   loaded by the plugin. An unreachable arbiter keeps the last list (it says nothing about
//!   the GPUs).
//!
//! A GPU marked unhealthy stays so until the plugin restarts: a card that lost its bus or
//! its memory needs an operator, not a retry.
//!
//! Only the GPUs the plugin's [`GpuFilter`] (`--gpus`) admits are listed, and only theirs are
//! watched for XID events: the others belong to another plugin. The first list is checked
//! against the filter ([`GpuFilter::warn_at_start`]).

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;
use tokio::sync::watch;

use crate::GpuFilter;

/// One GPU as the plugin sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuState {
    /// NVML index.
    pub index: u32,
    /// UUID, `GPU-...`.
    pub uuid: String,
    /// Total memory, bytes.
    pub memory_total: u64,
    /// Why the GPU is unhealthy, if it is.
    pub unhealthy: Option<String>,
}

/// The GPUs of the node, in index order.
pub type Snapshot = Arc<Vec<GpuState>>;

/// Errors of the GPU sources.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    /// NVML could not be loaded or initialised.
    #[error("cannot initialise NVML from {lib}: {source}")]
    NvmlInit {
        /// Library name or path tried.
        lib: String,
        /// Cause.
        source: NvmlError,
    },
    /// NVML loaded but the devices could not be listed.
    #[error("cannot list GPUs through NVML: {0}")]
    NvmlEnumerate(NvmlError),
    /// The watcher thread could not be started.
    #[error("cannot start the GPU watcher thread: {0}")]
    Thread(std::io::Error),
}

/// Where the GPU list comes from.
#[derive(Debug, Clone)]
pub enum GpuSource {
    /// NVML, loaded from this library (name or path).
    Nvml {
        /// e.g. `libnvidia-ml.so.1`.
        lib: PathBuf,
    },
    /// The arbiter's admin socket.
    Arbiter {
        /// Admin socket path.
        admin_socket: PathBuf,
    },
}

/// XIDs that mean the GPU itself failed (memory, bus, firmware), as opposed to an
/// application's fault (13 graphics engine exception, 31 MMU fault, 43 channel stopped,
/// 45 preemptive cleanup, 68 video decoder exception), which must not take the card away
/// from other tenants.
pub(crate) const FATAL_XIDS: &[u64] = &[48, 62, 64, 74, 79, 92, 94, 95, 119, 120];

/// True if an XID means the GPU failed.
pub(crate) fn is_fatal_xid(code: u64) -> bool {
    FATAL_XIDS.contains(&code)
}

/// Starts watching the GPUs of `source` that `offered` admits; the receiver always holds the
/// latest snapshot.
///
/// NVML failures at start are returned (so the caller can fall back); later ones are logged.
pub fn start(
    source: GpuSource,
    offered: GpuFilter,
    poll: Duration,
) -> Result<watch::Receiver<Snapshot>, HealthError> {
    match source {
        GpuSource::Nvml { lib } => start_nvml(lib, offered, poll),
        GpuSource::Arbiter { admin_socket } => Ok(start_arbiter(admin_socket, offered, poll)),
    }
}

/// One listed device: NVML index, UUID, total memory.
type Dev = (u32, String, u64);

/// The devices of `all` that `offered` admits; at start (`first`), `all` checked against it.
fn admitted(offered: &GpuFilter, all: Vec<Dev>, first: bool) -> Vec<Dev> {
    if first {
        let node: Vec<(u32, &str)> = all.iter().map(|d| (d.0, d.1.as_str())).collect();
        offered.warn_at_start(&node);
    }
    all.into_iter()
        .filter(|(index, uuid, _)| offered.admits(*index, uuid))
        .collect()
}

fn start_nvml(
    lib: PathBuf,
    offered: GpuFilter,
    poll: Duration,
) -> Result<watch::Receiver<Snapshot>, HealthError> {
    let (init_tx, init_rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("nvml-health".into())
        .spawn(move || nvml_thread(&lib, &offered, poll, init_tx))
        .map_err(HealthError::Thread)?;
    // The thread owns NVML (its handles borrow it); it reports the first snapshot or why not.
    match init_rx.recv() {
        Ok(res) => res,
        Err(_) => Err(HealthError::Thread(std::io::Error::other(
            "NVML watcher exited",
        ))),
    }
}

/// Lists the devices that answer; one that fails any query is left out (withdrawn).
fn enumerate(nvml: &Nvml) -> Result<Vec<Dev>, NvmlError> {
    let count = nvml.device_count()?;
    let mut out = Vec::new();
    for index in 0..count {
        let Ok(dev) = nvml.device_by_index(index) else {
            continue;
        };
        let (Ok(uuid), Ok(mem)) = (dev.uuid(), dev.memory_info()) else {
            continue;
        };
        out.push((index, uuid, mem.total));
    }
    Ok(out)
}

fn snapshot(devs: &[Dev], bad: &BTreeMap<String, String>) -> Snapshot {
    Arc::new(
        devs.iter()
            .map(|(index, uuid, mem)| GpuState {
                index: *index,
                uuid: uuid.clone(),
                memory_total: *mem,
                unhealthy: bad.get(uuid).cloned(),
            })
            .collect(),
    )
}

/// Registers critical-XID events for every listed device not yet registered.
fn register_events<'n>(
    nvml: &'n Nvml,
    mut set: Option<EventSet<'n>>,
    devs: &[Dev],
    registered: &mut Vec<String>,
) -> Option<EventSet<'n>> {
    for (index, uuid, _) in devs {
        if registered.contains(uuid) {
            continue;
        }
        let Ok(dev) = nvml.device_by_index(*index) else {
            continue;
        };
        let current = match set.take() {
            Some(s) => s,
            None => match nvml.create_event_set() {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("NVML events unavailable ({e}); health by polling only");
                    return None;
                }
            },
        };
        match dev.register_events(EventTypes::CRITICAL_XID_ERROR, current) {
            Ok(s) => {
                registered.push(uuid.clone());
                set = Some(s);
            }
            Err(e) => {
                // The set is released on failure; later devices start a new one.
                tracing::warn!("cannot watch XID events of {uuid}: {}", e.error);
            }
        }
    }
    set
}

fn nvml_thread(
    lib: &Path,
    offered: &GpuFilter,
    poll: Duration,
    init_tx: std::sync::mpsc::Sender<Result<watch::Receiver<Snapshot>, HealthError>>,
) {
    let lib_os: &OsStr = lib.as_os_str();
    let nvml = match Nvml::builder().lib_path(lib_os).init() {
        Ok(n) => n,
        Err(source) => {
            let _ = init_tx.send(Err(HealthError::NvmlInit {
                lib: lib.display().to_string(),
                source,
            }));
            return;
        }
    };
    let mut devs = match enumerate(&nvml) {
        Ok(d) => admitted(offered, d, true),
        Err(e) => {
            let _ = init_tx.send(Err(HealthError::NvmlEnumerate(e)));
            return;
        }
    };
    let mut bad: BTreeMap<String, String> = BTreeMap::new();
    let (tx, rx) = watch::channel(snapshot(&devs, &bad));
    if init_tx.send(Ok(rx)).is_err() {
        return;
    }
    let mut registered = Vec::new();
    let mut events = register_events(&nvml, None, &devs, &mut registered);
    let mut last_enum = Instant::now();
    let wait_ms = poll.as_millis().clamp(10, 1000) as u32;
    // Runs until every receiver is gone (the plugin is shutting down).
    while !tx.is_closed() {
        let mut changed = false;
        match &events {
            Some(set) => match set.wait(wait_ms) {
                Ok(ev) => {
                    let code = match ev.event_data {
                        Some(XidError::Value(c)) => Some(c),
                        _ => None,
                    };
                    let uuid = ev.device.uuid().ok();
                    match (code, uuid) {
                        (Some(code), Some(uuid)) if is_fatal_xid(code) => {
                            tracing::warn!("XID {code} on {uuid}: marking it unhealthy");
                            bad.entry(uuid).or_insert_with(|| format!("XID {code}"));
                            changed = true;
                        }
                        (Some(code), uuid) => {
                            let who = uuid.unwrap_or_else(|| "a GPU".into());
                            tracing::info!("XID {code} on {who} (application-caused; ignored)");
                        }
                        _ => {}
                    }
                }
                Err(NvmlError::Timeout) => {}
                Err(e) => {
                    tracing::warn!("NVML event wait failed ({e}); polling only");
                    events = None;
                }
            },
            None => std::thread::sleep(Duration::from_millis(u64::from(wait_ms))),
        }
        if last_enum.elapsed() >= poll {
            last_enum = Instant::now();
            if let Ok(now) = enumerate(&nvml).map(|d| admitted(offered, d, false))
                && now != devs
            {
                for gone in devs.iter().filter(|d| !now.iter().any(|n| n.1 == d.1)) {
                    tracing::warn!("GPU {} vanished: withdrawing its units", gone.1);
                }
                devs = now;
                events = register_events(&nvml, events, &devs, &mut registered);
                changed = true;
            }
        }
        if changed {
            let _ = tx.send(snapshot(&devs, &bad));
        }
    }
}

fn start_arbiter(
    admin_socket: PathBuf,
    offered: GpuFilter,
    poll: Duration,
) -> watch::Receiver<Snapshot> {
    let (tx, rx) = watch::channel(Arc::new(Vec::new()));
    tokio::spawn(async move {
        let (mut warned, mut first) = (false, true);
        while !tx.is_closed() {
            match crate::arbiter::with_admin(&admin_socket, |c| c.gpus()).await {
                Ok(gpus) => {
                    warned = false;
                    let all: Vec<Dev> = gpus
                        .into_iter()
                        .map(|g| (g.index, g.uuid, g.memory_total))
                        .collect();
                    let devs = admitted(&offered, all, std::mem::take(&mut first));
                    let snap = snapshot(&devs, &BTreeMap::new());
                    tx.send_if_modified(|cur| {
                        if **cur == *snap {
                            false
                        } else {
                            *cur = snap;
                            true
                        }
                    });
                }
                Err(e) if !warned => {
                    warned = true;
                    tracing::warn!("cannot list GPUs from the arbiter: {e}");
                }
                Err(_) => {}
            }
            tokio::time::sleep(poll).await;
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fatal_and_application_xids() {
        for code in [48, 62, 64, 74, 79, 92, 94, 95, 119, 120] {
            assert!(is_fatal_xid(code), "{code}");
        }
        for code in [13, 31, 43, 45, 68, 0] {
            assert!(!is_fatal_xid(code), "{code}");
        }
    }

    #[test]
    fn snapshot_marks_bad_gpus() {
        let devs = vec![(0, "GPU-a".to_string(), 10), (1, "GPU-b".to_string(), 20)];
        let bad = BTreeMap::from([("GPU-b".to_string(), "XID 79".to_string())]);
        let snap = snapshot(&devs, &bad);
        assert_eq!(snap[0].unhealthy, None);
        assert_eq!(snap[1].unhealthy.as_deref(), Some("XID 79"));
        assert_eq!(snap[1].memory_total, 20);
    }

    #[test]
    fn only_admitted_gpus_are_listed() {
        let devs = || {
            vec![
                (0, "GPU-aa".to_string(), 10),
                (1, "GPU-bb".to_string(), 20),
                (2, "GPU-cc".to_string(), 30),
            ]
        };
        let uuids = |d: Vec<Dev>| d.into_iter().map(|d| d.1).collect::<Vec<_>>();
        let f: GpuFilter = "2,gpu-AA,9".parse().unwrap();
        assert_eq!(uuids(admitted(&f, devs(), true)), ["GPU-aa", "GPU-cc"]);
        assert_eq!(uuids(admitted(&GpuFilter::all(), devs(), false)).len(), 3);
        let none: GpuFilter = "7".parse().unwrap();
        assert!(admitted(&none, devs(), true).is_empty());
    }

    #[test]
    fn missing_nvml_is_reported_not_fatal() {
        let err = start(
            GpuSource::Nvml {
                lib: PathBuf::from("/nonexistent/libnvidia-ml.so.1"),
            },
            GpuFilter::all(),
            Duration::from_millis(100),
        )
        .unwrap_err();
        assert!(matches!(err, HealthError::NvmlInit { .. }), "{err}");
    }
}
