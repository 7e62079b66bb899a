//! `tessera doctor`: a checklist of what Tessera needs on this node or in this container, with
//! a verdict per line (ok / FAIL / skip) and, for each failure, the fix.
//!
//! Modules: [`report`] (checks, the report and its text), [`inputs`] (the preload list and the
//! allocation this process belongs to), [`checks`] (driver, NVML, sockets, token, GPU) and
//! [`probe`] (the child process that tries the limit and the gate); this file runs them in
//! order.
//!
//! Checks, in order (a check whose prerequisite failed is skipped, not failed twice):
//! - `driver`, `nvml`: `libcuda.so.1` and `libnvidia-ml.so.1` load; versions and GPUs.
//! - `arbiter`: the tenant socket answers the handshake in our protocol version; `admin`: the
//!   admin socket does too (skipped when it was not given and is not there, as in a pod).
//! - `interposer`: the interposer loads and defines its hooks and Tessera's marker symbol
//!   itself (the `tessera run` check).
//! - `preload` (in a container only): `/etc/ld.so.preload` names the interposer.
//! - `token`: the arbiter accepts the allocation's token (Hello -> Welcome, which names the
//!   allocation's GPU and limit); `gpu`: CUDA device 0 of this process is that GPU.
//! - `limit`, `memory-info`, `kernel`: a probe, run as a child process under the interposer
//!   with the token (so its context and memory are not the doctor's), allocates 1 GiB blocks
//!   until refused, reads `cuMemGetInfo` and NVML, and launches one short kernel.
//!
//! Where things come from: by the node contract's rule, the interposer's
//! (`tessera_protocol::node::resolve`): the token and socket from the identity file when there
//! is one, else `--token`/`TESSERA_TOKEN` and `--tenant-socket`/`TESSERA_SOCKET`; a token
//! without a socket, or an identity file that cannot be used, fails the `token` check, as the
//! interposer would refuse everything. Without a token the `arbiter` check looks at
//! `--tenant-socket` or the default, /run/tessera/tenant/tessera.sock.
//!
//! Exit codes: 0 every check passed or was skipped, 1 a check failed, 2 bad usage.

use std::ffi::{CStr, CString, c_char, c_void};
use std::io::Read as _;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tessera_protocol::node;

use serde::{Deserialize, Serialize};
use tessera_protocol::identity::{CONTAINER_IDENTITY_FILE, Identity, IdentityReadError};
use tessera_protocol::node::{Closed, Target};
use tessera_protocol::{
    AllocationView, Hello, PROTOCOL_VERSION, RefusalKind, Role, ServerHello, SocketKind, frame,
};

use crate::CliError;
use crate::ffi::{self, Lib};
use crate::run::{DEFAULT_ADMIN_SOCKET, DEFAULT_SOCKET, INTERPOSER_FILE};
use crate::status::human;

mod checks;
mod inputs;
mod probe;
mod report;

use checks::*;
use inputs::*;
pub(crate) use probe::probe_main;
use probe::*;
pub(crate) use report::{Check, Report, Status, render};

