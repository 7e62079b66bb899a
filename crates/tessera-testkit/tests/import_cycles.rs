//! No import circles between the modules of any crate of the workspace, and the arbiter's layers
//! point one way.
//!
//! A module graph is read from the source text: one node per top-level module (a folder module
//! such as `launch/` with all its files is one node), one edge per `crate::NAME` path (in `use`
//! lines or written inline) that names another module. Comments are skipped; `$crate::` in
//! macros is not a path of the file it is written in. Any strongly connected set of two or more
//! modules fails the test with one circle through it.
//!
//! It lives in the test kit, the crate for what checks the whole workspace; it reads only files
//! (every member listed in the root `Cargo.toml`), so it runs in every `cargo test`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Module name -> the modules it names.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// The crate-root files, which declare modules rather than use them.
const ROOTS: [&str; 2] = ["lib.rs", "main.rs"];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file below `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a file of `src` belongs to (`None` for the crate root).
fn node_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts = rel.components();
    let first = parts.next()?.as_os_str().to_str()?.to_owned();
    if parts.next().is_some() {
        return Some(first); // a file inside a folder module
    }
    if ROOTS.contains(&first.as_str()) {
        return None;
    }
    first.strip_suffix(".rs").map(str::to_owned)
}

/// `line` without its `//` comment; a `//` inside a string literal is kept.
fn strip_comment(line: &str) -> &str {
    let bytes = line.as_bytes();
    let mut in_str = false;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if in_str => i += 1,
            b'"' => in_str = !in_str,
            b'/' if !in_str && bytes.get(i + 1) == Some(&b'/') => return &line[..i],
            _ => {}
        }
        i += 1;
    }
    line
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first segment of every `crate::` path in `code`, including each item of a
/// `crate::{a, b::c}` group.
fn crate_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        let after = &rest[at + "crate::".len()..];
        rest = after;
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        if let Some(group) = after.strip_prefix('{') {
            let body = &group[..group.find('}').unwrap_or(group.len())];
            let mut depth = 0;
            let mut start = 0;
            for (i, c) in body.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(ident_at(body[start..i].trim()).to_owned());
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            out.push(ident_at(body[start..].trim()).to_owned());
        } else {
            out.push(ident_at(after).to_owned());
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

/// The module graph of the crate whose sources are in `src`.
fn module_graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph = Graph::new();
    for f in &files {
        if let Some(n) = node_of(src, f) {
            graph.entry(n).or_default();
        }
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for f in &files {
        let Some(from) = node_of(src, f) else {
            continue;
        };
        let text = fs::read_to_string(f).unwrap();
        for line in text.lines() {
            for to in crate_paths(strip_comment(line)) {
                if to != from && modules.contains(&to) {
                    graph.get_mut(&from).unwrap().insert(to);
                }
            }
        }
    }
    graph
}

/// One circle through each strongly connected set of two or more modules (Tarjan).
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    struct Tarjan<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        sets: Vec<Vec<&'a str>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in &self.graph[v] {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut set = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    set.push(w);
                    if w == v {
                        break;
                    }
                }
                if set.len() > 1 {
                    self.sets.push(set);
                }
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        sets: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    // Walk inside each set from its smallest name back to itself: a concrete circle to show.
    t.sets
        .iter()
        .map(|set| {
            let inside: BTreeSet<&str> = set.iter().copied().collect();
            let start = *inside.iter().next().unwrap();
            let mut path = vec![start.to_owned()];
            let mut seen = BTreeSet::from([start]);
            let mut at = start;
            loop {
                let next = graph[at]
                    .iter()
                    .map(String::as_str)
                    .filter(|w| inside.contains(w))
                    .find(|w| *w == start || !seen.contains(w))
                    .or_else(|| {
                        graph[at]
                            .iter()
                            .map(String::as_str)
                            .find(|w| inside.contains(w))
                    })
                    .unwrap();
                path.push(next.to_owned());
                if next == start || !seen.insert(next) {
                    break;
                }
                at = next;
            }
            path
        })
        .collect()
}

/// The workspace members named in the root `Cargo.toml`'s `members = [...]`.
fn members() -> Vec<String> {
    let manifest = fs::read_to_string(repo_root().join("Cargo.toml")).unwrap();
    let start = manifest.find("members = [").expect("a members list") + "members = [".len();
    let end = start + manifest[start..].find(']').expect("the list's end");
    manifest[start..end]
        .split(',')
        .map(|m| m.trim().trim_matches('"').to_owned())
        .filter(|m| !m.is_empty())
        .collect()
}

#[test]
fn no_crate_of_the_workspace_has_an_import_circle() {
    let members = members();
    assert!(members.len() >= 16, "too few members read: {members:?}");
    let mut checked = BTreeMap::new();
    let mut circles = Vec::new();
    for m in &members {
        let src = repo_root().join(m).join("src");
        assert!(src.is_dir(), "{m} has no src/");
        let graph = module_graph(&src);
        for c in cycles(&graph) {
            circles.push(format!("{m}: {}", c.join(" -> ")));
        }
        checked.insert(m.as_str(), graph.len());
    }
    // The graph reader found the big crates' modules (a reader that finds none finds no circle).
    for (m, at_least) in [
        ("crates/tessera-arbiter", 15),
        ("interpose", 10),
        ("crates/tessera-sim-cuda", 10),
    ] {
        assert!(checked[m] >= at_least, "{m}: only {} modules", checked[m]);
    }
    assert!(circles.is_empty(), "import circles: {}", circles.join("; "));
}

