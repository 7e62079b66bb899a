//! A shared workstation without root: the real arbiter with a user socket (`--users-group`,
//! per-user quotas), and `tessera` run as two users (numeric uids, no system accounts: the
//! tests run as root and drop to them with `setpriv`). Each user's job runs as that user
//! within their quota; neither can delete, relabel or read the kill records or the token of
//! the other's allocation.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use crate::run_support::{GIB, interposer_in, tessera};
use tessera_testkit::{ArbiterSpec, FirstLine, RunningArbiter, SimGpu, artifact, spawn_first_line};

/// The users group, and two users in it (numbers no system account uses).
const GROUP: u32 = 61000;
const ALICE: u32 = 61001;
const BOB: u32 = 61002;
/// A user outside the group.
const EVE: u32 = 61003;

struct Bed {
    dir: tempfile::TempDir,
    arb: RunningArbiter,
    user_socket: PathBuf,
    interposer: PathBuf,
}

fn open_to_all(p: &Path) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

impl Bed {
    /// Every user may hold 4 GiB and 50 shares per GPU; Bob only 1 GiB.
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        // The users reach the sockets and the interposer through it.
        open_to_all(dir.path());
        let users = dir.path().join("users");
        std::fs::create_dir(&users).unwrap();
        open_to_all(&users);
        let user_socket = users.join("user.sock");
        let sim = SimGpu::prepare(&dir.path().join("sim"), "2x80GiB");
        let spec = ArbiterSpec::in_dir(artifact("tessera-arbiter"), dir.path(), sim)
            .log_to(dir.path().join("arbiter.log"));
        let mut cmd = spec.command();
        cmd.args(["--users-group", &GROUP.to_string(), "--user-socket"])
            .arg(&user_socket)
            .args(["--user-quota", "memory=4GiB,shares=50"])
            .args(["--user-quota-for", &format!("{BOB}:memory=1GiB")]);
        let arb = spec.start_command(cmd);
        tessera_testkit::wait_until(Duration::from_secs(20), || user_socket.exists())
            .unwrap_or_else(|| panic!("no user socket\n{}", arb.log_text()));
        let interposer = interposer_in(dir.path());
        Self {
            dir,
            arb,
            user_socket,
            interposer,
        }
    }

    /// `program args` as `uid` (in the users group unless it is [`EVE`]), aimed at this
    /// arbiter's user socket.
    fn as_user(&self, uid: u32, program: &Path, args: &[&str]) -> Command {
        let groups = if uid == EVE {
            uid.to_string()
        } else {
            GROUP.to_string()
        };
        let mut c = Command::new("setpriv");
        c.args(["--reuid", &uid.to_string(), "--regid", &uid.to_string()])
            .args(["--groups", &groups, "--"])
            .arg(program)
            .args(args)
            .env("TESSERA_USER_SOCKET", &self.user_socket)
            .env("TESSERA_SOCKET", &self.arb.socket)
            .env_remove("TESSERA_ADMIN_SOCKET")
            .env_remove("TESSERA_INTERPOSER")
            .env_remove("LD_PRELOAD")
            .current_dir(self.dir.path())
            .stdin(Stdio::null());
        c
    }

    /// `tessera args` as `uid`.
    fn tessera(&self, uid: u32, args: &[&str]) -> Command {
        self.as_user(uid, &tessera(), args)
    }

    /// One admin request as `uid` on the user socket (`tessera-admin-call`).
    fn call(&self, uid: u32, args: &[&str]) -> Output {
        let mut all = vec![self.user_socket.to_str().unwrap()];
        all.extend_from_slice(args);
        self.as_user(uid, &artifact("tessera-admin-call"), &all)
            .output()
            .unwrap()
    }

    /// `tessera run --memory <memory> -- <script>` as `uid`.
    fn run(&self, uid: u32, memory: &str, script: &str) -> Command {
        self.tessera(
            uid,
            &[
                "run",
                "--memory",
                memory,
                "--interposer",
                self.interposer.to_str().unwrap(),
                "--",
                "sh",
                "-c",
                script,
            ],
        )
    }
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The `key=value` word of `line`.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

