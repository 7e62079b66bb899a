//! `docs/cli.md`'s flag table is what the binaries' `--help` says: every flag of every binary
//! (and `tessera` subcommand) is in it with that binary, its value placeholder and its default,
//! and every row names only flags the binaries have. Old names a row lists still parse.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_testkit::artifact;

/// The programs the table covers: a name as the table writes it, and how to run it.
fn programs() -> Vec<(String, PathBuf, Vec<&'static str>)> {
    let tessera = PathBuf::from(env!("CARGO_BIN_EXE_tessera"));
    let mut out: Vec<(String, PathBuf, Vec<&str>)> =
        ["tessera-arbiter", "tessera-device-plugin", "tessera-dra"]
            .into_iter()
            .map(|b| (b.to_string(), artifact(b), vec![]))
            .collect();
    for sub in ["run", "sim", "status", "delete", "doctor"] {
        out.push((format!("tessera {sub}"), tessera.clone(), vec![sub]));
    }
    out
}

/// What one flag's help says: its placeholder (`PATH`, empty for a switch) and its default
/// (`-` when it has none), backticks dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Flag {
    value: String,
    default: String,
}

fn unquote(s: &str) -> String {
    s.replace('`', "").trim().to_string()
}

/// Every option of a `--help` text but `--help` and `--version`.
fn help_flags(help: &str) -> BTreeMap<String, Flag> {
    let mut blocks: Vec<(String, String, String)> = Vec::new();
    let mut in_block = false;
    for line in help.lines() {
        let t = line.trim_start();
        let indented = line.len() > t.len();
        let flag_start = t
            .strip_prefix("-h, ")
            .or(t.strip_prefix("-V, "))
            .unwrap_or(t);
        if indented && flag_start.starts_with("--") {
            let name: String = flag_start
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            let rest = &flag_start[name.len()..];
            let value = rest
                .strip_prefix(' ')
                .map(|r| r.trim_start_matches('['))
                .and_then(|r| r.strip_prefix('<'))
                .and_then(|r| r.split_once('>'))
                .map(|(v, _)| v.to_string())
                .unwrap_or_default();
            blocks.push((name, value, line.to_string()));
            in_block = true;
        } else if in_block && (indented || t.is_empty()) {
            let b = blocks.last_mut().unwrap();
            b.2.push('\n');
            b.2.push_str(line);
        } else {
            in_block = false;
        }
    }
    blocks
        .into_iter()
        .filter(|(n, _, _)| n != "--help" && n != "--version")
        .map(|(name, value, text)| {
            let default = ["[default: ", "(default: "]
                .iter()
                .find_map(|open| {
                    let close = if open.starts_with('[') { ']' } else { ')' };
                    let (_, after) = text.split_once(open)?;
                    after.split_once(close).map(|(d, _)| unquote(d))
                })
                .unwrap_or_else(|| "-".into());
            (name, Flag { value, default })
        })
        .collect()
}

/// The cells of a Markdown table row, `\|` unescaped.
fn cells(row: &str) -> Vec<String> {
    let inner = row.trim().trim_start_matches('|').trim_end_matches('|');
    let mut out = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                out.last_mut().unwrap().push('|');
                chars.next();
            }
            '|' => out.push(String::new()),
            c => out.last_mut().unwrap().push(c),
        }
    }
    out.iter().map(|c| c.trim().to_string()).collect()
}

struct Row {
    flag: String,
    programs: Vec<String>,
    flag_info: Flag,
    meaning: String,
}

fn table() -> Vec<Row> {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/cli.md"))
            .unwrap();
    doc.lines()
        .filter(|l| l.starts_with("| `--"))
        .map(|l| {
            let c = cells(l);
            assert_eq!(c.len(), 5, "five columns: {l}");
            let value = unquote(&c[2]);
            Row {
                flag: unquote(&c[0]),
                programs: c[1].split(',').map(unquote).collect(),
                flag_info: Flag {
                    value: if value == "-" { String::new() } else { value },
                    default: unquote(&c[3]),
                },
                meaning: c[4].clone(),
            }
        })
        .collect()
}

#[test]
fn the_flag_table_in_docs_matches_every_binarys_help() {
    let rows = table();
    let mut documented: BTreeMap<(String, String), Flag> = BTreeMap::new();
    for r in &rows {
        for p in &r.programs {
            let before = documented.insert((p.clone(), r.flag.clone()), r.flag_info.clone());
            assert!(before.is_none(), "{} twice for {p}", r.flag);
        }
    }
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for (name, exe, args) in programs() {
        let out = Command::new(&exe)
            .args(&args)
            .arg("--help")
            .output()
            .unwrap();
        assert!(out.status.success(), "{name} --help");
        for (flag, got) in help_flags(&String::from_utf8_lossy(&out.stdout)) {
            seen.insert((name.clone(), flag.clone()));
            match documented.get(&(name.clone(), flag.clone())) {
                None => problems.push(format!("{name} {flag} is not in docs/cli.md: {got:?}")),
                Some(want) if want != &got => {
                    problems.push(format!("{name} {flag}: docs say {want:?}, --help {got:?}"))
                }
                Some(_) => {}
            }
        }
    }
    for key in documented.keys() {
        if !seen.contains(key) {
            problems.push(format!(
                "docs/cli.md lists {} for {}, which has no such flag",
                key.1, key.0
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn old_flag_names_in_the_table_still_parse() {
    // "old name `--socket`" in a row: each of its programs accepts it (clap checks every flag
    // before it acts on --help, so an unknown one exits 2).
    let by_name: BTreeMap<String, (PathBuf, Vec<&str>)> = programs()
        .into_iter()
        .map(|(n, exe, args)| (n, (exe, args)))
        .collect();
    let mut checked = 0;
    for r in table() {
        let Some((_, rest)) = r.meaning.split_once("old name `") else {
            continue;
        };
        let old = rest.split('`').next().unwrap();
        // A value the flag accepts: its default where that is one word, else a path.
        let d = &r.flag_info.default;
        let value = if d != "-" && !d.contains(' ') {
            d.as_str()
        } else {
            "/tmp/x"
        };
        for p in &r.programs {
            let (exe, args) = &by_name[p];
            let out = Command::new(exe)
                .args(args)
                .args([old, value, "--help"])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{p} {old}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 4,
        "the tenant socket's old name is listed: {checked}"
    );
}