/// The loader's system-wide preload list (what the device plugin mounts into pods).
pub(crate) const LD_SO_PRELOAD: &str = "/etc/ld.so.preload";
/// Arguments of `tessera doctor`.
#[derive(Debug, clap::Args)]
pub(crate) struct DoctorArgs {
    /// Print one JSON object with every check instead of the checklist.
    #[arg(long)]
    pub json: bool,
    /// The interposer library [default: what /etc/ld.so.preload or LD_PRELOAD names, else
    /// libtessera_interpose.so next to `tessera`].
    #[arg(long, env = node::ENV_INTERPOSER, value_name = "PATH")]
    pub interposer: Option<PathBuf>,
    /// Allocation token for the token check and the probe (ignored when the identity file
    /// exists: it names the token, as for the interposer).
    #[arg(
        long,
        env = node::ENV_TOKEN,
        value_name = "TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// Arbiter tenant socket; old name `--socket`; a token needs one, as for the interposer
    /// [default: the identity file's, else /run/tessera/tenant/tessera.sock].
    #[arg(
        long = "tenant-socket",
        alias = "socket",
        env = node::ENV_SOCKET,
        value_name = "PATH"
    )]
    pub socket: Option<PathBuf>,
    /// Arbiter admin socket; checked when given or present [default: /run/tessera/admin.sock].
    #[arg(long, env = node::ENV_ADMIN_SOCKET, value_name = "PATH")]
    pub admin_socket: Option<PathBuf>,
    /// Where the container's identity file is.
    #[arg(long, value_name = "PATH", default_value = CONTAINER_IDENTITY_FILE)]
    pub identity_file: PathBuf,
    /// Where the loader's preload list is (e.g. a container's root seen from the host).
    #[arg(long, value_name = "PATH", default_value = LD_SO_PRELOAD)]
    pub ld_so_preload: PathBuf,
}

/// Arguments of the hidden `doctor-probe` subcommand: the probe's child process.
#[derive(Debug, clap::Args)]
pub(crate) struct ProbeArgs {
    /// The allocation's limit, bytes.
    #[arg(long)]
    pub limit: u64,
    /// The allocation's GPU (for NVML, which ignores `CUDA_VISIBLE_DEVICES`).
    #[arg(long)]
    pub gpu_uuid: String,
}

/// Errors of the doctor's own plumbing (not check failures, which are [`Check`]s).
#[derive(Debug, thiserror::Error)]
pub enum DoctorError {
    /// The probe's output could not be printed.
    #[error("cannot print the report: {0}")]
    Output(#[from] serde_json::Error),
}

/// Runs `tessera doctor`; returns the process exit code.
pub(crate) fn main(args: DoctorArgs) -> Result<u8, CliError> {
    if args.identity_file.as_os_str() != CONTAINER_IDENTITY_FILE && !args.identity_file.exists() {
        return Err(CliError::usage(format!(
            "--identity-file {}: no such file",
            args.identity_file.display()
        )));
    }
    let checks = run_checks(&args);
    let ok = !checks.iter().any(|c| c.status == Status::Fail);
    let report = Report { ok, checks };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(DoctorError::from)?
        );
    } else {
        print!("{}", render(&report));
    }
    Ok(if ok { 0 } else { 1 })
}

