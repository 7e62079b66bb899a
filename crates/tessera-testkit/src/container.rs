//! A container as a runtime would start it, emulated: a private mount namespace and a chroot
//! with the container edits' bind mounts and environment. Shared by the device plugin's
//! `Allocate` tests and the DRA plugin's CDI tests, so both paths are checked the same way.
//! Needs root and `unshare` (util-linux), as a container runtime does; fails, never skips,
//! without.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A bind mount into the container.
#[derive(Debug, Clone)]
pub struct Bind {
    /// Host path.
    pub host: PathBuf,
    /// Path inside the container.
    pub container: PathBuf,
    /// Remounted read-only.
    pub read_only: bool,
}

/// What a runtime applies to a container: mounts and environment.
#[derive(Debug, Clone, Default)]
pub struct Edits {
    /// Bind mounts, in order.
    pub mounts: Vec<Bind>,
    /// `(name, value)` pairs.
    pub env: Vec<(String, String)>,
}

/// Runs `program` the way a container runtime would start it with `edits` (a device plugin's
/// `Allocate` answer, or a CDI spec's container edits): in a private mount namespace and a
/// chroot whose `/usr` is the host's, with the edits' mounts bound (read-only where asked) at
/// their container paths and only the edits' environment plus `env`. `shared` paths are bound at the same place (the built binaries, the simulated
/// machine's state). Needs root, as the kubelet's runtime does.
pub fn run_in_container(
    edits: &Edits,
    root: &Path,
    shared: &[&Path],
    env: &[(&str, String)],
    program: &Path,
) -> std::process::Output {
    container_command(edits, root, shared, env, program, &[])
        .output()
        .expect("unshare (util-linux) is needed to emulate a container")
}

/// The command [`run_in_container`] runs (with `args` for the program); the container's
/// process is the command's own pid (every step execs).
pub fn container_command(
    edits: &Edits,
    root: &Path,
    shared: &[&Path],
    env: &[(&str, String)],
    program: &Path,
    args: &[&str],
) -> Command {
    // Paths go into a shell script unquoted: allow only plain characters.
    let safe = |p: &Path| {
        let t = p.display().to_string();
        assert!(
            t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"/._-,".contains(&b)),
            "unexpected characters in {t}"
        );
        t
    };
    let r = safe(root);
    let mut s = String::from("set -e\n");
    s += &format!("mkdir -p {r}/usr {r}/proc {r}/dev {r}/etc {r}/tmp\n");
    for link in ["lib", "lib64", "bin", "sbin"] {
        let host = Path::new("/").join(link);
        match std::fs::read_link(&host) {
            Ok(target) => s += &format!("ln -s {} {r}/{link}\n", safe(&target)),
            Err(_) if host.is_dir() => {
                s += &format!("mkdir -p {r}/{link}\nmount --rbind /{link} {r}/{link}\n")
            }
            Err(_) => {}
        }
    }
    s += &format!(
        "mount --rbind /usr {r}/usr\nmount --rbind /proc {r}/proc\nmount --rbind /dev {r}/dev\n"
    );
    s += &format!("cp /etc/ld.so.cache {r}/etc/ 2>/dev/null || true\n");
    for p in shared {
        let p = safe(p);
        s += &format!("mkdir -p {r}{p}\nmount --bind {p} {r}{p}\n");
    }
    for m in &edits.mounts {
        let host = m.host.as_path();
        let (h, c) = (safe(host), safe(&m.container));
        assert!(
            !c.starts_with("/usr/"),
            "{c}: this emulation shares the host's /usr"
        );
        if host.is_dir() {
            s += &format!("mkdir -p {r}{c}\n");
        } else {
            let parent = safe(m.container.parent().unwrap());
            s += &format!("mkdir -p {r}{parent}\ntouch {r}{c}\n");
        }
        s += &format!("mount --bind {h} {r}{c}\n");
        if m.read_only {
            s += &format!("mount -o remount,bind,ro {r}{c}\n");
        }
    }
    let mut vars: Vec<String> = edits
        .env
        .iter()
        .map(|(k, v)| format!("{k}={}", safe(Path::new(v))))
        .collect();
    vars.extend(
        env.iter()
            .map(|(k, v)| format!("{k}={}", safe(Path::new(v)))),
    );
    let args: Vec<String> = args.iter().map(|a| safe(Path::new(a))).collect();
    s += &format!(
        "exec chroot {r} /usr/bin/env -i {} {} {}\n",
        vars.join(" "),
        safe(program),
        args.join(" ")
    );
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "sh", "-c", &s]);
    cmd
}
