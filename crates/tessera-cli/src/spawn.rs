//! A command that could not be started: the shell's exit codes and words for it.

#![forbid(unsafe_code)]

use std::ffi::OsStr;
use std::io;

/// Exit code when the command does not exist (as shells do).
pub(crate) const NOT_FOUND: u8 = 127;
/// Exit code when it exists but cannot be run (not executable, not a program).
pub(crate) const CANNOT_RUN: u8 = 126;

/// Says on stderr why `program` did not start (`context`: `tessera run`, `tessera sim`) and
/// returns the exit code: 127 when it is not there, 126 when it cannot be run.
pub(crate) fn not_started(context: &str, program: &OsStr, e: &io::Error) -> u8 {
    let program = program.to_string_lossy();
    let (code, why) = match e.kind() {
        io::ErrorKind::NotFound => (NOT_FOUND, "command not found".to_owned()),
        io::ErrorKind::PermissionDenied => (CANNOT_RUN, "permission denied".to_owned()),
        _ => (CANNOT_RUN, e.to_string()),
    };
    eprintln!("{context}: {program}: {why}");
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shells_codes() {
        let nf = io::Error::from(io::ErrorKind::NotFound);
        assert_eq!(not_started("t", OsStr::new("x"), &nf), 127);
        let pd = io::Error::from(io::ErrorKind::PermissionDenied);
        assert_eq!(not_started("t", OsStr::new("x"), &pd), 126);
    }
}
