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
//! - [`endpoint`]: the admin socket (root) or the user socket (a workstation's users).
//! - [`spawn`]: a command that could not be started (exit 127 or 126, as shells).
//!
//! Exit codes (documented in README.md):
//! - `sim` and `run` pass the command's exit code through (128 + signal when it was killed);
//!   127 when the command does not exist, 126 when it cannot be run (as shells do);
//! - 1: any other error; 2: bad usage (from clap, or [`CliError::Usage`]: a value clap cannot
//!   check, e.g. a `--gpus` spec or an environment variable);
//! - 3: the arbiter could not be reached; 4: the arbiter refused the request;
//! - `doctor`: 0 when every check passed or was skipped, 1 when one failed, 2 bad usage.

mod delete;
mod doctor;
mod endpoint;
mod error;
mod ffi;
mod run;
mod signals;
mod sim;
mod spawn;
mod status;

use std::ffi::OsString;
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

/// Flags whose value is a size (or a spec of sizes).
const SIZE_FLAGS: [&str; 2] = ["--memory", "--gpus"];

/// `--memory 4 GiB`: the shell splits the size in two and clap sees a stray `GiB`. Says so
/// when the word after a size flag's value is a unit, with the one-word spelling.
fn split_size_hint(args: &[OsString]) -> Option<String> {
    let words: Vec<&str> = args
        .iter()
        .take_while(|a| *a != "--")
        .filter_map(|a| a.to_str())
        .collect();
    words.windows(3).find_map(|w| {
        let unit = w[2];
        let is_unit = unit.starts_with(|c: char| c.is_ascii_alphabetic())
            && run::parse_size(&format!("1{unit}")).is_ok();
        (SIZE_FLAGS.contains(&w[0]) && is_unit).then(|| {
            format!(
                "`{} {} {unit}`: a size is one word, without a space: {} {}{unit}",
                w[0], w[1], w[0], w[1]
            )
        })
    })
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let args: Vec<OsString> = std::env::args_os().collect();
            if e.kind() == clap::error::ErrorKind::UnknownArgument
                && let Some(hint) = split_size_hint(&args)
            {
                eprintln!("tessera: {hint}");
                return ExitCode::from(2);
            }
            // clap's own message (it names the flag) and exit code (2; 0 for --help).
            e.exit()
        }
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    fn hint(line: &str) -> Option<String> {
        split_size_hint(&line.split(' ').map(OsString::from).collect::<Vec<_>>())
    }

    #[test]
    fn a_size_split_by_a_space_is_named() {
        let h = hint("tessera run --memory 4 GiB -- true").unwrap();
        assert!(h.contains("--memory 4GiB"), "{h}");
        let h = hint("tessera sim --gpus 1x4 Gi -- true").unwrap();
        assert!(h.contains("--gpus 1x4Gi"), "{h}");
        // A command word after the size, or a unit only after `--`, is something else.
        assert_eq!(hint("tessera run --memory 4GiB true"), None);
        assert_eq!(hint("tessera run --memory 4GiB -- GiB"), None);
        assert_eq!(hint("tessera run --share 4 GiB"), None);
    }
}
