//! Checks that a file really is a loadable Tessera interposer, before `tessera run` preloads it
//! into a command or the device plugin installs it for pods.
//!
//! `LD_PRELOAD` of a file that does not load is not an error for the dynamic loader: it prints
//! a warning and runs the program anyway, without the interposer, so without limits. A wrong
//! `--interposer` path (a program, a truncated copy, another library, a build for another
//! architecture) would therefore go unnoticed. [`check`] opens the file with `dlopen` (in this
//! process, `RTLD_NOW | RTLD_LOCAL`: every dependency and symbol is resolved, nothing is added
//! to the global scope) and looks up the hook symbols [`REQUIRED_SYMBOLS`] and the marker
//! [`MARKER_SYMBOL`] in it. Each must be defined by the file itself (`dladdr` of the address
//! names the file, compared by device and inode): `dlsym` on a handle also searches the
//! library's dependencies, so every library linking libc would otherwise "export" `dlsym`, and
//! a CUDA driver library defines the CUDA hooks. Only Tessera's interposer defines the marker.
//!
//! Loading runs the library's constructors in this process. The interposer's constructor only
//! reads the environment, and it is closed again at once.

use std::ffi::{CStr, CString, c_void};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Symbols every interposer exports: an allocation hook, a launch hook and the `dlsym`
/// override (without which programs that `dlopen` the driver would escape it).
pub const REQUIRED_SYMBOLS: [&CStr; 3] = [c"cuMemAlloc_v2", c"cuLaunchKernel", c"dlsym"];

/// Defined only by Tessera's interposer (`interpose/src/lib.rs`).
pub const MARKER_SYMBOL: &CStr = c"tessera_interposer_abi_version";

/// Why a file is not a usable interposer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    /// The file does not load as a shared library.
    #[error("{path} does not load as a shared library: {reason}")]
    NotLoadable {
        /// The file.
        path: PathBuf,
        /// `dlerror()`'s text.
        reason: String,
    },
    /// The library loads but lacks a hook.
    #[error("{path} is not the Tessera interposer: it does not export {symbol}")]
    MissingSymbol {
        /// The file.
        path: PathBuf,
        /// The first missing symbol.
        symbol: String,
    },
    /// The symbol resolves, but to another file (a dependency such as libc).
    #[error(
        "{path} is not the Tessera interposer: its {symbol} is defined by {defined_in}, not by the file itself"
    )]
    ForeignSymbol {
        /// The file.
        path: PathBuf,
        /// The first symbol defined elsewhere.
        symbol: String,
        /// The file `dladdr` names for it.
        defined_in: String,
    },
}

/// (device, inode) of a file, to compare two names of one file.
fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The file `dladdr` says defines `addr`, if it names one.
fn defining_file(addr: *mut c_void) -> Option<PathBuf> {
    // SAFETY: Dl_info is plain data; all-zero is a valid value for it.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `addr` is an address dlsym returned and `info` is writable; dladdr only reads
    // the loader's tables.
    let rc = unsafe { libc::dladdr(addr, &mut info) };
    if rc == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader, valid while the
    // object stays loaded (the handle is still open here); it is copied at once.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

/// The last `dlerror()` text, or a fallback.
fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl call on
    // this thread; it is copied at once.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".to_owned()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// Loads `path` and checks it defines every symbol of [`REQUIRED_SYMBOLS`] and [`MARKER_SYMBOL`]
/// itself.
pub fn check(path: &Path) -> Result<(), CheckError> {
    let not_loadable = |reason: String| CheckError::NotLoadable {
        path: path.to_path_buf(),
        reason,
    };
    // dlopen searches the library path for a name without a '/': always name the file itself.
    let abs = if path.as_os_str().as_bytes().contains(&b'/') {
        path.to_path_buf()
    } else {
        Path::new(".").join(path)
    };
    let c = CString::new(abs.as_os_str().as_bytes())
        .map_err(|_| not_loadable("the path contains a NUL byte".into()))?;
    // SAFETY: `c` is a NUL-terminated path; dlopen has no other precondition.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(not_loadable(dl_error()));
    }
    let own = identity(&abs);
    let verdict = REQUIRED_SYMBOLS
        .iter()
        .chain(std::iter::once(&MARKER_SYMBOL))
        .try_for_each(|s| {
            let symbol = || s.to_string_lossy().into_owned();
            // SAFETY: `handle` is a live handle from dlopen and `s` a NUL-terminated name.
            let p: *mut c_void = unsafe { libc::dlsym(handle, s.as_ptr()) };
            if p.is_null() {
                return Err(CheckError::MissingSymbol {
                    path: path.to_path_buf(),
                    symbol: symbol(),
                });
            }
            let file = defining_file(p);
            let same = match (&file, own) {
                (Some(f), Some(own)) => identity(f) == Some(own),
                _ => false,
            };
            if same {
                Ok(())
            } else {
                Err(CheckError::ForeignSymbol {
                    path: path.to_path_buf(),
                    symbol: symbol(),
                    defined_in: file.map_or_else(
                        || "an unnamed object".to_owned(),
                        |f| f.display().to_string(),
                    ),
                })
            }
        });
    // SAFETY: `handle` came from dlopen above and nothing from it (the addresses, the names
    // dladdr returned) is used after this.
    unsafe { libc::dlclose(handle) };
    verdict
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_is_not_a_library() {
        let e = check(Path::new("/bin/true")).unwrap_err();
        assert!(matches!(e, CheckError::NotLoadable { .. }), "{e}");
    }

    #[test]
    fn a_text_file_or_nothing_is_not_a_library() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("libfake.so");
        std::fs::write(&f, "not an ELF file").unwrap();
        assert!(matches!(check(&f), Err(CheckError::NotLoadable { .. })));
        assert!(matches!(
            check(&dir.path().join("absent.so")),
            Err(CheckError::NotLoadable { .. })
        ));
    }

    #[test]
    fn another_library_lacks_the_hooks() {
        // libc loads everywhere and exports dlsym, but no CUDA hook.
        let e = check(Path::new("libc.so.6")).unwrap_err();
        assert!(
            matches!(e, CheckError::NotLoadable { .. }),
            "a bare name is taken as a file here: {e}"
        );
        let libc_path = [
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
            "/lib64/libc.so.6",
        ]
        .into_iter()
        .map(Path::new)
        .find(|p| p.exists());
        if let Some(p) = libc_path {
            let e = check(p).unwrap_err();
            assert_eq!(
                e,
                CheckError::MissingSymbol {
                    path: p.to_path_buf(),
                    symbol: "cuMemAlloc_v2".into()
                }
            );
            assert!(e.to_string().contains("not the Tessera interposer"), "{e}");
        }
    }
}
