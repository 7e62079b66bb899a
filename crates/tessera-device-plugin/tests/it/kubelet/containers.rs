//! What a container gets (the interposer, its limit, its identity) and what it cannot get around.

use super::*;

/// An `Allocate` answer as the container edits a runtime applies.
fn edits(resp: &ContainerAllocateResponse) -> Edits {
    Edits {
        mounts: resp
            .mounts
            .iter()
            .map(|m| Bind {
                host: m.host_path.clone().into(),
                container: m.container_path.clone().into(),
                read_only: m.read_only,
            })
            .collect(),
        env: resp
            .envs
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    }
}

/// [`tessera_testkit::container::run_in_container`] for an `Allocate` answer.
fn run_in_container(
    resp: &ContainerAllocateResponse,
    root: &Path,
    shared: &[&Path],
    env: &[(&str, String)],
    program: &Path,
) -> std::process::Output {
    container::run_in_container(&edits(resp), root, shared, env, program)
}

/// [`tessera_testkit::container::container_command`] for an `Allocate` answer.
fn container_command(
    resp: &ContainerAllocateResponse,
    root: &Path,
    shared: &[&Path],
    env: &[(&str, String)],
    program: &Path,
    args: &[&str],
) -> Command {
    container::container_command(&edits(resp), root, shared, env, program, args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_gets_the_interposer_and_its_limit() {
    let (node, kubelet, podres) = container_node().await;
    let g0 = node.gpus()[0].uuid.clone();
    let mut client = node.plugin_client().await;
    let units = unit_ids(&g0, 0..30);
    podres.set_holding("p", &units);
    let resp = allocate(&mut client, units).await.unwrap();
    // The card's device of the node's NVIDIA CDI spec, for a runtime without NVIDIA's.
    let cdi: Vec<&str> = resp.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(cdi, [format!("nvidia.com/gpu={g0}")]);

    let hello = artifact("hello_gpu");
    let target = target_dir();
    let sim_env = node.sim.var_strings();
    let root = tempfile::tempdir().unwrap();
    let out = tokio::task::block_in_place(|| {
        run_in_container(
            &resp,
            root.path(),
            &[&target, node.dir.path()],
            &sim_env,
            &hello,
        )
    });
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let shown = format!("container stdout:\n{stdout}\ncontainer stderr:\n{stderr}");
    // Preloaded through /etc/ld.so.preload (no LD_PRELOAD in the environment), the interposer
    // reached the arbiter with the token: the card shows the allocation's 24 GiB, and the
    // program's 40 GiB allocation is refused with CUDA_ERROR_OUT_OF_MEMORY (2).
    assert!(
        stdout.contains("GPU 0: Tessera Sim GPU 80GiB, 24 GiB"),
        "{shown}"
    );
    assert!(
        stderr.contains("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2)")
            && !stderr.contains("panicked"),
        "{shown}"
    );
    assert!(!out.status.success(), "{shown}");

    // Control: the same container without the preload file sees the whole card.
    let mut bare = resp.clone();
    bare.mounts
        .retain(|m| m.container_path != "/etc/ld.so.preload");
    let root = tempfile::tempdir().unwrap();
    let out = tokio::task::block_in_place(|| {
        run_in_container(
            &bare,
            root.path(),
            &[&target, node.dir.path()],
            &sim_env,
            &hello,
        )
    });
    let stdout = String::from_utf8_lossy(&out.stdout);
    let shown = format!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains("GPU 0: Tessera Sim GPU 80GiB, 80 GiB"),
        "{shown}"
    );
    assert!(stdout.contains("allocated 40 GiB"), "{shown}");
    kubelet.stop().await;
}

/// A node whose plugin puts the interposer under /opt (the emulated containers share the
/// host's /usr) and names the GPUs' NVIDIA CDI devices (the emulated runtime ignores them),
/// registered with a fake kubelet that serves PodResources.
async fn container_node() -> (Node, FakeKubelet, FakePodResources) {
    let mut node = Node::start().await;
    let mut kubelet = FakeKubelet::start(&node.kubelet_dir());
    let podres = FakePodResources::default();
    podres.serve(&node.podres());
    node.start_plugin_with(&[
        "--container-lib-path",
        "/opt/tessera/libtessera_interpose.so",
        "--nvidia-cdi-kind",
        "nvidia.com/gpu",
    ]);
    within(15, "registration", kubelet.registrations.recv())
        .await
        .unwrap();
    (node, kubelet, podres)
}

/// The arbiter's log once it contains `needle` (a backstop action is logged just after its
/// kill, so a test that saw the process die may be a moment early); panics after 30 s.
fn arbiter_log_with(node: &Node, needle: &str) -> String {
    let t = Instant::now();
    loop {
        let log = std::fs::read_to_string(node.dir.path().join("arbiter.log")).unwrap_or_default();
        if log.contains(needle) {
            return log;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no {needle:?} in the arbiter log:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The simulated machine's variables as strings, for a container's environment.
pub(super) fn sim_env(node: &Node) -> Vec<(&'static str, String)> {
    node.sim.var_strings()
}

/// Allocates `n` units of GPU 0 for pod `pod` through the plugin.
async fn allocate_units(
    node: &Node,
    podres: &FakePodResources,
    range: std::ops::Range<u32>,
    pod: &str,
) -> ContainerAllocateResponse {
    let g0 = node.gpus()[0].uuid.clone();
    let mut client = node.plugin_client().await;
    let units = unit_ids(&g0, range);
    podres.set_holding(pod, &units);
    allocate(&mut client, units).await.unwrap()
}

/// Runs the `tenant` example in an emulated container until it exits, and returns its
/// stdout, stderr, exit status and how long it lived after its memory was taken (the line
/// "holds N GiB" on stdout).
pub(super) fn run_tenant(
    node: &Node,
    resp: &ContainerAllocateResponse,
    env: &[(&str, String)],
    args: &[&str],
) -> (String, String, std::process::ExitStatus, Option<Duration>) {
    use std::io::BufRead;
    let root = tempfile::tempdir().unwrap();
    let target = target_dir();
    let mut child = container_command(
        resp,
        root.path(),
        &[&target, node.dir.path()],
        env,
        &artifact("tenant"),
        args,
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("unshare (util-linux) is needed to emulate a container");
    let err = child.stderr.take().unwrap();
    let err = std::thread::spawn(move || std::io::read_to_string(err).unwrap_or_default());
    let mut out = String::new();
    let mut held_at = None;
    for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap_or_default();
        if held_at.is_none() && line.contains(" holds ") {
            held_at = Some(Instant::now());
        }
        out.push_str(&line);
        out.push('\n');
    }
    let status = child.wait().unwrap();
    (
        out,
        err.join().unwrap(),
        status,
        held_at.map(|t| t.elapsed()),
    )
}

fn killed(status: &std::process::ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.signal() == Some(libc::SIGKILL)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_that_unsets_its_token_or_fakes_its_socket_still_gets_its_limit() {
    let (node, kubelet, podres) = container_node().await;
    let resp = allocate_units(&node, &podres, 0..30, "p").await;
    let mut no_token = resp.clone();
    no_token.envs.remove("TESSERA_TOKEN");
    let mut fake_socket = resp.clone();
    fake_socket
        .envs
        .insert("TESSERA_SOCKET".into(), "/tmp/fake-arbiter.sock".into());
    fake_socket
        .envs
        .insert("TESSERA_TOKEN".into(), "forged".into());
    for (what, r) in [
        ("token unset", &no_token),
        ("socket and token forged", &fake_socket),
    ] {
        let (out, err, status, _) = tokio::task::block_in_place(|| {
            run_tenant(
                &node,
                r,
                &sim_env(&node),
                &["--grab-gib", "40", "--seconds", "0.2"],
            )
        });
        let shown = format!("{what}\nstdout:\n{out}\nstderr:\n{err}");
        // The interposer took token and socket from the read-only identity file: it reached
        // the real arbiter (the card shows the allocation's 24 GiB) and, its context taking
        // 300 MiB of the limit, the 24th GiB was refused with CUDA_ERROR_OUT_OF_MEMORY.
        assert!(out.contains("with 24.0 GiB"), "{shown}");
        assert!(
            out.contains("holds 23 GiB; the next 1 GiB was refused: CUDA_ERROR_OUT_OF_MEMORY"),
            "{shown}"
        );
        assert!(status.success(), "{shown}\n{status:?}");
    }
    // The card never held more than the limit, and nobody was killed.
    let log = std::fs::read_to_string(node.dir.path().join("arbiter.log")).unwrap();
    assert!(!log.contains("backstop: pid"), "{log}");
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_process_that_never_connects_is_attributed_by_its_identity_and_killed() {
    let (node, kubelet, podres) = container_node().await;
    let resp = allocate_units(&node, &podres, 0..30, "p").await;
    // A copy of ld.so that ignores /etc/ld.so.preload, or a static binary: the interposer is
    // never loaded and nothing ever connects to the arbiter.
    let mut bare = resp.clone();
    bare.mounts
        .retain(|m| m.container_path != "/etc/ld.so.preload");
    let (out, err, status, after) = tokio::task::block_in_place(|| {
        run_tenant(
            &node,
            &bare,
            &sim_env(&node),
            &["--grab-gib", "40", "--seconds", "10"],
        )
    });
    let shown = format!("stdout:\n{out}\nstderr:\n{err}");
    assert!(killed(&status), "{status:?}\n{shown}");
    // The backstop may kill it while it is still allocating (a poll can land anywhere in
    // the 40 allocations), so what it held comes from the kill line, not from its stdout.
    let id = &resp.envs["TESSERA_ALLOCATION_ID"];
    let log = arbiter_log_with(&node, &format!("of allocation {id} killed"));
    let line = log
        .lines()
        .find(|l| l.contains(&format!("of allocation {id} killed")))
        .unwrap();
    assert!(line.contains("never connected"), "{line}");
    // No interposer: the driver gave it more than the 24 GiB limit, and only then was it
    // killed.
    let held = tessera_testkit::backstop_held_bytes(line, "killed")
        .unwrap_or_else(|| panic!("no held figure in {line:?}"))
        / GIB as f64;
    assert!(
        held > 24.0,
        "it was over its limit when killed: {line}\n{shown}"
    );
    eprintln!(
        "a container process over its limit that never connected: killed holding {held} GiB, {}",
        after.map_or("before it finished allocating".to_owned(), |a| format!(
            "{a:?} after it held all 40"
        ))
    );
    let used = tessera_sim_state::device_memory_used(&node.sim.dir, 0).unwrap();
    assert!(used < 24 << 30, "the card gave the memory back: {used}");
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_without_shares_that_reaches_the_gpu_is_killed_and_whole_gpus_are_left_alone() {
    let (node, kubelet, podres) = container_node().await;
    // A pod that asked for no shares but reached the device anyway (a privileged pod, or
    // NVIDIA_VISIBLE_DEVICES=all): no mount, no identity.
    let none = ContainerAllocateResponse::default();
    let (out, err, status, _) = tokio::task::block_in_place(|| {
        run_tenant(
            &node,
            &none,
            &sim_env(&node),
            &["--grab-gib", "1", "--seconds", "10"],
        )
    });
    assert!(killed(&status), "{status:?}\n{out}\n{err}");
    let log = arbiter_log_with(&node, "unknown container process");
    assert!(log.contains("killed"), "{log}");

    // A pod holding both whole GPUs runs without the interposer and uses its cards freely:
    // memory and GPU time outside any lease; it is attributed (identity file) and untouched.
    let gpus = node.gpus();
    let mut client = node.plugin_client().await;
    let mut units = unit_ids(&gpus[0].uuid, 0..100);
    units.extend(unit_ids(&gpus[1].uuid, 0..100));
    podres.set_holding("whole", &units);
    let whole = allocate(&mut client, units).await.unwrap();
    assert_eq!(whole.mounts.len(), 1, "only the identity file: {whole:?}");
    assert_eq!(whole.mounts[0].container_path, "/etc/tessera/tenant");
    let cdi: Vec<&str> = whole.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    let each: Vec<String> = whole.envs["NVIDIA_VISIBLE_DEVICES"]
        .split(',')
        .map(|u| format!("nvidia.com/gpu={u}"))
        .collect();
    assert_eq!(cdi, each);
    assert_eq!(cdi.len(), 2, "{cdi:?}");
    let env = sim_env(&node);
    let (out, err, status, _) = tokio::task::block_in_place(|| {
        run_tenant(
            &node,
            &whole,
            &env,
            &["--grab-gib", "60", "--seconds", "1.5"],
        )
    });
    assert!(status.success(), "{status:?}\n{out}\n{err}");
    assert!(out.contains("holds 60 GiB"), "{out}");
    // Its second card too: attributed to its first allocation (the identity's), it holds
    // the other card through their group, so it is not policed there either.
    // (The emulated runtime does not map NVIDIA_VISIBLE_DEVICES; the simulator honours
    // CUDA_VISIBLE_DEVICES, which is what the runtime's cards look like to CUDA.)
    let (_, other) = whole.envs["NVIDIA_VISIBLE_DEVICES"]
        .split_once(',')
        .expect("two cards");
    let mut env2 = env.clone();
    env2.push(("CUDA_VISIBLE_DEVICES", other.to_owned()));
    let (out, err, status, _) = tokio::task::block_in_place(|| {
        run_tenant(
            &node,
            &whole,
            &env2,
            &["--grab-gib", "60", "--seconds", "1.5"],
        )
    });
    assert!(status.success(), "{status:?}\n{out}\n{err}");
    assert!(out.contains("holds 60 GiB"), "{out}");
    let log = std::fs::read_to_string(node.dir.path().join("arbiter.log")).unwrap();
    assert_eq!(
        log.matches("killed").count(),
        1,
        "only the pod without shares: {log}"
    );
    kubelet.stop().await;
}

/// Issue 20, the pid-reuse trap aimed at a whole-GPU pod: tenant A (1 GiB on GPU 0) keeps a
/// connection open whose process exited; a process of a pod holding GPU 1 wholly then gets
/// that pid and takes 60 GiB of its card. Its own identity file wins: it is the pod's, on the
/// pod's card, and nobody is killed or counted against A.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_gpu_pods_process_on_a_trap_pid_stays_its_pods() {
    let (node, kubelet, podres) = container_node().await;
    let gpus = node.gpus();
    let (token_a, a) = node
        .admin_client()
        .create(tessera_testkit::allocation(0, 1 << 30, 10, None))
        .unwrap();
    let trap = tessera_testkit::trap::set(Command::new("python3"), &node.tenant(), &token_a);
    assert!(trap.answer > 0, "the arbiter answered the hello");
    let mut client = node.plugin_client().await;
    let units = unit_ids(&gpus[1].uuid, 0..100);
    podres.set_holding("whole", &units);
    let whole = allocate(&mut client, units).await.unwrap();
    // What the runtime's NVIDIA_VISIBLE_DEVICES does on a node (the emulation does not map it).
    let mut env = sim_env(&node);
    env.push(("CUDA_VISIBLE_DEVICES", gpus[1].uuid.clone()));
    let target = target_dir();
    let (out, status) = tokio::task::block_in_place(|| {
        let (mut child, _root) = tessera_testkit::trap::at_pid(trap.pid, || {
            // A fresh root each try: the emulation's script builds it once.
            let root = tempfile::tempdir().unwrap();
            let c = container_command(
                &whole,
                root.path(),
                &[&target, node.dir.path()],
                &env,
                &artifact("tenant"),
                &["--grab-gib", "60", "--seconds", "1.5"],
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("unshare (util-linux) is needed to emulate a container");
            let pid = c.id() as i32;
            ((KillOnDrop::new(c), root), pid)
        });
        let out = std::io::read_to_string(child.stdout.take().unwrap()).unwrap();
        (out, child.wait().unwrap())
    });
    let log = std::fs::read_to_string(node.dir.path().join("arbiter.log")).unwrap();
    assert!(status.success(), "{status:?}\n{out}\n{log}");
    assert!(out.contains("holds 60 GiB"), "{out}");
    assert!(!log.contains("killed"), "{log}");
    let a_now = node
        .admin_client()
        .list()
        .unwrap()
        .into_iter()
        .find(|x| x.id == a.id)
        .unwrap();
    assert_eq!((a_now.enforced, a_now.gpu_time_total_ns), (0, 0), "{log}");
    trap.release();
    kubelet.stop().await;
}
