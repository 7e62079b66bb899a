//! `tessera`: the command line of Tessera.
//!
//! Thin entry point; each subcommand lives in its own module:
//! - [`sim`]: run any command on the simulated GPUs.
//! - [`run`]: run a command under an enforced allocation, without Kubernetes.
//! - [`status`]: show allocations per GPU, like `nvidia-smi` (`--watch`: live).
//! - [`signals`]: SIGINT/SIGTERM waited for rather than handled (`status --watch`).
//! - [`doctor`]: a checklist of what Tessera needs here, with the fix for each failure.
//!
//! Exit codes (documented in README.md):
//! - `sim` and `run` pass the command's exit code through (128 + signal when it was killed);
//! - 1: any other error; 2: bad usage (from clap, or a [`Usage`] error: a value clap cannot
//!   check, e.g. a `--gpus` spec or an environment variable);
//! - 3: the arbiter could not be reached; 4: the arbiter refused the request;
//! - `doctor`: 0 when every check passed or was skipped, 1 when one failed, 2 bad usage.

mod doctor;
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
    /// Check the driver, the arbiter, the interposer and an allocation; say how to fix failures.
    Doctor(doctor::DoctorArgs),
    /// The probe `tessera doctor` runs as a child under the interposer (internal).
    #[command(name = "doctor-probe", hide = true)]
    DoctorProbe(doctor::ProbeArgs),
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

/// Bad usage found after parsing (a malformed spec, a flag combination): exit code 2, like
/// clap's own usage errors.
#[derive(Debug)]
pub struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// A [`Usage`] error.
pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    Usage(msg.into()).into()
}

/// The error and its causes on one line, each cause only once (many errors already print
/// their source, which `{:#}` would repeat).
fn one_message(err: &anyhow::Error) -> String {
    let mut msg = err.to_string();
    for cause in err.chain().skip(1) {
        let cause = cause.to_string();
        if !msg.contains(&cause) {
            msg.push_str(": ");
            msg.push_str(&cause);
        }
    }
    msg
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Sim(args) => sim::main(args),
        Command::Run(args) => run::main(args),
        Command::Status(args) => status::main(args),
        Command::Doctor(args) => doctor::main(args),
        Command::DoctorProbe(args) => doctor::probe_main(args),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            if let Some(Exit(code)) = err.downcast_ref::<Exit>() {
                return ExitCode::from(*code);
            }
            eprintln!("tessera: {}", one_message(&err));
            ExitCode::from(exit_code_for(&err))
        }
    }
}

/// Maps an error to the documented exit code; errors tag themselves through [`Exit`] context.
fn exit_code_for(err: &anyhow::Error) -> u8 {
    err.chain()
        .find_map(|e| {
            e.downcast_ref::<Exit>()
                .map(|Exit(c)| *c)
                .or_else(|| e.downcast_ref::<Usage>().map(|_| 2))
        })
        .unwrap_or(1)
}
