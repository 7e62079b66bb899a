//! `tessera status` (placeholder until its issue lands).

/// Arguments of `tessera status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {}

/// Runs `tessera status`; returns the process exit code.
pub fn main(_args: StatusArgs) -> anyhow::Result<u8> {
    anyhow::bail!("tessera status is not built yet")
}
