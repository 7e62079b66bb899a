//! The process-local ledger: every live object this process allocated through a hook, with
//! the bytes it was charged. Frees of objects not in it pass through untouched.
//!
//! `cuMemCreate` handles are kept apart ([`Ledger::create_handle`] and friends): their memory
//! lives until the handle has been released *and* every mapping of it unmapped (the driver
//! keeps released-but-mapped memory), and `cuMemRetainAllocationHandle` adds references that
//! need their own `cuMemRelease`. So each counted handle has a reference count and a map count,
//! and each mapping of a counted handle is remembered by its address, since `cuMemUnmap` names
//! an address range, not a handle.
//!
//! Imported handles (`cuMemImportFromShareableHandle`) are kept apart too ([`Ledger::import`]):
//! the driver keeps the memory behind them while any process holds a handle or a mapping of it,
//! whoever created it, so it is charged here from this process's import of it until its last
//! release and unmap. The charge belongs to the memory, not the handle: two imports of the same
//! memory ([`ImportKey`]) share one entry and count once. Its size is the shared object's size
//! when the descriptor tells it (charged from the import), else what is mapped of it (charged
//! from the first mapping).

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// The namespace of a key: device pointers, `cuMemCreate` handles and arrays can collide
/// numerically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A device pointer (`cuMemAlloc*`, managed, pitch, async, pool).
    Ptr,
    /// A `CUarray`.
    Array,
    /// A `CUmipmappedArray`.
    Mipmap,
}

/// A fast hasher for pointer-like keys (no hostile input: keys come from the driver).
#[derive(Debug, Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }
    fn write_u8(&mut self, v: u8) {
        self.write_u64(u64::from(v) << 56);
    }
    fn write_isize(&mut self, v: isize) {
        self.write_u64(v as u64);
    }
}

/// A counted `cuMemCreate` handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandleEntry {
    /// Bytes charged at `cuMemCreate`.
    pub bytes: u64,
    /// References not yet released: the creation, plus each `cuMemRetainAllocationHandle`.
    pub refs: u32,
    /// Live `cuMemMap` mappings.
    pub maps: u32,
}

/// A live mapping of a counted handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    /// First address.
    pub va: u64,
    /// Length in bytes.
    pub size: u64,
    /// The handle mapped there.
    pub handle: u64,
    /// The imported memory mapped there, when the handle was imported.
    pub import: Option<(ImportKey, u64)>,
}

/// What identifies imported memory in this process: the (device, inode) of the shareable
/// descriptor when it is a sized file (the same for every import of one allocation), else the
/// handle itself (each import its own entry: never merged on a guess).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImportKey {
    File { dev: u64, ino: u64 },
    Handle(u64),
}

/// A handle `cuMemImportFromShareableHandle` returned here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportHandle {
    /// The memory behind it.
    pub key: ImportKey,
    /// Its size, 0 when unknown (then what is mapped of it is charged).
    pub bytes: u64,
    /// Imports of it not yet released.
    pub refs: u32,
}

/// Imported memory this process holds (a handle or a mapping of it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Imported {
    /// Its size, 0 when unknown.
    bytes: u64,
    /// Unreleased imports over all its handles here.
    refs: u32,
    maps: u32,
    /// Bytes of its live mappings.
    mapped: u64,
}

impl Imported {
    /// What it is charged: its size while held, or what is mapped when its size is unknown.
    fn charge(&self) -> u64 {
        match (self.refs == 0 && self.maps == 0, self.bytes) {
            (true, _) => 0,
            (_, 0) => self.mapped,
            (_, b) => b,
        }
    }

    fn held(&self) -> bool {
        self.refs > 0 || self.maps > 0
    }
}

/// What [`Ledger::release_begin`] took, to settle after the driver answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The last reference of an unmapped handle: the entry is gone, its bytes are to be
    /// released once the driver succeeded.
    Last(HandleEntry),
    /// One reference of a handle that stays (more references, or still mapped).
    NotLast,
    /// One import of an imported handle; `freed`: the charge its memory drops (the last
    /// import of memory no longer mapped here).
    Import { taken: ImportHandle, freed: u64 },
}

