//! Shared by the `tessera run` and `tessera status` tests: starts the real `tessera-arbiter`
//! (built next to the test executable) on the simulated NVML, in a temp folder.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tessera_protocol::client::AdminClient;

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;

/// `<target>/debug`.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

fn built(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(
        p.is_file(),
        "{} missing: run `cargo build --workspace` first",
        p.display()
    );
    p
}

/// The `tessera` binary.
pub fn tessera() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tessera"))
}

pub struct Arbiter {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub admin_socket: PathBuf,
    child: Child,
}

impl Arbiter {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let sim = dir.path().join("sim");
        let libs = tessera_sim_state::find_built_lib_dir(Some(&target_dir()))
            .unwrap_or_else(|e| panic!("{e}"));
        let lib = tessera_sim_state::prepare_lib_dir(&sim, &libs).unwrap();
        let socket = dir.path().join("tessera.sock");
        let admin_socket = dir.path().join("admin.sock");
        let child = Command::new(built("tessera-arbiter"))
            .arg("--socket")
            .arg(&socket)
            .arg("--admin-socket")
            .arg(&admin_socket)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .env("LD_LIBRARY_PATH", lib)
            .env("TESSERA_SIM_DIR", &sim)
            .env("TESSERA_SIM_GPUS", "2x80GiB")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while AdminClient::connect(&admin_socket).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "arbiter did not come up"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Self {
            dir,
            socket,
            admin_socket,
            child,
        }
    }

    pub fn admin(&self) -> AdminClient {
        AdminClient::connect(&self.admin_socket).unwrap()
    }

    /// `tessera <args>` pointed at this arbiter (through the environment).
    pub fn tessera(&self, args: &[&str]) -> Command {
        self.tessera_at(&tessera(), args)
    }

    /// The same with another copy of the `tessera` executable.
    pub fn tessera_at(&self, exe: &Path, args: &[&str]) -> Command {
        let mut c = Command::new(exe);
        c.args(args)
            .env("TESSERA_ADMIN_SOCKET", &self.admin_socket)
            .env("TESSERA_SOCKET", &self.socket)
            .env_remove("TESSERA_INTERPOSER")
            .env_remove("LD_PRELOAD")
            .stdin(Stdio::null());
        c
    }
}

impl Drop for Arbiter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An empty stand-in for the interposer: the loader skips it with a warning on stderr, so
/// `tessera run`'s own behaviour can be tested without a CUDA program.
pub fn fake_interposer(dir: &Path) -> PathBuf {
    let p = dir.join("libtessera_interpose.so");
    std::fs::write(&p, b"").unwrap();
    p
}
