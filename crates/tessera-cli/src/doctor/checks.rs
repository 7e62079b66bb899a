//! The checks that ask the system: the driver, NVML, the arbiter's sockets, the token and the
//! GPU it names.

use super::*;

pub(super) fn cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as NVML and `nvidia-smi -L` print it.
pub(super) fn format_uuid(b: &[u8; 16]) -> String {
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

pub(super) fn check_driver() -> Check {
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
pub(super) unsafe fn nvml_string(f: ffi::nvmlDeviceGetString_t, dev: ffi::nvmlDevice_t) -> String {
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

pub(super) fn check_nvml() -> Check {
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
pub(super) fn hello(socket: &Path, role: Role) -> Result<ServerHello, String> {
    let mut s = UnixStream::connect(socket)
        .map_err(|e| format!("cannot connect to {}: {e}", socket.display()))?;
    let t = Some(Duration::from_secs(10));
    let _ = s.set_read_timeout(t);
    let _ = s.set_write_timeout(t);
    frame::write_frame(&mut s, &Hello::new(role)).map_err(|e| e.to_string())?;
    frame::read_frame(&mut s)
        .map_err(|e| format!("{} answered no handshake: {e}", socket.display()))
}

pub(super) fn check_arbiter(socket: &Path) -> Check {
    let fix_down = "start tessera-arbiter (systemd: `systemctl start tessera-arbiter`; \
                    Kubernetes: the tessera DaemonSet), or point --tenant-socket / \
                    TESSERA_SOCKET at its tenant socket";
    let fix_version =
        "run a tessera CLI and arbiter of the same release (protocol versions differ)";
    // A probe asks only "which socket, which version": the arbiter answers it without a token
    // and counts no failed handshake (so no warning in its log), after checking the version.
    let answer = hello(socket, Role::Probe);
    match answer {
        Err(e) => Check::fail("arbiter", e, fix_down),
        Ok(ServerHello::Probed {
            socket: SocketKind::Tenant,
            version,
        }) => Check::ok(
            "arbiter",
            format!("{} answers, protocol version {version}", socket.display()),
        ),
        Ok(ServerHello::Probed { socket: kind, .. }) => Check::fail(
            "arbiter",
            format!("{} is the arbiter's {kind} socket", socket.display()),
            "point --tenant-socket / TESSERA_SOCKET at the tenant socket (tessera.sock)",
        ),
        Ok(other) => match other.refused() {
            Some((RefusalKind::Version, reason)) => Check::fail(
                "arbiter",
                format!("{}: {reason}", socket.display()),
                fix_version,
            ),
            Some((kind, reason)) => Check::fail(
                "arbiter",
                format!("{} refused a probe as {kind}: {reason}", socket.display()),
                "point --tenant-socket / TESSERA_SOCKET at the arbiter's tenant socket",
            ),
            None => Check::fail(
                "arbiter",
                format!(
                    "{} welcomed a probe as a client: it is no tenant socket of protocol {PROTOCOL_VERSION}",
                    socket.display()
                ),
                "point --tenant-socket / TESSERA_SOCKET at the tenant socket (tessera.sock)",
            ),
        },
    }
}

pub(super) fn check_admin(explicit: Option<&Path>) -> Check {
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
        Ok(refused) => {
            let (kind, reason) = refused.refused().unwrap_or((RefusalKind::WrongSocket, ""));
            Check::fail(
                "admin",
                format!("{} refused: {reason}", path.display()),
                if kind == RefusalKind::Version {
                    "run a tessera CLI and arbiter of the same release"
                } else {
                    "point --admin-socket / TESSERA_ADMIN_SOCKET at admin.sock, not the tenant socket"
                },
            )
        }
        Err(e) => Check::fail(
            "admin",
            e,
            "start tessera-arbiter, or point --admin-socket / TESSERA_ADMIN_SOCKET at its admin \
             socket (reading it needs the socket's group or root)",
        ),
    }
}

pub(super) fn check_token(socket: &Path, token: &str) -> (Check, Option<AllocationView>) {
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
                "point --tenant-socket / TESSERA_SOCKET at the tenant socket",
            ),
            None,
        ),
        Ok(refused) => {
            let (kind, reason) = refused.refused().unwrap_or((RefusalKind::UnknownToken, ""));
            let fix = match kind {
                RefusalKind::Version => "run a tessera CLI and arbiter of the same release",
                RefusalKind::Full => {
                    "the allocation's connection places are in use: stop some of its processes, \
                     or raise the arbiter's --max-connections-per-allocation"
                }
                _ => {
                    "the allocation is gone or the token is wrong: in a pod, recreate the pod \
                     (the device plugin makes a new allocation); else use the token `tessera run` \
                     hands its command (TESSERA_TOKEN)"
                }
            };
            (
                Check::fail(
                    "token",
                    format!("refused by the arbiter ({kind}): {reason}"),
                    fix,
                ),
                None,
            )
        }
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

pub(super) fn check_gpu(a: &AllocationView) -> Check {
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

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    /// Runs `check` against a socket that reads one hello and answers `answer`.
    fn against<T>(answer: ServerHello, check: impl FnOnce(&Path) -> T) -> T {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let _: Hello = frame::read_frame(&mut s).unwrap();
            frame::write_frame(&mut s, &answer).unwrap();
        });
        let c = check(&path);
        server.join().unwrap();
        c
    }

    fn rejected(kind: RefusalKind) -> ServerHello {
        ServerHello::Rejected {
            kind,
            reason: "words that say nothing of versions".into(),
        }
    }

    #[test]
    fn the_arbiter_check_decides_on_the_kind_not_the_words() {
        // A server of another version answers the old form, whatever its words.
        let old = ServerHello::Refused {
            reason: "no".into(),
        };
        let c = against(old, check_arbiter);
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(c.fix.unwrap().contains("same release"));
        // The tenant socket answers the probe as itself.
        let probed = |socket| ServerHello::Probed {
            version: PROTOCOL_VERSION,
            socket,
        };
        let c = against(probed(SocketKind::Tenant), check_arbiter);
        assert_eq!(c.status, Status::Ok, "{c:?}");
        // Another socket of the arbiter says which it is.
        let c = against(probed(SocketKind::Admin), check_arbiter);
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(c.detail.contains("admin socket"), "{c:?}");
        // A refusal of another kind is not what a tenant socket answers a probe.
        let c = against(rejected(RefusalKind::UnknownToken), check_arbiter);
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(c.detail.contains("unknown_token"), "{c:?}");
    }

    /// The fixes name the flags the binaries have (`--socket` is an old alias).
    #[test]
    fn fixes_name_current_flags() {
        let c = check_arbiter(Path::new("/nonexistent/tessera.sock"));
        assert_eq!(c.status, Status::Fail, "{c:?}");
        let fix = c.fix.unwrap();
        assert!(fix.contains("--tenant-socket"), "{fix}");
        assert!(!fix.contains("--socket "), "{fix}");
    }

    #[test]
    fn the_token_check_names_the_fix_for_each_kind() {
        let fix = |answer| {
            let (c, view) = against(answer, |p| check_token(p, "t"));
            assert!(view.is_none());
            assert_eq!(c.status, Status::Fail, "{c:?}");
            c.fix.unwrap()
        };
        assert!(fix(rejected(RefusalKind::UnknownToken)).contains("recreate the pod"));
        assert!(fix(rejected(RefusalKind::Full)).contains("connection places"));
        let old = ServerHello::Refused {
            reason: "protocol version 1".into(),
        };
        assert!(fix(old).contains("same release"));
    }
}
