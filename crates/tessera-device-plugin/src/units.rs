//! Device units: the ids the kubelet sees, and the rules that keep a request on one GPU.
//!
//! Each GPU is cut into `per_gpu` units with ids `<GPU UUID>-<n>`, `n` in `0..per_gpu`. A
//! request of at most `per_gpu` units must sit on one GPU (a *fraction*); a larger one must be
//! whole GPUs (a multiple of `per_gpu`). Everything here is pure, so it is unit-tested alone.
//! The allocation labels that tie an arbiter allocation to its units live here too, and the
//! [`Pool`]s that split each GPU's units between the best-effort and the latency resource.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use tessera_node::labels::{LABEL_OWNER, OWNER_DEVICE_PLUGIN};

/// The kubelet's limit on a device id's length.
pub(crate) const MAX_ID_LEN: usize = 63;

/// Label key holding the extended resource name the units belong to.
pub(crate) const LABEL_RESOURCE: &str = "tessera.dev/resource";
/// Label key holding the GPU UUID of the units.
pub(crate) const LABEL_GPU: &str = "tessera.dev/gpu";
/// Label key holding the unit numbers in compact form (`0-29,40`).
pub(crate) const LABEL_UNITS: &str = "tessera.dev/units";

/// Errors of the unit rules. Their messages reach the user through the kubelet's events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitsError {
    /// An id that is not `<GPU UUID>-<n>`.
    #[error("device id {0:?} is not a Tessera unit id (<GPU UUID>-<n>)")]
    BadId(String),
    /// A unit number past the GPU's unit count.
    #[error("device id {id:?}: unit {index} is out of range (each GPU has {per_gpu} units)")]
    OutOfRange {
        /// The id.
        id: String,
        /// Its unit number.
        index: u32,
        /// Units per GPU.
        per_gpu: u32,
    },
    /// The same id twice in one request.
    #[error("device id {0:?} appears twice in one request")]
    Duplicate(String),
    /// An id the kubelet would reject.
    #[error("device id {id:?} is {len} characters; the kubelet allows at most {MAX_ID_LEN}")]
    TooLong {
        /// The longest id of the GPU.
        id: String,
        /// Its length.
        len: usize,
    },
    /// A request for no units.
    #[error("a request must name at least one unit (got size {0})")]
    BadSize(i64),
    /// Above one GPU but not a multiple of it.
    #[error(
        "a request for {size} units is larger than one GPU ({per_gpu} units) and must be whole \
         GPUs: ask for a multiple of {per_gpu}"
    )]
    NotWholeGpus {
        /// Units asked for.
        size: u32,
        /// Units per GPU.
        per_gpu: u32,
    },
    /// No single GPU has enough free units.
    #[error(
        "no single GPU has {size} free units (the most free on one GPU is {best}); \
         a fraction must fit on one GPU"
    )]
    NoFit {
        /// Units asked for.
        size: u32,
        /// Most free units on any one GPU.
        best: u32,
    },
    /// Not enough completely free GPUs.
    #[error("the request needs {needed} whole free GPUs but only {free} are completely free")]
    NotEnoughWholeGpus {
        /// GPUs needed.
        needed: u32,
        /// GPUs with all their units free.
        free: u32,
    },
    /// The units that must be included cannot be honoured.
    #[error("the units that must be included ({0}) do not fit a one-GPU or whole-GPU request")]
    MustInclude(String),
    /// A set over several GPUs that is not whole GPUs.
    #[error(
        "the units are spread over {gpus} GPUs ({detail}) but are not whole GPUs; a request \
         above one GPU must be a multiple of {per_gpu} units, and a smaller one must sit on one GPU"
    )]
    SpreadNotWhole {
        /// Number of GPUs touched.
        gpus: usize,
        /// Units per GPU touched, for the message.
        detail: String,
        /// Units per GPU.
        per_gpu: u32,
    },
    /// A malformed units label.
    #[error("bad units label {0:?}")]
    BadLabel(String),
    /// A unit of the other extended resource of the same GPU (the kubelet hands each resource
    /// only its own, so this is a confused or forged request).
    #[error(
        "device id {id:?}: unit {index} is not one of this resource's units ({first}..{end} of \
         each GPU)"
    )]
    OtherPool {
        /// The id.
        id: String,
        /// Its unit number.
        index: u32,
        /// This resource's first unit number.
        first: u32,
        /// One past its last.
        end: u32,
    },
}

