//! A simulated GPU in a test's temp folder.

#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_sim_state::{ENV_CONTEXT_MEMORY, ENV_DIR, ENV_GPUS, MODELED_CONTEXT_MEMORY};

use crate::artifacts::{BUILD_HINT, target_dir};

/// The simulated machine's state folder, its `lib/` folder (links named like the real driver
/// and NVML, pointing at the built simulated ones), the GPUs it reports and what a context
/// costs on them.
#[derive(Debug, Clone)]
pub struct SimGpu {
    /// `TESSERA_SIM_DIR`: the cross-process state of the simulated GPUs.
    pub dir: PathBuf,
    /// The folder to put on `LD_LIBRARY_PATH`.
    pub lib_dir: PathBuf,
    /// `TESSERA_SIM_GPUS`, e.g. `2x80GiB`.
    pub gpus: String,
    /// `TESSERA_SIM_CONTEXT_MEMORY`: [`MODELED_CONTEXT_MEMORY`] (300MiB, as on a real card)
    /// unless a test sets another.
    pub context_memory: String,
}

impl SimGpu {
    /// Prepares `dir` with the simulated libraries built in [`target_dir`].
    #[track_caller]
    pub fn prepare(dir: &Path, gpus: &str) -> Self {
        Self::prepare_with_hint(dir, gpus, BUILD_HINT)
    }

    /// [`SimGpu::prepare`] with another hint for when the libraries are not built.
    #[track_caller]
    pub fn prepare_with_hint(dir: &Path, gpus: &str, hint: &str) -> Self {
        let built = tessera_sim_state::find_built_lib_dir(Some(&target_dir()))
            .unwrap_or_else(|e| panic!("{e}: {hint}"));
        let lib_dir = tessera_sim_state::prepare_lib_dir(dir, &built).unwrap_or_else(|e| {
            panic!("cannot prepare the simulated GPU in {}: {e}", dir.display())
        });
        Self {
            dir: dir.to_path_buf(),
            lib_dir,
            gpus: gpus.to_owned(),
            context_memory: MODELED_CONTEXT_MEMORY.to_owned(),
        }
    }

    /// The variables that put a process on this simulated GPU.
    pub fn vars(&self) -> [(&'static str, OsString); 4] {
        [
            ("LD_LIBRARY_PATH", self.lib_dir.clone().into_os_string()),
            (ENV_DIR, self.dir.clone().into_os_string()),
            (ENV_GPUS, OsString::from(&self.gpus)),
            (ENV_CONTEXT_MEMORY, OsString::from(&self.context_memory)),
        ]
    }

    /// [`SimGpu::vars`] as strings (for environments written out, as a container's).
    pub fn var_strings(&self) -> Vec<(&'static str, String)> {
        self.vars()
            .into_iter()
            .map(|(k, v)| (k, v.to_string_lossy().into_owned()))
            .collect()
    }

    /// Context memory in bytes, as the simulated driver charges it.
    pub fn context_bytes(&self) -> u64 {
        tessera_sim_state::parse_context_memory(&self.context_memory)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Sets [`SimGpu::vars`] on `cmd`.
    pub fn apply<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        cmd.envs(self.vars())
    }
}
