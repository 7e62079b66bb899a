//! The per-thread re-entry guard and the panic barrier every `extern "C"` entry point uses.
//!
//! A driver may call its own exported entry points (which resolve to ours, since we come first
//! in the global scope), and our own code may call `dlsym` (the Rust runtime does, for weak
//! symbols). Inside a hook, any nested hook passes straight through to the real function.

#![forbid(unsafe_code)]

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};

thread_local! {
    // Const-initialised, no destructor: usable at any point of a thread's life.
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// Held while a hook runs on this thread.
#[derive(Debug)]
pub struct Entered(());

impl Drop for Entered {
    fn drop(&mut self) {
        IN_HOOK.with(|c| c.set(false));
    }
}

/// Marks this thread as inside a hook; `None` when it already is (a nested call).
#[inline]
pub fn enter() -> Option<Entered> {
    IN_HOOK.with(|c| {
        if c.get() {
            None
        } else {
            c.set(true);
            Some(Entered(()))
        }
    })
}

/// True while this thread runs a hook.
#[inline]
pub fn inside() -> bool {
    IN_HOOK.with(Cell::get)
}

/// Runs `f`, turning a panic into `fallback`: unwinding into C is undefined behaviour.
#[inline]
pub fn no_unwind<R>(fallback: R, f: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            crate::tlog!(Error, "internal panic caught at the C boundary");
            fallback
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_entry_is_refused_and_released() {
        let outer = enter().expect("first entry");
        assert!(inside());
        assert!(enter().is_none(), "nested entry must be refused");
        drop(outer);
        assert!(!inside());
        assert!(enter().is_some());
    }

    #[test]
    fn guard_is_per_thread() {
        let _g = enter().unwrap();
        std::thread::spawn(|| assert!(enter().is_some()))
            .join()
            .unwrap();
    }

    #[test]
    fn panics_become_the_fallback_and_release_the_guard() {
        let r = no_unwind(7, || {
            let _g = enter().unwrap();
            panic!("boom");
        });
        assert_eq!(r, 7);
        assert!(!inside());
        assert_eq!(no_unwind(0, || 5), 5);
    }
}