/// The unit numbers `first..end` of each GPU that one extended resource advertises. With a
/// latency split the best-effort resource has the low numbers and the latency resource the
/// high ones: one GPU's units are cut once, so the shares and memory of the two resources
/// can never add up to more than the card.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool {
    /// First unit number.
    pub first: u32,
    /// One past the last.
    pub end: u32,
}

impl Pool {
    /// Every unit of a GPU cut into `per_gpu` (no split).
    pub fn all(per_gpu: u32) -> Self {
        Pool {
            first: 0,
            end: per_gpu,
        }
    }

    /// The best-effort and the latency pools when `latency` of a GPU's `per_gpu` units are
    /// set apart for the latency resource (`latency < per_gpu`, checked by the caller).
    pub fn split(per_gpu: u32, latency: u32) -> (Self, Self) {
        let cut = per_gpu.saturating_sub(latency);
        (
            Pool { first: 0, end: cut },
            Pool {
                first: cut,
                end: per_gpu,
            },
        )
    }

    /// Units per GPU in the pool.
    pub fn len(&self) -> u32 {
        self.end.saturating_sub(self.first)
    }

    /// Whether the pool has no unit.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ids of the pool's units of one GPU, in order.
    pub fn ids(&self, uuid: &str) -> Vec<String> {
        (self.first..self.end)
            .map(|n| format!("{uuid}-{n}"))
            .collect()
    }

    /// Refuses any id that is malformed or not one of the pool's units.
    pub fn check(&self, ids: &[String]) -> Result<(), UnitsError> {
        for id in ids {
            let u = UnitId::parse(id)?;
            if !(self.first..self.end).contains(&u.index) {
                return Err(UnitsError::OtherPool {
                    id: id.clone(),
                    index: u.index,
                    first: self.first,
                    end: self.end,
                });
            }
        }
        Ok(())
    }
}

/// One unit: GPU UUID plus unit number.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct UnitId {
    /// GPU UUID, `GPU-...`.
    pub uuid: String,
    /// Unit number on that GPU.
    pub index: u32,
}

impl UnitId {
    /// Parses `<uuid>-<n>`; the UUID itself contains dashes, so the number is the last part.
    pub(crate) fn parse(id: &str) -> Result<Self, UnitsError> {
        let bad = || UnitsError::BadId(id.to_owned());
        let (uuid, n) = id.rsplit_once('-').ok_or_else(bad)?;
        if uuid.is_empty() || n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        // Leading zeros would give two ids for one unit.
        if n.len() > 1 && n.starts_with('0') {
            return Err(bad());
        }
        let index = n.parse().map_err(|_| bad())?;
        Ok(Self {
            uuid: uuid.to_owned(),
            index,
        })
    }

    fn parse_checked(id: &str, per_gpu: u32) -> Result<Self, UnitsError> {
        let u = Self::parse(id)?;
        if u.index >= per_gpu {
            return Err(UnitsError::OutOfRange {
                id: id.to_owned(),
                index: u.index,
                per_gpu,
            });
        }
        Ok(u)
    }
}

impl fmt::Display for UnitId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.uuid, self.index)
    }
}

/// The ids of every unit of one GPU, in order.
pub(crate) fn unit_ids(uuid: &str, per_gpu: u32) -> Vec<String> {
    (0..per_gpu).map(|n| format!("{uuid}-{n}")).collect()
}

/// Checks that the GPU's longest unit id fits the kubelet's limit.
pub(crate) fn check_id_len(uuid: &str, per_gpu: u32) -> Result<(), UnitsError> {
    let id = format!("{uuid}-{}", per_gpu.saturating_sub(1));
    if id.len() > MAX_ID_LEN {
        return Err(UnitsError::TooLong { len: id.len(), id });
    }
    Ok(())
}

/// What a set of units amounts to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Claim {
    /// Units of one GPU (possibly all of them).
    Fraction {
        /// The GPU.
        uuid: String,
        /// Unit numbers, sorted.
        units: Vec<u32>,
    },
    /// All units of two or more GPUs.
    WholeGpus {
        /// The GPUs, sorted.
        uuids: Vec<String>,
    },
}

