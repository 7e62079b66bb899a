//! The CLI's error: each variant knows its documented exit code, so `main` maps an error to
//! its code with one `match` and prints it once.

#![forbid(unsafe_code)]

use std::path::PathBuf;

use tessera_protocol::FrameError;
use tessera_protocol::client::ClientError;

/// Why a subcommand failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad usage found after parsing (a malformed spec, a flag combination, an environment
    /// variable): exit 2, like clap's own usage errors.
    #[error("{0}")]
    Usage(String),
    /// The arbiter could not be reached or hung up (exit 3), refused the request (exit 4), or
    /// answered something unexpected (exit 1).
    #[error("{}", arbiter_message(.socket, .source))]
    Arbiter {
        /// The admin socket asked.
        socket: PathBuf,
        /// What went wrong.
        #[source]
        source: ClientError,
    },
    /// `tessera doctor` could not report (exit 1; failed checks are exit 1 too, as a result).
    #[error(transparent)]
    Doctor(#[from] crate::doctor::DoctorError),
    /// The simulated GPUs could not be prepared (exit 1).
    #[error(transparent)]
    SimDirs(#[from] tessera_sim_state::DirsError),
    /// The running simulated machine's spec could not be read or written (exit 1; a spec
    /// that differs from it is a usage error, exit 2).
    #[error(transparent)]
    SimMachine(tessera_sim_state::MachineError),
    /// An XID could not be injected into the simulated GPUs (exit 1).
    #[error(transparent)]
    SimEvents(#[from] tessera_sim_state::EventsError),
    /// `--watch` could not take over SIGINT and SIGTERM (exit 1).
    #[error("cannot block SIGINT and SIGTERM: {0}")]
    Signals(#[source] std::io::Error),
    /// Anything else: exit 1.
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

impl From<tessera_sim_state::MachineError> for CliError {
    fn from(e: tessera_sim_state::MachineError) -> Self {
        match e {
            tessera_sim_state::MachineError::Differs { .. } => CliError::Usage(e.to_string()),
            e => CliError::SimMachine(e),
        }
    }
}

fn arbiter_message(socket: &std::path::Path, err: &ClientError) -> String {
    match err {
        ClientError::Connect { source, .. }
            if source.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            format!(
                "{err} (the admin socket is root's; a workstation's users use the user socket,                  which needs membership of the arbiter's --users-group: see docs/install.md,                  \"A shared workstation\")"
            )
        }
        ClientError::Connect { .. } => format!(
            "{err} (is tessera-arbiter running? set --admin-socket or TESSERA_ADMIN_SOCKET, or              --user-socket or TESSERA_USER_SOCKET)"
        ),
        _ => format!("arbiter at {}: {err}", socket.display()),
    }
}

impl CliError {
    /// A usage error.
    pub fn usage(msg: impl Into<String>) -> Self {
        CliError::Usage(msg.into())
    }

    /// An admin client error on `socket`.
    pub fn arbiter(source: ClientError, socket: &std::path::Path) -> Self {
        CliError::Arbiter {
            socket: socket.to_path_buf(),
            source,
        }
    }

    /// The documented exit code (README, "Exit codes").
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Arbiter { source, .. } => match source {
                ClientError::Connect { .. }
                | ClientError::Frame(FrameError::Io(_) | FrameError::Closed) => 3,
                ClientError::Refused { .. } | ClientError::Admin { .. } => 4,
                _ => 1,
            },
            CliError::Doctor(_)
            | CliError::Signals(_)
            | CliError::SimDirs(_)
            | CliError::SimMachine(_)
            | CliError::SimEvents(_)
            | CliError::Other(_) => 1,
        }
    }

    /// The message for stderr: an `Other` error with each of its causes once (many errors
    /// already print their source, which `{:#}` would repeat).
    pub fn message(&self) -> String {
        let CliError::Other(err) = self else {
            return self.to_string();
        };
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_errors_map_to_documented_exit_codes() {
        let sock = std::path::Path::new("/x.sock");
        let code = |e| CliError::arbiter(e, sock).exit_code();
        let connect = ClientError::Connect {
            path: "/x".into(),
            source: std::io::Error::other("no"),
        };
        assert!(
            CliError::arbiter(
                ClientError::Connect {
                    path: "/x".into(),
                    source: std::io::Error::other("no"),
                },
                sock
            )
            .to_string()
            .contains("is tessera-arbiter running?")
        );
        assert_eq!(code(connect), 3);
        assert_eq!(code(ClientError::Frame(FrameError::Closed)), 3);
        assert_eq!(
            code(ClientError::Refused {
                kind: tessera_protocol::RefusalKind::UnknownToken,
                reason: "no".into()
            }),
            4
        );
        let admin = ClientError::Admin {
            kind: tessera_protocol::AdminErrorKind::Exhausted,
            message: "full".into(),
        };
        assert_eq!(code(admin), 4);
        assert_eq!(code(ClientError::Unexpected("?".into())), 1);
        assert_eq!(CliError::usage("bad").exit_code(), 2);
        let other = CliError::from(anyhow::anyhow!("inner").context("outer"));
        assert_eq!(
            (other.exit_code(), other.message()),
            (1, "outer: inner".into())
        );
    }
}
