//! Minimal leveled logging to stderr, set by `TESSERA_LOG` (`off`, `error`, `warn`, `info`,
//! `debug`, `trace`; default `warn`). One `write(2)` per line, formatted on the stack, so a
//! log line never allocates and lines from several threads never interleave.

use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicU8, Ordering};
use tessera_protocol::node;

/// Log levels, most severe first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Level {
    /// Nothing is logged.
    Off = 0,
    /// Enforcement cannot work (arbiter refused us, driver missing).
    Error = 1,
    /// Something degraded (arbiter unreachable, unknown variant).
    Warn = 2,
    /// Connection life cycle.
    Info = 3,
    /// Per-call decisions (refusals, reservations).
    Debug = 4,
    /// Every intercepted look-up.
    Trace = 5,
}

const UNSET: u8 = u8::MAX;
static LEVEL: AtomicU8 = AtomicU8::new(UNSET);

/// Parses a `TESSERA_LOG` value; unknown values fall back to `warn`.
pub fn parse_level(value: Option<&str>) -> Level {
    match value.map(|v| v.trim().to_ascii_lowercase()) {
        None => Level::Warn,
        Some(v) => match v.as_str() {
            "off" | "none" | "0" => Level::Off,
            "error" => Level::Error,
            "warn" | "warning" => Level::Warn,
            "info" => Level::Info,
            "debug" => Level::Debug,
            "trace" => Level::Trace,
            _ => Level::Warn,
        },
    }
}

/// Sets the level (from the constructor, or lazily on first use).
pub fn set_level(level: Level) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

/// True when messages at `level` are printed. One relaxed load on the hot path.
#[inline]
pub fn enabled(level: Level) -> bool {
    let mut cur = LEVEL.load(Ordering::Relaxed);
    if cur == UNSET {
        let env = std::env::var(node::ENV_LOG).ok();
        let l = parse_level(env.as_deref());
        set_level(l);
        cur = l as u8;
    }
    level as u8 <= cur
}

/// A fixed stack buffer that silently truncates.
struct LineBuf {
    buf: [u8; 512],
    len: usize,
}

impl fmt::Write for LineBuf {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = self.buf.len() - 1 - self.len; // keep one byte for '\n'
        let n = s.len().min(room);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

/// Writes one line to stderr. Use the [`tlog!`](crate::tlog) macro instead.
pub fn write(level: Level, args: fmt::Arguments<'_>) {
    let mut line = LineBuf {
        buf: [0; 512],
        len: 0,
    };
    let tag = match level {
        Level::Off => "",
        Level::Error => "error",
        Level::Warn => "warn",
        Level::Info => "info",
        Level::Debug => "debug",
        Level::Trace => "trace",
    };
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    let _ = write!(line, "tessera-interpose[{pid}] {tag}: ");
    let _ = line.write_fmt(args);
    line.buf[line.len] = b'\n';
    line.len += 1;
    // SAFETY: the buffer is valid for `len` bytes; fd 2 may be closed, which only fails the call.
    let _ = unsafe { libc::write(2, line.buf.as_ptr().cast(), line.len) };
}

/// Logs at a level: `tlog!(Warn, "arbiter unreachable: {e}")`.
#[macro_export]
macro_rules! tlog {
    ($level:ident, $($arg:tt)*) => {
        if $crate::log::enabled($crate::log::Level::$level) {
            $crate::log::write($crate::log::Level::$level, format_args!($($arg)*));
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_and_order() {
        assert_eq!(parse_level(None), Level::Warn);
        assert_eq!(parse_level(Some("DEBUG")), Level::Debug);
        assert_eq!(parse_level(Some(" trace ")), Level::Trace);
        assert_eq!(parse_level(Some("off")), Level::Off);
        assert_eq!(parse_level(Some("bogus")), Level::Warn);
        assert!(Level::Error < Level::Trace);
    }

    #[test]
    fn long_lines_are_truncated_not_overflowed() {
        let mut line = LineBuf {
            buf: [0; 512],
            len: 0,
        };
        let long = "x".repeat(2000);
        let _ = write!(line, "{long}");
        assert_eq!(line.len, 511);
    }
}
