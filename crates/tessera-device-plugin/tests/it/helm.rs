//! The Helm chart (`deploy/helm/tessera`) checked with the real Helm, and every manifest in
//! `deploy/` with the Kubernetes schemas: `.ci/check_deploy.py` lints the chart through Helm
//! v4's library (`helm-sdkpy`), installs it against a fake API server that records what Helm
//! sends, and validates each object with `kubernetes-validate` (strict) for Kubernetes 1.34 and
//! the newest version the package knows. Every rendered container's command runs through its
//! binary's `--check-config` (target/debug), and values the binaries refuse are refused at
//! install. The venv is `.ci/test`'s (`.ci/requirements-deploy.txt`).
//! Each check is also shown to fail on a broken chart.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn chart() -> PathBuf {
    crate::repo().join("deploy/helm/tessera")
}

fn check(args: &[&str]) -> (Output, String) {
    // The binaries `--check-config` runs: the ones this test run built.
    let arbiter = tessera_testkit::artifact("tessera-arbiter");
    let out = Command::new(tessera_testkit::python::python())
        .arg(crate::repo().join(".ci/check_deploy.py"))
        .arg("--binaries")
        .arg(arbiter.parent().unwrap())
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
    // Every render's containers went through --check-config; every bad value was refused.
    assert!(
        text.contains("18 rendered containers passed --check-config"),
        "{text}"
    );
    assert!(
        text.contains("9 of 9 bad values refused at install"),
        "{text}"
    );
    // What the schemas could not check is said, never counted as passed.
    assert!(
        text.contains("not checked: chart (all features) ServiceMonitor/tessera-node"),
        "{text}"
    );
    // Defaults: only nodes the operator labelled; unknown container processes only reported
    // (read in the default render only: the other value sets turn these on).
    let defaults: String = text
        .split("--- # ")
        .filter(|d| d.starts_with("chart (defaults)"))
        .collect();
    assert!(
        defaults.contains("tessera.dev/enabled: 'true'"),
        "{defaults}"
    );
    assert!(!defaults.contains("nvidia.com/gpu.present"), "{defaults}");
    assert!(
        defaults.contains("--unknown-processes=report"),
        "{defaults}"
    );
    assert!(!defaults.contains("--unknown-processes=kill"), "{defaults}");
    assert!(defaults.contains("--enforce=kill"), "{defaults}");
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
    let shipped = std::fs::read(crate::repo().join("deploy/grafana/tessera.json")).unwrap();
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
    // Refused by the chart's schema at install, before any template runs.
    assert!(
        text.contains(
            "at '/arbiter/unknownProcesses': value must be one of 'kill', 'report', 'ignore'"
        ),
        "{text}"
    );
}

#[test]
fn the_latency_split_is_a_value_off_by_default() {
    let docs = rendered(&[]);
    let args = |title: &str| -> Vec<String> {
        let ds = doc(&docs, title);
        let c = ds["spec"]["template"]["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "device-plugin")
            .unwrap();
        c["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect()
    };
    let defaults = args("chart (defaults) DaemonSet/tessera-node");
    assert!(
        !defaults.iter().any(|a| a.starts_with("--latency")),
        "{defaults:?}"
    );
    assert!(
        !docs
            .iter()
            .any(|(t, _)| t.starts_with("chart (defaults) ValidatingAdmission")),
        "no admission policy without the split"
    );
    let split = args("chart (latency split) DaemonSet/tessera-node");
    for want in [
        "--latency-shares=30",
        "--latency-resource-name=tessera.dev/gpu-latency-shares",
    ] {
        assert!(split.iter().any(|a| a == want), "{want} not in {split:?}");
    }
    // With the split, the API server refuses a container asking for both resources, by the
    // names the plugin was given.
    let policy = doc(
        &docs,
        "chart (latency split) ValidatingAdmissionPolicy/tessera-one-tier-per-container",
    );
    let rule = policy["spec"]["validations"][0]["expression"]
        .as_str()
        .unwrap();
    for name in [
        "'tessera.dev/gpu-shares'",
        "'tessera.dev/gpu-latency-shares'",
    ] {
        assert!(rule.contains(name), "{rule}");
    }
    let binding = doc(
        &docs,
        "chart (latency split) ValidatingAdmissionPolicyBinding/tessera-one-tier-per-container",
    );
    assert_eq!(binding["spec"]["validationActions"][0], "Deny");
    // A split that leaves best-effort nothing is refused at install.
    let (out, text) = check(&["--set", "devicePlugin.latencyShares=100"]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("devicePlugin.latencyShares must be 0 (off) up to sharesPerGpu - 1"),
        "{text}"
    );
}

/// The rendered document titled `title` (`chart (dra) DaemonSet/tessera-node`).
fn doc<'a>(docs: &'a [(String, serde_json::Value)], title: &str) -> &'a serde_json::Value {
    &docs
        .iter()
        .find(|(t, _)| t == title)
        .unwrap_or_else(|| {
            let titles: Vec<&String> = docs.iter().map(|(t, _)| t).collect();
            panic!("no {title} in {titles:?}")
        })
        .1
}

