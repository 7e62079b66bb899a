//! `tessera doctor`: a checklist of what Tessera needs on this node or in this container, with
//! a verdict per line (ok / FAIL / skip) and, for each failure, the fix.
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
use tessera_protocol::{AllocationView, Hello, PROTOCOL_VERSION, Role, ServerHello, frame};

use crate::CliError;
use crate::ffi::{self, Lib};
use crate::run::{DEFAULT_ADMIN_SOCKET, DEFAULT_SOCKET, INTERPOSER_FILE};
use crate::status::human;

/// The loader's system-wide preload list (what the device plugin mounts into pods).
pub const LD_SO_PRELOAD: &str = "/etc/ld.so.preload";
const GIB: u64 = 1 << 30;
/// Memory the probe's own CUDA context may be charged before its first block (about 300 MiB
/// on current cards): the refusal is "at the limit" when less than 1 GiB plus this was left.
const CONTEXT_ALLOWANCE: u64 = 512 << 20;
/// Longest the probe may take: a gated launch waits for the arbiter's lease, not forever.
const PROBE_TIMEOUT: Duration = Duration::from_secs(60);
/// Duration of the probe's kernel on the simulated GPU (the `spin` kernel's parameter).
const KERNEL_NS: u64 = 1_000_000;
/// `spin(u64 ns)`: runs `ns` nanoseconds on the simulated GPU, an empty kernel on a real one.
const SPIN_PTX: &CStr =
    c".version 8.0\n.target sm_90\n.visible .entry spin(.param .u64 ns) { ret; }\n";

/// Arguments of `tessera doctor`.
#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
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
pub struct ProbeArgs {
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

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Passed.
    Ok,
    /// Failed: `fix` says what to do.
    Fail,
    /// Not applicable here, or its prerequisite failed.
    Skip,
}

/// One line of the checklist.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// Short stable name (`driver`, `arbiter`, ...).
    pub name: &'static str,
    /// Verdict.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do about a failure.
    pub fix: Option<String>,
}

impl Check {
    fn ok(name: &'static str, detail: impl Into<String>) -> Self {
        Self {
            name,
            status: Status::Ok,
            detail: detail.into(),
            fix: None,
        }
    }
    fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            name,
            status: Status::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
    fn skip(name: &'static str, detail: impl Into<String>) -> Self {
        Self {
            name,
            status: Status::Skip,
            detail: detail.into(),
            fix: None,
        }
    }
}

/// The whole report (`--json`).
#[derive(Debug, Serialize)]
pub struct Report {
    /// True when no check failed.
    pub ok: bool,
    /// Every check, in order.
    pub checks: Vec<Check>,
}

/// What the probe child reports (one JSON line on its stdout).
#[derive(Debug, Serialize, Deserialize)]
pub struct ProbeReport {
    /// A step that failed before the checks could be made.
    pub error: Option<String>,
    /// `cuMemGetInfo_v2` total before the first block.
    pub memget_total: u64,
    /// NVML memory total of the allocation's GPU, or why it could not be read.
    pub nvml_total: Result<u64, String>,
    /// Bytes held when the driver refused (or when the probe stopped).
    pub held: u64,
    /// The refusal's `CUresult`; `None`: no refusal before the probe's cap (past the limit).
    pub refusal: Option<u32>,
    /// The kernel: `Ok(milliseconds)` or why it failed.
    pub kernel: Result<f64, String>,
}

impl Default for ProbeReport {
    fn default() -> Self {
        Self {
            error: None,
            memget_total: 0,
            nvml_total: Err("not read".into()),
            held: 0,
            refusal: None,
            kernel: Err("not launched".into()),
        }
    }
}

/// Runs `tessera doctor`; returns the process exit code.
pub fn main(args: DoctorArgs) -> Result<u8, CliError> {
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

/// The checklist for people.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    for c in &r.checks {
        let verdict = match c.status {
            Status::Ok => "ok",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
        };
        out.push_str(&format!("{verdict:<5} {:<12} {}\n", c.name, c.detail));
        if let Some(fix) = &c.fix {
            out.push_str(&format!("{:<18} fix: {fix}\n", ""));
        }
    }
    let count = |s| r.checks.iter().filter(|c| c.status == s).count();
    out.push_str(&format!(
        "{} ok, {} failed, {} skipped\n",
        count(Status::Ok),
        count(Status::Fail),
        count(Status::Skip)
    ));
    out
}

