//! PTX modules, functions and kernel launches.
//!
//! Modules are PTX text; every `.entry NAME` becomes a function. A launch does no work: its first
//! kernel parameter, read as a u64, is the engine time it occupies (ns).

use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::Arc;

use crate::context::current;
use crate::ffi::*;
use crate::queue::Op;
use crate::runtime::{Registry, Res, guard, next_handle, put, rt};
use crate::stream::resolve;

/// A loaded module.
pub struct Module {
    pub id: usize,
    pub entries: Vec<String>,
    funcs: Mutex<HashMap<String, usize>>,
}

/// A kernel of a module.
pub struct Function {
    pub id: usize,
    pub module: usize,
    pub name: CString,
}

pub static MODULES: Registry<Module> = Registry::new();
pub static FUNCTIONS: Registry<Function> = Registry::new();

/// The `.entry` names of a PTX text.
pub fn ptx_entries(ptx: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = ptx;
    while let Some(i) = rest.find(".entry") {
        rest = &rest[i + ".entry".len()..];
        if !rest.starts_with(|c: char| c.is_whitespace()) {
            continue;
        }
        let name: String = rest
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '$' | '.'))
            .collect();
        if !name.is_empty() && !out.contains(&name) {
            out.push(name);
        }
    }
    out
}

fn load(pm: *mut Handle, text: &[u8]) -> Res {
    if pm.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    current()?;
    if text.starts_with(b"\x7fELF") || text.starts_with(&[0x50, 0xed, 0x55, 0xba]) {
        // Compiled cubins / fatbins carry no PTX to read entry names from.
        return Err(CUDA_ERROR_INVALID_IMAGE);
    }
    let ptx = std::str::from_utf8(text).map_err(|_| CUDA_ERROR_INVALID_IMAGE)?;
    let entries = ptx_entries(ptx);
    if !ptx.contains(".version") && entries.is_empty() {
        return Err(CUDA_ERROR_INVALID_IMAGE);
    }
    let m = Arc::new(Module {
        id: next_handle(),
        entries,
        funcs: Mutex::new(HashMap::new()),
    });
    MODULES.insert(m.id, m.clone());
    // SAFETY: non-null out-pointer from the caller.
    unsafe { put(pm, m.id as Handle) }
}

/// `cuModuleLoadData`: a NUL-terminated PTX image.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(pm: *mut Handle, image: *const c_void) -> CUresult {
    guard(|| {
        rt()?;
        if image.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // ELF images are not NUL-terminated text: look at the magic before scanning.
        // SAFETY: any loadable image is at least 4 bytes long.
        let head = unsafe { std::slice::from_raw_parts(image as *const u8, 4) };
        if head == b"\x7fELF" || head == [0x50, 0xed, 0x55, 0xba] {
            return load(pm, head);
        }
        // SAFETY: PTX images are NUL-terminated strings.
        let text = unsafe { CStr::from_ptr(image as *const c_char) };
        load(pm, text.to_bytes())
    })
}

/// `cuModuleLoadDataEx`: JIT options are ignored.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    pm: *mut Handle,
    image: *const c_void,
    _n: u32,
    _opts: *mut u32,
    _vals: *mut *mut c_void,
) -> CUresult {
    // SAFETY: same contract as cuModuleLoadData.
    unsafe { cuModuleLoadData(pm, image) }
}

/// `cuModuleLoad`: a PTX file.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoad(pm: *mut Handle, fname: *const c_char) -> CUresult {
    guard(|| {
        rt()?;
        if fname.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null C string from the caller.
        let path = unsafe { CStr::from_ptr(fname) }
            .to_string_lossy()
            .into_owned();
        let data = std::fs::read(path).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?;
        load(pm, &data)
    })
}

/// `cuModuleUnload`.
#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(m: Handle) -> CUresult {
    guard(|| {
        rt()?;
        let m = MODULES
            .remove(m as usize)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        for id in m.funcs.lock().values() {
            FUNCTIONS.remove(*id);
        }
        Ok(())
    })
}

