//! Command-line and environment configuration of the daemon.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use tessera_protocol::node;

/// Default tenant socket. Its folder is what the device plugins mount into containers, so it
/// holds nothing else (the admin socket is outside it); every binary has this default.
pub const DEFAULT_SOCKET: &str = node::DEFAULT_TENANT_SOCKET;
/// Default admin socket (never mounted into containers).
pub const DEFAULT_ADMIN_SOCKET: &str = node::DEFAULT_ADMIN_SOCKET;
/// Default state directory.
pub const DEFAULT_STATE_DIR: &str = node::DEFAULT_STATE_DIR;

/// `tessera-arbiter`: the per-node daemon that enforces Tessera's GPU memory limits and
/// compute shares.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "tessera-arbiter", version, about)]
pub struct Config {
    /// Tenant socket (mode 0666: the allocation token is the authority); old name `--socket`.
    #[arg(
        long = "tenant-socket",
        alias = "socket",
        value_name = "PATH",
        env = node::ENV_SOCKET,
        default_value = DEFAULT_SOCKET
    )]
    pub socket: PathBuf,
    /// Admin socket (mode 0600).
    #[arg(long, value_name = "PATH", env = node::ENV_ADMIN_SOCKET, default_value = DEFAULT_ADMIN_SOCKET)]
    pub admin_socket: PathBuf,
    /// Directory of the persisted allocations (created with mode 0700).
    #[arg(long, value_name = "DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// Log format: `text` (lines for people) or `json` (one object per line, for cluster log
    /// pipelines). Levels come from `RUST_LOG` (default `info`).
    #[arg(
        long,
        env = node::ENV_LOG_FORMAT,
        default_value = "text",
        value_name = "text|json"
    )]
    pub log_format: tessera_log::LogFormat,
    /// NVML library to load (a bare name is looked up on the loader's search path).
    #[arg(
        long,
        value_name = "PATH",
        env = node::ENV_NVML_LIB,
        default_value = "libnvidia-ml.so.1"
    )]
    pub nvml_lib: PathBuf,
    /// What the memory backstop does with a process whose allocation's processes hold more
    /// device memory (by NVML) than the limit plus the slack (and tolerance): `kill` (SIGKILL)
    /// or `report`.
    #[arg(long, value_name = "kill|report", value_enum, default_value = "kill")]
    pub enforce: EnforceArg,
    /// How often the backstop reads NVML, milliseconds; 0 turns it off.
    #[arg(long, default_value_t = 250, value_name = "MS")]
    pub backstop_interval_ms: u64,
    /// Device memory an allocation's processes may hold together beyond its limit, MiB: the
    /// driver's own rounding. One figure per allocation, whatever its number of processes
    /// (contexts are inside the limit: the interposer reserves each one's cost).
    #[arg(long, default_value_t = crate::backstop::DEFAULT_MEMORY_SLACK >> 20, value_name = "MIB")]
    pub backstop_slack_mib: u64,
    /// Device memory each process of an allocation may hold beyond that, MiB (default 0). Only
    /// for cards whose contexts cost more than the interposer reserves for one (300 MiB): set
    /// it to the difference. It lets the card pass the limit by this much per process.
    #[arg(long, default_value_t = 0, value_name = "MIB")]
    pub backstop_tolerance_mib: u64,
    /// What the backstop does with a process in a container that uses a GPU but belongs to
    /// no allocation (no connection, no Tessera identity file): `kill`, `report` or `ignore`.
    /// Such processes on the host are only ever reported (or ignored).
    #[arg(
        long,
        value_name = "kill|report|ignore",
        value_enum,
        default_value = "kill"
    )]
    pub unknown_processes: UnknownArg,
    /// GPU time the allocations of a GPU that bypass its leases (kernels launched around the
    /// gate) may use together beyond the slack before the backstop kills the busiest process
    /// of each, milliseconds. Every such millisecond is also charged to its allocation's share.
    #[arg(long, default_value_t = 500, value_name = "MS")]
    pub compute_bypass_ms: u64,
    /// Unleased GPU time forgiven per GPU, as a percentage of wall time, for all the GPU's
    /// allocations together (kernels that run past the end of their lease).
    #[arg(long, default_value_t = 5.0, value_name = "PERCENT")]
    pub compute_slack_percent: f64,
    /// Unleased GPU time an allocation may show by NVML before any of it is charged to its
    /// share, milliseconds: NVML attributes GPU time per process in whole sample periods
    /// (200 ms on an H200), so an honest tenant's figure runs ahead of its leases by up to a
    /// period or two. The kill rule (`--compute-bypass-ms`) is not affected.
    #[arg(long, default_value_t = crate::backstop::DEFAULT_COMPUTE_TOLERANCE.as_millis() as u64, value_name = "MS")]
    pub compute_tolerance_ms: u64,
    /// After a latency-tier lease is handed back (its request done), how long the GPU stays
    /// held for that allocation, charged to it, before best-effort work is let on,
    /// microseconds (0: none). Worth it for requests that come in bursts; with spread-out
    /// arrivals it only idles the GPU (docs/compute.md, "Tiers").
    #[arg(long, default_value_t = 0, value_name = "US")]
    pub latency_linger_us: u64,
    /// How long a reservation that does not fit waits for the allocation's other processes to
    /// give back unused credit or free memory before it is refused, milliseconds.
    #[arg(long, default_value_t = 50, value_name = "MS")]
    pub memory_wait_ms: u64,
    /// The host's mount namespace: a process in another one runs in a container. With
    /// `hostPID` (the DaemonSet) this is init's. If it cannot be read, a process without a
    /// Tessera identity file is taken for a host process (reported, never killed).
    #[arg(long, default_value = "/proc/1/ns/mnt", value_name = "PATH")]
    pub host_mount_ns: PathBuf,
    /// The folder where the kubelet plugins write containers' identity files (their
    /// `--host-identity-dir`). When set, a container's identity file proves its allocation
    /// only if it is one of these files (the same inode, as a bind mount shows it), never a
    /// file a tenant mounted over it; unset, any read-only file naming a live allocation does.
    #[arg(long, value_name = "DIR")]
    pub identity_dir: Option<PathBuf>,
    /// Deadline for a new connection's whole handshake (its `Hello` and the answer),
    /// milliseconds; not per read, so a peer that trickles bytes is dropped all the same.
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub handshake_timeout_ms: u64,
    /// Connections that have not finished their handshake, all peers together; more are closed
    /// at once (each socket counts its own).
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub max_pending_handshakes: usize,
    /// Connections that have not finished their handshake per container (the peer's cgroup;
    /// its uid where that cannot be read). Past it a new connection takes the place of the
    /// container's oldest pending one, so a flood delays only its own container.
    #[arg(
        long,
        alias = "max-pending-per-uid",
        default_value_t = 128,
        value_name = "N"
    )]
    pub max_pending_per_container: usize,
    /// Connections that have not finished their handshake per peer pid (`SO_PEERCRED`).
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub max_pending_per_pid: usize,
    /// Admitted tenant connections per allocation; more are refused after their `Hello`.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub max_connections_per_allocation: usize,
    /// Admitted tenant connections in total (each is served by a thread). With the other caps
    /// it bounds the arbiter's memory: see docs/arbiter.md.
    #[arg(long, default_value_t = 4096, value_name = "N")]
    pub max_tenant_connections: usize,
    /// Admitted tenant connections every allocation may always have, whatever the others hold
    /// (reserved out of `--max-tenant-connections`): a few allocations cannot fill the arbiter
    /// for the rest.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub guaranteed_connections_per_allocation: usize,
    /// Where Prometheus metrics are served (`GET /metrics`, plain HTTP): HOST:PORT, port 0 for
    /// any free port (logged), or `none`. Loopback by default; the DaemonSet binds the pod's
    /// address. See docs/metrics.md.
    #[arg(
        long,
        env = tessera_protocol::node::ENV_METRICS_ADDR,
        default_value = crate::metrics::DEFAULT_METRICS_ADDR,
        value_name = "ADDR|none"
    )]
    pub metrics_addr: crate::metrics::MetricsAddr,
    /// A shared workstation's users: `--users-group`, `--user-socket`, `--user-quota`,
    /// `--user-quota-for` ([`crate::users`]).
    #[command(flatten)]
    pub users: crate::users::UserArgs,
    /// Parse and validate the flags, print `config ok` and exit 0 (exit 2 with the reason
    /// otherwise); nothing is opened or started. The Helm chart's check runs every rendered
    /// container's arguments through it.
    #[arg(long)]
    pub check_config: bool,
}

