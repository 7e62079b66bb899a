//! Benchmarks of Tessera's overheads and compute sharing (criterion benches in `benches/`,
//! benchmark programs in `src/bin/`). The library holds what both kinds share:
//! - [`exit_with_parent`]: a started arbiter goes when the benchmark does.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Makes the child started by `cmd` receive SIGTERM when this process dies, however it ends:
/// an aborted run (`process::exit`, a signal) would otherwise leave the arbiter it started
/// running, holding every inherited descriptor (a `flock` on a benchmark lock included).
pub fn exit_with_parent(cmd: &mut Command) {
    // SAFETY: pre_exec runs in the forked child before exec; prctl is async-signal-safe. The
    // signal is tied to the thread that forks, so callers start children from their main thread.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0);
            Ok(())
        });
    }
}