fn container_names(ds: &serde_json::Value) -> Vec<String> {
    ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn the_dra_switch_renders_the_plugin_its_rbac_and_device_classes() {
    let docs = rendered(&[]);
    // The `dra` render: dra.enabled=true, devicePlugin.enabled=false.
    let ds = doc(&docs, "chart (dra) DaemonSet/tessera-node");
    assert_eq!(container_names(ds), ["arbiter", "dra-plugin"]);
    let pod = &ds["spec"]["template"]["spec"];
    assert!(pod.get("initContainers").is_none(), "{pod}");
    let dra = pod["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "dra-plugin")
        .unwrap();
    let cmd: Vec<&str> = dra["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(cmd[0], "tessera-dra");
    // In-cluster configuration: no URL, no proxy sidecar.
    assert!(
        !cmd.iter().any(|a| a.starts_with("--api-server")),
        "{cmd:?}"
    );
    // The kubelet's folders at their host paths (the kubelet dials the reported endpoint).
    let mounts: Vec<&str> = dra["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["mountPath"].as_str().unwrap())
        .collect();
    for (flag, path) in [
        ("--registry-dir=", "/var/lib/kubelet/plugins_registry"),
        ("--plugin-dir=", "/var/lib/kubelet/plugins/gpu.tessera.dev"),
        ("--cdi-dir=", "/var/run/cdi"),
        ("--host-identity-dir=", "/var/lib/tessera/identity"),
    ] {
        assert!(cmd.contains(&format!("{flag}{path}").as_str()), "{cmd:?}");
        assert!(mounts.contains(&path), "{path} not mounted: {mounts:?}");
    }
    // The API token reaches the DRA plugin only: no automount, a projected volume mounted in
    // that one container.
    assert_eq!(pod["automountServiceAccountToken"], false);
    let sa_dir = "/var/run/secrets/kubernetes.io/serviceaccount";
    assert!(mounts.contains(&sa_dir));
    for c in pod["containers"].as_array().unwrap() {
        if c["name"] != "dra-plugin" {
            assert!(!c.to_string().contains(sa_dir), "{}", c["name"]);
        }
    }
    let token = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "api-credentials")
        .unwrap();
    assert_eq!(
        token["projected"]["sources"][0]["serviceAccountToken"]["path"],
        "token"
    );
    // RBAC: the slices of the node and the claims it prepares, bound to the pods' account.
    let role = doc(&docs, "chart (dra) ClusterRole/tessera-dra");
    let verbs = |res: &str| -> Vec<String> {
        role["rules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["resources"][0] == res)
            .unwrap()["verbs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(verbs("resourceclaims"), ["get", "list"]);
    for v in ["list", "create", "update", "delete"] {
        assert!(verbs("resourceslices").iter().any(|x| x == v), "{v}");
    }
    let binding = doc(&docs, "chart (dra) ClusterRoleBinding/tessera-dra");
    assert_eq!(binding["subjects"][0]["name"], pod["serviceAccountName"]);
    let class = doc(&docs, "chart (dra) DeviceClass/gpu.tessera.dev");
    assert_eq!(
        class["spec"]["selectors"][0]["cel"]["expression"],
        "device.driver == \"gpu.tessera.dev\" && \
         (device.attributes[\"gpu.tessera.dev\"].type == \"gpu\")"
    );
    let mig = doc(&docs, "chart (dra) DeviceClass/mig.tessera.dev");
    assert_eq!(
        mig["spec"]["selectors"][0]["cel"]["expression"],
        "device.driver == \"gpu.tessera.dev\" && \
         (device.attributes[\"gpu.tessera.dev\"].type == \"mig\")"
    );
    // Both plugins when both are asked for; neither DRA object by default.
    assert_eq!(
        container_names(doc(&docs, "chart (all features) DaemonSet/tessera-node")),
        ["arbiter", "device-plugin", "dra-plugin"]
    );
    assert_eq!(
        container_names(doc(&docs, "chart (defaults) DaemonSet/tessera-node")),
        ["arbiter", "device-plugin"]
    );
    assert!(
        !docs
            .iter()
            .any(|(t, _)| t.starts_with("chart (defaults)") && t.contains("tessera-dra")),
        "RBAC only with dra.enabled"
    );
}

#[test]
fn device_classes_come_from_values_and_always_require_the_driver() {
    let docs = rendered(&[
        "--set",
        "dra.enabled=true",
        "--set",
        r#"dra.deviceClasses=[{"name":"h100.gpu.tessera.dev","expression":"device.attributes[\"gpu.tessera.dev\"].productName.startsWith(\"NVIDIA H100\")"}]"#,
    ]);
    let class = doc(&docs, "chart (--set) DeviceClass/h100.gpu.tessera.dev");
    assert_eq!(
        class["spec"]["selectors"][0]["cel"]["expression"],
        r#"device.driver == "gpu.tessera.dev" && (device.attributes["gpu.tessera.dev"].productName.startsWith("NVIDIA H100"))"#
    );
    let (out, text) = check(&[
        "--set",
        "dra.enabled=true",
        "--set",
        "dra.defaultMemoryMiB=1000",
    ]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("at '/dra/defaultMemoryMiB': multipleOf: got 1,000, want 256"),
        "{text}"
    );
}

#[test]
fn a_release_without_either_plugin_is_refused() {
    let (out, text) = check(&["--set", "devicePlugin.enabled=false"]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("enable devicePlugin.enabled") && text.contains("dra.enabled"),
        "{text}"
    );
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
    // Each container's command runs with `--check-config` appended: the binary parses and
    // validates its flags as at start-up (ranges, names, paths that must differ) and exits 0
    // with `config ok`, opening nothing; a renamed flag or a refused value exits 2.
    for values in [&[][..], &["--set", "arbiter.unknownProcesses=\"kill\""][..]] {
        let docs = rendered(values);
        // Defaults (device plugin), every feature (both plugins), DRA only, the edges.
        let mut seen = BTreeSet::new();
        for (title, ds) in docs
            .iter()
            .filter(|(t, _)| t.ends_with("DaemonSet/tessera-node"))
        {
            let spec = &ds["spec"]["template"]["spec"];
            let init = spec["initContainers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            for c in spec["containers"].as_array().unwrap().iter().chain(&init) {
                let cmd: Vec<String> = c["command"]
                    .as_array()
                    .unwrap()
                    .iter()
                    // The kubelet expands $(POD_IP) and $(NODE_NAME) from the downward API.
                    .map(|a| {
                        a.as_str()
                            .unwrap()
                            .replace("$(POD_IP)", "127.0.0.1")
                            .replace("$(NODE_NAME)", "node-a")
                    })
                    .collect();
                let out = Command::new(tessera_testkit::artifact(&cmd[0]))
                    .args(&cmd[1..])
                    .arg("--check-config")
                    .output()
                    .unwrap();
                assert!(
                    out.status.success() && out.stdout == b"config ok\n",
                    "{title} {}: {cmd:?}\n{}",
                    c["name"],
                    String::from_utf8_lossy(&out.stderr)
                );
                seen.insert(c["name"].as_str().unwrap().to_owned());
            }
        }
        assert_eq!(
            seen,
            BTreeSet::from(
                [
                    "arbiter",
                    "device-plugin",
                    "dra-plugin",
                    "install-interposer"
                ]
                .map(String::from)
            )
        );
    }
}

#[test]
fn a_container_its_binary_refuses_fails_the_check() {
    // The schema and the templates cannot see extraArgs: --check-config does.
    let (out, text) = check(&[
        "--set",
        r#"devicePlugin.extraArgs=["--latency-resource-name=tessera.dev/gpu-shares","--latency-shares=10"]"#,
    ]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("chart (--set) tessera-node/device-plugin")
            && text.contains("--check-config exited 2")
            && text.contains("must be <domain>/<name> and differ from --resource-name"),
        "{text}"
    );
}

#[test]
fn shares_the_plugin_refuses_are_refused_at_install() {
    let (out, text) = check(&["--set", "devicePlugin.sharesPerGpu=5000"]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("at '/devicePlugin/sharesPerGpu': maximum: got 5,000, want 1,000"),
        "{text}"
    );
    let (out, text) = check(&["--set", "arbiter.metricsPort=9465"]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("arbiter.metricsPort and devicePlugin.metricsPort are both 9465"),
        "{text}"
    );
}

#[test]
fn a_device_class_with_a_tier_carries_the_drivers_opaque_configuration() {
    let docs = rendered(&[]);
    // The `tiers` render: gpu-latency.tessera.dev with tier latency, large.gpu.tessera.dev
    // best-effort.
    let class = doc(&docs, "chart (tiers) DeviceClass/gpu-latency.tessera.dev");
    assert_eq!(
        class["spec"]["config"],
        serde_json::json!([{"opaque": {"driver": "gpu.tessera.dev",
                                       "parameters": {"tier": "latency"}}}])
    );
    assert_eq!(
        class["spec"]["selectors"][0]["cel"]["expression"],
        "device.driver == \"gpu.tessera.dev\""
    );
    for best_effort in [
        "chart (tiers) DeviceClass/large.gpu.tessera.dev",
        "chart (tiers) DeviceClass/gpu.tessera.dev",
    ] {
        assert!(
            doc(&docs, best_effort)["spec"].get("config").is_none(),
            "{best_effort}"
        );
    }
}
