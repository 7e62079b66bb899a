//! The per-claim CDI spec: Tessera's part of a prepared claim's container edits.
//!
//! The container runtime (containerd, CRI-O) applies CDI devices the kubelet names from the
//! prepare response. Tessera adds, per claim, a spec of kind [`CDI_KIND`] that mounts the
//! interposer and a read-only `/etc/ld.so.preload` naming it, the tenant socket's folder and
//! the claim's identity file, and sets `CUDA_VISIBLE_DEVICES`/`NVIDIA_VISIBLE_DEVICES`. The
//! card's device nodes and driver libraries come from the node's NVIDIA spec
//! (`nvidia.com/gpu=<uuid>`), listed beside ours in the response and never rewritten.
//!
//! The spec is written `0600` (the runtime reads it as root): it names the identity file,
//! whose random name is what keeps other host users from reading the claim's token.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use tessera_protocol::node;

use serde::Serialize;

use crate::claim::Planned;

/// CDI kind (`vendor/class`) of Tessera's claim specs.
pub(crate) const CDI_KIND: &str = "tessera.dev/claim";
/// CDI spec version written (mount options and env, nothing newer needed).
pub(crate) const CDI_VERSION: &str = "0.6.0";
/// Where glibc's loader reads libraries to preload.
pub(crate) const CONTAINER_PRELOAD: &str = "/etc/ld.so.preload";

/// Errors writing or removing a spec.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CdiError {
    /// File system.
    #[error("CDI spec {path}: {source}")]
    Io {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Serialisation (cannot happen for these types, kept typed).
    #[error("CDI spec: {0}")]
    Json(#[from] serde_json::Error),
}

/// Host and container paths a fraction's edits use.
#[derive(Debug, Clone)]
pub(crate) struct Wiring {
    /// Host path of the installed interposer.
    pub host_lib: PathBuf,
    /// Host path of the matching preload file.
    pub host_preload: PathBuf,
    /// The interposer's path inside containers.
    pub container_lib: PathBuf,
    /// Host folder of the arbiter's tenant socket.
    pub host_socket_dir: PathBuf,
    /// Where that folder appears inside containers.
    pub container_socket_dir: PathBuf,
    /// The tenant socket's path inside containers.
    pub container_socket: PathBuf,
    /// Where the identity file appears inside containers.
    pub container_identity: PathBuf,
}

/// A CDI spec (the subset written).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    /// Spec version.
    pub cdi_version: String,
    /// `vendor/class`.
    pub kind: String,
    /// Devices.
    pub devices: Vec<Device>,
    /// Edits applied when any device of the spec is.
    pub container_edits: Edits,
}

/// One CDI device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    /// Name (unique in the kind).
    pub name: String,
    /// Its own edits (CDI refuses a device without any).
    pub container_edits: Edits,
}

/// Container edits.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Edits {
    /// `NAME=value` entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Bind mounts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

/// A bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    /// Host path.
    pub host_path: String,
    /// Container path.
    pub container_path: String,
    /// Mount options.
    pub options: Vec<String>,
}

fn bind(host: &Path, container: &Path, read_only: bool) -> Mount {
    let mut options = vec!["rbind".to_owned(), "nosuid".to_owned(), "nodev".to_owned()];
    if read_only {
        options.insert(0, "ro".to_owned());
    }
    Mount {
        host_path: host.display().to_string(),
        container_path: container.display().to_string(),
        options,
    }
}

/// The CDI device name of result `i` of claim `uid`.
pub(crate) fn device_name(uid: &str, i: usize) -> String {
    format!("{uid}-{i}")
}

/// The fully qualified CDI id of result `i` of claim `uid`.
pub(crate) fn device_id(uid: &str, i: usize) -> String {
    format!("{CDI_KIND}={}", device_name(uid, i))
}

/// The spec for claim `uid`: `results` with their allocation ids, `identity` the host path of
/// the claim's identity file.
pub(crate) fn spec(
    uid: &str,
    results: &[(Planned, String)],
    identity: &Path,
    wiring: &Wiring,
) -> Spec {
    let uuids: Vec<&str> = results.iter().map(|(p, _)| p.uuid.as_str()).collect();
    let ids: Vec<&str> = results.iter().map(|(_, id)| id.as_str()).collect();
    let visible = uuids.join(",");
    let mut env = BTreeMap::from([
        ("CUDA_VISIBLE_DEVICES", visible.clone()),
        ("NVIDIA_VISIBLE_DEVICES", visible),
        (node::ENV_ALLOCATION_ID, ids.join(",")),
    ]);
    let mut mounts = vec![bind(identity, &wiring.container_identity, true)];
    let fraction = results.iter().any(|(p, _)| !p.whole);
    if fraction {
        // The identity file carries token and socket (the interposer trusts it over the
        // environment); the variable is for tools and people, the token is never in the spec.
        env.insert(
            node::ENV_SOCKET,
            wiring.container_socket.display().to_string(),
        );
        mounts.push(bind(&wiring.host_lib, &wiring.container_lib, true));
        mounts.push(bind(
            &wiring.host_preload,
            Path::new(CONTAINER_PRELOAD),
            true,
        ));
        // Read-only: connecting to a socket needs no write access to the mount (Linux checks
        // EROFS only for files, folders and links), and a tenant must not plant files in the
        // host's socket folder.
        mounts.push(bind(
            &wiring.host_socket_dir,
            &wiring.container_socket_dir,
            true,
        ));
    }
    Spec {
        cdi_version: CDI_VERSION.to_owned(),
        kind: CDI_KIND.to_owned(),
        devices: results
            .iter()
            .enumerate()
            .map(|(i, (p, _))| Device {
                name: device_name(uid, i),
                container_edits: Edits {
                    env: vec![format!("TESSERA_CLAIM_DEVICE_{i}={}", p.uuid)],
                    mounts: Vec::new(),
                },
            })
            .collect(),
        container_edits: Edits {
            env: env.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
            mounts,
        },
    }
}