fn run_checks(args: &DoctorArgs) -> Vec<Check> {
    let mut checks = Vec::new();
    let preload_list = std::fs::read_to_string(&args.ld_so_preload).ok();
    let preloaded = preload_list
        .as_deref()
        .map(preload_entries)
        .unwrap_or_default();
    let preloaded_interposer = interposer_among(&preloaded);
    let identity = Identity::read(&args.identity_file);
    let in_container = identity.is_some() || preloaded_interposer.is_some();
    let target = doctor_target(identity, args);

    // 1. Driver and NVML.
    let cuda = check_driver();
    let cuda_ok = cuda.status == Status::Ok;
    checks.push(cuda);
    checks.push(check_nvml());

    // 2. Arbiter.
    // A tenant's socket is the one the interposer would use; otherwise the one given, or the
    // default, to see whether an arbiter runs here at all.
    let socket = match &target {
        Target::Tenant { socket, .. } => socket.clone(),
        _ => args
            .socket
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET)),
    };
    let arbiter = check_arbiter(&socket);
    let arbiter_ok = arbiter.status == Status::Ok;
    checks.push(arbiter);
    checks.push(check_admin(args.admin_socket.as_deref()));

    // 3. Interposer.
    let (interposer, source) = match (&args.interposer, &preloaded_interposer) {
        (Some(p), _) => (Some(p.clone()), "--interposer"),
        (None, Some(p)) => (Some(p.clone()), "ld.so.preload"),
        (None, None) => {
            let env = std::env::var("LD_PRELOAD").unwrap_or_default();
            let named = preload_entries(&env).into_iter().find(|e| {
                e.file_name()
                    .is_some_and(|n| n.to_string_lossy().contains("tessera"))
            });
            match named {
                Some(p) => (Some(p), "LD_PRELOAD"),
                None => (
                    std::env::current_exe()
                        .ok()
                        .and_then(|e| e.parent().map(|d| d.join(INTERPOSER_FILE))),
                    "next to tessera",
                ),
            }
        }
    };
    let interposer = interposer.map(|p| std::fs::canonicalize(&p).unwrap_or(p));
    let interposer_check = match &interposer {
        None => Check::fail(
            "interposer",
            "cannot locate the tessera executable to look next to it",
            "pass --interposer PATH",
        ),
        Some(p) => match tessera_preload::check(p) {
            Ok(()) => Check::ok(
                "interposer",
                format!(
                    "{} ({source}) defines its hooks and the Tessera marker",
                    p.display()
                ),
            ),
            Err(e) => Check::fail(
                "interposer",
                e.to_string(),
                "point --interposer (or TESSERA_INTERPOSER) at libtessera_interpose.so \
                 (`cargo build --release -p tessera-interpose` makes it); without it limits \
                 are not enforced",
            ),
        },
    };
    let interposer_ok = interposer_check.status == Status::Ok;
    checks.push(interposer_check);

    // 4. Container wiring, token and GPU.
    checks.push(if !in_container {
        Check::skip(
            "preload",
            format!("not in a container (no {})", args.identity_file.display()),
        )
    } else if let Some(p) = &preloaded_interposer {
        Check::ok(
            "preload",
            format!("{} names {}", args.ld_so_preload.display(), p.display()),
        )
    } else {
        Check::fail(
            "preload",
            format!(
                "{} does not name a loadable interposer ({})",
                args.ld_so_preload.display(),
                if preloaded.is_empty() {
                    "missing or empty".to_owned()
                } else {
                    format!("{preloaded:?}")
                }
            ),
            "the device plugin mounts it into containers that request tessera.dev/gpu-shares: \
             recreate the pod, and check the plugin's log (its mounts may have been refused)",
        )
    });
    let token = match &target {
        Target::Tenant { token, .. } => Some(token.clone()),
        _ => None,
    };
    let allocation = match &target {
        Target::Closed(why) => {
            checks.push(Check::fail(
                "token",
                format!("this process cannot prove its allocation: {why}"),
                match why {
                    Closed::TokenWithoutSocket => {
                        "set --tenant-socket / TESSERA_SOCKET to the arbiter's tenant socket, or \
                         unset TESSERA_TOKEN (the interposer refuses every allocation and launch)"
                    }
                    Closed::UnusableIdentity(_) | Closed::IdentityWithoutSocket => {
                        "the device plugin writes the identity file; recreate the pod"
                    }
                },
            ));
            None
        }
        Target::NotATenant => {
            checks.push(Check::skip(
                "token",
                "no allocation here: not in a container and no --token/TESSERA_TOKEN given \
                 (`tessera run -- tessera doctor` checks one)",
            ));
            None
        }
        Target::Tenant { .. } if !arbiter_ok => {
            checks.push(Check::skip("token", "the arbiter is not reachable"));
            None
        }
        Target::Tenant { token, .. } => {
            let (c, a) = check_token(&socket, token);
            checks.push(c);
            a
        }
    };
    checks.push(match &allocation {
        None => Check::skip("gpu", "no accepted allocation to compare with"),
        Some(_) if !cuda_ok => Check::skip("gpu", "no CUDA driver"),
        Some(a) => check_gpu(a),
    });

    // 5. The probe.
    let probe = match (&allocation, &interposer) {
        (None, _) => {
            Err("no accepted allocation: pass --token and --socket to probe one".to_owned())
        }
        (Some(_), _) if !cuda_ok => Err("no CUDA driver".to_owned()),
        (Some(_), _) if !interposer_ok => Err("no loadable interposer".to_owned()),
        (Some(a), Some(i)) => Ok((a, run_probe(i, &socket, token.as_deref().unwrap_or(""), a))),
        (Some(_), None) => Err("no interposer".to_owned()),
    };
    match probe {
        Err(why) => {
            for name in ["limit", "memory-info", "kernel"] {
                checks.push(Check::skip(name, why.clone()));
            }
        }
        Ok((_, Err(e))) => {
            let fix = "run the probe by hand to see its error: `LD_PRELOAD=<interposer> \
                       TESSERA_TOKEN=<token> TESSERA_SOCKET=<socket> tessera doctor-probe \
                       --limit <bytes> --gpu-uuid <uuid>`";
            checks.push(Check::fail("limit", format!("the probe failed: {e}"), fix));
            checks.push(Check::skip("memory-info", "the probe failed"));
            checks.push(Check::skip("kernel", "the probe failed"));
        }
        Ok((a, Ok(p))) => checks.extend(judge_probe(a, &p)),
    }
    checks
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `doctor` names the allocation exactly as the interposer does, in every case of the node
    /// contract's table (the interposer's config test runs the same table).
    #[test]
    fn doctor_and_the_interposer_agree_on_the_target() {
        for (what, file, env, want) in node::contract_cases() {
            let var = |k: &str| {
                env.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            };
            let args = DoctorArgs {
                json: false,
                interposer: None,
                token: var(node::ENV_TOKEN),
                socket: var(node::ENV_SOCKET).map(PathBuf::from),
                admin_socket: None,
                identity_file: PathBuf::from(CONTAINER_IDENTITY_FILE),
                ld_so_preload: PathBuf::from(LD_SO_PRELOAD),
            };
            let identity = file.map(|t| Identity::read_from(t.as_bytes()));
            assert_eq!(doctor_target(identity, &args), want, "{what}");
        }
    }

    #[test]
    fn preload_lists_split_like_the_loader() {
        let e = preload_entries("# by tessera\n/a/lib.so /b/c.so:/d.so\n\n\t/e.so # x\n");
        assert_eq!(
            e,
            ["/a/lib.so", "/b/c.so", "/d.so", "/e.so"].map(PathBuf::from)
        );
    }

    #[test]
    fn uuids_print_like_nvml() {
        let b: [u8; 16] = std::array::from_fn(|i| i as u8);
        assert_eq!(format_uuid(&b), "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f");
    }

    fn alloc(limit: u64) -> AllocationView {
        AllocationView {
            id: "a".into(),
            gpu_index: 0,
            gpu_uuid: "GPU-x".into(),
            memory_limit: limit,
            share: 10,
            cap: None,
        }
    }

    #[test]
    fn the_refusal_must_come_at_the_limit() {
        let a = alloc(4 * GIB);
        let p = |held, refusal| ProbeReport {
            held,
            refusal,
            memget_total: 4 * GIB,
            nvml_total: Ok(4 * GIB),
            kernel: Ok(1.0),
            ..Default::default()
        };
        let verdict = |r: &ProbeReport| judge_probe(&a, r)[0].status;
        assert_eq!(verdict(&p(3 * GIB, Some(2))), Status::Ok);
        assert_eq!(verdict(&p(4 * GIB, Some(2))), Status::Ok);
        assert_eq!(
            verdict(&p(2 * GIB, Some(2))),
            Status::Fail,
            "the card ran out first"
        );
        assert_eq!(verdict(&p(6 * GIB, None)), Status::Fail, "not enforced");
        assert_eq!(verdict(&p(3 * GIB, Some(999))), Status::Fail);
        let all = judge_probe(&a, &p(3 * GIB, Some(2)));
        assert!(all.iter().all(|c| c.status == Status::Ok), "{all:?}");
    }
}
