//! The frame every `extern "C"` hook runs in, and what a hook's logic answers.
//!
//! The hooks themselves sit beside their logic: [`crate::memory::hooks`],
//! [`crate::contexts::hooks`] and [`crate::launch_hooks`]. Each is a thin shim that decodes its C
//! arguments and calls [`cuda`] (or [`run`], for NVML) with two closures: `pass`, the real call
//! with the arguments unchanged, and `logic`, the safe accounting that answers an [`Outcome`].
//!
//! The frame: finds the real function (loading the real library on first use), takes the
//! re-entry guard (a nested call passes straight through), passes through when no token is
//! set, never lets a panic unwind into C, and logs every pass-through with its [`Pass`]
//! reason (level-checked first: one relaxed load, no allocation, when not logged).

use crate::driver;
use crate::ffi::{
    CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_UNKNOWN, CUDA_SUCCESS, CUdevice, CUresult,
};
use crate::guard;
use crate::log::Level;
use crate::state::{self, Process};
use crate::table::HookId;

/// What a hook's logic decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome<T> {
    /// The call was handled; return this.
    Handled(T),
    /// Not ours to account: call the real function as is, for this reason.
    PassThrough(Pass),
}

/// Why a hook called the real function as is, accounting nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// No arbiter configured (`TESSERA_TOKEN` unset): this process is not enforced.
    NotEnforcing,
    /// A hook entered from inside another on the same thread (the driver calling its own
    /// entry points, or our code calling the driver): the outer hook accounts.
    Reentry,
    /// A null pointer argument the logic would read or write: the driver answers the error.
    NullArgument,
    /// Zero bytes (or an extent that makes zero): the driver rejects it, nothing is counted.
    ZeroSize,
    /// Memory placed on the host, which the device's limit does not cover.
    HostMemory,
    /// An object this process did not count (a pointer, array, handle, mapping or context
    /// made before the interposer, by another process, or already gone): nothing to release.
    NotCounted,
}

impl Pass {
    /// A few words for the log line.
    pub const fn as_str(self) -> &'static str {
        match self {
            Pass::NotEnforcing => "no arbiter configured",
            Pass::Reentry => "re-entered from inside a hook",
            Pass::NullArgument => "null argument",
            Pass::ZeroSize => "zero bytes",
            Pass::HostMemory => "host memory",
            Pass::NotCounted => "not counted here",
        }
    }

    /// The level it is logged at: the frame's reasons happen on every call of an unconfigured
    /// process, or many times inside the driver, so only `trace` shows them; the logic's are
    /// per-call decisions, shown at `debug` like refusals.
    pub const fn level(self) -> Level {
        match self {
            Pass::NotEnforcing | Pass::Reentry => Level::Trace,
            Pass::NullArgument | Pass::ZeroSize | Pass::HostMemory | Pass::NotCounted => {
                Level::Debug
            }
        }
    }
}

impl std::fmt::Display for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Logs that hook `id` passed through, and why (no allocation; nothing when the level is off).
#[inline]
pub fn log_pass(id: HookId, why: Pass) {
    if crate::log::enabled(why.level()) {
        pass_line(id, why);
    }
}

#[cold]
#[inline(never)]
fn pass_line(id: HookId, why: Pass) {
    let name = id.hook().name.to_str().unwrap_or("?");
    crate::log::write(why.level(), format_args!("{name}: passed through: {why}"));
}

/// The common frame of every hook (`CUresult` and `nvmlReturn_t` are both `u32`).
///
/// # Safety
/// `F` must be the C signature of `id`'s entry point.
#[inline(always)]
pub unsafe fn run<F: Copy>(
    id: HookId,
    missing: u32,
    panicked: u32,
    pass: impl FnOnce(F) -> u32,
    logic: impl FnOnce(F, &'static Process) -> Outcome<u32>,
) -> u32 {
    // SAFETY: the caller guarantees `F` matches `id`.
    let Some(real) = (unsafe { driver::real::<F>(id) }) else {
        return missing;
    };
    let Some(_g) = guard::enter() else {
        log_pass(id, Pass::Reentry);
        return pass(real);
    };
    guard::no_unwind(panicked, || {
        let why = match state::process_here() {
            None => Pass::NotEnforcing,
            Some(p) => match logic(real, p) {
                Outcome::Handled(r) => return r,
                Outcome::PassThrough(why) => why,
            },
        };
        log_pass(id, why);
        pass(real)
    })
}

/// [`run`] for CUDA driver entry points.
///
/// # Safety
/// As [`run`].
#[inline(always)]
pub unsafe fn cuda<F: Copy>(
    id: HookId,
    pass: impl FnOnce(F) -> CUresult,
    logic: impl FnOnce(F, &'static Process) -> Outcome<CUresult>,
) -> CUresult {
    // SAFETY: forwarded contract.
    unsafe {
        run(
            id,
            CUDA_ERROR_NOT_INITIALIZED,
            CUDA_ERROR_UNKNOWN,
            pass,
            logic,
        )
    }
}

/// Reads an out-parameter the driver has just written, only when it succeeded.
///
/// # Safety
/// `p` is non-null and points to a `T` the driver initialised when `r` is success.
#[inline(always)]
pub unsafe fn written<T: Copy + Default>(r: CUresult, p: *const T) -> T {
    if r == CUDA_SUCCESS {
        // SAFETY: per the contract.
        unsafe { *p }
    } else {
        T::default()
    }
}

/// The state accounting for device `dev` (the hook's own argument, not the current context:
/// a context made for device 1 while device 0 is current costs device 1's slice).
#[inline]
pub fn on(dev: CUdevice, p: &'static Process) -> &'static Process {
    state::process_on(Some(dev)).unwrap_or(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_says_why_and_only_the_frames_hide_below_debug() {
        let all = [
            Pass::NotEnforcing,
            Pass::Reentry,
            Pass::NullArgument,
            Pass::ZeroSize,
            Pass::HostMemory,
            Pass::NotCounted,
        ];
        for (i, a) in all.iter().enumerate() {
            assert!(!a.as_str().is_empty());
            assert_eq!(a.to_string(), a.as_str());
            for b in &all[i + 1..] {
                assert_ne!(a.as_str(), b.as_str(), "two reasons read the same");
            }
        }
        assert_eq!(Pass::Reentry.level(), Level::Trace);
        assert_eq!(Pass::NotEnforcing.level(), Level::Trace);
        assert_eq!(Pass::NotCounted.level(), Level::Debug);
        // The log line of a pass-through formats without panicking.
        log_pass(HookId::MemAlloc_v2, Pass::ZeroSize);
    }
}
