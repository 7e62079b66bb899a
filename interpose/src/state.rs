//! The per-process state (arbiter session + ledger) and its life across `fork`.
//!
//! The state lives behind one atomic pointer. A forked child's `pthread_atfork` handler closes
//! the inherited socket without sending anything and clears the pointer: the child then builds
//! a fresh state on first use, connects with its own connection and starts with nothing held
//! (CUDA allocations do not survive fork). The parent's state is leaked in the child, never
//! dropped: its locks may have been held by threads that do not exist there.

use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use crate::config;
use crate::launch::Gate;
use crate::ledger::Ledger;
use crate::session::{Policy, Session};
use crate::tlog;

/// Everything a process under enforcement keeps.
#[derive(Debug)]
pub struct Process {
    /// The arbiter session.
    pub session: Session,
    /// Live objects and their sizes.
    pub ledger: parking_lot::Mutex<Ledger>,
    /// Kernel launch gating (compute leases).
    pub gate: Gate,
    /// What its contexts reserved.
    pub contexts: parking_lot::Mutex<crate::context_book::Book>,
}

impl Process {
    /// A process state with the given session and launch gate.
    pub fn new(session: Session, gate: Gate) -> Self {
        Self {
            session,
            ledger: parking_lot::Mutex::new(Ledger::default()),
            gate,
            contexts: parking_lot::Mutex::new(crate::context_book::Book::default()),
        }
    }

    /// The context book (locks never poison: every update is a single map change).
    pub fn contexts(&self) -> parking_lot::MutexGuard<'_, crate::context_book::Book> {
        self.contexts.lock()
    }

    /// The ledger, even after a panic elsewhere poisoned its lock (its data stays consistent:
    /// every operation is a single map update).
    pub fn ledger(&self) -> parking_lot::MutexGuard<'_, Ledger> {
        self.ledger.lock()
    }
}

static PROCESS: AtomicPtr<Process> = AtomicPtr::new(std::ptr::null_mut());

/// The process state when enforcing (a token is set); `None` means pass everything through.
#[inline]
pub fn process() -> Option<&'static Process> {
    let p = PROCESS.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: states are leaked, never freed, so the pointer stays valid forever.
        return Some(unsafe { &*p });
    }
    create()
}

/// A companion ticket from this process's memory connection, for its lease connection.
fn companion_ticket() -> Option<u64> {
    process().and_then(|p| p.session.companion_ticket())
}

#[cold]
fn create() -> Option<&'static Process> {
    let cfg = config::get();
    let token = cfg.token()?;
    let socket = cfg.socket().map(ToOwned::to_owned);
    let fresh = Box::into_raw(Box::new(Process::new(
        Session::new(socket.clone(), token.clone(), Policy::default()),
        if cfg.closed() {
            Gate::new(None, token).closed()
        } else {
            Gate::new(socket, token).with_companion(companion_ticket)
        },
    )));
    match PROCESS.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: we just published `fresh`; it is never freed.
        Ok(_) => Some(unsafe { &*fresh }),
        Err(winner) => {
            // SAFETY: `fresh` was never shared; `winner` is a leaked, live state.
            unsafe {
                drop(Box::from_raw(fresh));
                Some(&*winner)
            }
        }
    }
}

static ATFORK: AtomicBool = AtomicBool::new(false);

/// Registers the fork handler once (from the constructor when a token is set).
pub fn register_atfork() {
    if ATFORK.swap(true, Ordering::AcqRel) {
        return;
    }
    // SAFETY: the handler is a plain function that lives as long as the process.
    let rc = unsafe { crate::ffi::pthread_atfork(None, None, Some(atfork_child)) };
    if rc != 0 {
        tlog!(
            Warn,
            "pthread_atfork failed ({rc}); a forked child would share its parent's connection"
        );
    }
}

/// Child side of `fork`: abandon the parent's state without sending anything.
unsafe extern "C" fn atfork_child() {
    let p = PROCESS.swap(std::ptr::null_mut(), Ordering::AcqRel);
    if !p.is_null() {
        // SAFETY: states are never freed; only the (single) child thread runs here.
        unsafe {
            (*p).session.abandon_in_child();
            (*p).gate.abandon_in_child();
        }
    }
    crate::launch::reset_in_child();
}
