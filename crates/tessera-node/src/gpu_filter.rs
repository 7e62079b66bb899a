//! [`GpuFilter`]: which of the node's GPUs a kubelet plugin offers (`--gpus` of both plugins),
//! for nodes where some GPUs are left to another plugin.
//!
//! The list names GPUs by NVML index (`0`) or UUID (`GPU-...`, as NVML and `nvidia-smi -L`
//! write it; compared without regard to case), comma-separated, or is `all` (the default). A
//! GPU is offered when any item names it. An item that names no GPU of the node is not an
//! error (GPUs come and go): [`GpuFilter::warn_at_start`] says so once at start, and loudly
//! when the filter leaves the plugin nothing to offer.

use std::fmt;
use std::str::FromStr;

/// Why a `--gpus` list was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuFilterError {
    /// Nothing at all (`all` offers every GPU).
    #[error("an empty list: name GPUs by NVML index or UUID (`0,GPU-...`), or `all`")]
    Empty,
    /// An empty item: two commas in a row, or one at an end.
    #[error("an empty item in {list:?} (two commas in a row, or one at an end)")]
    EmptyItem {
        /// The whole list.
        list: String,
    },
    /// Neither an index nor a GPU UUID.
    #[error("{item:?} is neither an NVML index nor a GPU UUID (`GPU-` and hex digits)")]
    Malformed {
        /// The item.
        item: String,
    },
    /// `all` in a list of GPUs.
    #[error("`all` must stand alone, not in a list of GPUs")]
    AllInList,
}

/// One GPU the list names.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Item {
    /// By NVML index.
    Index(u32),
    /// By UUID, lower case after the `GPU-` prefix.
    Uuid(String),
}

impl Item {
    fn parse(s: &str) -> Result<Self, GpuFilterError> {
        let malformed = || GpuFilterError::Malformed { item: s.to_owned() };
        if s.bytes().all(|b| b.is_ascii_digit()) {
            return s.parse().map(Item::Index).map_err(|_| malformed());
        }
        let rest = s
            .get(..4)
            .filter(|p| p.eq_ignore_ascii_case("GPU-"))
            .map(|_| &s[4..])
            .ok_or_else(malformed)?;
        let hex = rest.bytes().any(|b| b.is_ascii_hexdigit());
        if !hex || !rest.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
            return Err(malformed());
        }
        Ok(Item::Uuid(format!("GPU-{}", rest.to_ascii_lowercase())))
    }

    fn names(&self, index: u32, uuid: &str) -> bool {
        match self {
            Item::Index(i) => *i == index,
            Item::Uuid(u) => u.eq_ignore_ascii_case(uuid),
        }
    }
}

impl fmt::Display for Item {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Item::Index(i) => write!(f, "{i}"),
            Item::Uuid(u) => f.write_str(u),
        }
    }
}

/// The GPUs a plugin offers: every one (the default), or those a list names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuFilter {
    /// `None`: every GPU.
    items: Option<Vec<Item>>,
}

impl GpuFilter {
    /// Every GPU (`all`).
    pub fn all() -> Self {
        Self::default()
    }

    /// Whether this is `all`.
    pub fn is_all(&self) -> bool {
        self.items.is_none()
    }

    /// Whether the GPU at NVML index `index` with UUID `uuid` is offered.
    pub fn admits(&self, index: u32, uuid: &str) -> bool {
        match &self.items {
            None => true,
            Some(items) => items.iter().any(|i| i.names(index, uuid)),
        }
    }

    /// Whether GPU `index` is left out whatever its UUID: the list names other indexes and no
    /// UUID (what can be checked before the GPUs are read).
    pub fn excludes_index(&self, index: u32) -> bool {
        match &self.items {
            None => false,
            Some(items) => items
                .iter()
                .all(|i| matches!(i, Item::Index(x) if *x != index)),
        }
    }

    /// The items that name none of `node`'s GPUs (index, UUID), as written back.
    fn unmatched(&self, node: &[(u32, &str)]) -> Vec<String> {
        self.items
            .iter()
            .flatten()
            .filter(|i| !node.iter().any(|(index, uuid)| i.names(*index, uuid)))
            .map(Item::to_string)
            .collect()
    }

    /// Logs, at start, each item that names none of `node`'s GPUs (index, UUID) as a warning
    /// (not an error: GPUs come and go, and one that appears later is offered), and as an
    /// error when the list leaves nothing of the node's GPUs to offer (the plugin still runs).
    pub fn warn_at_start(&self, node: &[(u32, &str)]) {
        if self.is_all() {
            return;
        }
        for item in self.unmatched(node) {
            tracing::warn!(
                "--gpus names GPU {item}, which this node does not have (ignored; offered if \
                 it appears)"
            );
        }
        if !node.iter().any(|(index, uuid)| self.admits(*index, uuid)) {
            let have: Vec<String> = node.iter().map(|(i, u)| format!("{i} ({u})")).collect();
            tracing::error!(
                "--gpus {self} admits none of this node's {} GPUs [{}]: this plugin offers NO \
                 GPU",
                node.len(),
                have.join(", ")
            );
        }
    }
}

