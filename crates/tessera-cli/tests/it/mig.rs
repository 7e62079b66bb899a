//! Tenants inside MIG instances of a simulated H200 (issue 40): an allocation on one instance
//! that widens its `CUDA_VISIBLE_DEVICES` to another instance of the same GPU is on a card not
//! its own there. Without the interposer the backstop kills it (the simulated NVML, read
//! through the other instance's MIG handle, is the truth); with it, it gets no context there.

use std::process::Stdio;
use std::time::{Duration, Instant};

use tessera_sim_state::SimSpec;
use tessera_sim_state::mig::{GpuModel, MigDevice, store};
use tessera_testkit::process::{FirstLine, spawn_first_line};
use tessera_testkit::{ArbiterSpec, RunningArbiter, SimGpu, artifact};

use crate::run_support::{interposer_in, tessera};

/// The real arbiter on a simulated H200 with two `1g.18gb` instances (made before it starts:
/// it reads the layout at start), and those instances.
struct MigNode {
    dir: tempfile::TempDir,
    sim: SimGpu,
    arbiter: RunningArbiter,
    socket: std::path::PathBuf,
    admin_socket: std::path::PathBuf,
    devs: Vec<MigDevice>,
}

impl MigNode {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let sim = SimGpu::prepare(&dir.path().join("sim"), "1xH200");
        let spec = SimSpec::parse("1xH200").unwrap();
        let m = GpuModel::H200;
        store::update(&sim.dir, |st| {
            st.gpu_mut(0).set_mode(true, false)?;
            for _ in 0..2 {
                let gi = st
                    .gpu_mut(0)
                    .create_gi(m, m.profile_by_name("1g.18gb").unwrap(), None)?;
                let u = st.fresh_uuid(&spec.gpus[0].uuid_bytes);
                st.gpu_mut(0).create_ci(m, gi, 0, u)?;
            }
            Ok(())
        })
        .unwrap();
        let devs = store::load(&sim.dir).unwrap().devices(&spec);
        let spec = ArbiterSpec::in_dir(artifact("tessera-arbiter"), dir.path(), sim.clone())
            .log_to(dir.path().join("arbiter.log"));
        let arbiter = spec.start();
        Self {
            dir,
            sim,
            arbiter,
            socket: spec.socket,
            admin_socket: spec.admin_socket,
            devs,
        }
    }

    /// `tessera run --gpu <instance A> --share 50 --memory 1GiB` whose command turns to
    /// instance B (`env CUDA_VISIBLE_DEVICES=MIG-B`) and takes 512 MiB there; `env` first.
    fn widening(&self, env: &[&str]) -> std::process::Command {
        let lib = interposer_in(self.dir.path());
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/sim_visible.py");
        let mut cmd = std::process::Command::new(tessera());
        cmd.args(["run", "--gpu", &self.devs[0].uuid])
            .args(["--share", "50", "--memory", "1GiB", "--interposer"])
            .arg(&lib)
            .args(["--", "env"])
            .args(env)
            .arg(format!("CUDA_VISIBLE_DEVICES={}", self.devs[1].uuid))
            .arg(tessera_testkit::python())
            .arg(&script)
            .args(["512", "1000000"])
            .env("TESSERA_ADMIN_SOCKET", &self.admin_socket)
            .env("TESSERA_SOCKET", &self.socket)
            .env_remove("TESSERA_INTERPOSER")
            .env_remove("LD_PRELOAD")
            .stdin(Stdio::piped());
        self.sim.apply(&mut cmd);
        cmd
    }

    /// Memory in use in instance B.
    fn used_in_b(&self) -> u64 {
        tessera_sim_state::instance_memory_used(&self.sim.dir, 0, self.devs[1].tag()).unwrap()
    }
}

#[test]
fn a_tenant_that_widens_to_another_mig_instance_is_killed_there() {
    let node = MigNode::start();
    // The arbiter schedules the instances, not the GPU.
    let gpus = node.arbiter.admin().gpus().unwrap();
    let uuids: Vec<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
    assert_eq!(uuids, [&node.devs[0].uuid, &node.devs[1].uuid]);
    assert_eq!(gpus[0].memory_total, 16 << 30);
    // Without the interposer: the backstop's case.
    let mut cmd = node.widening(&["-u", "LD_PRELOAD"]);
    let FirstLine {
        mut child,
        stdin: _stdin,
        line,
    } = spawn_first_line(&mut cmd);
    // The script prints after its allocation on B (or is killed before it can): either way
    // B held its 512 MiB; they go with the kill.
    let took = Instant::now();
    tessera_testkit::wait_until(Duration::from_secs(5), || node.used_in_b() == 0).unwrap_or_else(
        || {
            panic!(
                "instance B still holds {} bytes ({line:?})\n{}",
                node.used_in_b(),
                node.arbiter.log_text()
            )
        },
    );
    eprintln!(
        "widened to another instance: gone {:?} after",
        took.elapsed()
    );
    let status = tessera_testkit::process::wait_exit(&mut child, Duration::from_secs(10))
        .expect("tessera run ends once its command is killed");
    assert_eq!(
        status.code(),
        Some(128 + libc::SIGKILL),
        "{status:?} ({line:?})\n{}",
        node.arbiter.log_text()
    );
}

#[test]
fn a_tenant_that_widens_to_another_mig_instance_gets_no_context_there() {
    // The interposer's half: the process sees instance B as its device 0, whose UUID is not
    // its allocation's: its session there is refused and B never holds anything of it.
    let node = MigNode::start();
    let mut cmd = node.widening(&[]);
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("arbiter refused this process") && err.contains("CUDA_ERROR_OUT_OF_MEMORY"),
        "{err}"
    );
    assert_eq!(node.used_in_b(), 0);
    // And the same tenant on its own instance runs (the interposer knows its MIG device).
    let lib = interposer_in(node.dir.path());
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/sim_visible.py");
    let mut own = std::process::Command::new(tessera());
    own.args(["run", "--gpu", &node.devs[0].uuid])
        .args(["--share", "50", "--memory", "1GiB", "--interposer"])
        .arg(&lib)
        .arg("--")
        .arg(tessera_testkit::python())
        .arg(&script)
        .args(["512", "1000000"])
        .env("TESSERA_ADMIN_SOCKET", &node.admin_socket)
        .env("TESSERA_SOCKET", &node.socket)
        .env_remove("TESSERA_INTERPOSER")
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::piped());
    node.sim.apply(&mut own);
    let FirstLine {
        child: _child,
        stdin: _stdin,
        line,
    } = spawn_first_line(&mut own);
    let v: serde_json::Value =
        serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    assert_eq!(v["devices"].as_array().map(Vec::len), Some(1), "{v}");
    let held =
        tessera_sim_state::instance_memory_used(&node.sim.dir, 0, node.devs[0].tag()).unwrap();
    assert!(
        held >= 512 << 20,
        "instance A holds its 512 MiB: {held} ({v})"
    );
}
