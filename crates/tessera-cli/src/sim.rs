//! `tessera sim`: run any command on the simulated GPUs.
//!
//! Makes `<state>/lib/` with `libcuda.so.1` and `libnvidia-ml.so.1` links to the built simulated
//! libraries, prepends it to `LD_LIBRARY_PATH`, exports `TESSERA_SIM_GPUS` / `TESSERA_SIM_DIR`
//! (and `TESSERA_SIM_CONTEXT_MEMORY`, 300MiB unless set: contexts cost memory as on a real card;
//! `TESSERA_SIM_FURTHER_CONTEXT_MEMORY`, each further context of a process, is passed on as set)
//! and execs the command: it replaces this process, so its exit status, and any signal sent to
//! `tessera sim`, are the command's own.
//!
//! While the machine runs, a detached process serves `<state>/driver.sock`, from which a
//! process in a container learns its host pid ([`tessera_sim_state::driver`]), so that NVML
//! reports host pids as on a real card; `tessera sim --gpus 2x80GiB -- sleep infinity` keeps
//! it for a node whose GPUs are simulated.
//!
//! Every command of one state folder sees the same GPUs ([`tessera_sim_state::machine`]):
//! without `--gpus` (or `TESSERA_SIM_GPUS`) a command joins the machine running there, and a
//! spec that differs from the running machine's is refused (exit 2).

#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;

use crate::CliError;
use tessera_sim_state::{
    ENV_CONTEXT_MEMORY, ENV_DIR, ENV_FURTHER_CONTEXT_MEMORY, ENV_GPUS, MODELED_CONTEXT_MEMORY,
    SimSpec,
};