/// What [`Ledger::unmap_begin`] took out, to settle after the driver answered.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Unmapped {
    /// The mappings removed.
    pub maps: Vec<Mapping>,
    /// Handles whose last mapping went while no reference was left: gone from the ledger.
    pub gone: Vec<(u64, HandleEntry)>,
    /// Charge of imported memory that its unmapped mappings drop.
    pub imported: u64,
}

impl Unmapped {
    /// Bytes to release once the unmap succeeded.
    pub fn bytes(&self) -> u64 {
        self.gone.iter().map(|(_, e)| e.bytes).sum::<u64>() + self.imported
    }
}

/// Live objects and their sizes.
#[derive(Debug, Default)]
pub struct Ledger {
    map: HashMap<(Kind, u64), u64, BuildHasherDefault<KeyHasher>>,
    handles: HashMap<u64, HandleEntry, BuildHasherDefault<KeyHasher>>,
    mappings: BTreeMap<u64, Mapping>,
    imports: HashMap<u64, ImportHandle, BuildHasherDefault<KeyHasher>>,
    imported: HashMap<ImportKey, Imported>,
}

impl Ledger {
    /// Records a new object; returns the size of an entry it replaced (an object freed behind
    /// our back whose address the driver reused), which the caller must release.
    pub fn insert(&mut self, kind: Kind, key: u64, bytes: u64) -> Option<u64> {
        self.map.insert((kind, key), bytes)
    }

    /// Forgets an object; its size, if it was ours.
    pub fn remove(&mut self, kind: Kind, key: u64) -> Option<u64> {
        self.map.remove(&(kind, key))
    }

    /// Bytes of all live objects, counted handles and mapped imports included.
    pub fn total(&self) -> u64 {
        self.map.values().sum::<u64>()
            + self.handles.values().map(|e| e.bytes).sum::<u64>()
            + self.imported.values().map(Imported::charge).sum::<u64>()
    }

    /// Number of live objects, counted handles included.
    pub fn len(&self) -> usize {
        self.map.len() + self.handles.len()
    }

    /// True when nothing is live.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
            && self.handles.is_empty()
            && self.imports.is_empty()
            && self.imported.is_empty()
    }
}

// ---- VMM: cuMemCreate handles, imported memory, and the mappings of both -------------------

impl Ledger {
    // ---- cuMemCreate handles -------------------------------------------------------------

    /// Records a handle `cuMemCreate` just returned: one reference, no mapping. Returns the
    /// bytes of an entry it replaced (a handle value the driver reused, so the old one was
    /// destroyed behind our back), which the caller must release; that entry's mappings are
    /// forgotten with it.
    pub fn create_handle(&mut self, handle: u64, bytes: u64) -> Option<u64> {
        let old = self.handles.insert(
            handle,
            HandleEntry {
                bytes,
                refs: 1,
                maps: 0,
            },
        );
        if old.is_some() {
            self.mappings.retain(|_, m| m.handle != handle);
        }
        // A value once an imported handle: that one is gone (its mappings stay until unmapped).
        self.imports.remove(&handle);
        old.map(|e| e.bytes)
    }

    // ---- imported handles ----------------------------------------------------------------

    /// What importing the memory `key` (`bytes`, 0 when unknown) would add to the charge: its
    /// size unless this process holds it already.
    pub fn import_cost(&self, key: ImportKey, bytes: u64) -> u64 {
        match self.imported.get(&key) {
            Some(_) => 0,
            None => bytes,
        }
    }

    /// Records a handle `cuMemImportFromShareableHandle` just returned, of the memory `key`
    /// (`bytes`, 0 when unknown); returns what it added to the charge. An import answered
    /// with a handle this process created is one more reference of it (its charge is the
    /// creation's).
    pub fn import(&mut self, handle: u64, key: ImportKey, bytes: u64) -> u64 {
        if self.retain_handle(handle) {
            return 0;
        }
        let h = self.imports.entry(handle).or_insert(ImportHandle {
            key,
            bytes,
            refs: 0,
        });
        h.refs = h.refs.saturating_add(1);
        let (key, bytes) = (h.key, h.bytes);
        let e = self.imported.entry(key).or_insert(Imported {
            bytes,
            ..Imported::default()
        });
        let before = e.charge();
        e.refs = e.refs.saturating_add(1);
        e.charge().saturating_sub(before)
    }

