//! `tessera`: the command line of Tessera.
//!
//! Thin entry point; each subcommand lives in its own module:
//! - [`sim`]: run any command on the simulated GPUs.
//! - [`run`]: run a command under an enforced allocation, without Kubernetes.
//! - [`delete`]: delete an allocation by id (refused while processes of it are connected,
//!   unless `--force`).
//! - [`status`]: show allocations per GPU, like `nvidia-smi` (`--watch`: live).
//! - [`signals`]: SIGINT/SIGTERM waited for rather than handled (`status --watch`).
//! - [`doctor`]: a checklist of what Tessera needs here, with the fix for each failure.
//! - [`error`]: [`CliError`], the one error type of the subcommands, with its exit codes.
//!
//! Exit codes (documented in README.md):
//! - `sim` and `run` pass the command's exit code through (128 + signal when it was killed);
//! - 1: any other error; 2: bad usage (from clap, or [`CliError::Usage`]: a value clap cannot
//!   check, e.g. a `--gpus` spec or an environment variable);
//! - 3: the arbiter could not be reached; 4: the arbiter refused the request;
//! - `doctor`: 0 when every check passed or was skipped, 1 when one failed, 2 bad usage.

mod delete;
mod doctor;
mod error;
mod ffi;
mod run;
mod signals;
mod sim;
mod status;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Share one GPU between several processes with enforced limits.
#[derive(Debug, Parser)]
#[command(name = "tessera", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a command on the simulated GPUs (libcuda.so.1 and libnvidia-ml.so.1 stand-ins).
    Sim(sim::SimArgs),
    /// Run a command with an enforced GPU memory limit and compute share.
    Run(run::RunArgs),
    /// Show every allocation per GPU.
    Status(status::StatusArgs),
    /// Delete an allocation by id (refused while processes of it are connected).
    Delete(delete::DeleteArgs),
    /// Check the driver, the arbiter, the interposer and an allocation; say how to fix failures.
    Doctor(doctor::DoctorArgs),
    /// The probe `tessera doctor` runs as a child under the interposer (internal).
    #[command(name = "doctor-probe", hide = true)]
    DoctorProbe(doctor::ProbeArgs),
}

pub use error::CliError;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Sim(args) => sim::main(args),
        Command::Run(args) => run::main(args),
        Command::Status(args) => status::main(args),
        Command::Delete(args) => delete::main(args),
        Command::Doctor(args) => doctor::main(args),
        Command::DoctorProbe(args) => doctor::probe_main(args),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            eprintln!("tessera: {}", err.message());
            ExitCode::from(err.exit_code())
        }
    }
}
