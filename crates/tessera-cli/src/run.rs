//! `tessera run`: run a command under an enforced allocation, without Kubernetes.
//!
//! Checks that the interposer loads and defines its hooks and marker itself (a file that does
//! not load would be skipped by the loader with a warning, and the command would run
//! unlimited), creates an
//! allocation through the arbiter's admin socket (root) or user socket (anyone else, within
//! the quota the operator set; see [`crate::endpoint`]), runs the command with the interposer
//! preloaded (`LD_PRELOAD`, prepended to any existing value), `TESSERA_SOCKET` /
//! `TESSERA_TOKEN` set, `CUDA_VISIBLE_DEVICES` set to the allocation's GPU (its UUID, so the
//! command sees exactly that GPU) and `TESSERA_ADMIN_SOCKET` removed (the command has no business
//! creating or deleting allocations), passes its exit code through (128 + signal when it was
//! killed; 127 when it does not exist, 126 when it cannot be run, as shells do), says on
//! stderr why the backstop killed a process of it (the arbiter's record, not a guess from the
//! exit status), and deletes the allocation when the command ends. The command runs as the
//! caller: `tessera run` is the caller's own process and never changes user.
//!
//! What this protects against: the command passing its memory limit or compute share through
//! the interposer, and the command finding the admin socket through an inherited variable. It
//! is not a security boundary against a local user: anyone who can reach the admin socket (its
//! file permissions decide) can create and delete allocations, and a command that unsets
//! `LD_PRELOAD` or calls the driver by other means escapes the interposer (see README.md).
//!
//! Process tree: `tessera run` is a child subreaper (`PR_SET_CHILD_SUBREAPER`), so a process
//! the command double-forks away is reparented to it rather than to init, and it creates the
//! allocation as its owner (its pid and start time). The arbiter's backstop holds every
//! process under the owner to the allocation's limit, connected or not (a child that drops
//! `LD_PRELOAD` included), and deletes the allocation once the owner is gone and none of its
//! processes is left: a `tessera run` killed by SIGKILL leaks nothing. After the command ends,
//! `tessera run` waits for what it left behind (adopted orphans) before deleting the
//! allocation and passing the command's exit code through.
//!
//! `--exec`: `tessera run` creates the allocation as above, with itself as the owner, and then
//! becomes the command (`execve`: same pid, same start time, so the command is the owner). No
//! second process and no wait; the arbiter deletes the allocation when the owner and its
//! processes are gone (it watches the owner's pidfd). Not a subreaper then (the mark would pass
//! to the command), and no kill report: the command's exit status is its own.
//!
//! Signals: SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to `tessera run` by another process
//! (`kill`) are forwarded to the command; the same signals typed at the terminal (Ctrl-C)
//! already reach the command, which shares the terminal's process group, so they are not
//! sent twice. Either way `tessera run` waits for the command and then cleans up.

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};
use tessera_protocol::node;

use anyhow::{Context, bail};
use tessera_protocol::client::{AdminClient, ClientError};
use tessera_protocol::{AdminReply, AdminRequest, CreateAllocation, GpuSelector};

use crate::CliError;

/// Default admin socket (same as the arbiter's).
pub(crate) const DEFAULT_ADMIN_SOCKET: &str = node::DEFAULT_ADMIN_SOCKET;
/// Default tenant socket (same as the arbiter's).
pub(crate) const DEFAULT_SOCKET: &str = node::DEFAULT_TENANT_SOCKET;
/// File name of the interposer, looked for next to the `tessera` executable.
pub(crate) const INTERPOSER_FILE: &str = "libtessera_interpose.so";
/// Share given when `--share` is not: weights are relative and WFQ hands idle time to whoever
/// is busy, so a lone command gets the whole GPU; 10 lets ten default runs share one GPU.
pub(crate) const DEFAULT_SHARE: u32 = 10;