/// The arbiter's layers, bottom up: pure rules and data, the state that ties them together,
/// the services, the metrics renderer, the wiring. A module may import only from its own layer
/// or those below (and, by the test above, without a circle); a new module must be given a
/// layer here.
const ARBITER_LAYERS: [&[&str]; 5] = [
    &[
        "gpus",
        "ledger",
        "owner",
        "peer",
        "pressure",
        "scheduler",
        "stats",
        "store",
        "wire",
    ],
    &["state"],
    &[
        "admin",
        "admission",
        "backstop",
        "drain",
        "reaper",
        "tenant",
        "users",
    ],
    &["metrics"],
    &["config", "server"],
];

fn layer_violations(graph: &Graph, layers: &[&[&str]]) -> Vec<String> {
    let layer_of = |m: &str| layers.iter().position(|l| l.contains(&m));
    let mut out = Vec::new();
    for (from, tos) in graph {
        let Some(lf) = layer_of(from) else {
            out.push(format!("{from} has no layer"));
            continue;
        };
        for to in tos {
            match layer_of(to) {
                Some(lt) if lt <= lf => {}
                Some(_) => out.push(format!("{from} (layer {lf}) imports {to}, a layer above")),
                None => out.push(format!("{to} has no layer")),
            }
        }
    }
    out
}

#[test]
fn the_arbiter_layers_point_down() {
    let graph = module_graph(&repo_root().join("crates/tessera-arbiter/src"));
    let bad = layer_violations(&graph, &ARBITER_LAYERS);
    assert!(bad.is_empty(), "{}", bad.join("; "));
    // The state in particular imports no service, renderer or wiring.
    assert!(
        graph["state"]
            .iter()
            .all(|m| ARBITER_LAYERS[0].contains(&m.as_str())),
        "state imports {:?}",
        graph["state"]
    );
}

#[test]
fn an_import_from_a_layer_above_is_found() {
    let d = fixture(&[
        ("state.rs", "use crate::metrics::Snapshot;\n"),
        ("metrics.rs", "use crate::state::Arbiter;\n"),
        ("ledger.rs", ""),
        ("extra.rs", "use crate::ledger::X;\n"),
    ]);
    let g = module_graph(&d.0);
    let bad = layer_violations(&g, &[&["ledger"], &["state"], &["metrics"]]);
    assert_eq!(
        bad,
        [
            "extra has no layer".to_owned(),
            "state (layer 1) imports metrics, a layer above".to_owned()
        ]
    );
}

/// Writes `files` (relative path, text) into a fresh folder.
fn fixture(files: &[(&str, &str)]) -> tempfile_free::Dir {
    let dir = tempfile_free::Dir::new();
    for (path, text) in files {
        let p = dir.0.join(path);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }
    dir
}

/// A temporary folder without a dependency: removed on drop.
mod tempfile_free {
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    pub(crate) struct Dir(pub PathBuf);

    impl Dir {
        pub(crate) fn new() -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "tessera-import-cycles-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Self(p)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[test]
fn a_circle_through_a_folder_module_is_found() {
    let d = fixture(&[
        (
            "lib.rs",
            "pub mod a;\npub mod b;\npub mod c;\npub mod launch;\n",
        ),
        ("a.rs", "use crate::b::Thing;\n"),
        ("b.rs", "use crate::{c, ffi::X};\n"),
        ("c.rs", "fn f() { crate::launch::go(); }\n"),
        ("launch/mod.rs", "mod credit;\n"),
        ("launch/credit.rs", "use crate::a;\n"),
    ]);
    let g = module_graph(&d.0);
    assert_eq!(
        g.keys().map(String::as_str).collect::<Vec<_>>(),
        ["a", "b", "c", "launch"]
    );
    let found = cycles(&g);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0], ["a", "b", "c", "launch", "a"]);
}

#[test]
fn comments_macros_and_unknown_names_are_not_edges() {
    let d = fixture(&[
        ("a.rs", "use crate::b;\n"),
        (
            "b.rs",
            "// use crate::a;\n/// see [`crate::a`]\nlet s = \"//\"; $crate::a::f();\nuse crate::tlog;\nuse other_crate::a;\n",
        ),
        ("c.rs", "let url = \"http://x\"; // crate::a\n"),
    ]);
    let g = module_graph(&d.0);
    assert!(cycles(&g).is_empty(), "{g:?}");
    assert_eq!(g["a"], BTreeSet::from(["b".to_owned()]));
    assert!(g["b"].is_empty(), "{g:?}");
    assert!(g["c"].is_empty(), "{g:?}");
}