/// A combination of flags the daemon refuses before it opens anything (exit 2).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// Both sockets at one path: the second bind would remove the first one's socket.
    #[error("--tenant-socket and --admin-socket are the same path {0}")]
    SameSocket(PathBuf),
    /// A percentage outside 0-100 (or not a number): clamping it would hide the typo.
    #[error("--compute-slack-percent must be a number from 0 to 100, not {0}")]
    SlackPercent(f64),
    /// No connection could ever be admitted.
    #[error("--{0} must be at least 1")]
    Zero(&'static str),
}

impl Config {
    /// The checks the daemon makes on its flags before it opens anything (and all that
    /// `--check-config` runs). Paths are compared as written: the folders may not exist yet.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.socket == self.admin_socket {
            return Err(ConfigError::SameSocket(self.socket.clone()));
        }
        if !(0.0..=100.0).contains(&self.compute_slack_percent) {
            return Err(ConfigError::SlackPercent(self.compute_slack_percent));
        }
        for (flag, v) in [
            ("max-pending-handshakes", self.max_pending_handshakes),
            ("max-pending-per-container", self.max_pending_per_container),
            ("max-pending-per-pid", self.max_pending_per_pid),
            (
                "max-connections-per-allocation",
                self.max_connections_per_allocation,
            ),
            ("max-tenant-connections", self.max_tenant_connections),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(flag));
            }
        }
        Ok(())
    }

    /// The admission caps of these flags.
    pub fn limits(&self) -> crate::admission::Limits {
        crate::admission::Limits {
            handshake_timeout: std::time::Duration::from_millis(self.handshake_timeout_ms.max(1)),
            pending: self.max_pending_handshakes,
            pending_per_group: self.max_pending_per_container,
            pending_per_pid: self.max_pending_per_pid,
            per_allocation: self.max_connections_per_allocation,
            admitted: self.max_tenant_connections,
            guaranteed: self.guaranteed_connections_per_allocation,
        }
    }
}

