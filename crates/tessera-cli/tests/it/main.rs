//! The `tessera` command's integration tests, one binary (one link, not one per file).
//! Each module was a test file of its own; a test that sets what a process holds once (the
//! simulated NVML loaded in-process, the environment it reads) runs alone in a child process
//! ([`nvml_alone`]).
//!
//! Modules: [`cli_table`] (the flags against docs/cli.md), [`doctor`], [`interposer_glibc`]
//! (the glibc 2.17 build), [`run`] (`tessera run` on the real arbiter) and [`run_exec`] (its
//! `--exec`), [`sim`] and its
//! `sim_*` neighbours (the simulated GPU seen by real clients, NVML and pid namespaces),
//! [`status`], [`users`] (a workstation's users on the user socket); [`run_support`] is the
//! arbiter fixture `run`, `status`, `doctor` and `users` share.

mod cli_table;
mod doctor;
mod interposer_glibc;
mod mig;
mod run;
mod run_exec;
mod run_support;
mod sim;
mod sim_nvml;
mod sim_pid_namespace;
mod sim_process_utilization;
mod sim_surface;
mod sim_visible;
mod status;
mod users;

use std::path::PathBuf;

/// The simulated NVML's state folder and GPUs (read from the environment when it loads).
const SIM_DIR: &str = "TESSERA_SIM_DIR";
const SIM_GPUS: &str = "TESSERA_SIM_GPUS";

/// For a test that loads the simulated NVML in its own process: runs it alone
/// ([`tessera_testkit::alone`]) with a fresh state folder and `gpus` in the environment.
/// Returns that folder in the process that runs the body; `None` in the first one, once the
/// body has passed (the folder is removed then).
#[track_caller]
pub(crate) fn nvml_alone(module_path: &str, function: &str, gpus: &str) -> Option<PathBuf> {
    let name = tessera_testkit::alone::test_name(module_path, function);
    if std::env::var_os(tessera_testkit::alone::ALONE_ENV).is_some_and(|v| v == name.as_str()) {
        return Some(
            std::env::var_os(SIM_DIR)
                .expect("set by the first process")
                .into(),
        );
    }
    let state = tempfile::tempdir().unwrap();
    let env = [
        (SIM_DIR, state.path().as_os_str()),
        (SIM_GPUS, gpus.as_ref()),
    ];
    let ran_here = tessera_testkit::alone(module_path, function, &env);
    assert!(!ran_here);
    None
}

/// The simulated NVML through `nvml-wrapper`, in a test run by [`nvml_alone`].
pub(crate) fn sim_nvml() -> nvml_wrapper::Nvml {
    let lib = tessera_testkit::artifact("libtessera_sim_nvml.so");
    nvml_wrapper::Nvml::builder()
        .lib_path(lib.as_os_str())
        .init()
        .unwrap()
}
