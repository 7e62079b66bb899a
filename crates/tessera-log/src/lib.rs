//! Logging set-up shared by Tessera's daemons (`tessera-arbiter`, `tessera-device-plugin`).
//!
//! Daemons log through [`tracing`] macros; [`init`] installs one subscriber writing to stderr:
//! levels from `RUST_LOG` (default `info`, e.g. `RUST_LOG=tessera_arbiter=debug`), and either
//! human-readable lines or one JSON object per line for cluster log pipelines
//! (`--log-format json`). The interposer does not use this: it lives inside tenant processes
//! and keeps its own minimal logger.
//!
//! Modules: none; [`LogFormat`], [`LogError`] and [`init`] are the whole API.

#![forbid(unsafe_code)]

use std::fmt;
use std::io::IsTerminal;
use std::str::FromStr;

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// `2026-11-30T22:41:07.123456Z  INFO tessera_arbiter::admin: created allocation ...`
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `target`, `fields.message`, ...).
    Json,
}

impl FromStr for LogFormat {
    type Err = LogError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(LogError::Format(other.to_owned())),
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Text => "text",
            Self::Json => "json",
        })
    }
}

/// Why logging could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// `--log-format` is neither `text` nor `json`.
    #[error("log format {0:?} is neither \"text\" nor \"json\"")]
    Format(String),
    /// `RUST_LOG` does not parse as a filter.
    #[error("RUST_LOG: {0}")]
    Filter(#[source] tracing_subscriber::filter::ParseError),
    /// A subscriber was already installed in this process.
    #[error("cannot install the log subscriber: {0}")]
    Install(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// The filter from `RUST_LOG`, `info` when it is unset or empty.
pub fn filter_from(rust_log: Option<&str>) -> Result<EnvFilter, LogError> {
    match rust_log.map(str::trim).filter(|s| !s.is_empty()) {
        Some(spec) => EnvFilter::try_new(spec).map_err(LogError::Filter),
        None => Ok(EnvFilter::new("info")),
    }
}

/// Installs the process's subscriber: stderr, `RUST_LOG` levels, `format`.
pub fn init(format: LogFormat) -> Result<(), LogError> {
    let filter = filter_from(std::env::var("RUST_LOG").ok().as_deref())?;
    // Colours only for a person at a terminal: log files and pipelines get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    }
    .map_err(LogError::Install)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_and_print_back() {
        for f in [LogFormat::Text, LogFormat::Json] {
            assert_eq!(f.to_string().parse::<LogFormat>().unwrap(), f);
        }
        assert!(matches!(
            "yaml".parse::<LogFormat>(),
            Err(LogError::Format(s)) if s == "yaml"
        ));
    }

    #[test]
    fn rust_log_is_checked_and_defaults_to_info() {
        assert_eq!(filter_from(None).unwrap().to_string(), "info");
        assert_eq!(filter_from(Some("  ")).unwrap().to_string(), "info");
        assert_eq!(
            filter_from(Some("tessera_arbiter=debug"))
                .unwrap()
                .to_string(),
            "tessera_arbiter=debug"
        );
        assert!(matches!(
            filter_from(Some("tessera_arbiter=loud")),
            Err(LogError::Filter(_))
        ));
    }
}