/// Entries of a preload list (`/etc/ld.so.preload` or `LD_PRELOAD`): separated by spaces,
/// tabs, newlines or ':'; `#` starts a comment in the file.
fn preload_entries(text: &str) -> Vec<PathBuf> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .flat_map(|l| l.split([' ', '\t', ':']))
        .filter(|e| !e.is_empty())
        .map(PathBuf::from)
        .collect()
}

/// The first entry that is a Tessera interposer (loads and exports the hooks).
fn interposer_among(entries: &[PathBuf]) -> Option<PathBuf> {
    entries
        .iter()
        .find(|e| tessera_preload::check(e).is_ok())
        .cloned()
}

/// The allocation this process belongs to, by the node contract's rule (the interposer's):
/// the identity file, else `--token`/`TESSERA_TOKEN` and `--tenant-socket`/`TESSERA_SOCKET`
/// (clap has read the variables into the flags).
fn doctor_target(
    identity: Option<Result<Identity, IdentityReadError>>,
    args: &DoctorArgs,
) -> Target {
    node::resolve(identity, |k| match k {
        node::ENV_TOKEN => args.token.clone().map(Into::into),
        node::ENV_SOCKET => args.socket.clone().map(Into::into),
        _ => None,
    })
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

fn cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as NVML and `nvidia-smi -L` print it.
fn format_uuid(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn check_driver() -> Check {
    let fix = "install the NVIDIA driver (or run on the simulated GPU: `tessera sim -- tessera \
               doctor`); in a container, the NVIDIA container toolkit mounts libcuda.so.1";
    let lib = match Lib::open(c"libcuda.so.1") {
        Ok(l) => l,
        Err(e) => return Check::fail("driver", format!("libcuda.so.1 does not load: {e}"), fix),
    };
    // SAFETY: each type is the documented C signature of the named entry point.
    let r = unsafe {
        (|| -> Result<(i32, i32), String> {
            let version: ffi::cuDriverGetVersion_t = lib.sym(c"cuDriverGetVersion")?;
            let init: ffi::cuInit_t = lib.sym(c"cuInit")?;
            let count: ffi::cuDeviceGetCount_t = lib.sym(c"cuDeviceGetCount")?;
            let mut v = 0;
            let rc = version(&mut v);
            if rc != ffi::CUDA_SUCCESS {
                return Err(format!("cuDriverGetVersion failed: CUresult {rc}"));
            }
            let rc = init(0);
            if rc != ffi::CUDA_SUCCESS {
                return Err(format!("cuInit failed: CUresult {rc}"));
            }
            let mut n = 0;
            let rc = count(&mut n);
            if rc != ffi::CUDA_SUCCESS {
                return Err(format!("cuDeviceGetCount failed: CUresult {rc}"));
            }
            Ok((v, n))
        })()
    };
    match r {
        Ok((_, 0)) => Check::fail(
            "driver",
            "libcuda.so.1 loads but this process sees no GPU",
            "check CUDA_VISIBLE_DEVICES (and NVIDIA_VISIBLE_DEVICES in a container)",
        ),
        Ok((v, n)) => Check::ok(
            "driver",
            format!("CUDA driver {}, {n} GPU(s) visible", cuda_version(v)),
        ),
        Err(e) => Check::fail("driver", e, fix),
    }
}

/// A string out of an NVML getter.
///
/// # Safety
/// `f` must be an NVML string getter and `dev` a handle from the same library.
unsafe fn nvml_string(f: ffi::nvmlDeviceGetString_t, dev: ffi::nvmlDevice_t) -> String {
    let mut buf = [0 as c_char; 96];
    // SAFETY: by the caller's contract; the buffer's length is passed.
    if unsafe { f(dev, buf.as_mut_ptr(), buf.len() as u32) } != ffi::NVML_SUCCESS {
        return "?".into();
    }
    // SAFETY: NVML NUL-terminates within the given length.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn check_nvml() -> Check {
    let fix = "install the NVIDIA driver's libnvidia-ml.so.1 (the arbiter and the device plugin \
               read GPUs and usage through it)";
    let lib = match Lib::open(c"libnvidia-ml.so.1") {
        Ok(l) => l,
        Err(e) => return Check::fail("nvml", format!("libnvidia-ml.so.1 does not load: {e}"), fix),
    };
    // SAFETY: each type is the documented C signature of the named entry point.
    let r = unsafe {
        (|| -> Result<String, String> {
            let init: ffi::nvmlInit_v2_t = lib.sym(c"nvmlInit_v2")?;
            let version: ffi::nvmlSystemGetDriverVersion_t =
                lib.sym(c"nvmlSystemGetDriverVersion")?;
            let count: ffi::nvmlDeviceGetCount_v2_t = lib.sym(c"nvmlDeviceGetCount_v2")?;
            let by_index: ffi::nvmlDeviceGetHandleByIndex_v2_t =
                lib.sym(c"nvmlDeviceGetHandleByIndex_v2")?;
            let name: ffi::nvmlDeviceGetString_t = lib.sym(c"nvmlDeviceGetName")?;
            let uuid: ffi::nvmlDeviceGetString_t = lib.sym(c"nvmlDeviceGetUUID")?;
            let rc = init();
            if rc != ffi::NVML_SUCCESS {
                return Err(format!("nvmlInit_v2 failed: nvmlReturn {rc}"));
            }
            let mut buf = [0 as c_char; 96];
            let v = if version(buf.as_mut_ptr(), buf.len() as u32) == ffi::NVML_SUCCESS {
                CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
            } else {
                "?".into()
            };
            let mut n = 0u32;
            let rc = count(&mut n);
            if rc != ffi::NVML_SUCCESS {
                return Err(format!("nvmlDeviceGetCount_v2 failed: nvmlReturn {rc}"));
            }
            let mut gpus = Vec::new();
            for i in 0..n {
                let mut dev = std::ptr::null_mut();
                if by_index(i, &mut dev) == ffi::NVML_SUCCESS {
                    gpus.push(format!(
                        "{i}: {} {}",
                        nvml_string(name, dev),
                        nvml_string(uuid, dev)
                    ));
                }
            }
            Ok(format!("driver {v}, {n} GPU(s): {}", gpus.join("; ")))
        })()
    };
    match r {
        Ok(d) => Check::ok("nvml", d),
        Err(e) => Check::fail("nvml", e, fix),
    }
}

/// One handshake on `socket`; the stream gets a timeout so a wedged arbiter cannot hang us.
fn hello(socket: &Path, role: Role) -> Result<ServerHello, String> {
    let mut s = UnixStream::connect(socket)
        .map_err(|e| format!("cannot connect to {}: {e}", socket.display()))?;
    let t = Some(Duration::from_secs(10));
    let _ = s.set_read_timeout(t);
    let _ = s.set_write_timeout(t);
    frame::write_frame(&mut s, &Hello::new(role)).map_err(|e| e.to_string())?;
    frame::read_frame(&mut s)
        .map_err(|e| format!("{} answered no handshake: {e}", socket.display()))
}

fn version_refusal(reason: &str) -> bool {
    reason.contains("protocol version")
}

fn check_arbiter(socket: &Path) -> Check {
    let fix_down = "start tessera-arbiter (systemd: `systemctl start tessera-arbiter`; \
                    Kubernetes: the tessera DaemonSet), or point --socket / TESSERA_SOCKET at \
                    its tenant socket";
    let fix_version =
        "run a tessera CLI and arbiter of the same release (protocol versions differ)";
    // An admin hello on the tenant socket is refused by role, after the version is checked:
    // it proves the arbiter is there and speaks our version without needing a token.
    match hello(socket, Role::Admin) {
        Err(e) => Check::fail("arbiter", e, fix_down),
        Ok(ServerHello::Refused { reason }) if version_refusal(&reason) => Check::fail(
            "arbiter",
            format!("{}: {reason}", socket.display()),
            fix_version,
        ),
        Ok(ServerHello::Refused { .. }) => Check::ok(
            "arbiter",
            format!(
                "{} answers, protocol version {PROTOCOL_VERSION}",
                socket.display()
            ),
        ),
        Ok(ServerHello::Welcome { .. }) => Check::fail(
            "arbiter",
            format!(
                "{} welcomed an admin client: it is the admin socket",
                socket.display()
            ),
            "point --tenant-socket / TESSERA_SOCKET at the tenant socket (tessera.sock), not admin.sock",
        ),
    }
}

fn check_admin(explicit: Option<&Path>) -> Check {
    let path = explicit.map_or_else(|| PathBuf::from(DEFAULT_ADMIN_SOCKET), Path::to_path_buf);
    if explicit.is_none() && !path.exists() {
        return Check::skip(
            "admin",
            format!("{} not here (normal in a container)", path.display()),
        );
    }
    match hello(&path, Role::Admin) {
        Ok(ServerHello::Welcome { version, .. }) => Check::ok(
            "admin",
            format!("{} answers, protocol version {version}", path.display()),
        ),
        Ok(ServerHello::Refused { reason }) => Check::fail(
            "admin",
            format!("{} refused: {reason}", path.display()),
            if version_refusal(&reason) {
                "run a tessera CLI and arbiter of the same release"
            } else {
                "point --admin-socket / TESSERA_ADMIN_SOCKET at admin.sock, not the tenant socket"
            },
        ),
        Err(e) => Check::fail(
            "admin",
            e,
            "start tessera-arbiter, or point --admin-socket / TESSERA_ADMIN_SOCKET at its admin \
             socket (reading it needs the socket's group or root)",
        ),
    }
}

fn check_token(socket: &Path, token: &str) -> (Check, Option<AllocationView>) {
    match hello(
        socket,
        Role::Tenant {
            token: token.to_owned(),
        },
    ) {
        Ok(ServerHello::Welcome {
            allocation: Some(a),
            version,
        }) => (
            Check::ok(
                "token",
                format!(
                    "accepted (protocol {version}): allocation {} on GPU {} {}, limit {}, share {}{}",
                    a.id,
                    a.gpu_index,
                    a.gpu_uuid,
                    human(a.memory_limit),
                    a.share,
                    a.cap.map(|c| format!(", cap {c}%")).unwrap_or_default()
                ),
            ),
            Some(a),
        ),
        Ok(ServerHello::Welcome {
            allocation: None, ..
        }) => (
            Check::fail(
                "token",
                "welcomed without an allocation",
                "point --socket at the tenant socket",
            ),
            None,
        ),
        Ok(ServerHello::Refused { reason }) => (
            Check::fail(
                "token",
                format!("refused by the arbiter: {reason}"),
                "the allocation is gone or the token is wrong: in a pod, recreate the pod (the \
                 device plugin makes a new allocation); else use the token `tessera run` hands \
                 its command (TESSERA_TOKEN)",
            ),
            None,
        ),
        Err(e) => (
            Check::fail(
                "token",
                e,
                "check that the arbiter is running and the socket is its tenant socket",
            ),
            None,
        ),
    }
}

fn check_gpu(a: &AllocationView) -> Check {
    let fix = format!(
        "make the allocation's GPU the one the process sees: CUDA_VISIBLE_DEVICES={} (`tessera \
         run` sets it; in a pod the device plugin sets NVIDIA_VISIBLE_DEVICES: do not override it)",
        a.gpu_uuid
    );
    let lib = match Lib::open(c"libcuda.so.1") {
        Ok(l) => l,
        Err(e) => return Check::fail("gpu", e, fix),
    };
    let mut uuid = ffi::CUuuid::default();
    // SAFETY: documented C signatures; `uuid` is a CUuuid the call writes.
    let rc = unsafe {
        lib.sym::<ffi::cuInit_t>(c"cuInit")
            .and_then(|init| Ok((init, lib.sym::<ffi::cuDeviceGetUuid_t>(c"cuDeviceGetUuid")?)))
            .map(|(init, get)| {
                let rc = init(0);
                if rc != ffi::CUDA_SUCCESS {
                    rc
                } else {
                    get(&mut uuid, 0)
                }
            })
    };
    match rc {
        Ok(ffi::CUDA_SUCCESS) => {
            let seen = format_uuid(&uuid.bytes);
            if seen.eq_ignore_ascii_case(&a.gpu_uuid) {
                Check::ok(
                    "gpu",
                    format!("CUDA device 0 is {seen}, the allocation's GPU"),
                )
            } else {
                Check::fail(
                    "gpu",
                    format!(
                        "CUDA device 0 is {seen}, but the allocation is on {}",
                        a.gpu_uuid
                    ),
                    fix,
                )
            }
        }
        Ok(rc) => Check::fail(
            "gpu",
            format!("cuDeviceGetUuid(0) failed: CUresult {rc}"),
            fix,
        ),
        Err(e) => Check::fail("gpu", e, fix),
    }
}

/// Runs the probe child under the interposer with the token; its stdout is one JSON report.
fn run_probe(
    interposer: &Path,
    socket: &Path,
    token: &str,
    a: &AllocationView,
) -> Result<ProbeReport, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot locate tessera: {e}"))?;
    let mut child = Command::new(exe)
        .args([
            "doctor-probe",
            "--limit",
            &a.memory_limit.to_string(),
            "--gpu-uuid",
            &a.gpu_uuid,
        ])
        .env(
            "LD_PRELOAD",
            crate::run::ld_preload(interposer, std::env::var_os("LD_PRELOAD")),
        )
        .env(node::ENV_TOKEN, token)
        .env(node::ENV_SOCKET, socket)
        .env_remove(node::ENV_ADMIN_SOCKET)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the probe: {e}"))?;
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if start.elapsed() > PROBE_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "no answer in {} s (a kernel launch waiting for the arbiter's lease?)",
                    PROBE_TIMEOUT.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("cannot wait for the probe: {e}")),
        }
    };
    // The report is one short line, well within the pipe's buffer, so reading after the
    // child exited cannot deadlock.
    let mut out = String::new();
    let mut err = String::new();
    let _ = child.stdout.take().map(|mut s| s.read_to_string(&mut out));
    let _ = child.stderr.take().map(|mut s| s.read_to_string(&mut err));
    let report: ProbeReport = serde_json::from_str(out.trim()).map_err(|_| {
        format!(
            "it exited with {status} and no report; stderr: {}",
            err.trim()
        )
    })?;
    match report.error.clone() {
        Some(e) => Err(e),
        None => Ok(report),
    }
}

