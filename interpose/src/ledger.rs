//! The process-local ledger: every live object this process allocated through a hook, with
//! the bytes it was charged. Frees of objects not in it pass through untouched.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The namespace of a key: device pointers, `cuMemCreate` handles and arrays can collide
/// numerically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A device pointer (`cuMemAlloc*`, managed, pitch, async, pool).
    Ptr,
    /// A `cuMemCreate` physical allocation handle.
    Handle,
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
        self.0 = (self.0 ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29);
    }
    fn write_u8(&mut self, v: u8) {
        self.write_u64(u64::from(v) << 56);
    }
    fn write_isize(&mut self, v: isize) {
        self.write_u64(v as u64);
    }
}

/// Live objects and their sizes.
#[derive(Debug, Default)]
pub struct Ledger {
    map: HashMap<(Kind, u64), u64, BuildHasherDefault<KeyHasher>>,
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

    /// Bytes of all live objects.
    pub fn total(&self) -> u64 {
        self.map.values().sum()
    }

    /// Number of live objects.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when nothing is live.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_do_not_collide() {
        let mut l = Ledger::default();
        assert_eq!(l.insert(Kind::Ptr, 0x1000, 10), None);
        assert_eq!(l.insert(Kind::Handle, 0x1000, 20), None);
        assert_eq!(l.total(), 30);
        assert_eq!(l.remove(Kind::Ptr, 0x1000), Some(10));
        assert_eq!(l.remove(Kind::Ptr, 0x1000), None, "double free is not ours");
        assert_eq!(l.remove(Kind::Handle, 0x1000), Some(20));
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
}
