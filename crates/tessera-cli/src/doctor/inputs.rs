//! What the checks look at: the preload list, the interposer named in it, and the allocation
//! this process belongs to by the node contract.

use super::*;

/// Entries of a preload list (`/etc/ld.so.preload` or `LD_PRELOAD`): separated by spaces,
/// tabs, newlines or ':'; `#` starts a comment in the file.
pub(super) fn preload_entries(text: &str) -> Vec<PathBuf> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .flat_map(|l| l.split([' ', '\t', ':']))
        .filter(|e| !e.is_empty())
        .map(PathBuf::from)
        .collect()
}

/// The first entry that is a Tessera interposer (loads and exports the hooks).
pub(super) fn interposer_among(entries: &[PathBuf]) -> Option<PathBuf> {
    entries
        .iter()
        .find(|e| tessera_preload::check(e).is_ok())
        .cloned()
}

/// The allocation this process belongs to, by the node contract's rule (the interposer's):
/// the identity file, else `--token`/`TESSERA_TOKEN` and `--tenant-socket`/`TESSERA_SOCKET`
/// (clap has read the variables into the flags).
pub(super) fn doctor_target(
    identity: Option<Result<Identity, IdentityReadError>>,
    args: &DoctorArgs,
) -> Target {
    node::resolve(identity, |k| match k {
        node::ENV_TOKEN => args.token.clone().map(Into::into),
        node::ENV_SOCKET => args.socket.clone().map(Into::into),
        _ => None,
    })
}