/// The verdicts on the probe's findings.
fn judge_probe(a: &AllocationView, p: &ProbeReport) -> Vec<Check> {
    let limit = a.memory_limit;
    let mut out = Vec::new();
    out.push(match p.refusal {
        None => Check::fail(
            "limit",
            format!(
                "allocated {} with a limit of {}: the limit is not enforced",
                human(p.held),
                human(limit)
            ),
            "the probe ran with the interposer preloaded, yet was not limited: check the \
             arbiter's log for this allocation, and that the interposer and arbiter are one release",
        ),
        Some(rc) if rc != ffi::CUDA_ERROR_OUT_OF_MEMORY => Check::fail(
            "limit",
            format!("the next 1 GiB after {} failed with CUresult {rc}, not CUDA_ERROR_OUT_OF_MEMORY", human(p.held)),
            "see the arbiter's log and the interposer's (TESSERA_LOG=debug) for why allocations fail",
        ),
        Some(_) if limit.saturating_sub(p.held) >= GIB + CONTEXT_ALLOWANCE => Check::fail(
            "limit",
            format!(
                "refused with CUDA_ERROR_OUT_OF_MEMORY at {} held, {} below the {} limit: the \
                 card ran out before the limit",
                human(p.held),
                human(limit - p.held),
                human(limit)
            ),
            format!(
                "GPU {} has less free memory than the allocation was promised: find what holds \
                 it outside Tessera (nvidia-smi; `tessera status` shows Tessera's own) and stop \
                 it, or give the allocation a smaller limit",
                a.gpu_uuid
            ),
        ),
        Some(_) => Check::ok(
            "limit",
            format!(
                "refused the next 1 GiB at {} held of the {} limit with CUDA_ERROR_OUT_OF_MEMORY",
                human(p.held),
                human(limit)
            ),
        ),
    });
    let nvml = match &p.nvml_total {
        Ok(t) => human(*t),
        Err(e) => format!("unreadable ({e})"),
    };
    out.push(if p.memget_total == limit && p.nvml_total == Ok(limit) {
        Check::ok(
            "memory-info",
            format!(
                "cuMemGetInfo and NVML both report a total of {}",
                human(limit)
            ),
        )
    } else {
        Check::fail(
            "memory-info",
            format!(
                "totals: cuMemGetInfo {}, NVML {nvml}; the limit is {}",
                human(p.memget_total),
                human(limit)
            ),
            "programs size themselves by these totals: use the interposer of the arbiter's \
             release, and check nothing preloads another libcuda or libnvidia-ml shim before it",
        )
    });
    out.push(match &p.kernel {
        Ok(ms) => Check::ok(
            "kernel",
            format!(
                "a {} ms gated kernel completed in {ms:.1} ms",
                KERNEL_NS / 1_000_000
            ),
        ),
        Err(e) => Check::fail(
            "kernel",
            e.clone(),
            "see the arbiter's log: launches wait for its lease (a cap of 0 or a wedged \
             arbiter keeps them waiting)",
        ),
    });
    out
}