/// Arguments of `tessera run`.
#[derive(Debug, clap::Args)]
pub(crate) struct RunArgs {
    /// GPU by index or UUID; several, comma-separated (0,1), make one allocation spanning them,
    /// with --memory, --share and --cap applying to each GPU.
    #[arg(long, default_value = "0", value_name = "INDEX|UUID[,...]", value_parser = parse_gpu_arg,
          value_delimiter = ',', allow_hyphen_values = true)]
    pub gpu: Vec<GpuSelector>,
    /// Memory limit for all processes of the command together, on each GPU, e.g. 512MiB, 4GiB.
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg)]
    pub memory: u64,
    /// Compute weight 1..=100 (relative to the other allocations of the GPU; the shares of a
    /// GPU add up to at most 100).
    #[arg(long, default_value_t = DEFAULT_SHARE, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=100))]
    pub share: u32,
    /// Also cap the command's GPU time at its share (percent of the GPU), even when the GPU is
    /// otherwise idle.
    #[arg(long)]
    pub cap: bool,
    /// Service tier: `best-effort`, or `latency` (served first within its share, which is
    /// then also its ceiling; other tenants keep little work in flight while it runs).
    #[arg(long, default_value = "best-effort", value_name = "TIER")]
    pub tier: tessera_protocol::Tier,
    /// The arbiter's admin or user socket.
    #[command(flatten)]
    pub sockets: crate::endpoint::SocketArgs,
    /// Arbiter tenant socket, handed to the command; old name `--socket`.
    #[arg(
        long = "tenant-socket",
        alias = "socket",
        value_name = "PATH",
        env = node::ENV_SOCKET,
        default_value = DEFAULT_SOCKET
    )]
    pub socket: PathBuf,
    /// Become the command (`exec`) instead of waiting for it: no second process, so the
    /// command starts sooner (about 0.5 ms here), and the arbiter deletes the allocation when
    /// the command and every process of it have ended. Given up: a process the command
    /// double-forks away is no longer kept under it (the backstop then knows it only by its
    /// connection), and the backstop's reason for a kill is not said on stderr (`tessera
    /// status` and the arbiter's log have it).
    #[arg(long)]
    pub exec: bool,
    /// The interposer library [default: libtessera_interpose.so next to `tessera`].
    #[arg(long, env = node::ENV_INTERPOSER, value_name = "PATH")]
    pub interposer: Option<PathBuf>,
    /// The command to run, after `--` (so a misspelled flag is an error, never the command).
    #[arg(
        last = true,
        allow_hyphen_values = true,
        required = true,
        value_name = "COMMAND"
    )]
    pub command: Vec<OsString>,
}

// One size parser for every command and message (`tessera sim --gpus`, the arbiter's refusals).
pub(crate) use tessera_protocol::size::parse_size;

fn parse_size_arg(text: &str) -> Result<u64, String> {
    parse_size(text).map_err(|e| e.to_string())
}

/// `--gpu`: a plain number is an index, anything else a UUID.
pub(crate) fn parse_gpu(text: &str) -> GpuSelector {
    match text.trim().parse::<u32>() {
        Ok(i) => GpuSelector::Index(i),
        Err(_) => GpuSelector::Uuid(text.trim().to_owned()),
    }
}

/// clap's parser for `--gpu`: like [`parse_gpu`], but a number that is no index (negative, or
/// too large) is bad usage, not a UUID nobody has.
fn parse_gpu_arg(text: &str) -> Result<GpuSelector, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err("expected a GPU index (0, 1, ...) or UUID (GPU-...)".into());
    }
    if t.parse::<i128>().is_ok() && t.parse::<u32>().is_err() {
        return Err(format!(
            "{t} is not a GPU index (0, 1, ...); give an index or a UUID (GPU-...)"
        ));
    }
    Ok(parse_gpu(t))
}

/// The interposer to preload: the flag (or `TESSERA_INTERPOSER`), else the file next to the
/// running `tessera`. Refuses to go on without one (the command would run unlimited); whether
/// it loads as the interposer is [`check_interposer`]'s.
fn interposer_path(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => {
            let exe = std::env::current_exe().context("cannot locate the tessera executable")?;
            exe.parent()
                .map(|d| d.join(INTERPOSER_FILE))
                .unwrap_or_default()
        }
    };
    if !path.is_file() {
        bail!(
            "interposer {} not found: pass --interposer or set TESSERA_INTERPOSER \
             (without it the limits would not be enforced)",
            path.display()
        );
    }
    // LD_PRELOAD entries are separated by ':' and spaces, and a relative one is searched
    // for like a library name, so hand the loader an absolute path.
    let path = std::fs::canonicalize(&path).unwrap_or(path);
    let text = path.to_string_lossy();
    if text.contains([':', ' ']) {
        bail!(
            "interposer path {} contains ':' or a space, which LD_PRELOAD cannot carry",
            text
        );
    }
    Ok(path)
}

