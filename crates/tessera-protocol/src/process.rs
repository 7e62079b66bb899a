//! Naming a process so that a recycled pid is not mistaken for it: its pid and its start time
//! (field 22 of `/proc/<pid>/stat`, clock ticks after boot), which a later process with the same
//! pid does not share. Used for allocation owners ([`crate::ProcessOwner`]).

use std::path::Path;

use crate::ProcessOwner;

/// The start time of `pid` read under `proc` (normally `/proc`), if it is listed there (an
/// exited process nobody waited for yet included).
pub fn start_time(proc: &Path, pid: i32) -> Option<u64> {
    stat_of(proc, pid).map(|(_, start)| start)
}

/// Whether `pid` under `proc` has not exited (its state is not `Z`, `X` or `x`), and its start
/// time: fields 3 and 22 of its `stat`.
fn stat_of(proc: &Path, pid: i32) -> Option<(bool, u64)> {
    let text = read_proc_file(&proc.join(format!("{pid}/stat"))).ok()?;
    let mut fields = stat_fields(&text)?;
    let running = !matches!(fields.next()?, "Z" | "X" | "x");
    // Field 22 is the 19th after field 3.
    Some((running, fields.nth(18)?.parse().ok()?))
}

/// Reads a small `/proc` file (`stat`, `cgroup`, `status`) as text in as few system calls as
/// it takes: one `read` into a page-sized buffer, more only for a longer file.
///
/// Why not `std::fs::read_to_string`: a `/proc` file reports size 0, so the standard library
/// asks for its metadata and then probes with 32-byte reads, doubling: six system calls for a
/// 350-byte `stat`, on the path of every tenant connection's handshake (three such files).
pub fn read_proc_file(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 4096];
    let mut len = 0;
    loop {
        if len == buf.len() {
            buf.resize(len * 2, 0);
        }
        match file.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(len);
    String::from_utf8(buf).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// The fields of a `/proc/<pid>/stat` text from field 3 (the state) on. The command (field 2)
/// may hold spaces and parentheses: the fields resume after the last `)`.
pub fn stat_fields(stat: &str) -> Option<std::str::SplitWhitespace<'_>> {
    Some(stat[stat.rfind(')')? + 1..].split_whitespace())
}

/// The calling process.
pub fn this_process() -> Option<ProcessOwner> {
    let pid = std::process::id() as i32;
    Some(ProcessOwner {
        pid,
        start_time: start_time(Path::new("/proc"), pid)?,
    })
}

/// Whether `p` still runs: same pid, same start time, and not exited. A process that has
/// exited stays in `/proc` as a zombie (state `Z`, or `X` while it goes) until its parent waits
/// for it, which may be never soon: it runs nothing and holds no device file, so it is gone for
/// every rule here (an owned allocation's reaper looked at an exited `tessera run --exec`'s
/// command, found its zombie, and kept the allocation a tick longer than the command).
pub fn alive(proc: &Path, p: ProcessOwner) -> bool {
    stat_of(proc, p.pid) == Some((true, p.start_time))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proc_file_is_read_whole_however_long_and_bad_text_is_an_error() {
        let status = read_proc_file(Path::new("/proc/self/status")).unwrap();
        let pid_line = format!("\nPid:\t{}\n", std::process::id());
        assert!(status.contains(&pid_line), "{status}");
        // Longer than the first buffer: every byte comes back, in order.
        let dir = tempfile::tempdir().unwrap();
        let long: String = (0..3_000).map(|i| format!("{i} ")).collect();
        assert!(long.len() > 3 * 4096);
        std::fs::write(dir.path().join("long"), &long).unwrap();
        assert_eq!(read_proc_file(&dir.path().join("long")).unwrap(), long);
        std::fs::write(dir.path().join("bad"), [0x66, 0xff, 0x66]).unwrap();
        let err = read_proc_file(&dir.path().join("bad")).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        let gone = read_proc_file(&dir.path().join("absent")).unwrap_err();
        assert_eq!(gone.kind(), std::io::ErrorKind::NotFound);
    }

    #[test]
    fn start_time_is_field_22_even_with_a_command_holding_parentheses() {
        let dir = std::env::temp_dir().join(format!("tessera-stat-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("7")).unwrap();
        let fields: Vec<String> = (3..=25).map(|f| f.to_string()).collect();
        let stat = format!("7 (a) b (c)) {}\n", fields.join(" "));
        std::fs::write(dir.join("7/stat"), stat).unwrap();
        assert_eq!(start_time(&dir, 7), Some(22));
        assert_eq!(start_time(&dir, 8), None);
        std::fs::remove_dir_all(&dir).unwrap();
        // This process: alive as itself, not under another start time.
        let me = this_process().unwrap();
        assert!(alive(Path::new("/proc"), me));
        let later = ProcessOwner {
            start_time: me.start_time + 1,
            ..me
        };
        assert!(!alive(Path::new("/proc"), later));
    }

    /// A child that has exited but that nobody waited for yet (a zombie) is not alive, though
    /// its pid and start time are still in `/proc`.
    #[test]
    fn an_exited_process_is_not_alive_before_its_parent_waits() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let proc = Path::new("/proc");
        let stat = |pid: i32| std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let state = |text: &str| stat_fields(text).unwrap().next().unwrap().to_owned();
        let owner = ProcessOwner {
            pid,
            start_time: start_time(proc, pid).unwrap(),
        };
        let started = std::time::Instant::now();
        while state(&stat(pid)) != "Z" {
            assert!(
                started.elapsed() < std::time::Duration::from_secs(10),
                "never exited"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(
            start_time(proc, pid),
            Some(owner.start_time),
            "still listed"
        );
        assert!(!alive(proc, owner));
        child.wait().unwrap();
        assert!(!alive(proc, owner));
    }
}