#[test]
fn two_users_each_within_their_quota_and_neither_touches_the_others() {
    let bed = Bed::start();
    // Alice's job runs as Alice, holding her allocation until its stdin closes.
    let FirstLine {
        mut child,
        stdin,
        line,
    } = spawn_first_line(
        bed.run(
            ALICE,
            "3GiB",
            r#"echo "uid=$(id -u) pid=$$ token=$TESSERA_TOKEN"; read x || true"#,
        )
        .stdin(Stdio::piped()),
    );
    assert_eq!(field(&line, "uid"), ALICE.to_string(), "{line}");
    let job_pid = field(&line, "pid").to_owned();
    let token = field(&line, "token").to_owned();
    assert_eq!(token.len(), 64, "{line}");
    let mine: Vec<_> = bed
        .arb
        .admin()
        .list()
        .unwrap()
        .into_iter()
        .filter(|a| a.owner_uid == Some(ALICE))
        .collect();
    assert_eq!(mine.len(), 1, "{mine:?}");
    let id = mine[0].id.clone();
    assert_eq!(mine[0].memory_limit, 3 * GIB);

    // Within her quota of 4 GiB another 1 GiB fits, 2 GiB does not.
    let o = bed.run(ALICE, "2GiB", "true").output().unwrap();
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("over uid 61001's quota"),
        "{}",
        text(&o)
    );
    let o = bed.run(ALICE, "1GiB", "id -u").output().unwrap();
    assert!(o.status.success(), "{}", text(&o));

    // Bob runs as Bob within his own quota (1 GiB), not past it.
    let o = bed.run(BOB, "512MiB", "id -u").output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), BOB.to_string());
    let o = bed.run(BOB, "2GiB", "true").output().unwrap();
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("over uid 61002's quota"),
        "{}",
        text(&o)
    );

    // Bob sees Alice's allocation and who owns it, never its token...
    let o = bed.tessera(BOB, &["status", "--json"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let status = String::from_utf8_lossy(&o.stdout);
    assert!(
        status.contains(&id) && status.contains("\"owner_uid\": 61001"),
        "{status}"
    );
    assert!(!status.contains(&token), "{status}");
    let o = bed.tessera(BOB, &["status"]).output().unwrap();
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("owner 61001 (uid 61001)"),
        "{}",
        text(&o)
    );
    // ...and cannot read it from her job's environment.
    let o = bed
        .as_user(
            BOB,
            Path::new("cat"),
            &[&format!("/proc/{job_pid}/environ")],
        )
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert!(!String::from_utf8_lossy(&o.stdout).contains(&token));

    // Bob cannot delete, relabel or read the kill records of Alice's allocation.
    let o = bed.tessera(BOB, &["delete", &id]).output().unwrap();
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("belongs to uid 61001, not to uid 61002"),
        "{}",
        text(&o)
    );
    for op in [
        vec!["update-labels", &id, "note=bob"],
        vec!["last-kill", &id],
        vec!["delete", &id],
    ] {
        let o = bed.call(BOB, &op);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            !o.status.success() && out.contains("PermissionDenied") && out.contains("uid 61001"),
            "{op:?}: {}",
            text(&o)
        );
    }
    // Alice may relabel her own; a reserved label is the operator's.
    assert!(
        bed.call(ALICE, &["update-labels", &id, "note=alice"])
            .status
            .success()
    );
    let o = bed.call(ALICE, &["update-labels", &id, "tessera.dev/whole-group=x"]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(bed.arb.admin().list().unwrap().iter().any(|a| a.id == id));

    // Someone outside the group cannot even connect (the socket is 0660, group 61000).
    let o = bed.tessera(EVE, &["status"]).output().unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--users-group"),
        "{}",
        text(&o)
    );

    // Alice's job ends; her allocation goes with it.
    drop(stdin);
    let st = tessera_testkit::process::wait_exit(&mut child, Duration::from_secs(20))
        .expect("Alice's run ends");
    assert!(st.success(), "{st:?}");
    assert!(bed.arb.admin().list().unwrap().is_empty());
    // The log says who did what; a user over their quota is no warning.
    let log = bed.arb.log_text();
    assert!(log.contains("uid 61001"), "{log}");
    assert!(
        !log.lines()
            .any(|l| l.contains("WARN") && l.contains("quota")),
        "{log}"
    );
}

/// The user socket refuses a peer outside the group even when the file's mode lets it in:
/// the kernel's credentials decide, not the file alone.
#[test]
fn a_peer_outside_the_group_is_refused_by_the_arbiter_too() {
    let bed = Bed::start();
    std::fs::set_permissions(&bed.user_socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let o = bed.call(EVE, &["list"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        !o.status.success() && out.contains("not in the arbiter's users group"),
        "{}",
        text(&o)
    );
    assert!(bed.call(ALICE, &["list"]).status.success());
}