/// Refuses a file that does not load as the interposer: the loader would skip it with a
/// warning and the command would run unlimited. (It loads the file: `tessera run` does this
/// while the arbiter creates the allocation.)
fn check_interposer(path: &Path) -> anyhow::Result<()> {
    tessera_preload::check(path).map_err(|e| {
        anyhow::anyhow!("{e} (without the interposer the limits would not be enforced)")
    })
}

/// `LD_PRELOAD` for the command: the interposer first, then whatever was there.
pub(crate) fn ld_preload(interposer: &Path, existing: Option<OsString>) -> OsString {
    let mut v = interposer.as_os_str().to_owned();
    if let Some(e) = existing.filter(|e| !e.is_empty()) {
        v.push(":");
        v.push(e);
    }
    v
}

/// Pid of the running command (0 before it starts), read by the signal handler.
static CHILD: AtomicI32 = AtomicI32::new(0);
/// A signal that arrived before the command started, forwarded once it has.
static EARLY_SIGNAL: AtomicI32 = AtomicI32::new(0);
const FORWARDED: [libc::c_int; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

extern "C" fn forward(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t to an SA_SIGINFO handler.
    let code = unsafe { (*info).si_code };
    // Positive codes (SI_KERNEL) are terminal-generated: the command got the signal too.
    if code > 0 {
        return;
    }
    let pid = CHILD.load(Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe; pid is our child, not reaped before CHILD is reset.
        unsafe { libc::kill(pid, sig) };
    } else {
        EARLY_SIGNAL.store(sig, Ordering::SeqCst);
    }
}

fn install_forwarding() -> anyhow::Result<()> {
    for sig in FORWARDED {
        // SAFETY: a zeroed sigaction is a valid starting value; the handler only touches
        // atomics and calls kill, which is async-signal-safe.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = forward as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error()).context("cannot install signal handlers");
        }
    }
    Ok(())
}