/// Groups ids by GPU, rejecting bad and repeated ids.
fn group(ids: &[String], per_gpu: u32) -> Result<BTreeMap<String, BTreeSet<u32>>, UnitsError> {
    let mut by_gpu: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
    for id in ids {
        let u = UnitId::parse_checked(id, per_gpu)?;
        if !by_gpu.entry(u.uuid).or_default().insert(u.index) {
            return Err(UnitsError::Duplicate(id.clone()));
        }
    }
    Ok(by_gpu)
}

/// Classifies the units the kubelet chose for one container. Units spread over several GPUs
/// are accepted only as whole GPUs.
pub(crate) fn classify(ids: &[String], per_gpu: u32) -> Result<Claim, UnitsError> {
    if ids.is_empty() {
        return Err(UnitsError::BadSize(0));
    }
    let by_gpu = group(ids, per_gpu)?;
    if by_gpu.len() == 1 {
        let (uuid, units) = by_gpu.into_iter().next().expect("one group");
        return Ok(Claim::Fraction {
            uuid,
            units: units.into_iter().collect(),
        });
    }
    if by_gpu.values().any(|u| u.len() != per_gpu as usize) {
        let detail = by_gpu
            .iter()
            .map(|(g, u)| format!("{g}: {} units", u.len()))
            .collect::<Vec<_>>()
            .join(", ");
        return Err(UnitsError::SpreadNotWhole {
            gpus: by_gpu.len(),
            detail,
            per_gpu,
        });
    }
    Ok(Claim::WholeGpus {
        uuids: by_gpu.into_keys().collect(),
    })
}

/// Picks `size` units from `available` the way this plugin wants them placed:
/// - `size <= per_gpu`: all on one GPU, the one with the fewest free units that still fits
///   (best fit, so large holes stay free for large requests); lowest unit numbers first.
/// - `size > per_gpu`: a multiple of `per_gpu`, as that many completely free GPUs.
///
/// Units in `must_include` are always part of the answer (the kubelet requires it).
pub(crate) fn preferred(
    available: &[String],
    must_include: &[String],
    size: i64,
    per_gpu: u32,
) -> Result<Vec<String>, UnitsError> {
    let size = match u32::try_from(size) {
        Ok(s) if s > 0 => s,
        _ => return Err(UnitsError::BadSize(size)),
    };
    // The pool is what is free plus what must be reused; parse both, ignoring repeats.
    let mut free: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
    for id in available.iter().chain(must_include) {
        let u = UnitId::parse_checked(id, per_gpu)?;
        free.entry(u.uuid).or_default().insert(u.index);
    }
    let mut must: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
    for id in must_include {
        let u = UnitId::parse_checked(id, per_gpu)?;
        must.entry(u.uuid).or_default().insert(u.index);
    }
    let must_count: usize = must.values().map(BTreeSet::len).sum();
    if must_count > size as usize {
        return Err(UnitsError::MustInclude(format!(
            "{must_count} units for a request of {size}"
        )));
    }

    if size <= per_gpu {
        let candidates: Vec<&String> = match must.len() {
            0 => free.keys().collect(),
            1 => must.keys().collect(),
            n => return Err(UnitsError::MustInclude(format!("units on {n} GPUs"))),
        };
        let best = candidates
            .iter()
            .map(|g| (free[*g].len(), *g))
            .filter(|(n, _)| *n >= size as usize)
            .min();
        let Some((_, uuid)) = best else {
            let most = free.values().map(BTreeSet::len).max().unwrap_or(0);
            return Err(UnitsError::NoFit {
                size,
                best: most as u32,
            });
        };
        let wanted = must.get(uuid).cloned().unwrap_or_default();
        let rest = free[uuid].iter().filter(|n| !wanted.contains(n)).copied();
        let picked = wanted.iter().copied().chain(rest).take(size as usize);
        let mut out: Vec<u32> = picked.collect();
        out.sort_unstable();
        return Ok(out.into_iter().map(|n| format!("{uuid}-{n}")).collect());
    }

    if size % per_gpu != 0 {
        return Err(UnitsError::NotWholeGpus { size, per_gpu });
    }
    let needed = size / per_gpu;
    let whole: Vec<&String> = free
        .iter()
        .filter(|(_, u)| u.len() == per_gpu as usize)
        .map(|(g, _)| g)
        .collect();
    if let Some(g) = must.keys().find(|g| !whole.contains(g)) {
        return Err(UnitsError::MustInclude(format!(
            "{g} is not completely free"
        )));
    }
    if (whole.len() as u32) < needed {
        return Err(UnitsError::NotEnoughWholeGpus {
            needed,
            free: whole.len() as u32,
        });
    }
    // GPUs holding must-include units first, then the rest in UUID order.
    let mut chosen: Vec<&String> = whole
        .iter()
        .copied()
        .filter(|g| must.contains_key(*g))
        .collect();
    chosen.extend(whole.iter().copied().filter(|g| !must.contains_key(*g)));
    chosen.truncate(needed as usize);
    chosen.sort();
    Ok(chosen
        .into_iter()
        .flat_map(|g| unit_ids(g, per_gpu))
        .collect())
}

