//! `tessera run` (placeholder until its issue lands).

/// Arguments of `tessera run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {}

/// Runs `tessera run`; returns the process exit code.
pub fn main(_args: RunArgs) -> anyhow::Result<u8> {
    anyhow::bail!("tessera run is not built yet")
}