/// `cuModuleGetFunction`: `CUDA_ERROR_NOT_FOUND` for names that are not `.entry` kernels.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    pf: *mut Handle,
    m: Handle,
    name: *const c_char,
) -> CUresult {
    guard(|| {
        rt()?;
        if pf.is_null() || name.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let m = MODULES.get(m as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        // SAFETY: non-null C string from the caller.
        let name = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        if !m.entries.contains(&name) {
            return Err(CUDA_ERROR_NOT_FOUND);
        }
        let mut funcs = m.funcs.lock();
        let id = *funcs.entry(name.clone()).or_insert_with(|| {
            let f = Arc::new(Function {
                id: next_handle(),
                module: m.id,
                name: CString::new(name).unwrap_or_default(),
            });
            FUNCTIONS.insert(f.id, f.clone());
            f.id
        });
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(pf, id as Handle) }
    })
}

/// `cuModuleGetGlobal_v2`: PTX globals are not simulated.
#[unsafe(no_mangle)]
pub extern "C" fn cuModuleGetGlobal_v2(
    _dptr: *mut CUdeviceptr,
    _bytes: *mut usize,
    m: Handle,
    _name: *const c_char,
) -> CUresult {
    guard(|| {
        rt()?;
        MODULES.get(m as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        Err(CUDA_ERROR_NOT_FOUND)
    })
}

fn function(f: Handle) -> Result<Arc<Function>, CUresult> {
    rt()?;
    FUNCTIONS.get(f as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)
}

/// `cuFuncGetAttribute`: plausible fixed values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncGetAttribute(pi: *mut i32, attr: u32, f: Handle) -> CUresult {
    guard(|| {
        function(f)?;
        let v = match attr {
            0 => 1024,
            1..=3 => 0,
            4 => 32,
            5 | 6 => 90,
            7 => 0,
            8 => 232_448,
            9 => -1,
            _ => 0,
        };
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(pi, v) }
    })
}

/// `cuFuncSetAttribute`: accepted.
#[unsafe(no_mangle)]
pub extern "C" fn cuFuncSetAttribute(f: Handle, _attr: u32, _v: i32) -> CUresult {
    guard(|| function(f).map(|_| ()))
}

/// `cuFuncSetCacheConfig`: accepted.
#[unsafe(no_mangle)]
pub extern "C" fn cuFuncSetCacheConfig(f: Handle, _cfg: u32) -> CUresult {
    guard(|| function(f).map(|_| ()))
}

/// `cuFuncGetName`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncGetName(name: *mut *const c_char, f: Handle) -> CUresult {
    guard(|| {
        let f = function(f)?;
        // The Function lives in the registry until its module unloads, as the driver promises.
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(name, f.name.as_ptr()) }
    })
}

/// The engine time a launch asks for: the u64 behind `kernelParams[0]`, or the first 8 bytes of
/// an `extra` parameter buffer; 0 when there is none.
///
/// # Safety
/// `params` / `extra` must follow the `cuLaunchKernel` conventions.
pub unsafe fn kernel_ns(params: *mut *mut c_void, extra: *mut *mut c_void) -> u64 {
    // SAFETY: the caller passes the launch arguments as the driver API defines them.
    unsafe {
        if !params.is_null() {
            let first = *params;
            return if first.is_null() {
                0
            } else {
                (first as *const u64).read_unaligned()
            };
        }
        if !extra.is_null() {
            let (mut buf, mut size) = (std::ptr::null::<u8>(), 0usize);
            let mut i = 0;
            loop {
                let key = *extra.add(i) as usize;
                match key {
                    CU_LAUNCH_PARAM_END => break,
                    CU_LAUNCH_PARAM_BUFFER_POINTER => buf = *extra.add(i + 1) as *const u8,
                    CU_LAUNCH_PARAM_BUFFER_SIZE => {
                        let p = *extra.add(i + 1) as *const usize;
                        if !p.is_null() {
                            size = *p;
                        }
                    }
                    _ => break,
                }
                i += 2;
                if i > 64 {
                    break;
                }
            }
            if !buf.is_null() && size >= 8 {
                return (buf as *const u64).read_unaligned();
            }
        }
    }
    0
}

