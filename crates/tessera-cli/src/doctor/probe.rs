//! The probe: a child process under the interposer with the allocation's token that allocates
//! until refused, reads the memory the card reports and launches one gated kernel; and the
//! verdicts drawn from what it saw.

use super::*;

pub(super) const GIB: u64 = 1 << 30;
/// Memory the probe's own CUDA context may be charged before its first block (about 300 MiB
/// on current cards): the refusal is "at the limit" when less than 1 GiB plus this was left.
pub(super) const CONTEXT_ALLOWANCE: u64 = 512 << 20;
/// Longest the probe may take: a gated launch waits for the arbiter's lease, not forever.
pub(super) const PROBE_TIMEOUT: Duration = Duration::from_secs(60);
/// Duration of the probe's kernel on the simulated GPU (the `spin` kernel's parameter).
pub(super) const KERNEL_NS: u64 = 1_000_000;
/// `spin(u64 ns)`: runs `ns` nanoseconds on the simulated GPU, an empty kernel on a real one.
pub(super) const SPIN_PTX: &CStr =
    c".version 8.0\n.target sm_90\n.visible .entry spin(.param .u64 ns) { ret; }\n";

/// What the probe child reports (one JSON line on its stdout).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct ProbeReport {
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

/// Runs the probe child under the interposer with the token; its stdout is one JSON report.
pub(super) fn run_probe(
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
pub(super) fn judge_probe(a: &AllocationView, p: &ProbeReport) -> Vec<Check> {
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
pub(crate) fn probe_main(args: ProbeArgs) -> Result<u8, CliError> {
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

pub(super) fn cu(what: &str, rc: ffi::CUresult) -> Result<(), String> {
    if rc == ffi::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: CUresult {rc}"))
    }
}

pub(super) fn probe(args: &ProbeArgs) -> Result<ProbeReport, String> {
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
pub(super) fn nvml_total(uuid: &str) -> Result<u64, String> {
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
