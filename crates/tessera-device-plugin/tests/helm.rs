//! The Helm chart (`deploy/helm/tessera`) checked with the real Helm, and every manifest in
//! `deploy/` with the Kubernetes schemas: `.ci/check_deploy.py` lints the chart through Helm
//! v4's library (`helm-sdkpy`), installs it against a fake API server that records what Helm
//! sends, and validates each object with `kubernetes-validate` (strict) for Kubernetes 1.34 and
//! the newest version the package knows. The venv is `.ci/test`'s (`.ci/requirements-deploy.txt`).
//! Each check is also shown to fail on a broken chart.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn chart() -> PathBuf {
    root().join("deploy/helm/tessera")
}

fn check(args: &[&str]) -> (Output, String) {
    let out = Command::new(tessera_testkit::python::python())
        .arg(root().join(".ci/check_deploy.py"))
        .args(args)
        .output()
        .expect("run .ci/check_deploy.py");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

/// A copy of the chart in a temporary folder, with `edit` applied to one of its files.
fn broken_chart(file: &str, edit: impl FnOnce(String) -> String) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join("tessera");
    for entry in walk(&chart()) {
        let rel = entry.strip_prefix(chart()).unwrap();
        let to = dst.join(rel);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(&entry, &to).unwrap();
    }
    let target = dst.join(file);
    let text = std::fs::read_to_string(&target).unwrap();
    let changed = edit(text.clone());
    assert_ne!(changed, text, "the edit changed nothing in {file}");
    std::fs::write(&target, changed).unwrap();
    dir
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn the_chart_lints_renders_and_every_manifest_validates() {
    let (out, text) = check(&["--print"]);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("objects valid"), "{text}");
    assert!(!text.contains("FAILED"), "{text}");
    // What the schemas could not check is said, never counted as passed.
    assert!(
        text.contains("not checked: chart (all features) ServiceMonitor/tessera-node"),
        "{text}"
    );
    // Defaults: only nodes the operator labelled; unknown container processes only reported.
    assert!(text.contains("tessera.dev/enabled: 'true'"), "{text}");
    assert!(!text.contains("nvidia.com/gpu.present"), "{text}");
    assert!(text.contains("--unknown-processes=report"), "{text}");
    assert!(!text.contains("--unknown-processes=kill"), "{text}");
    assert!(text.contains("--enforce=kill"), "{text}");
    // The dashboard ConfigMap and the ServiceMonitor come with the values that ask for them.
    assert!(
        text.contains("chart (all features) ConfigMap/tessera-grafana-dashboard"),
        "{text}"
    );
    assert!(
        !text.contains("chart (defaults) ServiceMonitor"),
        "the ServiceMonitor needs the operator's CRD: off by default\n{text}"
    );
}

#[test]
fn the_charts_dashboard_is_the_shipped_one() {
    // A chart cannot read files outside itself, so it carries a copy.
    let shipped = std::fs::read(root().join("deploy/grafana/tessera.json")).unwrap();
    let copy = std::fs::read(chart().join("dashboards/tessera.json")).unwrap();
    assert!(
        shipped == copy,
        "deploy/helm/tessera/dashboards/tessera.json differs from deploy/grafana/tessera.json: \
         copy it again"
    );
}

#[test]
fn killing_unknown_processes_is_an_opt_in_value() {
    let (out, text) = check(&["--print", "--set", "arbiter.unknownProcesses=\"kill\""]);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("--unknown-processes=kill"), "{text}");
    let (out, text) = check(&["--set", "arbiter.unknownProcesses=\"always\""]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("arbiter.unknownProcesses must be kill, report or ignore"),
        "{text}"
    );
}

#[test]
fn the_dra_switch_refuses_and_points_at_the_dra_manifests() {
    let (out, text) = check(&["--set", "dra.enabled=true"]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("install deploy/dra/"), "{text}");
}

#[test]
fn a_misspelled_field_in_the_chart_fails_the_schema_check() {
    let dir = broken_chart("templates/daemonset.yaml", |t| {
        t.replace(
            "      hostPID: true",
            "      hostPID: true\n      hostPIDD: true",
        )
    });
    let (out, text) = check(&["--chart", dir.path().join("tessera").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("'hostPIDD' was unexpected"), "{text}");
    assert!(text.contains("for Kubernetes 1.34"), "{text}");
}

#[test]
fn a_template_error_fails_helms_lint() {
    let dir = broken_chart("templates/serviceaccount.yaml", |t| {
        format!("{t}\n{{{{ .Values.no.such.value }}}}\n")
    });
    let (out, text) = check(&["--chart", dir.path().join("tessera").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("lint error: templates/"), "{text}");
}

#[test]
fn a_bad_manifest_in_deploy_fails_the_schema_check() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("bad.yaml"),
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\nspec:\n  containers:\n    - name: c\n      image: busybox\n      imagePullPolicyy: Always\n",
    )
    .unwrap();
    let (out, text) = check(&["--deploy", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("'imagePullPolicyy' was unexpected"), "{text}");
}

/// The rendered chart's documents (`--print` output), as JSON values.
fn rendered(args: &[&str]) -> Vec<(String, serde_json::Value)> {
    let mut all = vec!["--print"];
    all.extend_from_slice(args);
    let (out, text) = check(&all);
    assert!(out.status.success(), "{text}");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut docs = Vec::new();
    for chunk in stdout.split("--- # ").skip(1) {
        let (title, body) = chunk.split_once('\n').unwrap();
        // The summary line after the last document is not YAML.
        let body = body.split("\ncheck_deploy:").next().unwrap();
        let value: serde_json::Value =
            serde_yaml_ng::from_str(body).unwrap_or_else(|e| panic!("{title}: {e}\n{body}"));
        docs.push((title.to_owned(), value));
    }
    assert!(!docs.is_empty(), "{stdout}");
    docs
}

#[test]
fn the_binaries_accept_every_flag_the_chart_passes() {
    // Each container's command runs with `--help` appended: clap parses and checks every flag
    // and value before it prints the help, so a renamed flag or a bad value exits 2.
    for values in [&[][..], &["--set", "arbiter.unknownProcesses=\"kill\""][..]] {
        let docs = rendered(values);
        let (_, ds) = docs
            .iter()
            .find(|(t, _)| t.starts_with("chart (defaults) DaemonSet"))
            .expect("the DaemonSet");
        let spec = &ds["spec"]["template"]["spec"];
        let containers = spec["containers"]
            .as_array()
            .unwrap()
            .iter()
            .chain(spec["initContainers"].as_array().unwrap());
        let mut seen = 0;
        for c in containers {
            let cmd: Vec<String> = c["command"]
                .as_array()
                .unwrap()
                .iter()
                // The kubelet expands $(POD_IP) from the downward API.
                .map(|a| a.as_str().unwrap().replace("$(POD_IP)", "127.0.0.1"))
                .collect();
            let out = Command::new(tessera_testkit::artifact(&cmd[0]))
                .args(&cmd[1..])
                .arg("--help")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}: {cmd:?}\n{}",
                c["name"],
                String::from_utf8_lossy(&out.stderr)
            );
            seen += 1;
        }
        assert_eq!(seen, 3, "arbiter, device plugin and installer");
    }
}