impl FromStr for GpuFilter {
    type Err = GpuFilterError;

    /// `all`, or NVML indexes and GPU UUIDs, comma-separated (spaces around items ignored).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let list = s.trim();
        if list.is_empty() {
            return Err(GpuFilterError::Empty);
        }
        if list.eq_ignore_ascii_case("all") {
            return Ok(Self::all());
        }
        let mut items: Vec<Item> = Vec::new();
        for raw in list.split(',').map(str::trim) {
            if raw.is_empty() {
                return Err(GpuFilterError::EmptyItem { list: s.to_owned() });
            }
            if raw.eq_ignore_ascii_case("all") {
                return Err(GpuFilterError::AllInList);
            }
            let item = Item::parse(raw)?;
            if !items.contains(&item) {
                items.push(item);
            }
        }
        Ok(Self { items: Some(items) })
    }
}

impl fmt::Display for GpuFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.items {
            None => f.write_str("all"),
            Some(items) => {
                let shown: Vec<String> = items.iter().map(Item::to_string).collect();
                f.write_str(&shown.join(","))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "GPU-5a4d7f6e-1b2c-4d3e-8f90-a1b2c3d4e5f6";
    const B: &str = "GPU-00000000-0000-4000-8000-000000000001";

    fn f(s: &str) -> GpuFilter {
        s.parse().unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    #[test]
    fn all_admits_every_gpu_and_is_the_default() {
        for s in ["all", " ALL "] {
            let all = f(s);
            assert!(all.is_all() && all == GpuFilter::default());
            assert!(all.admits(0, A) && all.admits(7, B));
            assert!(!all.excludes_index(3));
            assert_eq!(all.to_string(), "all");
            assert!(all.unmatched(&[]).is_empty());
        }
    }

    #[test]
    fn indexes_and_uuids_admit_what_they_name_and_uuids_ignore_case() {
        let g = f(&format!(
            " 1 , {} ",
            A.to_uppercase().replace("GPU-", "gpu-")
        ));
        assert!(!g.is_all());
        assert!(g.admits(1, B), "by index");
        assert!(g.admits(0, A), "by UUID, case aside");
        assert!(g.admits(5, &A.to_uppercase()));
        assert!(!g.admits(0, B) && !g.admits(2, "GPU-ffff"));
        // Written back canonically: NVML's lower case after `GPU-`.
        assert_eq!(g.to_string(), format!("1,{A}"));
        // Repeats are one item.
        assert_eq!(f("0,0,00").to_string(), "0");
        let only = f("0,2");
        assert!(only.admits(2, A) && !only.admits(1, A));
    }

    #[test]
    fn an_index_is_excluded_beforehand_only_when_no_uuid_could_name_it() {
        assert!(f("1,2").excludes_index(0));
        assert!(!f("1,2").excludes_index(2));
        assert!(
            !f(&format!("1,{A}")).excludes_index(0),
            "the UUID may be GPU 0's"
        );
    }

    #[test]
    fn empty_or_malformed_items_are_refused_with_the_reason() {
        for (s, want) in [
            ("", GpuFilterError::Empty),
            ("  ", GpuFilterError::Empty),
            (
                "0,,1",
                GpuFilterError::EmptyItem {
                    list: "0,,1".into(),
                },
            ),
            ("0,", GpuFilterError::EmptyItem { list: "0,".into() }),
            (",0", GpuFilterError::EmptyItem { list: ",0".into() }),
            ("all,1", GpuFilterError::AllInList),
            ("1,all", GpuFilterError::AllInList),
        ] {
            assert_eq!(s.parse::<GpuFilter>(), Err(want), "{s:?}");
        }
        for bad in [
            "-1",
            "1.5",
            "gpu0",
            "GPU-",
            "GPU--",
            "GPU-xyz",
            "MIG-5a4d7f6e-1b2c-4d3e-8f90-a1b2c3d4e5f6",
            "99999999999",
            "0 1",
        ] {
            let err = format!("0,{bad}").parse::<GpuFilter>().unwrap_err();
            assert_eq!(
                err,
                GpuFilterError::Malformed { item: bad.into() },
                "{bad:?}"
            );
            assert!(err.to_string().contains(bad), "{err}");
        }
        let msg = GpuFilterError::Malformed { item: "x".into() }.to_string();
        assert!(msg.contains("NVML index") && msg.contains("GPU-"), "{msg}");
    }

    #[test]
    fn items_naming_no_gpu_of_the_node_are_reported_as_written_back() {
        let node = [(0, A), (1, B)];
        let g = f(&format!("1,7,{},GPU-abc", A.to_uppercase()));
        assert_eq!(g.unmatched(&node), ["7", "GPU-abc"]);
        assert!(f("0,1").unmatched(&node).is_empty());
        assert_eq!(f("3").unmatched(&[]), ["3"]);
        // Logging cannot fail, whatever matches.
        g.warn_at_start(&node);
        f("5").warn_at_start(&node);
        GpuFilter::all().warn_at_start(&[]);
    }
}