    /// The imported memory mapped at `addr` (inside a recorded mapping), with its size.
    pub fn import_at(&self, addr: u64) -> Option<(ImportKey, u64)> {
        let (_, m) = self.mappings.range(..=addr).next_back()?;
        (addr < m.va.saturating_add(m.size)).then_some(m.import?)
    }

    /// The imported handle `handle`, if it is one.
    pub fn imported_handle(&self, handle: u64) -> Option<ImportHandle> {
        self.imports.get(&handle).copied()
    }

    /// What mapping `size` bytes of `handle` would add to the charge (0 for a handle not
    /// imported, or memory already mapped here).
    pub fn map_cost(&self, handle: u64, size: u64) -> u64 {
        let Some(h) = self.imports.get(&handle) else {
            return 0;
        };
        let now = self.imported.get(&h.key).copied().unwrap_or(Imported {
            bytes: h.bytes,
            ..Imported::default()
        });
        let then = Imported {
            maps: now.maps + 1,
            mapped: now.mapped.saturating_add(size),
            ..now
        };
        then.charge().saturating_sub(now.charge())
    }

    /// The entry of a counted handle.
    pub fn handle(&self, handle: u64) -> Option<HandleEntry> {
        self.handles.get(&handle).copied()
    }

    /// One more reference to a counted handle (`cuMemRetainAllocationHandle`, or an import of
    /// the process's own handle). False when the handle is not counted here.
    pub fn retain_handle(&mut self, handle: u64) -> bool {
        match self.handles.get_mut(&handle) {
            Some(e) => {
                e.refs = e.refs.saturating_add(1);
                true
            }
            None => false,
        }
    }

    /// Takes one reference away before `cuMemRelease` reaches the driver. The last reference
    /// of an unmapped handle removes the entry at once, so a handle value the driver reuses
    /// right after it is never mistaken for this one. `None`: not counted here.
    pub fn release_begin(&mut self, handle: u64) -> Option<Release> {
        if let Some(h) = self.imports.get_mut(&handle) {
            let taken = *h;
            h.refs = h.refs.saturating_sub(1);
            if h.refs == 0 {
                self.imports.remove(&handle);
            }
            let mut freed = 0;
            if let Some(e) = self.imported.get_mut(&taken.key) {
                let before = e.charge();
                e.refs = e.refs.saturating_sub(1);
                freed = before.saturating_sub(e.charge());
                if !e.held() {
                    self.imported.remove(&taken.key);
                }
            }
            return Some(Release::Import { taken, freed });
        }
        let e = self.handles.get_mut(&handle)?;
        e.refs = e.refs.saturating_sub(1);
        if e.refs == 0 && e.maps == 0 {
            let e = self.handles.remove(&handle)?;
            return Some(Release::Last(HandleEntry { refs: 1, ..e }));
        }
        Some(Release::NotLast)
    }

    /// Puts back what [`Ledger::release_begin`] took when the driver refused the release.
    pub fn release_undo(&mut self, handle: u64, r: Release) {
        match r {
            Release::Last(e) => {
                self.handles.insert(handle, e);
            }
            Release::NotLast => {
                let _ = self.retain_handle(handle);
            }
            Release::Import { taken, .. } => {
                self.imports.insert(handle, taken);
                let e = self.imported.entry(taken.key).or_insert(Imported {
                    bytes: taken.bytes,
                    ..Imported::default()
                });
                e.refs = e.refs.saturating_add(1);
            }
        }
    }

