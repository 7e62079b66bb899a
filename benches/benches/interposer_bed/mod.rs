//! Shared set-up of the interposer benchmarks: a simulated GPU, the real arbiter with an
//! allocation, and, in this process, the simulated driver loaded directly next to the built
//! interposer (`dlopen`ed, so the same run can call the raw and the intercepted entry points).
//!
//! Artifacts are taken from the benchmark's own profile folder (`target/release` under
//! `cargo bench`): build them first with
//! `cargo build --release -p tessera-interpose -p tessera-sim-cuda -p tessera-sim-nvml -p tessera-arbiter`.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Instant;

use libloading::Library;
use tessera_protocol::client::TenantClient;
use tessera_protocol::node;
use tessera_testkit::{ArbiterSpec, RunningArbiter, SimGpu, allocation, artifact_with_hint};

/// The folder of the benchmark's profile (`target/release`).
pub(crate) use tessera_testkit::target_dir as profile_dir;

use tessera_cuda_abi::{cuCtxSetCurrent_t, cuDeviceGet_t, cuDevicePrimaryCtxRetain_t, cuInit_t};

/// What to build before `cargo bench` (its artifacts come from the release profile).
const BUILD_HINT: &str = "run `cargo build --release -p tessera-interpose -p tessera-sim-cuda \
     -p tessera-sim-nvml -p tessera-arbiter` before `cargo bench`";

/// The simulated card of the benchmarks.
const SIM_GPUS: &str = "1x80GiB";

fn artifact(name: &str) -> PathBuf {
    artifact_with_hint(name, BUILD_HINT)
}

/// Pins the calling thread (and every thread it creates later) to `cpu`.
fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
    }
}

/// A simulated GPU, an arbiter, and both the raw and the intercepted driver in this process.
pub(crate) struct Bed {
    // Fields drop in order: the arbiter is killed before its folder goes.
    _arbiter: RunningArbiter,
    _dir: tempfile::TempDir,
    /// The tenant socket and the allocation's token.
    pub socket: PathBuf,
    pub token: String,
    /// The simulated GPU (its variables put another process on it).
    pub gpu: SimGpu,
    /// The simulated `libcuda.so.1`.
    pub sim: Library,
    /// The built interposer.
    pub interposer: Library,
}

impl Bed {
    /// Sets everything up with an allocation of `memory` bytes, `share` and `cap`.
    ///
    /// With `pin_cpu`, this process (all its threads) and the arbiter run on that one CPU: a
    /// round trip is then two context switches on one core whatever the scheduler does, so
    /// the echo and the arbiter are measured alike (across cores, a VM's wake-up IPIs make
    /// round trips bimodal, 6 or 60 us, run to run).
    pub(crate) fn start(memory: u64, share: u32, cap: Option<u32>, pin_cpu: Option<usize>) -> Self {
        if let Some(cpu) = pin_cpu {
            pin(cpu);
        }
        let dir = tempfile::tempdir().unwrap();
        let sim = SimGpu::prepare_with_hint(&dir.path().join("sim"), SIM_GPUS, BUILD_HINT);
        let (sim_dir, lib_dir) = (sim.dir.clone(), sim.lib_dir.clone());
        let gpu = sim.clone();
        let spec = ArbiterSpec::in_dir(artifact("tessera-arbiter"), dir.path(), sim);
        let mut arbiter = spec.command();
        tessera_benches::exit_with_parent(&mut arbiter);
        if let Some(cpu) = pin_cpu {
            use std::os::unix::process::CommandExt;
            // SAFETY: pre_exec runs in the forked child before exec; sched_setaffinity is
            // async-signal-safe and touches only a local set.
            unsafe {
                arbiter.pre_exec(move || {
                    pin(cpu);
                    Ok(())
                });
            }
        }
        let arbiter = spec.start_command(arbiter);
        let socket = spec.socket;
        let (token, _) = arbiter
            .admin()
            .create(allocation(0, memory, share, cap))
            .unwrap();
        // SAFETY: no other thread of this process reads the environment yet (set-up runs
        // before criterion and before any thread is spawned).
        unsafe {
            std::env::set_var(tessera_sim_state::ENV_DIR, &sim_dir);
            std::env::set_var(tessera_sim_state::ENV_GPUS, SIM_GPUS);
            std::env::set_var(node::ENV_REAL_LIBCUDA, lib_dir.join("libcuda.so.1"));
            std::env::set_var(node::ENV_SOCKET, &socket);
            std::env::set_var(node::ENV_TOKEN, &token);
        }
        // SAFETY: loading the simulated driver and the interposer runs their constructors,
        // which only read the environment set above.
        let (sim, interposer) = unsafe {
            (
                Library::new(lib_dir.join("libcuda.so.1")).unwrap(),
                Library::new(artifact("libtessera_interpose.so")).unwrap(),
            )
        };
        let bed = Self {
            _arbiter: arbiter,
            _dir: dir,
            socket,
            token,
            gpu,
            sim,
            interposer,
        };
        bed.make_context_current();
        bed
    }