/// Validates a launch and returns its engine time.
///
/// # Safety
/// As [`kernel_ns`].
pub unsafe fn check_launch(
    f: Handle,
    grid: [u32; 3],
    block: [u32; 3],
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<u64, CUresult> {
    function(f)?;
    if grid.contains(&0) || block.contains(&0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let threads = u64::from(block[0]) * u64::from(block[1]) * u64::from(block[2]);
    if threads > 1024 || block[2] > 64 || grid[1] > 65535 || grid[2] > 65535 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: forwarded contract.
    Ok(unsafe { kernel_ns(params, extra) })
}

#[allow(clippy::too_many_arguments)]
fn launch(
    f: Handle,
    grid: [u32; 3],
    block: [u32; 3],
    h: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    ptds: bool,
) -> CUresult {
    guard(|| {
        // SAFETY: arguments straight from the caller of cuLaunchKernel.
        let ns = unsafe { check_launch(f, grid, block, params, extra) }?;
        let s = resolve(h, ptds)?;
        match s.capture() {
            Some(c) => {
                c.check()?;
                c.add_kernel(ns);
            }
            None => s.enqueue(Op::Kernel(ns)),
        }
        Ok(())
    })
}

macro_rules! launch_fns {
    ($name:ident, $ptds:expr) => {
        #[doc = concat!("`", stringify!($name), "`.")]
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "C" fn $name(
            f: Handle,
            gx: u32,
            gy: u32,
            gz: u32,
            bx: u32,
            by: u32,
            bz: u32,
            _shmem: u32,
            h: Handle,
            params: *mut *mut c_void,
            extra: *mut *mut c_void,
        ) -> CUresult {
            launch(f, [gx, gy, gz], [bx, by, bz], h, params, extra, $ptds)
        }
    };
}

launch_fns!(cuLaunchKernel, false);
launch_fns!(cuLaunchKernel_ptsz, true);

macro_rules! coop_fns {
    ($name:ident, $ptds:expr) => {
        #[doc = concat!("`", stringify!($name), "`.")]
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "C" fn $name(
            f: Handle,
            gx: u32,
            gy: u32,
            gz: u32,
            bx: u32,
            by: u32,
            bz: u32,
            _shmem: u32,
            h: Handle,
            params: *mut *mut c_void,
        ) -> CUresult {
            launch(
                f,
                [gx, gy, gz],
                [bx, by, bz],
                h,
                params,
                std::ptr::null_mut(),
                $ptds,
            )
        }
    };
}

coop_fns!(cuLaunchCooperativeKernel, false);
coop_fns!(cuLaunchCooperativeKernel_ptsz, true);

fn launch_ex(
    cfg: *const CUlaunchConfig,
    f: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    ptds: bool,
) -> CUresult {
    if cfg.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: non-null launch config from the caller.
    let c = unsafe { &*cfg };
    launch(
        f,
        c.shape.grid,
        c.shape.block,
        c.h_stream,
        params,
        extra,
        ptds,
    )
}

/// `cuLaunchKernelEx`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx(
    cfg: *const CUlaunchConfig,
    f: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    launch_ex(cfg, f, params, extra, false)
}

/// `cuLaunchKernelEx_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx_ptsz(
    cfg: *const CUlaunchConfig,
    f: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    launch_ex(cfg, f, params, extra, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_entries() {
        let ptx = ".version 8.0\n.target sm_90\n.visible .entry spin(\n.param .u64 ns)\n{ ret; }\n.entry other_k ( ) { ret; }\n.func helper() {}";
        assert_eq!(
            ptx_entries(ptx),
            vec!["spin".to_string(), "other_k".to_string()]
        );
    }

    #[test]
    fn reads_first_param() {
        let mut ns: u64 = 1234;
        let mut params = [&mut ns as *mut u64 as *mut c_void];
        // SAFETY: params holds one valid pointer to a u64.
        let first = unsafe { kernel_ns(params.as_mut_ptr(), std::ptr::null_mut()) };
        assert_eq!(first, 1234);
        // SAFETY: both null means no parameters.
        let none = unsafe { kernel_ns(std::ptr::null_mut(), std::ptr::null_mut()) };
        assert_eq!(none, 0);
        let mut buf = 99u64.to_ne_bytes();
        let mut size = 8usize;
        let mut extra = [
            CU_LAUNCH_PARAM_BUFFER_POINTER as *mut c_void,
            buf.as_mut_ptr() as *mut c_void,
            CU_LAUNCH_PARAM_BUFFER_SIZE as *mut c_void,
            &mut size as *mut usize as *mut c_void,
            CU_LAUNCH_PARAM_END as *mut c_void,
        ];
        // SAFETY: a well-formed extra array.
        let buffered = unsafe { kernel_ns(std::ptr::null_mut(), extra.as_mut_ptr()) };
        assert_eq!(buffered, 99);
    }
}
