//! Checks that a file really is a loadable Tessera interposer, before `tessera run` preloads it
//! into a command or the device plugin installs it for pods.
//!
//! `LD_PRELOAD` of a file that does not load is not an error for the dynamic loader: it prints
//! a warning and runs the program anyway, without the interposer, so without limits. A wrong
//! `--interposer` path (a program, a truncated copy, another library, a build for another
//! architecture) would therefore go unnoticed. [`check`] opens the file with `dlopen` (in this
//! process, `RTLD_NOW | RTLD_LOCAL`: every dependency and symbol is resolved, nothing is added
//! to the global scope) and looks up the hook symbols [`REQUIRED_SYMBOLS`] in it.
//!
//! Loading runs the library's constructors in this process. The interposer's constructor only
//! reads the environment, and it is closed again at once.

use std::ffi::{CStr, CString, c_void};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Symbols every interposer exports: an allocation hook, a launch hook and the `dlsym`
/// override (without which programs that `dlopen` the driver would escape it).
pub const REQUIRED_SYMBOLS: [&CStr; 3] = [c"cuMemAlloc_v2", c"cuLaunchKernel", c"dlsym"];

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

/// Loads `path` and checks it exports every symbol of [`REQUIRED_SYMBOLS`].
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
    let missing = REQUIRED_SYMBOLS.iter().find(|s| {
        // SAFETY: `handle` is a live handle from dlopen and `s` a NUL-terminated name.
        let p: *mut c_void = unsafe { libc::dlsym(handle, s.as_ptr()) };
        p.is_null()
    });
    // SAFETY: `handle` came from dlopen above and nothing from it is used after this.
    unsafe { libc::dlclose(handle) };
    match missing {
        Some(s) => Err(CheckError::MissingSymbol {
            path: path.to_path_buf(),
            symbol: s.to_string_lossy().into_owned(),
        }),
        None => Ok(()),
    }
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