/// Runs `tessera run`; returns the process exit code.
pub(crate) fn main(args: RunArgs) -> Result<u8, CliError> {
    if args.gpu.len() > 1 && args.tier != tessera_protocol::Tier::BestEffort {
        // Refused before anything is created: a group's slices have no tier yet.
        return Err(CliError::usage(
            "--tier latency takes one GPU: an allocation spanning GPUs is best-effort",
        ));
    }
    let interposer = interposer_path(args.interposer.as_deref())?;
    // With --exec the subreaper mark would pass to the command (execve keeps it), which would
    // then collect orphans it never waits for.
    if !args.exec {
        // SAFETY: PR_SET_CHILD_SUBREAPER takes an integer flag and affects only this process.
        let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) };
        if rc != 0 {
            return Err(anyhow::Error::from(std::io::Error::last_os_error())
                .context("cannot become a child subreaper")
                .into());
        }
    }
    let owner = tessera_protocol::process::this_process()
        .context("cannot read this process's start time from /proc/self/stat")?;
    let endpoint = args.sockets.endpoint();
    let sock = &endpoint.path;
    let mut labels = std::collections::BTreeMap::new();
    labels.insert("created-by".to_owned(), "tessera run".to_owned());
    labels.insert("pid".to_owned(), std::process::id().to_string());
    labels.insert(
        "command".to_owned(),
        args.command[0].to_string_lossy().into_owned(),
    );
    let slices: Vec<CreateAllocation> = args
        .gpu
        .iter()
        .map(|gpu| CreateAllocation {
            gpu: gpu.clone(),
            memory_limit: args.memory,
            share: args.share,
            cap: args.cap.then_some(args.share),
            labels: labels.clone(),
        })
        .collect();
    // One GPU: a plain allocation in its tier; several: one group, all or nothing, under one
    // token (best-effort: a group has no tier yet).
    let owner = Some(owner);
    let req = match <[CreateAllocation; 1]>::try_from(slices) {
        Ok([create]) => AdminRequest::CreateTiered {
            create,
            owner,
            tier: args.tier,
        },
        Err(slices) => AdminRequest::CreateGroup { slices, owner },
    };
    // The create goes out with the handshake, and the interposer is loaded and checked while
    // the arbiter works on it (two round trips and the check were a tenth of `tessera run`'s
    // added start-up, docs/benchmarks.md).
    let sent = AdminClient::connect_pipelined(sock).and_then(|mut a| a.send(&req).map(|()| a));
    let checked = check_interposer(&interposer);
    let created = sent.and_then(|mut admin| {
        let reply = admin.recv()?;
        Ok((admin, reply))
    });
    let (mut admin, reply) = match (created, checked) {
        (Ok(c), Ok(())) => c,
        // The interposer's error first: it is the caller's to fix, whatever the arbiter said.
        (Ok((mut admin, reply)), Err(e)) => {
            delete_unused(&mut admin, &created_ids(&reply));
            return Err(e.into());
        }
        (Err(_), Err(e)) => return Err(e.into()),
        (Err(e), Ok(())) => return Err(CliError::arbiter(e, sock)),
    };
    let (token, allocs) = match reply {
        AdminReply::Created { token, allocation } => (token, vec![allocation]),
        AdminReply::CreatedGroup { token, allocations } => (token, allocations),
        other => {
            let e = ClientError::Unexpected(format!("{other:?}"));
            return Err(CliError::arbiter(e, sock));
        }
    };
    // The command sees exactly its GPUs, in the order asked (ordinal 0 is the first).
    let visible: Vec<&str> = allocs.iter().map(|a| a.gpu_uuid.as_str()).collect();
    let visible = visible.join(",");
    if args.exec {
        // Only returns when the command could not be started: then nothing owns the
        // allocation but this process, which deletes it on the connection it has.
        let e = command(&args, &interposer, &token, &visible).exec();
        let ids: Vec<String> = allocs.iter().map(|a| a.id.clone()).collect();
        delete_unused(&mut admin, &ids);
        return Ok(crate::spawn::not_started(
            "tessera run",
            &args.command[0],
            &e,
        ));
    }
    drop(admin);
    let status = run_command(&args, &interposer, &token, &visible);
    // The kill questions and the deletes go out together with the handshake (one round trip),
    // answered in order: the questions before the deletes. An arbiter that does not know the
    // question hangs up at it, before the deletes: they are then sent again, each on a
    // connection of its own.
    let mut after = AdminClient::connect_pipelined(sock).ok();
    let questions = allocs
        .iter()
        .map(|a| AdminRequest::LastKill { id: a.id.clone() });
    let deletes = allocs
        .iter()
        .map(|a| AdminRequest::Delete { id: a.id.clone() });
    let mut sent = questions.chain(deletes);
    if let Some(admin) = after.as_mut()
        && (sent.any(|req| admin.send(&req).is_err()) || !say_kills(admin, &allocs))
    {
        after = None;
    }
    for id in allocs.iter().map(|a| &a.id) {
        let deleted = match after.as_mut() {
            Some(admin) => admin.recv().and_then(|reply| match reply {
                AdminReply::Deleted => Ok(()),
                other => Err(ClientError::Unexpected(format!("{other:?}"))),
            }),
            None => AdminClient::connect(sock).and_then(|mut a| a.delete(id)),
        };
        if deleted.is_err() && !matches!(deleted, Err(ClientError::Admin { .. })) {
            // The connection broke (or answered out of turn): the next delete starts from a
            // fresh one. An arbiter that refused this delete answered it, and the next delete,
            // already sent on it, is answered there too.
            after = None;
        }
        if let Err(e) = &deleted {
            eprintln!(
                "tessera run: could not delete allocation {id}: {e}; it stays until deleted \
                 (see `tessera status`)"
            );
        }
    }
    let status = match status? {
        Ok(status) => status,
        Err(e) => {
            return Ok(crate::spawn::not_started(
                "tessera run",
                &args.command[0],
                &e,
            ));
        }
    };
    Ok(match status.code() {
        Some(c) => c as u8,
        None => 128u8.wrapping_add(status.signal().unwrap_or(0) as u8),
    })
}

/// Deletes allocations `ids` that no command will use (the interposer check failed, or the
/// command could not be started), on `admin`; says on stderr what could not be deleted.
fn delete_unused(admin: &mut AdminClient, ids: &[String]) {
    for id in ids {
        if let Err(d) = admin.delete(id) {
            eprintln!("tessera run: could not delete allocation {id}: {d}");
        }
    }
}