/// Compact text for a set of unit numbers: `0-29,40,42-43`. Keeps labels small (the admin
/// protocol has a frame limit, and a fraction may hold a hundred units).
pub(crate) fn encode_units(units: &BTreeSet<u32>) -> String {
    let mut parts = Vec::new();
    let mut iter = units.iter().copied().peekable();
    while let Some(start) = iter.next() {
        let mut end = start;
        while iter.peek() == Some(&(end + 1)) {
            end += 1;
            iter.next();
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
    }
    parts.join(",")
}

/// Inverse of [`encode_units`].
pub(crate) fn decode_units(text: &str) -> Result<BTreeSet<u32>, UnitsError> {
    let bad = || UnitsError::BadLabel(text.to_owned());
    let mut out = BTreeSet::new();
    if text.is_empty() {
        return Ok(out);
    }
    for part in text.split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let a: u32 = a.parse().map_err(|_| bad())?;
        let b: u32 = b.parse().map_err(|_| bad())?;
        // A bound stops a corrupt label from asking for billions of entries.
        if a > b || b - a > 100_000 {
            return Err(bad());
        }
        out.extend(a..=b);
    }
    Ok(out)
}

/// Labels for an allocation holding `units` of GPU `uuid` for resource `resource`.
pub(crate) fn allocation_labels(
    resource: &str,
    uuid: &str,
    units: &BTreeSet<u32>,
) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_OWNER.to_owned(), OWNER_DEVICE_PLUGIN.to_owned()),
        (LABEL_RESOURCE.to_owned(), resource.to_owned()),
        (LABEL_GPU.to_owned(), uuid.to_owned()),
        (LABEL_UNITS.to_owned(), encode_units(units)),
    ])
}

/// The unit ids of an allocation made by this plugin for `resource`; `None` for allocations
/// made by anyone else (or for another resource), which the plugin never touches.
pub(crate) fn units_from_labels(
    labels: &BTreeMap<String, String>,
    resource: &str,
) -> Option<Vec<String>> {
    if labels.get(LABEL_OWNER).map(String::as_str) != Some(OWNER_DEVICE_PLUGIN)
        || labels.get(LABEL_RESOURCE).map(String::as_str) != Some(resource)
    {
        return None;
    }
    let uuid = labels.get(LABEL_GPU)?;
    let units = decode_units(labels.get(LABEL_UNITS)?).ok()?;
    Some(units.into_iter().map(|n| format!("{uuid}-{n}")).collect())
}

/// Memory limit for `units` of a card with `memory_total` bytes: the same fraction, rounded
/// down so the parts never add up to more than the card.
pub(crate) fn memory_for(units: u32, per_gpu: u32, memory_total: u64) -> u64 {
    (u128::from(memory_total) * u128::from(units) / u128::from(per_gpu.max(1))) as u64
}

