//! Shared by the `tessera run` and `tessera status` tests: starts the real `tessera-arbiter`
//! (built next to the test executable) on the simulated NVML, in a temp folder.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tessera_protocol::client::AdminClient;
use tessera_testkit::{ArbiterSpec, RunningArbiter, SimGpu, artifact};

pub(crate) use tessera_testkit::{GIB, MIB};

/// The `tessera` binary.
pub(crate) fn tessera() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tessera"))
}

pub(crate) struct Arbiter {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub admin_socket: PathBuf,
    pub sim: SimGpu,
    process: RunningArbiter,
}

impl Arbiter {
    pub(crate) fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let sim = SimGpu::prepare(&dir.path().join("sim"), "2x80GiB");
        let spec = ArbiterSpec::in_dir(artifact("tessera-arbiter"), dir.path(), sim.clone())
            .log_to(dir.path().join("arbiter.log"));
        let process = spec.start();
        Self {
            dir,
            socket: spec.socket,
            admin_socket: spec.admin_socket,
            sim,
            process,
        }
    }

    pub(crate) fn admin(&self) -> AdminClient {
        self.process.admin()
    }

    /// The arbiter's log so far.
    pub(crate) fn process_log(&self) -> String {
        self.process.log_text()
    }

    /// `tessera <args>` pointed at this arbiter (through the environment).
    pub(crate) fn tessera(&self, args: &[&str]) -> Command {
        self.tessera_at(&tessera(), args)
    }

    /// The same with another copy of the `tessera` executable.
    pub(crate) fn tessera_at(&self, exe: &Path, args: &[&str]) -> Command {
        let mut c = Command::new(exe);
        c.args(args)
            .env("TESSERA_ADMIN_SOCKET", &self.admin_socket)
            .env("TESSERA_SOCKET", &self.socket)
            .env_remove("TESSERA_INTERPOSER")
            .env_remove("LD_PRELOAD")
            .stdin(Stdio::null());
        c
    }
}

/// A copy of the built interposer in `dir` (`tessera run` checks that it loads and exports its
/// hooks). Programs that do not use CUDA run under it untouched: it connects to the arbiter
/// only at the first intercepted CUDA call.
pub(crate) fn interposer_in(dir: &Path) -> PathBuf {
    let p = dir.join("libtessera_interpose.so");
    std::fs::copy(artifact("libtessera_interpose.so"), &p).unwrap();
    p
}

/// The UUID of the simulated GPU `index` of [`Arbiter`]'s machine.
pub(crate) fn gpu_uuid(index: usize) -> String {
    tessera_sim_state::SimSpec::parse("2x80GiB").unwrap().gpus[index]
        .uuid
        .clone()
}