/// The hidden `doctor-probe` subcommand: runs under the interposer, prints a [`ProbeReport`].
pub fn probe_main(args: ProbeArgs) -> Result<u8, CliError> {
    let report = probe(&args).unwrap_or_else(|e| ProbeReport {
        error: Some(e),
        ..Default::default()
    });
    println!(
        "{}",
        serde_json::to_string(&report).map_err(DoctorError::from)?
    );
    Ok(0)
}

fn cu(what: &str, rc: ffi::CUresult) -> Result<(), String> {
    if rc == ffi::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: CUresult {rc}"))
    }
}

fn probe(args: &ProbeArgs) -> Result<ProbeReport, String> {
    let lib = Lib::open(c"libcuda.so.1").map_err(|e| format!("libcuda.so.1: {e}"))?;
    // SAFETY: cuGetProcAddress_v2 has this signature in every driver since 12.0.
    let get_proc: ffi::cuGetProcAddress_v2_t = unsafe { lib.sym(c"cuGetProcAddress_v2")? };
    // Entry points come through cuGetProcAddress, as the CUDA runtime gets them, so the
    // interposer's hooks are what the probe calls.
    let sym = |name: &CStr, version: i32| -> Result<*mut c_void, String> {
        let mut p = std::ptr::null_mut();
        // SAFETY: a NUL-terminated name and a valid out-pointer; a null status is allowed.
        let rc = unsafe { get_proc(name.as_ptr(), &mut p, version, 0, std::ptr::null_mut()) };
        if rc != ffi::CUDA_SUCCESS || p.is_null() {
            return Err(format!(
                "cannot resolve {}: CUresult {rc}",
                name.to_string_lossy()
            ));
        }
        Ok(p)
    };
    macro_rules! entry {
        ($t:ty, $name:expr, $v:expr) => {{
            let p = sym($name, $v)?;
            // SAFETY: $t is the documented C signature of $name at ABI version $v.
            unsafe { std::mem::transmute::<*mut c_void, $t>(p) }
        }};
    }
    let init = entry!(ffi::cuInit_t, c"cuInit", 2000);
    let retain = entry!(
        ffi::cuDevicePrimaryCtxRetain_t,
        c"cuDevicePrimaryCtxRetain",
        7000
    );
    let set_current = entry!(ffi::cuCtxSetCurrent_t, c"cuCtxSetCurrent", 4000);
    let alloc = entry!(ffi::cuMemAlloc_v2_t, c"cuMemAlloc", 3020);
    let free = entry!(ffi::cuMemFree_v2_t, c"cuMemFree", 3020);
    let info = entry!(ffi::cuMemGetInfo_v2_t, c"cuMemGetInfo", 3020);
    let load = entry!(ffi::cuModuleLoadData_t, c"cuModuleLoadData", 2000);
    let getf = entry!(ffi::cuModuleGetFunction_t, c"cuModuleGetFunction", 2000);
    let stream_create = entry!(ffi::cuStreamCreate_t, c"cuStreamCreate", 2000);
    let sync = entry!(ffi::cuStreamSynchronize_t, c"cuStreamSynchronize", 2000);
    let launch = entry!(ffi::cuLaunchKernel_t, c"cuLaunchKernel", 4000);

    let mut r = ProbeReport::default();
    // SAFETY: every pointer passed is a live local or a handle the driver gave.
    unsafe {
        cu("cuInit", init(0))?;
        let mut ctx = std::ptr::null_mut();
        cu("cuDevicePrimaryCtxRetain", retain(&mut ctx, 0))?;
        cu("cuCtxSetCurrent", set_current(ctx))?;
        let (mut f, mut t) = (0usize, 0usize);
        cu("cuMemGetInfo", info(&mut f, &mut t))?;
        r.memget_total = t as u64;
        r.nvml_total = nvml_total(&args.gpu_uuid);
        // Past the limit by two blocks is proof enough; never sweep a whole unlimited card.
        let cap = args.limit / GIB + 2;
        let mut held = Vec::new();
        while (held.len() as u64) < cap {
            let mut p = 0u64;
            match alloc(&mut p, GIB as usize) {
                ffi::CUDA_SUCCESS => held.push(p),
                rc => {
                    r.refusal = Some(rc);
                    break;
                }
            }
        }
        r.held = held.len() as u64 * GIB;
        for p in held {
            free(p);
        }
        r.kernel = (|| {
            let mut module = std::ptr::null_mut();
            cu(
                "cuModuleLoadData",
                load(&mut module, SPIN_PTX.as_ptr().cast()),
            )?;
            let mut spin = std::ptr::null_mut();
            cu(
                "cuModuleGetFunction",
                getf(&mut spin, module, c"spin".as_ptr()),
            )?;
            let mut stream = std::ptr::null_mut();
            cu("cuStreamCreate", stream_create(&mut stream, 0))?;
            let mut ns = KERNEL_NS;
            let mut params = [(&raw mut ns).cast::<c_void>()];
            let start = Instant::now();
            cu(
                "cuLaunchKernel",
                launch(
                    spin,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
            )?;
            cu("cuStreamSynchronize", sync(stream))?;
            Ok(start.elapsed().as_secs_f64() * 1000.0)
        })();
    }
    Ok(r)
}

/// NVML's memory total for the GPU `uuid` (through the interposer's hook, in the probe).
fn nvml_total(uuid: &str) -> Result<u64, String> {
    let lib = Lib::open(c"libnvidia-ml.so.1")?;
    let c_uuid = CString::new(uuid).map_err(|e| e.to_string())?;
    // SAFETY: documented C signatures; every pointer is a live local.
    unsafe {
        let init: ffi::nvmlInit_v2_t = lib.sym(c"nvmlInit_v2")?;
        let by_uuid: ffi::nvmlDeviceGetHandleByUUID_t = lib.sym(c"nvmlDeviceGetHandleByUUID")?;
        let mem: ffi::nvmlDeviceGetMemoryInfo_t = lib.sym(c"nvmlDeviceGetMemoryInfo")?;
        let rc = init();
        if rc != ffi::NVML_SUCCESS {
            return Err(format!("nvmlInit_v2: nvmlReturn {rc}"));
        }
        let mut dev = std::ptr::null_mut();
        let rc = by_uuid(c_uuid.as_ptr(), &mut dev);
        if rc != ffi::NVML_SUCCESS {
            return Err(format!(
                "nvmlDeviceGetHandleByUUID({uuid}): nvmlReturn {rc}"
            ));
        }
        let mut m = ffi::nvmlMemory_t::default();
        let rc = mem(dev, &mut m);
        if rc != ffi::NVML_SUCCESS {
            return Err(format!("nvmlDeviceGetMemoryInfo: nvmlReturn {rc}"));
        }
        Ok(m.total)
    }
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
