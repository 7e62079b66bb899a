//! The node's NVIDIA CDI devices in an `Allocate` answer (`--nvidia-cdi-kind`).
//!
//! On a node whose container runtime reads no `NVIDIA_VISIBLE_DEVICES` (containerd with plain
//! runc and CDI on, the containerd 2.x default), a container only gets the driver (device
//! nodes, libraries, hooks) when the answer names the GPU's CDI devices: the kubelet passes
//! `ContainerAllocateResponse.cdi_devices` to the runtime (KEP-4009, GA in Kubernetes 1.31),
//! which applies the edits of the node's NVIDIA spec (`nvidia-ctk cdi generate
//! --device-name-strategy=uuid`: kind `nvidia.com/gpu`, one device per GPU named by its UUID).
//!
//! The names follow NVIDIA's own device plugin with `--device-list-strategy=cdi-cri`
//! (NVIDIA/k8s-device-plugin, `internal/plugin/server.go`, `updateResponseForCDI`): one
//! `CDIDevice` per GPU of the container, named `<vendor>/<class>=<GPU UUID>` (the CDI parser's
//! `QualifiedName`, `nvidia.com` + `gpu` by default). The kind's syntax is the CDI parser's
//! (`tags.cncf.io/container-device-interface/pkg/parser`: `ValidateVendorName`,
//! `ValidateClassName`).

use std::fmt;
use std::str::FromStr;

use crate::proto::deviceplugin::CdiDevice;

/// Why a CDI kind was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CdiKindError {
    /// Not `<vendor>/<class>`.
    #[error("{0:?} is not a CDI kind <vendor>/<class>, e.g. nvidia.com/gpu")]
    Shape(String),
    /// A vendor or class with characters CDI refuses.
    #[error(
        "CDI {part} {name:?} must start with a letter, end with a letter or digit and hold \
         only letters, digits, '_', '-' and '.'"
    )]
    Name {
        /// `vendor` or `class`.
        part: &'static str,
        /// What was given.
        name: String,
    },
}

/// A CDI kind (`vendor/class`, e.g. `nvidia.com/gpu`), checked as the CDI parser checks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiKind(String);

impl CdiKind {
    /// The kind as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The fully qualified name of the kind's device `name`: `<kind>=<name>`.
    pub fn qualified(&self, name: &str) -> String {
        format!("{}={name}", self.0)
    }

    /// One CDI device per GPU (by UUID), in the order given.
    pub fn devices<'a>(&self, uuids: impl IntoIterator<Item = &'a str>) -> Vec<CdiDevice> {
        uuids
            .into_iter()
            .map(|u| CdiDevice {
                name: self.qualified(u),
            })
            .collect()
    }
}

impl FromStr for CdiKind {
    type Err = CdiKindError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let Some((vendor, class)) = s.split_once('/') else {
            return Err(CdiKindError::Shape(s.to_owned()));
        };
        if vendor.is_empty() || class.is_empty() {
            return Err(CdiKindError::Shape(s.to_owned()));
        }
        for (part, name) in [("vendor", vendor), ("class", class)] {
            if !valid_name(name) {
                return Err(CdiKindError::Name {
                    part,
                    name: name.to_owned(),
                });
            }
        }
        Ok(CdiKind(s.to_owned()))
    }
}

impl fmt::Display for CdiKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A CDI vendor or class name: a letter first, a letter or digit last, and letters, digits,
/// `_`, `-`, `.` between.
fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    let (Some(first), Some(last)) = (b.first(), b.last()) else {
        return false;
    };
    first.is_ascii_alphabetic()
        && last.is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_as_the_cdi_parser_checks_them() {
        for ok in ["nvidia.com/gpu", "example.org/my_gpu-2.x", "a/b", "N/G1"] {
            let k: CdiKind = ok.parse().unwrap();
            assert_eq!(k.as_str(), ok);
            assert_eq!(k.to_string(), ok);
        }
        for shape in ["", "nvidia.com", "/gpu", "nvidia.com/", "/"] {
            assert_eq!(
                shape.parse::<CdiKind>(),
                Err(CdiKindError::Shape(shape.into())),
                "{shape:?}"
            );
        }
        for (bad, part) in [
            ("1vendor/gpu", "vendor"),
            ("nvidia.com./gpu", "vendor"),
            ("nvi dia/gpu", "vendor"),
            ("nvidia.com/gpu/x", "class"),
            ("nvidia.com/gpu=x", "class"),
            ("nvidia.com/-gpu", "class"),
            ("nvidia.com/gpü", "class"),
        ] {
            match bad.parse::<CdiKind>() {
                Err(CdiKindError::Name { part: p, .. }) => assert_eq!(p, part, "{bad:?}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        let err = "nvidia.com".parse::<CdiKind>().unwrap_err().to_string();
        assert!(err.contains("<vendor>/<class>"), "{err}");
    }

    #[test]
    fn devices_are_named_kind_equals_uuid_in_order() {
        let k: CdiKind = "nvidia.com/gpu".parse().unwrap();
        let names: Vec<String> = k
            .devices(["GPU-b", "GPU-a"])
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert_eq!(names, ["nvidia.com/gpu=GPU-b", "nvidia.com/gpu=GPU-a"]);
        assert!(k.devices([]).is_empty());
    }
}
