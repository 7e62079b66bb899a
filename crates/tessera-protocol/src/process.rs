//! Naming a process so that a recycled pid is not mistaken for it: its pid and its start time
//! (field 22 of `/proc/<pid>/stat`, clock ticks after boot), which a later process with the same
//! pid does not share. Used for allocation owners ([`crate::ProcessOwner`]).

use std::path::Path;

use crate::ProcessOwner;

/// The start time of `pid` read under `proc` (normally `/proc`), if it runs.
pub fn start_time(proc: &Path, pid: i32) -> Option<u64> {
    let text = std::fs::read_to_string(proc.join(format!("{pid}/stat"))).ok()?;
    // Field 22 is the 20th from field 3.
    stat_fields(&text)?.nth(19)?.parse().ok()
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

/// Whether `p` still runs (same pid, same start time).
pub fn alive(proc: &Path, p: ProcessOwner) -> bool {
    start_time(proc, p.pid) == Some(p.start_time)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
