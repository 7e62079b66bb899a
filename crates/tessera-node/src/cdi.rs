//! The CDI kind of the node's NVIDIA spec (`--nvidia-cdi-kind` of both kubelet plugins):
//! `<vendor>/<class>`, `nvidia.com/gpu` for the spec `nvidia-ctk cdi generate
//! --device-name-strategy=uuid` writes (one device per GPU, named by its UUID).
//!
//! The kind's syntax is the CDI parser's (`tags.cncf.io/container-device-interface/pkg/parser`:
//! `ValidateVendorName`, `ValidateClassName`); a device of the kind is named
//! `<kind>=<device>` (the parser's `QualifiedName`). The device plugin names these devices in
//! its `Allocate` answers, the DRA driver in its per-claim CDI specs.

use std::fmt;
use std::str::FromStr;

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
}
