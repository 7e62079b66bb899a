//! The Grafana dashboard `deploy/grafana/tessera.json` parses, has the panels the README
//! describes, and every PromQL expression in it (panel targets and template variables) names
//! only metrics that docs/metrics.md documents. The metric names are pulled out of each
//! expression by a small PromQL scanner (strings, label matchers, ranges, grouping clauses and
//! function names removed), tested on its own below.

use std::collections::BTreeSet;

use serde_json::Value;

/// Removes everything between `open` and its matching `close` (nesting counted), keeping the
/// delimiters, so `f{a="b"}` becomes `f{}`.
fn strip_between(text: &str, open: char, close: char) -> String {
    let mut out = String::new();
    let mut depth = 0usize;
    for c in text.chars() {
        if c == close && depth > 0 {
            depth -= 1;
        }
        if depth == 0 {
            out.push(c);
        }
        if c == open {
            depth += 1;
        }
    }
    out
}

/// Removes string literals (label values, regexes), which may hold anything.
fn strip_strings(text: &str) -> String {
    let mut out = String::new();
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for c in text.chars() {
        match quote {
            Some(q) => {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == q {
                    quote = None;
                    out.push(c);
                }
            }
            None => {
                out.push(c);
                if matches!(c, '"' | '\'' | '`') {
                    quote = Some(c);
                }
            }
        }
    }
    out
}

const KEYWORDS: [&str; 13] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
];

/// Aggregation operators, which may come before their `by (...)` clause rather than a `(`.
const AGGREGATIONS: [&str; 12] = [
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
];

/// The metric names a PromQL expression reads.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let text = strip_strings(expr);
    let text = strip_between(&text, '{', '}');
    let text = strip_between(&text, '[', ']');
    let chars: Vec<char> = text.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    // The label list after by/without/on/ignoring/group_*: skipped as a whole.
    let mut skip_group = false;
    while i < chars.len() {
        let c = chars[i];
        let starts_ident = c.is_ascii_alphabetic() || c == '_' || c == ':';
        if !starts_ident {
            if c == '(' && skip_group {
                let mut depth = 0;
                while i < chars.len() {
                    match chars[i] {
                        '(' => depth += 1,
                        ')' => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                    i += 1;
                }
                skip_group = false;
            } else if !c.is_whitespace() {
                skip_group = false;
            }
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '_' | ':'))
        {
            i += 1;
        }
        let word: String = chars[start..i].iter().collect();
        let before = start.checked_sub(1).map(|j| chars[j]);
        // `$var`, and the exponent or suffix of a number (`1e3`), are not names.
        if matches!(before, Some(b) if b == '$' || b.is_ascii_digit() || b == '.') {
            continue;
        }
        let lower = word.to_ascii_lowercase();
        if KEYWORDS.contains(&lower.as_str()) {
            skip_group = matches!(
                lower.as_str(),
                "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
            );
            continue;
        }
        let next = chars[i..].iter().find(|c| !c.is_whitespace());
        if next == Some(&'(') || AGGREGATIONS.contains(&lower.as_str()) {
            continue; // a function or an aggregation
        }
        names.insert(word);
    }
    names
}

/// Every PromQL text in the dashboard: panel target `expr`s, and the selectors of template
/// variables (`label_values(<selector>, <label>)` reads the selector's metric only).
fn expressions(dash: &Value) -> Vec<String> {
    let mut out = Vec::new();
    fn panels<'a>(v: &'a Value, acc: &mut Vec<&'a Value>) {
        for p in v.as_array().into_iter().flatten() {
            acc.push(p);
            panels(&p["panels"], acc);
        }
    }
    let mut all = Vec::new();
    panels(&dash["panels"], &mut all);
    for p in all {
        for t in p["targets"].as_array().into_iter().flatten() {
            let e = t["expr"].as_str().expect("every target has an expr");
            out.push(e.to_owned());
        }
    }
    for var in dash["templating"]["list"].as_array().into_iter().flatten() {
        if var["type"] != "query" {
            continue;
        }
        let q = var["query"]["query"]
            .as_str()
            .or_else(|| var["query"].as_str())
            .expect("a query variable has a query");
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|r| r.strip_suffix(')'))
            .unwrap_or_else(|| panic!("unexpected variable query {q:?}"));
        let selector = inner.rsplit_once(',').map_or(inner, |(s, _)| s);
        out.push(selector.trim().to_owned());
    }
    out
}

/// Whether `doc` mentions `name` as a whole word.
fn documents(doc: &str, name: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    doc.match_indices(name).any(|(at, _)| {
        let before = doc[..at].chars().next_back();
        let after = doc[at + name.len()..].chars().next();
        !before.is_some_and(ident) && !after.is_some_and(ident)
    })
}

#[test]
fn the_scanner_finds_metric_names_only() {
    let e = r#"sum by (namespace, pod) (rate(tessera_a_seconds_total{pod=~"x.*", gpu="0"}[$__rate_interval])) / on (pod) group_left (container) tessera_b_ratio * 1e3 > bool 0.5"#;
    let got: Vec<String> = metric_names(e).into_iter().collect();
    assert_eq!(got, ["tessera_a_seconds_total", "tessera_b_ratio"]);
    assert_eq!(
        metric_names("increase(x_total[5m] offset 1h) or y").len(),
        2
    );
    assert!(metric_names(r#"vector(1)"#).is_empty());
    assert!(documents(
        "| `tessera_a_total` | counter |",
        "tessera_a_total"
    ));
    assert!(!documents("tessera_a_total_x", "tessera_a_total"));
    assert!(!documents("x_tessera_a_total", "tessera_a_total"));
}

#[test]
fn dashboard_parses_and_names_only_documented_metrics() {
    let text = std::fs::read_to_string(crate::repo().join("deploy/grafana/tessera.json")).unwrap();
    let dash: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    assert!(dash["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(dash["uid"].as_str().is_some_and(|u| !u.is_empty()));
    let doc = std::fs::read_to_string(crate::repo().join("docs/metrics.md")).unwrap();

    let exprs = expressions(&dash);
    assert!(exprs.len() >= 10, "{exprs:?}");
    let mut used = BTreeSet::new();
    for e in &exprs {
        let names = metric_names(e);
        assert!(!names.is_empty(), "no metric in {e:?}");
        for n in names {
            assert!(
                n.starts_with("tessera_"),
                "{n} (in {e:?}) is not a Tessera metric"
            );
            assert!(
                documents(&doc, &n),
                "{n} (in {e:?}) is not in docs/metrics.md"
            );
            used.insert(n);
        }
    }
    // The panels the issue asks for: per pod memory used vs limit, GPU time vs share,
    // throttled time, OOM refusals; per GPU promised vs total.
    for needed in [
        "tessera_allocation_memory_used_bytes",
        "tessera_allocation_memory_limit_bytes",
        "tessera_allocation_gpu_seconds_total",
        "tessera_allocation_share_ratio",
        "tessera_allocation_throttled_seconds_total",
        "tessera_allocation_oom_refusals_total",
        "tessera_gpu_memory_promised_bytes",
        "tessera_gpu_memory_total_bytes",
    ] {
        assert!(used.contains(needed), "no panel uses {needed}");
    }
    // Each panel reads through the chosen data source, and ids are unique.
    let mut ids = BTreeSet::new();
    for p in dash["panels"].as_array().unwrap() {
        assert!(ids.insert(p["id"].as_u64().unwrap()), "duplicate panel id");
        if p["type"] != "row" {
            assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        }
    }
}