/// The allocations a create's reply names (none for any other reply).
fn created_ids(reply: &AdminReply) -> Vec<String> {
    match reply {
        AdminReply::Created { allocation, .. } => vec![allocation.id.clone()],
        AdminReply::CreatedGroup { allocations, .. } => {
            allocations.iter().map(|a| a.id.clone()).collect()
        }
        _ => Vec::new(),
    }
}

/// Says on stderr which process of `allocs` the backstop killed and why, as the arbiter
/// recorded it (an exit status of 137 alone does not say who sent the SIGKILL, or why): reads
/// the answers to the `LastKill` questions sent for them, in order. True when the arbiter
/// answered every question (the connection can serve more).
fn say_kills(admin: &mut AdminClient, allocs: &[tessera_protocol::AllocationStatus]) -> bool {
    for a in allocs {
        let answer = admin.recv().and_then(|reply| match reply {
            AdminReply::LastKill(k) => Ok(k),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        });
        match answer {
            Ok(Some(k)) => eprintln!(
                "tessera: the backstop killed pid {} of allocation {}: {}",
                k.pid, a.id, k.reason
            ),
            Ok(None) => {}
            // An older arbiter does not know the question and hangs up: nothing to say.
            Err(tessera_protocol::client::ClientError::Frame(_)) => return false,
            Err(e) => {
                eprintln!(
                    "tessera run: could not ask the arbiter whether allocation {} was enforced: {e}",
                    a.id
                );
                return false;
            }
        }
    }
    true
}

/// The command, with the interposer preloaded and the allocation's token, socket and GPUs in
/// its environment (and the admin socket's variable removed).
fn command(args: &RunArgs, interposer: &Path, token: &str, visible_devices: &str) -> Command {
    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .env(
            "LD_PRELOAD",
            ld_preload(interposer, std::env::var_os("LD_PRELOAD")),
        )
        .env(node::ENV_SOCKET, &args.socket)
        .env(node::ENV_TOKEN, token)
        .env("CUDA_VISIBLE_DEVICES", visible_devices)
        .env_remove(node::ENV_ADMIN_SOCKET);
    cmd
}

/// Runs the command; the inner error is a command that could not be started (its exit code
/// is the shell's, see [`crate::spawn`]).
fn run_command(
    args: &RunArgs,
    interposer: &Path,
    token: &str,
    visible_devices: &str,
) -> anyhow::Result<Result<std::process::ExitStatus, std::io::Error>> {
    install_forwarding()?;
    let mut child = match command(args, interposer, token, visible_devices).spawn() {
        Ok(c) => c,
        Err(e) => return Ok(Err(e)),
    };
    CHILD.store(child.id() as i32, Ordering::SeqCst);
    let early = EARLY_SIGNAL.swap(0, Ordering::SeqCst);
    if early != 0 {
        // SAFETY: kill has no memory preconditions; the child is not reaped yet.
        unsafe { libc::kill(child.id() as i32, early) };
    }
    let status = child.wait();
    CHILD.store(0, Ordering::SeqCst);
    reap_leftovers();
    Ok(Ok(status?))
}

/// Waits for every process the command left behind (reparented to this subreaper): the
/// allocation lives as long as its processes.
fn reap_leftovers() {
    loop {
        let mut st = 0;
        // SAFETY: waitpid with a valid status pointer; -1 waits for any child of ours.
        let r = unsafe { libc::waitpid(-1, &mut st, 0) };
        if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_selector_and_preload() {
        assert_eq!(parse_gpu("1"), GpuSelector::Index(1));
        assert_eq!(parse_gpu("GPU-ab"), GpuSelector::Uuid("GPU-ab".into()));
        assert_eq!(parse_gpu_arg(" 2 "), Ok(GpuSelector::Index(2)));
        assert!(
            parse_gpu_arg("-1")
                .unwrap_err()
                .contains("-1 is not a GPU index")
        );
        assert!(parse_gpu_arg("99999999999").is_err());
        assert!(parse_gpu_arg("").is_err());
        let p = Path::new("/opt/t/libtessera_interpose.so");
        assert_eq!(ld_preload(p, None), "/opt/t/libtessera_interpose.so");
        assert_eq!(
            ld_preload(p, Some("".into())),
            "/opt/t/libtessera_interpose.so"
        );
        assert_eq!(
            ld_preload(p, Some("/x/libfoo.so".into())),
            "/opt/t/libtessera_interpose.so:/x/libfoo.so"
        );
    }
}
