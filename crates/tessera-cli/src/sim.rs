//! `tessera sim` (placeholder until its issue lands).

/// Arguments of `tessera sim`.
#[derive(Debug, clap::Args)]
pub struct SimArgs {}

/// Runs `tessera sim`; returns the process exit code.
pub fn main(_args: SimArgs) -> anyhow::Result<u8> {
    anyhow::bail!("tessera sim is not built yet")
}