    /// A separate tenant connection of the allocation (the protocol crate's blocking client).
    pub(crate) fn tenant_client(&self) -> TenantClient {
        TenantClient::connect(&self.socket, &self.token).unwrap()
    }

    /// A function of the simulated driver (raw, not intercepted).
    pub(crate) fn raw<T: Copy>(&self, name: &str) -> T {
        // SAFETY: callers name the C signature of the symbol they ask for.
        unsafe { *self.sim.get::<T>(name.as_bytes()).unwrap() }
    }

    /// A function as the interposer exports it (intercepted).
    pub(crate) fn hooked<T: Copy>(&self, name: &str) -> T {
        // SAFETY: as for `raw`.
        unsafe { *self.interposer.get::<T>(name.as_bytes()).unwrap() }
    }

    /// Initialises the driver and makes device 0's primary context current on this thread.
    pub(crate) fn make_context_current(&self) {
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the simulated driver's entry points with their C signatures.
        unsafe {
            assert_eq!(self.raw::<cuInit_t>("cuInit")(0), 0);
            assert_eq!(self.raw::<cuDeviceGet_t>("cuDeviceGet")(&mut dev, 0), 0);
            assert_eq!(
                self.raw::<cuDevicePrimaryCtxRetain_t>("cuDevicePrimaryCtxRetain")(&mut ctx, dev),
                0
            );
            assert_eq!(self.raw::<cuCtxSetCurrent_t>("cuCtxSetCurrent")(ctx), 0);
        }
    }
}

/// A plain echo over a `UnixStream` pair: the machine's raw round trip, for comparison.
pub(crate) struct Echo {
    client: UnixStream,
}

impl Echo {
    /// Starts the echo thread.
    pub(crate) fn start() -> Self {
        let (client, mut server) = UnixStream::pair().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 16];
            while server.read_exact(&mut buf).is_ok() {
                if server.write_all(&buf).is_err() {
                    return;
                }
            }
        });
        Self { client }
    }

    /// One 16-byte round trip.
    pub(crate) fn round_trip(&mut self) {
        let mut buf = [7u8; 16];
        self.client.write_all(&buf).unwrap();
        self.client.read_exact(&mut buf).unwrap();
    }
}

/// Median over `batches` of the mean time of `iters` calls of each function, interleaved so
/// that machine noise hits every variant alike. Returns nanoseconds per call for each.
pub(crate) fn interleaved_medians(
    batches: usize,
    iters: u32,
    fs: &mut [&mut dyn FnMut()],
) -> Vec<f64> {
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(batches); fs.len()];
    for _ in 0..batches {
        for (i, f) in fs.iter_mut().enumerate() {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            samples[i].push(t.elapsed().as_nanos() as f64 / f64::from(iters));
        }
    }
    samples
        .into_iter()
        .map(|mut s| {
            s.sort_by(|a, b| a.total_cmp(b));
            s[s.len() / 2]
        })
        .collect()
}

/// Where the benchmark's summary goes besides stdout (`target/criterion/<name>.txt`).
pub(crate) fn write_summary(name: &str, text: &str) {
    let dir = profile_dir().parent().unwrap().join("criterion");
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join(format!("{name}.txt")), text);
}