    /// Records a mapping the driver just made. A mapping recorded at the same address is
    /// stale (its range was unmapped behind our back, e.g. by `cuMemAddressFree`) and is
    /// dropped first; the bytes that frees are returned for the caller to release. Mappings
    /// of handles neither counted nor imported here are not recorded. A mapping of an
    /// imported handle adds to its memory's charge: the second value returned (what
    /// [`Ledger::map_cost`] said, unless another mapping of it came or went meanwhile).
    pub fn map_handle(&mut self, va: u64, size: u64, handle: u64) -> (u64, u64) {
        let stale = self.unmap_begin(va, size.max(1));
        let freed = stale.bytes();
        if let Some(e) = self.handles.get_mut(&handle) {
            e.maps = e.maps.saturating_add(1);
            self.mappings.insert(
                va,
                Mapping {
                    va,
                    size,
                    handle,
                    import: None,
                },
            );
        } else if let Some(h) = self.imports.get(&handle).copied() {
            let added = self.map_cost(handle, size);
            let m = Mapping {
                va,
                size,
                handle,
                import: Some((h.key, h.bytes)),
            };
            self.add_import_mapping(&m);
            self.mappings.insert(va, m);
            return (freed, added);
        }
        (freed, 0)
    }

    fn add_import_mapping(&mut self, m: &Mapping) {
        if let Some((key, bytes)) = m.import {
            let e = self.imported.entry(key).or_insert(Imported {
                bytes,
                ..Imported::default()
            });
            e.maps = e.maps.saturating_add(1);
            e.mapped = e.mapped.saturating_add(m.size);
        }
    }

    /// True when a recorded mapping starts in `[va, va + size)`.
    pub fn has_mappings_in(&self, va: u64, size: u64) -> bool {
        self.mappings
            .range(va..va.saturating_add(size))
            .next()
            .is_some()
    }

    /// Takes out every recorded mapping that starts in `[va, va + size)` before `cuMemUnmap`
    /// (or `cuMemAddressFree`) reaches the driver. A handle left with no reference and no
    /// mapping leaves the ledger; [`Unmapped::bytes`] is what to release once the driver
    /// succeeded.
    pub fn unmap_begin(&mut self, va: u64, size: u64) -> Unmapped {
        let starts: Vec<u64> = self
            .mappings
            .range(va..va.saturating_add(size))
            .map(|(k, _)| *k)
            .collect();
        let mut out = Unmapped::default();
        for k in starts {
            let Some(m) = self.mappings.remove(&k) else {
                continue;
            };
            out.maps.push(m);
            if let Some((key, _)) = m.import {
                if let Some(e) = self.imported.get_mut(&key) {
                    let before = e.charge();
                    e.maps = e.maps.saturating_sub(1);
                    e.mapped = e.mapped.saturating_sub(m.size);
                    out.imported += before.saturating_sub(e.charge());
                    if !e.held() {
                        self.imported.remove(&key);
                    }
                }
                continue;
            }
            let unused = self.handles.get_mut(&m.handle).is_some_and(|e| {
                e.maps = e.maps.saturating_sub(1);
                e.refs == 0 && e.maps == 0
            });
            if unused {
                out.gone
                    .extend(self.handles.remove(&m.handle).map(|e| (m.handle, e)));
            }
        }
        out
    }

    /// Puts back what [`Ledger::unmap_begin`] took when the driver refused the unmap.
    pub fn unmap_undo(&mut self, u: Unmapped) {
        for (h, e) in u.gone {
            self.handles.entry(h).or_insert(e);
        }
        for m in u.maps {
            if m.import.is_some() {
                self.add_import_mapping(&m);
                self.mappings.insert(m.va, m);
                continue;
            }
            if let Some(e) = self.handles.get_mut(&m.handle) {
                e.maps = e.maps.saturating_add(1);
                self.mappings.insert(m.va, m);
            }
        }
    }