/// `--enforce`: what the backstop does with a process past its allocation's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EnforceArg {
    /// `SIGKILL` it (the default).
    Kill,
    /// Log and count it only.
    Report,
}

/// `--unknown-processes`: what the backstop does with a container process that belongs to no
/// allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum UnknownArg {
    /// `SIGKILL` it (`--enforce report` turns it into a report too).
    Kill,
    /// Log it once.
    Report,
    /// Say nothing.
    Ignore,
}

impl From<EnforceArg> for crate::backstop::Enforce {
    fn from(a: EnforceArg) -> Self {
        match a {
            EnforceArg::Kill => Self::Kill,
            EnforceArg::Report => Self::Report,
        }
    }
}

impl From<UnknownArg> for crate::backstop::Unknown {
    fn from(a: UnknownArg) -> Self {
        match a {
            UnknownArg::Kill => Self::Kill,
            UnknownArg::Report => Self::Report,
            UnknownArg::Ignore => Self::Ignore,
        }
    }
}

impl Config {
    /// The scheduler's tunables: the defaults with the flags that set some of them.
    pub fn scheduler_params(&self) -> crate::scheduler::SchedulerParams {
        crate::scheduler::SchedulerParams {
            latency_linger_ns: self.latency_linger_us.saturating_mul(1_000),
            ..crate::scheduler::SchedulerParams::default()
        }
    }

    /// The backstop's policy from these flags; `None` when `--backstop-interval-ms 0` turns it
    /// off.
    pub fn backstop_policy(&self) -> Option<crate::backstop::Policy> {
        use crate::backstop::{Policy, Tolerance};
        (self.backstop_interval_ms > 0).then(|| Policy {
            interval: std::time::Duration::from_millis(self.backstop_interval_ms),
            memory_tolerance: Tolerance {
                per_allocation: self.backstop_slack_mib.saturating_mul(1 << 20),
                per_process: self.backstop_tolerance_mib.saturating_mul(1 << 20),
            },
            enforce: self.enforce.into(),
            unknown: self.unknown_processes.into(),
            compute_threshold: std::time::Duration::from_millis(self.compute_bypass_ms),
            compute_slack: (self.compute_slack_percent / 100.0).clamp(0.0, 1.0),
            compute_tolerance: std::time::Duration::from_millis(self.compute_tolerance_ms),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn parse(args: &[&str]) -> Config {
        Config::try_parse_from(std::iter::once("tessera-arbiter").chain(args.iter().copied()))
            .unwrap()
    }

    #[test]
    fn the_defaults_and_the_charts_flags_are_valid() {
        parse(&[]).validate().unwrap();
        let chart = parse(&[
            "--tenant-socket=/run/tessera/tenant/tessera.sock",
            "--admin-socket=/run/tessera/admin.sock",
            "--state-dir=/var/lib/tessera/state",
            "--enforce=kill",
            "--unknown-processes=report",
            "--backstop-interval-ms=250",
            "--metrics-addr=10.0.0.5:9464",
            "--check-config",
        ]);
        assert!(chart.check_config);
        chart.validate().unwrap();
    }

    #[test]
    fn combinations_the_daemon_cannot_serve_are_refused() {
        let same = parse(&["--tenant-socket=/run/t.sock", "--admin-socket=/run/t.sock"]);
        assert_eq!(
            same.validate(),
            Err(ConfigError::SameSocket("/run/t.sock".into()))
        );
        for bad in ["-1", "100.5", "NaN"] {
            let c = parse(&[&format!("--compute-slack-percent={bad}")]);
            assert!(
                matches!(c.validate(), Err(ConfigError::SlackPercent(_))),
                "{bad}"
            );
        }
        let c = parse(&["--max-tenant-connections=0"]);
        assert_eq!(
            c.validate(),
            Err(ConfigError::Zero("max-tenant-connections"))
        );
    }
}