/// Arguments of `tessera sim`.
#[derive(Debug, clap::Args)]
pub(crate) struct SimArgs {
    /// GPUs to simulate, e.g. `2x80GiB` or `1x16GiB,1x24GiB`; must match the machine already
    /// running in the state folder, if any [env: TESSERA_SIM_GPUS] [default: the running
    /// machine's, else 1x80GiB].
    #[arg(long, value_name = "SPEC")]
    pub gpus: Option<String>,
    /// Shared state folder [env: TESSERA_SIM_DIR] [default: /tmp/tessera-sim-<uid>].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Folder with the built libtessera_sim_*.so [env: TESSERA_SIM_LIB_DIR] [default: next to
    /// tessera].
    #[arg(long, value_name = "DIR")]
    pub lib_dir: Option<PathBuf>,
    /// Device memory a process's first context on a device costs, e.g. `300MiB`, `0` for none
    /// [env: TESSERA_SIM_CONTEXT_MEMORY] [default: 300MiB].
    #[arg(long, value_name = "SIZE")]
    pub context_memory: Option<String>,
    /// Device memory each further context of a process on the same device costs (every
    /// `cuCtxCreate` beside the first context) [env: TESSERA_SIM_FURTHER_CONTEXT_MEMORY]
    /// [default: what the first costs].
    #[arg(long, value_name = "SIZE")]
    pub further_context_memory: Option<String>,
    /// Inject an XID error event on a GPU (e.g. `0:79`), then exit without running a command.
    #[arg(long, value_name = "GPU:CODE")]
    pub inject_xid: Option<String>,
    /// The command to run, after `--` (so a misspelled flag is an error, never the command).
    #[arg(last = true, allow_hyphen_values = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// Runs `tessera sim`; returns the process exit code.
pub(crate) fn main(args: SimArgs) -> Result<u8, CliError> {
    // The user's spec, a flag over the environment; without one, the running machine's.
    let requested = match &args.gpus {
        Some(g) => Some((g.clone(), "--gpus")),
        None => std::env::var(ENV_GPUS)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .map(|v| (v, ENV_GPUS)),
    };
    if let Some((gpus, from)) = &requested {
        SimSpec::parse(gpus)
            .map_err(|e| CliError::usage(format!("invalid GPU spec {from} {gpus}: {e}")))?;
    }
    let state_dir = match &args.state_dir {
        Some(d) => d.clone(),
        None => tessera_sim_state::state_dir_from_env(),
    };
    if let Some(xid) = &args.inject_xid {
        let gpus = match &requested {
            Some((g, _)) => g.clone(),
            None => tessera_sim_state::machine::running_spec(&state_dir)?
                .unwrap_or_else(|| tessera_sim_state::DEFAULT_GPUS.to_string()),
        };
        let spec = SimSpec::parse(&gpus)
            .map_err(|e| CliError::usage(format!("invalid GPU spec {gpus}: {e}")))?;
        if !args.command.is_empty() {
            return Err(CliError::usage(
                "--inject-xid does not run a command; drop the command or the flag",
            ));
        }
        let (gpu, code) = xid
            .split_once(':')
            .and_then(|(g, c)| Some((g.trim().parse::<u32>().ok()?, c.trim().parse::<u64>().ok()?)))
            .ok_or_else(|| {
                CliError::usage(format!(
                    "--inject-xid {xid:?}: expected GPU:CODE, e.g. 0:79"
                ))
            })?;
        if gpu as usize >= spec.count() {
            return Err(CliError::usage(format!(
                "--inject-xid: GPU {gpu} does not exist ({} simulated)",
                spec.count()
            )));
        }
        tessera_sim_state::inject_xid(&state_dir, gpu, code)?;
        eprintln!("tessera sim: injected XID {code} on GPU {gpu}");
        return Ok(0);
    }
    let Some((program, rest)) = args.command.split_first() else {
        return Err(CliError::usage(
            "no command given: use `tessera sim [OPTIONS] -- COMMAND ARGS...`",
        ));
    };
    // The user's value wins, a flag over the environment (checked here, so a typo fails before
    // the command starts).
    let context_memory = match args
        .context_memory
        .clone()
        .map(|v| (v, "--context-memory"))
        .or_else(|| {
            std::env::var(ENV_CONTEXT_MEMORY)
                .ok()
                .map(|v| (v, ENV_CONTEXT_MEMORY))
        }) {
        Some((v, from)) => {
            tessera_sim_state::parse_context_memory(&v)
                .map_err(|e| CliError::usage(format!("{from} {v:?}: {e}")))?;
            v
        }
        None => MODELED_CONTEXT_MEMORY.to_string(),
    };
    // Further contexts cost what the first does unless set; a bad value fails here too.
    let further = match &args.further_context_memory {
        Some(v) => {
            tessera_sim_state::parse_context_memory(v)
                .map_err(|e| CliError::usage(format!("--further-context-memory {v:?}: {e}")))?;
            Some(v.clone())
        }
        None => {
            tessera_sim_state::further_context_memory_from_env()
                .map_err(|e| CliError::usage(e.to_string()))?;
            None
        }
    };
    let built = tessera_sim_state::find_built_lib_dir(args.lib_dir.as_deref())?;
    let lib = tessera_sim_state::prepare_lib_dir(&state_dir, &built)?;
    // Last, once nothing else can fail: joins the running machine (or starts it). The hold's
    // descriptor stays open into the command, which keeps the machine's spec while it runs.
    let (gpus, _hold) =
        tessera_sim_state::machine::join(&state_dir, requested.as_ref().map(|(g, _)| g.as_str()))
            .map_err(|e| match (e, &requested) {
            // Say where the differing spec came from (a stale TESSERA_SIM_GPUS, say).
            (tessera_sim_state::MachineError::Differs { dir, running, .. }, Some((g, from))) => {
                tessera_sim_state::MachineError::Differs {
                    dir,
                    running,
                    requested: format!("{from} {g}"),
                }
            }
            (e, _) => e,
        })?;
    // The machine's kernel side: tells each process in a container its host pid, as a real
    // driver knows it (NVML reports host pids). A process of its own, detached, serving while
    // the machine runs (this one execs, and a thread would not survive that); one already
    // serving the machine is kept. Without it everything still runs, each process known by its
    // own pid (right outside containers), so a failure is only a warning.
    if let Err(e) = tessera_sim_state::driver::spawn_detached(&state_dir) {
        eprintln!(
            "tessera sim: warning: {e}; processes in containers will be known by the pids of \
             their own PID namespaces"
        );
    }
    let mut ld = OsString::from(lib.as_os_str());
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|v| !v.is_empty()) {
        ld.push(":");
        ld.push(old);
    }
    // Exec, not spawn: the command *is* this process, so a signal sent to `tessera sim` (a
    // supervisor's SIGTERM, a shell's kill) reaches it, and nothing is left orphaned.
    let mut cmd = std::process::Command::new(program);
    if let Some(v) = further {
        cmd.env(ENV_FURTHER_CONTEXT_MEMORY, v);
    }
    let err = cmd
        .args(rest)
        .env("LD_LIBRARY_PATH", ld)
        .env(ENV_GPUS, &gpus)
        .env(ENV_DIR, &state_dir)
        .env(ENV_CONTEXT_MEMORY, context_memory)
        .exec();
    Ok(crate::spawn::not_started("tessera sim", program, &err))
}
