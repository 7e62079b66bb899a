//! `libtessera_interpose.so`: the `LD_PRELOAD` library that enforces a Tessera allocation's
//! GPU memory limit (and, with `launch`, its compute share) inside a CUDA process.
//!
//! Modules:
//! - [`ffi`]: raw C declarations (loader, fork, cancellation) and the CUDA driver and NVML ABI
//!   (`tessera-cuda-abi`, re-exported).
//! - [`config`]: the four environment variables it reads; limits never come from there.
//! - [`log`]: leveled, allocation-free logging to stderr (`TESSERA_LOG`).
//! - [`guard`]: the per-thread re-entry guard and the panic barrier at the C boundary.
//! - [`table`]: every hooked variant, its version range and real-function slot.
//! - [`driver`]: the real `dlsym`, the real driver and NVML, never resolved through ourselves.
//! - [`dlsym`]: our `dlsym` (with an exact `RTLD_NEXT` trampoline), our `cuGetProcAddress`, and
//!   the wrapper of each table row they hand out.
//! - [`conn`]: one blocking, `SIGPIPE`-free connection to the arbiter's tenant socket.
//! - [`session`]: reserve / release / re-declare, reconnection, behaviour while the arbiter is
//!   down: credit arithmetic (`credit`), the link state machine (`link`), the pressure channel
//!   (`channel`), the watcher thread (`watcher`).
//! - [`ledger`]: live objects and their charged sizes.
//! - [`state`]: the per-process state, one per device of a multi-GPU allocation (routed by the
//!   current context's device, or the call's), and its reset in a forked child.
//! - [`shim`]: the frame every hook runs in (real function, re-entry guard, panic barrier) and
//!   what a hook's logic answers: [`shim::Outcome`], handled or passed through for a
//!   [`shim::Pass`] reason, logged at `debug`/`trace`.
//! - [`memory`]: the accounting logic behind each allocation, free and memory query, and beside
//!   it its `extern "C"` shims ([`memory::hooks`]).
//! - [`contexts`]: contexts count against the limit: each one's cost reserved before the
//!   driver makes it, given back when it goes; its shims in [`contexts::hooks`];
//!   [`context_book`]: what was reserved for which.
//! - [`launch`]: kernel launch gating on compute leases: the credit fast path and stream slots
//!   (`gate`), the lease rules as a pure state machine (`lease`), the driver's event functions
//!   behind a trait (`events`), the manager thread (`manager`).
//! - [`launch_hooks`]: the launch, stream-destroy and synchronise shims. They sit beside
//!   `launch/`, not in it: they reach the gate through [`state`], which holds it, so inside
//!   `launch/` they would close an import circle.
//!
//! Each family's shims are thin: decode the C arguments, call [`shim::cuda`] with the real call
//! and the safe logic. A new hook is one row in [`table`], one shim beside its family's logic,
//! and one line in [`dlsym::WRAPPERS`].
//!
//! The modules form no import circle (checked for every crate by `tessera-testkit`'s `import_cycles` test):
//! the table sits below the driver loader, the frame (`shim`) above both and the state, each
//! family's shims above the frame, the wrappers (`dlsym`) above the shims.
//!
//! Without `TESSERA_TOKEN` every hook passes straight through and `dlsym` hands out the real
//! functions, so an unconfigured process pays a few atomic loads per intercepted call (the
//! state pointer, the configuration, the log level of its pass-through) and nothing more.

pub mod config;
pub mod conn;
pub mod context_book;
pub mod contexts;
pub mod dlsym;
pub mod driver;
pub mod ffi;
pub mod guard;
pub mod launch;
pub mod launch_hooks;
pub mod ledger;
pub mod log;
pub mod memory;
#[cfg(test)]
mod mock_arbiter;
pub mod session;
pub mod shim;
pub mod state;
pub mod table;

/// Marks this file as Tessera's interposer. `tessera run`, `tessera doctor` and the device
/// plugin (`tessera-preload`) refuse a file that does not define it itself: a CUDA driver
/// library exports the hook names too, and any library finds `dlsym` in libc. The value is
/// the interposer's ABI generation (1 so far).
#[unsafe(no_mangle)]
#[allow(
    non_upper_case_globals,
    reason = "an exported C symbol, named as C callers see it"
)]
pub static tessera_interposer_abi_version: u32 = 1;

/// Library constructor: reads the environment and registers the fork handler. Nothing else
/// (no socket, no driver loading): start-up stays in the microseconds.
extern "C" fn tessera_init() {
    guard::no_unwind((), || {
        let _ = log::enabled(log::Level::Error);
        if config::get().enforcing() {
            state::register_atfork();
        }
    });
}

#[used]
#[unsafe(link_section = ".init_array")]
static INIT: extern "C" fn() = tessera_init;
