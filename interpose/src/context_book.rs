//! What this process reserved for its contexts: the primary context of each device (reference
//! counted, charged once) and every created one (charged each). Pure data; [`crate::contexts`]
//! reserves and releases at the arbiter around the driver calls and keeps this book.

#![forbid(unsafe_code)]

use std::collections::HashMap;

/// The primary context of one device, as far as this process's calls made it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Primary {
    /// Successful retains not yet released.
    refs: u32,
    /// Bytes reserved for it (0 while it is not active).
    charged: u64,
}

/// What this process reserved for its contexts.
#[derive(Debug, Default)]
pub struct Book {
    primary: HashMap<i32, Primary>,
    created: HashMap<u64, u64>,
}

impl Book {
    /// True when a retain of `dev`'s primary context will make it (no reference is held).
    pub fn primary_inactive(&self, dev: i32) -> bool {
        self.primary.get(&dev).is_none_or(|p| p.refs == 0)
    }

    /// A retain of `dev`'s primary context succeeded; `charged` is what was reserved for it
    /// (0 when it was already active).
    pub fn primary_retained(&mut self, dev: i32, charged: u64) {
        let p = self.primary.entry(dev).or_default();
        p.refs = p.refs.saturating_add(1);
        p.charged = p.charged.saturating_add(charged);
    }

    /// A release of `dev`'s primary context succeeded: the bytes to give back when it was the
    /// last reference (the driver destroyed the context).
    pub fn primary_released(&mut self, dev: i32) -> u64 {
        let Some(p) = self.primary.get_mut(&dev) else {
            return 0;
        };
        p.refs = p.refs.saturating_sub(1);
        if p.refs > 0 {
            return 0;
        }
        self.primary.remove(&dev).map_or(0, |p| p.charged)
    }

    /// `dev`'s primary context was reset (destroyed whatever its references): the bytes to
    /// give back.
    pub fn primary_reset(&mut self, dev: i32) -> u64 {
        self.primary.remove(&dev).map_or(0, |p| p.charged)
    }

    /// A context `cuCtxCreate*` made; returns the bytes of an entry it replaced (a handle
    /// the driver reused, so the old context went behind our back), to give back.
    pub fn created(&mut self, ctx: u64, charged: u64) -> Option<u64> {
        self.created.insert(ctx, charged)
    }

    /// Forgets a created context before `cuCtxDestroy` reaches the driver; its bytes, if it
    /// is one.
    pub fn destroy_begin(&mut self, ctx: u64) -> Option<u64> {
        self.created.remove(&ctx)
    }

    /// Bytes reserved for all live contexts.
    pub fn total(&self) -> u64 {
        self.primary.values().map(|p| p.charged).sum::<u64>() + self.created.values().sum::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: u64 = 300 << 20;

    #[test]
    fn the_primary_context_is_charged_once_per_device_until_its_last_reference() {
        let mut b = Book::default();
        assert!(b.primary_inactive(0));
        b.primary_retained(0, R);
        assert!(!b.primary_inactive(0), "a second retain shares it");
        b.primary_retained(0, 0);
        assert!(b.primary_inactive(1), "each device has its own");
        b.primary_retained(1, R);
        assert_eq!(b.total(), 2 * R);
        assert_eq!(b.primary_released(0), 0, "one reference is left");
        assert_eq!(b.primary_released(0), R, "the last one");
        assert!(b.primary_inactive(0));
        assert_eq!(
            b.primary_released(0),
            0,
            "an extra release gives nothing twice"
        );
        assert_eq!(b.primary_reset(1), R);
        assert_eq!(b.primary_reset(1), 0);
        assert_eq!(b.total(), 0);
    }

    #[test]
    fn created_contexts_are_charged_each() {
        let mut b = Book::default();
        for ctx in 1..=64 {
            assert_eq!(b.created(ctx, R), None);
        }
        assert_eq!(b.total(), 64 * R);
        assert_eq!(b.destroy_begin(7), Some(R));
        assert_eq!(b.destroy_begin(7), None, "destroyed once");
        assert_eq!(
            b.created(8, R),
            Some(R),
            "a reused handle: the old context went behind our back"
        );
        assert_eq!(b.total(), 63 * R);
    }
}