/// Path of claim `uid`'s spec in `dir` (one file per claim, named by the CDI convention
/// `<vendor>-<class>_<name>.json`).
pub(crate) fn path(dir: &Path, uid: &str) -> PathBuf {
    dir.join(format!("tessera.dev-claim_{uid}.json"))
}

/// Writes `spec` for `uid` into `dir`, atomically (a runtime never reads half a spec).
pub(crate) fn write(dir: &Path, uid: &str, spec: &Spec) -> Result<PathBuf, CdiError> {
    let dest = path(dir, uid);
    let io = |p: &Path| {
        let p = p.to_owned();
        move |source| CdiError::Io { path: p, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = dir.join(format!(".tessera-{uid}.tmp"));
    let bytes = serde_json::to_vec_pretty(spec)?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io(&tmp))?;
    f.write_all(&bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, &dest).map_err(io(&dest))?;
    Ok(dest)
}

/// Reads claim `uid`'s spec, `None` if there is none.
pub(crate) fn read(dir: &Path, uid: &str) -> Result<Option<Spec>, CdiError> {
    let p = path(dir, uid);
    match std::fs::read(&p) {
        Ok(b) => Ok(Some(serde_json::from_slice(&b)?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(CdiError::Io { path: p, source }),
    }
}

/// Removes claim `uid`'s spec; absent is fine (unprepare is idempotent).
pub(crate) fn remove(dir: &Path, uid: &str) -> Result<(), CdiError> {
    let p = path(dir, uid);
    match std::fs::remove_file(&p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(CdiError::Io { path: p, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn wiring() -> Wiring {
        Wiring {
            host_lib: "/var/lib/tessera/lib/libtessera_interpose-1.so".into(),
            host_preload: "/var/lib/tessera/lib/ld.so.preload-1".into(),
            container_lib: "/usr/lib/tessera/libtessera_interpose.so".into(),
            host_socket_dir: "/run/tessera/tenant".into(),
            container_socket_dir: "/run/tessera".into(),
            container_socket: "/run/tessera/tessera.sock".into(),
            container_identity: "/etc/tessera/tenant".into(),
        }
    }

    fn planned(uuid: &str, whole: bool) -> Planned {
        Planned {
            request: "gpu".into(),
            pool: "n".into(),
            device: "gpu-0".into(),
            share_id: None,
            uuid: uuid.into(),
            share: if whole { 100 } else { 30 },
            memory_limit: 1,
            whole,
            tier: tessera_protocol::Tier::BestEffort,
            kind: crate::claim::Kind::Plain,
        }
    }

    #[test]
    fn fraction_gets_the_interposer_read_only_and_whole_gpus_do_not() {
        let identity = Path::new("/var/lib/tessera/identity/a1.ff");
        let s = spec(
            "u1",
            &[(planned("GPU-a", false), "a1".into())],
            identity,
            &wiring(),
        );
        let ro = |host: &str, container: &str| {
            s.container_edits.mounts.iter().any(|m| {
                m.host_path == host && m.container_path == container && m.options[0] == "ro"
            })
        };
        assert!(ro(
            "/var/lib/tessera/lib/ld.so.preload-1",
            "/etc/ld.so.preload"
        ));
        assert!(ro(
            "/var/lib/tessera/lib/libtessera_interpose-1.so",
            "/usr/lib/tessera/libtessera_interpose.so"
        ));
        assert!(ro("/var/lib/tessera/identity/a1.ff", "/etc/tessera/tenant"));
        assert!(ro("/run/tessera/tenant", "/run/tessera"));
        assert!(
            s.container_edits
                .env
                .contains(&"CUDA_VISIBLE_DEVICES=GPU-a".to_owned())
        );
        assert!(
            s.container_edits
                .env
                .contains(&"NVIDIA_VISIBLE_DEVICES=GPU-a".to_owned())
        );
        assert!(
            !s.container_edits
                .env
                .iter()
                .any(|e| e.starts_with("TESSERA_TOKEN"))
        );
        assert_eq!(s.devices[0].name, "u1-0");

        let w = spec(
            "u2",
            &[
                (planned("GPU-a", true), "a2".into()),
                (planned("GPU-b", true), "a3".into()),
            ],
            identity,
            &wiring(),
        );
        assert_eq!(w.container_edits.mounts.len(), 1, "identity only: {w:?}");
        assert!(
            w.container_edits
                .env
                .contains(&"CUDA_VISIBLE_DEVICES=GPU-a,GPU-b".to_owned())
        );
        assert_eq!(w.devices.len(), 2);
    }

    #[test]
    fn written_private_read_back_and_removed_idempotently() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(
            "u1",
            &[(planned("GPU-a", false), "a1".into())],
            Path::new("/x"),
            &wiring(),
        );
        let p = write(dir.path(), "u1", &s).unwrap();
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(read(dir.path(), "u1").unwrap(), Some(s));
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(v["cdiVersion"], CDI_VERSION);
        assert_eq!(v["kind"], CDI_KIND);
        remove(dir.path(), "u1").unwrap();
        remove(dir.path(), "u1").unwrap();
        assert_eq!(read(dir.path(), "u1").unwrap(), None);
    }
}