    /// Number of recorded mappings.
    pub fn mapping_count(&self) -> usize {
        self.mappings.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_do_not_collide() {
        let mut l = Ledger::default();
        assert_eq!(l.insert(Kind::Ptr, 0x1000, 10), None);
        assert_eq!(l.insert(Kind::Array, 0x1000, 20), None);
        assert_eq!(l.create_handle(0x1000, 40), None);
        assert_eq!(l.total(), 70);
        assert_eq!(l.remove(Kind::Ptr, 0x1000), Some(10));
        assert_eq!(l.remove(Kind::Ptr, 0x1000), None, "double free is not ours");
        assert_eq!(l.remove(Kind::Array, 0x1000), Some(20));
        assert_eq!(
            l.release_begin(0x1000),
            Some(Release::Last(HandleEntry {
                bytes: 40,
                refs: 1,
                maps: 0
            }))
        );
        assert!(l.is_empty());
    }

    #[test]
    fn reused_address_reports_the_replaced_size() {
        let mut l = Ledger::default();
        l.insert(Kind::Ptr, 7, 100);
        assert_eq!(l.insert(Kind::Ptr, 7, 50), Some(100));
        assert_eq!(l.total(), 50);
        assert_eq!(l.len(), 1);
    }

    #[test]
    fn many_keys() {
        let mut l = Ledger::default();
        for i in 0..10_000u64 {
            l.insert(Kind::Ptr, 0x7f00_0000_0000 + i * 512, 1);
        }
        assert_eq!(l.total(), 10_000);
        for i in 0..10_000u64 {
            assert_eq!(l.remove(Kind::Ptr, 0x7f00_0000_0000 + i * 512), Some(1));
        }
        assert!(l.is_empty());
    }

    const H: u64 = 0x7e55_0000_1000;
    const MB2: u64 = 2 << 20;

    /// Releases then settles as the hook does after a successful driver call; returns the
    /// bytes released.
    fn release(l: &mut Ledger, h: u64) -> u64 {
        match l.release_begin(h) {
            Some(Release::Last(e)) => e.bytes,
            _ => 0,
        }
    }

    fn unmap(l: &mut Ledger, va: u64, size: u64) -> u64 {
        l.unmap_begin(va, size).bytes()
    }

    #[test]
    fn create_map_release_unmap_frees_at_the_unmap() {
        let mut l = Ledger::default();
        l.create_handle(H, 4 * MB2);
        assert_eq!(l.map_handle(0x1000_0000, 4 * MB2, H), (0, 0));
        assert_eq!(release(&mut l, H), 0, "still mapped: nothing released");
        assert_eq!(
            l.total(),
            4 * MB2,
            "released but mapped memory stays counted"
        );
        assert_eq!(unmap(&mut l, 0x1000_0000, 4 * MB2), 4 * MB2);
        assert!(l.is_empty());
        assert_eq!(l.mapping_count(), 0);
    }

    #[test]
    fn create_map_unmap_release_frees_at_the_release() {
        let mut l = Ledger::default();
        l.create_handle(H, MB2);
        l.map_handle(0x1000_0000, MB2, H);
        assert_eq!(
            unmap(&mut l, 0x1000_0000, MB2),
            0,
            "the handle is still referenced"
        );
        assert_eq!(l.total(), MB2);
        assert_eq!(release(&mut l, H), MB2);
        assert!(l.is_empty());
    }

    #[test]
    fn each_retained_reference_needs_its_own_release() {
        let mut l = Ledger::default();
        l.create_handle(H, MB2);
        assert!(l.retain_handle(H));
        assert!(l.retain_handle(H));
        assert_eq!(release(&mut l, H), 0);
        assert_eq!(release(&mut l, H), 0);
        assert_eq!(l.handle(H).unwrap().refs, 1);
        assert_eq!(
            release(&mut l, H),
            MB2,
            "the third release is the last reference"
        );
        assert_eq!(l.release_begin(H), None, "a fourth one is not ours");
        assert!(!l.retain_handle(H), "an unknown handle is never retained");
    }

    #[test]
    fn two_mappings_unmapped_one_by_one() {
        let mut l = Ledger::default();
        l.create_handle(H, MB2);
        l.map_handle(0x1000_0000, MB2, H);
        l.map_handle(0x2000_0000, MB2, H);
        assert_eq!(release(&mut l, H), 0);
        assert_eq!(unmap(&mut l, 0x2000_0000, MB2), 0, "one mapping is left");
        assert_eq!(
            l.handle(H),
            Some(HandleEntry {
                bytes: MB2,
                refs: 0,
                maps: 1
            })
        );
        assert_eq!(unmap(&mut l, 0x1000_0000, MB2), MB2);
        assert!(l.is_empty());
    }

    #[test]
    fn one_unmap_covering_two_mappings_of_two_handles() {
        let mut l = Ledger::default();
        let h2 = H + 0x10;
        l.create_handle(H, MB2);
        l.create_handle(h2, 2 * MB2);
        l.map_handle(0x1000_0000, MB2, H);
        l.map_handle(0x1000_0000 + MB2, 2 * MB2, h2);
        assert_eq!(release(&mut l, H), 0);
        assert_eq!(release(&mut l, h2), 0);
        assert!(l.has_mappings_in(0x1000_0000, 3 * MB2));
        assert!(!l.has_mappings_in(0x1000_0000 + 3 * MB2, MB2));
        assert_eq!(unmap(&mut l, 0x1000_0000, 3 * MB2), 3 * MB2);
        assert!(l.is_empty());
    }

    #[test]
    fn foreign_handles_are_never_counted() {
        // A handle neither created nor imported through the hooks (made before the interposer
        // was loaded, say) is mapped and released: nothing is recorded, nothing released.
        let mut l = Ledger::default();
        assert_eq!(l.map_handle(0x1000_0000, MB2, H), (0, 0));
        assert_eq!(l.mapping_count(), 0);
        assert_eq!(l.release_begin(H), None);
        assert_eq!(unmap(&mut l, 0x1000_0000, MB2), 0);
        assert!(l.is_empty());
    }

    #[test]
    fn refused_driver_calls_are_undone() {
        let mut l = Ledger::default();
        l.create_handle(H, MB2);
        let r = l.release_begin(H).unwrap();
        assert!(l.is_empty(), "the last reference leaves at once");
        l.release_undo(H, r);
        assert_eq!(
            l.handle(H),
            Some(HandleEntry {
                bytes: MB2,
                refs: 1,
                maps: 0
            })
        );
        l.map_handle(0x1000_0000, MB2, H);
        let r = l.release_begin(H).unwrap();
        assert_eq!(r, Release::NotLast);
        let u = l.unmap_begin(0x1000_0000, MB2);
        assert_eq!(u.bytes(), MB2);
        l.unmap_undo(u);
        assert_eq!(
            l.handle(H),
            Some(HandleEntry {
                bytes: MB2,
                refs: 0,
                maps: 1
            })
        );
        assert_eq!(l.mapping_count(), 1);
        l.release_undo(H, r);
        assert_eq!(l.handle(H).unwrap().refs, 1);
    }

    #[test]
    fn a_stale_mapping_at_a_reused_address_is_dropped() {
        // The range was freed behind our back (cuMemAddressFree unmaps): mapping again at the
        // same address drops the old record, and the released handle it kept goes with it.
        let mut l = Ledger::default();
        let h2 = H + 0x10;
        l.create_handle(H, MB2);
        l.create_handle(h2, MB2);
        l.map_handle(0x1000_0000, MB2, H);
        release(&mut l, H);
        assert_eq!(l.map_handle(0x1000_0000, MB2, h2), (MB2, 0));
        assert_eq!(l.handle(H), None);
        assert_eq!(l.handle(h2).unwrap().maps, 1);
    }

    const FILE: ImportKey = ImportKey::File { dev: 1, ino: 99 };

    #[test]
    fn imported_memory_is_charged_from_its_import_to_its_last_release_and_unmap() {
        let mut l = Ledger::default();
        assert_eq!(l.import_cost(FILE, 4 * MB2), 4 * MB2);
        assert_eq!(l.import(H, FILE, 4 * MB2), 4 * MB2, "the whole allocation");
        assert_eq!(l.map_cost(H, MB2), 0, "held already: mapping adds nothing");
        assert_eq!(l.map_handle(0x1000_0000, MB2, H), (0, 0));
        assert_eq!(l.map_handle(0x2000_0000, MB2, H), (0, 0));
        let r = l.release_begin(H).unwrap();
        assert!(matches!(r, Release::Import { freed: 0, .. }), "{r:?}");
        assert_eq!(l.total(), 4 * MB2, "released but mapped: still charged");
        assert_eq!(unmap(&mut l, 0x2000_0000, MB2), 0, "one mapping left");
        assert_eq!(unmap(&mut l, 0x1000_0000, MB2), 4 * MB2, "the last unmap");
        assert!(l.is_empty());
        // Mapped then unmapped: the unreleased import keeps it; its release frees it.
        l.import(H, FILE, 4 * MB2);
        l.map_handle(0x1000_0000, MB2, H);
        assert_eq!(unmap(&mut l, 0x1000_0000, MB2), 0);
        assert!(matches!(
            l.release_begin(H),
            Some(Release::Import { freed, .. }) if freed == 4 * MB2
        ));
        assert!(l.is_empty());
    }

    #[test]
    fn two_imports_of_the_same_memory_count_once() {
        let mut l = Ledger::default();
        let h2 = H + 0x10;
        assert_eq!(l.import(H, FILE, 4 * MB2), 4 * MB2);
        assert_eq!(l.import_cost(FILE, 4 * MB2), 0);
        assert_eq!(l.import(h2, FILE, 4 * MB2), 0);
        l.map_handle(0x1000_0000, MB2, H);
        l.map_handle(0x2000_0000, 4 * MB2, h2);
        assert_eq!(l.total(), 4 * MB2);
        assert_eq!(release(&mut l, H), 0);
        assert_eq!(
            unmap(&mut l, 0x1000_0000, MB2),
            0,
            "the other import holds it"
        );
        assert_eq!(unmap(&mut l, 0x2000_0000, 4 * MB2), 0);
        let r = l.release_begin(h2).unwrap();
        assert!(matches!(r, Release::Import { freed, .. } if freed == 4 * MB2));
        l.release_undo(h2, r);
        assert_eq!(l.total(), 4 * MB2, "a refused release keeps the charge");
        assert!(
            matches!(l.release_begin(h2), Some(Release::Import { freed, .. }) if freed == 4 * MB2)
        );
        assert!(l.is_empty());
    }

    #[test]
    fn memory_of_unknown_size_is_charged_what_is_mapped_per_handle() {
        let mut l = Ledger::default();
        let h2 = H + 0x10;
        let (a, b) = (ImportKey::Handle(H), ImportKey::Handle(h2));
        assert_eq!(l.import(H, a, 0), 0);
        assert_eq!(l.import(h2, b, 0), 0);
        assert_eq!(l.map_cost(H, MB2), MB2);
        assert_eq!(l.map_handle(0x1000_0000, MB2, H).1, MB2);
        assert_eq!(l.map_handle(0x2000_0000, MB2, H).1, MB2);
        assert_eq!(
            l.map_handle(0x3000_0000, MB2, h2).1,
            MB2,
            "not merged on a guess"
        );
        assert_eq!(l.total(), 3 * MB2);
        let u = l.unmap_begin(0x1000_0000, 0x3000_0000);
        assert_eq!(u.bytes(), 3 * MB2);
        l.unmap_undo(u);
        assert_eq!(l.total(), 3 * MB2, "a refused unmap keeps the charge");
        // A retained handle of an address inside an imported mapping is that memory.
        assert_eq!(l.import_at(0x1000_0000 + 5), Some((a, 0)));
        assert_eq!(l.import_at(0x1000_0000 + MB2), None);
    }

    #[test]
    fn an_import_of_a_handle_created_here_is_one_more_reference() {
        let mut l = Ledger::default();
        l.create_handle(H, MB2);
        assert_eq!(l.import(H, FILE, MB2), 0, "charged once, at its creation");
        assert_eq!(l.imported_handle(H), None);
        assert_eq!(l.handle(H).unwrap().refs, 2);
        assert_eq!(l.map_cost(H, MB2), 0);
    }

    #[test]
    fn a_reused_handle_value_replaces_the_old_entry_and_its_mappings() {
        let mut l = Ledger::default();
        l.create_handle(H, MB2);
        l.map_handle(0x1000_0000, MB2, H);
        assert_eq!(l.create_handle(H, 2 * MB2), Some(MB2));
        assert_eq!(l.mapping_count(), 0);
        assert_eq!(l.total(), 2 * MB2);
    }
}