/// Compute weight (1..=100) for `units`: the same fraction of 100, rounded up so one unit is
/// never weightless.
pub(crate) fn share_for(units: u32, per_gpu: u32) -> u32 {
    let per_gpu = per_gpu.max(1);
    (units.saturating_mul(100).div_ceil(per_gpu)).clamp(1, 100)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
    const B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000000";
    const C: &str = "GPU-cccccccc-0000-0000-0000-000000000000";

    fn ids(uuid: &str, range: std::ops::Range<u32>) -> Vec<String> {
        range.map(|n| format!("{uuid}-{n}")).collect()
    }

    #[test]
    fn id_round_trip_and_rejects() {
        let u = UnitId::parse(&format!("{A}-42")).unwrap();
        assert_eq!(u.uuid, A);
        assert_eq!(u.index, 42);
        assert_eq!(u.to_string(), format!("{A}-42"));
        for bad in [
            "",
            "nodash",
            "GPU-x-",
            "-3",
            "GPU-x-1a",
            "GPU-x-01",
            "GPU-x-99999999999",
        ] {
            assert!(UnitId::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(matches!(
            UnitId::parse_checked(&format!("{A}-100"), 100),
            Err(UnitsError::OutOfRange { index: 100, .. })
        ));
    }

    #[test]
    fn id_length_limit() {
        // GPU- + 36 + -99 = 43 characters: fine. MIG-style long UUIDs are refused.
        assert!(check_id_len(A, 100).is_ok());
        assert_eq!(format!("{A}-99").len(), 43);
        let long = format!("MIG-{}", "x".repeat(57));
        assert!(matches!(
            check_id_len(&long, 100),
            Err(UnitsError::TooLong { .. })
        ));
        assert_eq!(
            unit_ids(A, 3),
            vec![format!("{A}-0"), format!("{A}-1"), format!("{A}-2")]
        );
    }

    #[test]
    fn best_fit_picks_fullest_gpu_that_fits() {
        // A has 100 free, B has 40 free, C has 20 free.
        let mut avail = ids(A, 0..100);
        avail.extend(ids(B, 60..100));
        avail.extend(ids(C, 80..100));
        assert_eq!(preferred(&avail, &[], 30, 100).unwrap(), ids(B, 60..90));
        assert_eq!(preferred(&avail, &[], 20, 100).unwrap(), ids(C, 80..100));
        assert_eq!(preferred(&avail, &[], 41, 100).unwrap(), ids(A, 0..41));
        assert_eq!(preferred(&avail, &[], 100, 100).unwrap(), ids(A, 0..100));
    }

    #[test]
    fn no_single_gpu_fits_is_an_error() {
        let mut avail = ids(A, 0..20);
        avail.extend(ids(B, 0..20));
        assert_eq!(
            preferred(&avail, &[], 30, 100).unwrap_err(),
            UnitsError::NoFit { size: 30, best: 20 }
        );
    }

    #[test]
    fn must_include_is_honoured() {
        let mut avail = ids(A, 0..100);
        avail.extend(ids(B, 50..100));
        // Best fit alone would take B; the must-include unit on A wins.
        let must = vec![format!("{A}-7")];
        let got = preferred(&avail, &must, 10, 100).unwrap();
        assert_eq!(got.len(), 10);
        assert!(got.contains(&must[0]));
        assert!(got.iter().all(|g| g.starts_with(A)));
        // Must-include units on two GPUs cannot make a fraction.
        let must2 = vec![format!("{A}-7"), format!("{B}-60")];
        assert!(matches!(
            preferred(&avail, &must2, 10, 100),
            Err(UnitsError::MustInclude(_))
        ));
        // More must-include units than the size.
        assert!(matches!(
            preferred(&avail, &must2, 1, 100),
            Err(UnitsError::MustInclude(_))
        ));
    }

    #[test]
    fn whole_gpu_requests() {
        let mut avail = ids(A, 0..100);
        avail.extend(ids(B, 0..100));
        avail.extend(ids(C, 1..100)); // C is partly used
        let got = preferred(&avail, &[], 200, 100).unwrap();
        let mut want = ids(A, 0..100);
        want.extend(ids(B, 0..100));
        assert_eq!(got, want);
        assert_eq!(
            preferred(&avail, &[], 150, 100).unwrap_err(),
            UnitsError::NotWholeGpus {
                size: 150,
                per_gpu: 100
            }
        );
        assert_eq!(
            preferred(&avail, &[], 300, 100).unwrap_err(),
            UnitsError::NotEnoughWholeGpus { needed: 3, free: 2 }
        );
        // Must-include on B puts B first among the chosen.
        let got = preferred(&avail, &[format!("{B}-3")], 100, 100).unwrap();
        assert_eq!(got, ids(B, 0..100));
        assert!(preferred(&avail, &[], 0, 100).is_err());
        assert!(preferred(&avail, &[], -5, 100).is_err());
    }

    #[test]
    fn classify_fraction_whole_and_spread() {
        assert_eq!(
            classify(&ids(A, 5..35), 100).unwrap(),
            Claim::Fraction {
                uuid: A.into(),
                units: (5..35).collect()
            }
        );
        let mut two = ids(B, 0..100);
        two.extend(ids(A, 0..100));
        assert_eq!(
            classify(&two, 100).unwrap(),
            Claim::WholeGpus {
                uuids: vec![A.into(), B.into()]
            }
        );
        let mut spread = ids(A, 0..20);
        spread.extend(ids(B, 0..10));
        let err = classify(&spread, 100).unwrap_err();
        assert!(matches!(err, UnitsError::SpreadNotWhole { gpus: 2, .. }));
        assert!(err.to_string().contains("20 units"), "{err}");
        let dup = vec![format!("{A}-1"), format!("{A}-1")];
        assert!(matches!(classify(&dup, 100), Err(UnitsError::Duplicate(_))));
        assert!(classify(&[], 100).is_err());
        assert!(classify(&["junk".into()], 100).is_err());
    }

    #[test]
    fn unit_label_codec() {
        let set: BTreeSet<u32> = [0, 1, 2, 5, 7, 8, 99].into_iter().collect();
        assert_eq!(encode_units(&set), "0-2,5,7-8,99");
        assert_eq!(decode_units("0-2,5,7-8,99").unwrap(), set);
        assert_eq!(decode_units("").unwrap(), BTreeSet::new());
        for bad in ["x", "3-1", "1,,2", "0-4000000000"] {
            assert!(decode_units(bad).is_err(), "{bad:?}");
        }
        let labels = allocation_labels("tessera.dev/gpu-shares", A, &set);
        let back = units_from_labels(&labels, "tessera.dev/gpu-shares").unwrap();
        assert_eq!(back.len(), 7);
        assert_eq!(back[3], format!("{A}-5"));
        assert!(units_from_labels(&labels, "other/resource").is_none());
        assert!(units_from_labels(&BTreeMap::new(), "tessera.dev/gpu-shares").is_none());
    }

    #[test]
    fn a_split_cuts_each_gpu_once_and_each_pool_refuses_the_others_units() {
        let (be, lat) = Pool::split(100, 30);
        assert_eq!((be.first, be.end, lat.first, lat.end), (0, 70, 70, 100));
        assert_eq!(be.len() + lat.len(), 100);
        assert_eq!(be.ids(A), ids(A, 0..70));
        assert_eq!(lat.ids(A), ids(A, 70..100));
        be.check(&ids(A, 0..70)).unwrap();
        lat.check(&ids(B, 70..100)).unwrap();
        assert!(matches!(
            be.check(&ids(A, 69..71)),
            Err(UnitsError::OtherPool { index: 70, .. })
        ));
        assert!(matches!(
            lat.check(&ids(A, 0..1)),
            Err(UnitsError::OtherPool { index: 0, .. })
        ));
        assert!(lat.check(&[format!("{A}-100")]).is_err());
        assert!(lat.check(&["junk".into()]).is_err());
        // No split: one pool of every unit.
        assert_eq!(Pool::split(100, 0).0, Pool::all(100));
        assert!(Pool::split(100, 0).1.is_empty());
        // The parts' shares never add up past the card.
        assert!(share_for(be.len(), 100) + share_for(lat.len(), 100) <= 100);
    }

    #[test]
    fn memory_and_share() {
        let gib = 1u64 << 30;
        assert_eq!(memory_for(30, 100, 80 * gib), 24 * gib);
        assert_eq!(memory_for(100, 100, 80 * gib), 80 * gib);
        // Rounded down: three thirds never exceed the card.
        assert!(3 * memory_for(1, 3, 10) <= 10);
        assert_eq!(share_for(30, 100), 30);
        assert_eq!(share_for(3, 10), 30);
        assert_eq!(share_for(1, 1000), 1);
        assert_eq!(share_for(10, 10), 100);
    }
}
