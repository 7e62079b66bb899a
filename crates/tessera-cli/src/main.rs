//! `tessera`: the command line of Tessera.
//!
//! Thin entry point; each subcommand lives in its own module:
//! - [`sim`]: run any command on the simulated GPUs.
//! - [`run`]: run a command under an enforced allocation, without Kubernetes.
//! - [`status`]: show allocations per GPU, like `nvidia-smi`.
//!
//! Exit codes (documented in README.md):
//! - `sim` and `run` pass the command's exit code through (128 + signal when it was killed);
//! - 1: any other error; 2: bad usage (from clap);
//! - 3: the arbiter could not be reached; 4: the arbiter refused the request.

mod run;
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
}

/// An error carrying the exit code `main` should return.
#[derive(Debug)]
pub struct Exit(pub u8);

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit code {}", self.0)
    }
}

impl std::error::Error for Exit {}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Sim(args) => sim::main(args),
        Command::Run(args) => run::main(args),
        Command::Status(args) => status::main(args),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            if let Some(Exit(code)) = err.downcast_ref::<Exit>() {
                return ExitCode::from(*code);
            }
            eprintln!("tessera: {err:#}");
            ExitCode::from(exit_code_for(&err))
        }
    }
}

/// Maps an error to the documented exit code; errors tag themselves through [`Exit`] context.
fn exit_code_for(err: &anyhow::Error) -> u8 {
    err.chain()
        .find_map(|e| e.downcast_ref::<Exit>().map(|Exit(c)| *c))
        .unwrap_or(1)
}
