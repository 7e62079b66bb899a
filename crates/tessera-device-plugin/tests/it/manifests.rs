//! Every manifest in `deploy/` is valid Kubernetes: each YAML document is deserialised into
//! its `k8s-openapi` type, serialised back, and must equal the input exactly, so an unknown
//! or misspelled field (which serde would otherwise drop silently) fails the test. Plus a few
//! checks a schema cannot make (selectors, volume names, the example's request, the metrics
//! ports). The Prometheus operator's `ServiceMonitor` is not in `k8s-openapi`: it is checked
//! against the subset of its CRD schema written out below, unknown fields refused.

use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Pod, PodSpec, Service, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// A parsed, schema-checked object.
#[derive(Debug)]
enum Object {
    Namespace(Box<Namespace>),
    ServiceAccount(Box<ServiceAccount>),
    DaemonSet(Box<DaemonSet>),
    Pod(Box<Pod>),
    /// `deploy/doctor-job.yaml`: `tessera doctor` in a pod with 30 shares.
    Job(Box<Job>),
    Service(Box<Service>),
    ServiceMonitor(Box<ServiceMonitor>),
}

/// `monitoring.coreos.com/v1` `ServiceMonitor`: the fields of the operator's CRD this project
/// uses (names and types as in the CRD); anything else is refused.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitor {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: ServiceMonitorSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitorSpec {
    selector: LabelSelector,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    namespace_selector: Option<NamespaceSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    job_label: Option<String>,
    endpoints: Vec<MonitorEndpoint>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct NamespaceSelector {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    any: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    match_names: Option<Vec<String>>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MonitorEndpoint {
    port: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    scheme: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    interval: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    scrape_timeout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    honor_labels: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    relabelings: Option<Vec<RelabelConfig>>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RelabelConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    source_labels: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    separator: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    target_label: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    regex: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    replacement: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    action: Option<String>,
}

/// A Prometheus duration as the CRD's pattern allows (`15s`, `1m30s`).
fn is_duration(text: &str) -> bool {
    let mut rest = text;
    let mut any = false;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return false;
        }
        rest = &rest[digits..];
        let Some(unit) = ["ms", "s", "m", "h", "d", "w", "y"]
            .into_iter()
            .find(|u| rest.starts_with(u))
        else {
            return false;
        };
        rest = &rest[unit.len()..];
        any = true;
    }
    any
}

/// The first place two JSON values differ, as a path, for a readable failure.
fn first_difference(path: &str, want: &Value, got: &Value) -> Option<String> {
    match (want, got) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, va) in a {
                let p = format!("{path}.{k}");
                match b.get(k) {
                    None => {
                        return Some(format!(
                            "{p}: unknown or misspelled field (dropped by the schema)"
                        ));
                    }
                    Some(vb) => {
                        if let Some(d) = first_difference(&p, va, vb) {
                            return Some(d);
                        }
                    }
                }
            }
            b.keys()
                .find(|k| !a.contains_key(*k))
                .map(|k| format!("{path}.{k}: added by the schema"))
        }
        (Value::Array(a), Value::Array(b)) => {
            if a.len() != b.len() {
                return Some(format!("{path}: {} items became {}", a.len(), b.len()));
            }
            a.iter()
                .zip(b)
                .enumerate()
                .find_map(|(i, (x, y))| first_difference(&format!("{path}[{i}]"), x, y))
        }
        _ if want == got => None,
        _ => Some(format!("{path}: {want} became {got}")),
    }
}

/// Deserialises `value` as `T` and insists the round trip is lossless.
fn strict<T: DeserializeOwned + serde::Serialize>(value: &Value) -> Result<T, String> {
    let typed: T = serde_json::from_value(value.clone()).map_err(|e| format!("schema: {e}"))?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    match first_difference("", value, &back) {
        None => Ok(typed),
        Some(d) => Err(d),
    }
}

fn check_document(value: &Value) -> Result<Object, String> {
    let api = value
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or("");
    let kind = value.get("kind").and_then(Value::as_str).unwrap_or("");
    match (api, kind) {
        ("v1", "Namespace") => strict(value).map(|o| Object::Namespace(Box::new(o))),
        ("v1", "ServiceAccount") => strict(value).map(|o| Object::ServiceAccount(Box::new(o))),
        ("apps/v1", "DaemonSet") => strict(value).map(|o| Object::DaemonSet(Box::new(o))),
        ("v1", "Pod") => strict(value).map(|o| Object::Pod(Box::new(o))),
        ("batch/v1", "Job") => strict(value).map(|o| Object::Job(Box::new(o))),
        ("v1", "Service") => strict(value).map(|o| Object::Service(Box::new(o))),
        ("monitoring.coreos.com/v1", "ServiceMonitor") => {
            strict(value).map(|o| Object::ServiceMonitor(Box::new(o)))
        }
        _ => Err(format!(
            "unsupported apiVersion/kind {api:?}/{kind:?} (add it to this test)"
        )),
    }
}

/// Parses a multi-document YAML text and checks each document.
fn check_yaml(text: &str) -> Result<Vec<Object>, String> {
    let mut out = Vec::new();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(doc).map_err(|e| format!("document {i}: YAML: {e}"))?;
        if value.is_null() {
            continue; // an empty document (e.g. a trailing ---)
        }
        out.push(check_document(&value).map_err(|e| format!("document {i}: {e}"))?);
    }
    Ok(out)
}

fn all_manifests() -> Vec<(PathBuf, Vec<Object>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir())
        .expect("deploy/ exists")
        .flatten()
        .map(|e| e.path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
        .collect();
    files.sort();
    assert!(
        files.len() >= 3,
        "expected the manifests in deploy/, found {files:?}"
    );
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            let objs = check_yaml(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            assert!(!objs.is_empty(), "{} has no documents", p.display());
            (p, objs)
        })
        .collect()
}

/// Every volume a container mounts is declared, and every declared volume is used.
fn check_volumes(spec: &PodSpec) {
    let declared: Vec<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    let containers = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten());
    let mut used = Vec::new();
    for c in containers {
        for m in c.volume_mounts.iter().flatten() {
            assert!(
                declared.contains(&m.name.as_str()),
                "{} mounts undeclared volume {}",
                c.name,
                m.name
            );
            used.push(m.name.as_str());
        }
    }
    for d in declared {
        assert!(
            used.contains(&d),
            "volume {d} is declared but never mounted"
        );
    }
}

#[test]
fn every_manifest_matches_the_kubernetes_schema() {
    let all = all_manifests();
    let objs: Vec<&Object> = all.iter().flat_map(|(_, o)| o).collect();

    let ds = objs
        .iter()
        .find_map(|o| {
            if let Object::DaemonSet(d) = o {
                Some(d)
            } else {
                None
            }
        })
        .expect("a DaemonSet");
    let spec = ds.spec.as_ref().unwrap();
    let tmpl_labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .as_ref()
        .unwrap();
    for (k, v) in spec.selector.match_labels.as_ref().unwrap() {
        assert_eq!(
            tmpl_labels.get(k),
            Some(v),
            "selector {k}={v} does not match the template"
        );
    }
    let pod = spec.template.spec.as_ref().unwrap();
    check_volumes(pod);
    assert!(
        pod.node_selector.as_ref().is_some_and(|s| !s.is_empty()),
        "GPU node selector"
    );
    let names: Vec<&str> = pod.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["arbiter", "device-plugin"]);
    assert_eq!(pod.init_containers.as_ref().map(Vec::len), Some(1));
    for c in &pod.containers {
        assert!(
            c.liveness_probe.is_some(),
            "{} has no liveness probe",
            c.name
        );
        let req = c.resources.as_ref().and_then(|r| r.requests.as_ref());
        assert!(
            req.is_some_and(|r| r.contains_key("cpu") && r.contains_key("memory")),
            "{}",
            c.name
        );
    }
    // The admin socket's folder must not be the one pods get.
    let plugin = &pod.containers[1];
    let args = plugin.command.as_ref().unwrap().join(" ");
    assert!(
        args.contains("--admin-socket=/run/tessera/admin.sock"),
        "{args}"
    );
    assert!(
        args.contains("--tenant-socket=/run/tessera/tenant/tessera.sock"),
        "{args}"
    );

    let sa = objs
        .iter()
        .find_map(|o| {
            if let Object::ServiceAccount(s) = o {
                Some(s)
            } else {
                None
            }
        })
        .expect("a ServiceAccount");
    assert_eq!(
        pod.service_account_name.as_deref(),
        sa.metadata.name.as_deref()
    );
    let ns = objs
        .iter()
        .find_map(|o| {
            if let Object::Namespace(n) = o {
                Some(n)
            } else {
                None
            }
        })
        .expect("a Namespace");
    assert_eq!(ds.metadata.namespace, ns.metadata.name);

    let example = objs
        .iter()
        .find_map(|o| {
            if let Object::Pod(p) = o {
                Some(p)
            } else {
                None
            }
        })
        .expect("an example Pod");
    let limits = example.spec.as_ref().unwrap().containers[0]
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .unwrap();
    assert_eq!(
        limits.get("tessera.dev/gpu-shares").map(|q| q.0.as_str()),
        Some("30")
    );
}

#[test]
fn metrics_ports_annotations_and_service_monitor_agree() {
    let all = all_manifests();
    let objs: Vec<&Object> = all.iter().flat_map(|(_, o)| o).collect();
    let ds = objs
        .iter()
        .find_map(|o| match o {
            Object::DaemonSet(d) => Some(d),
            _ => None,
        })
        .expect("a DaemonSet");
    let tmpl = &ds.spec.as_ref().unwrap().template;
    let meta = tmpl.metadata.as_ref().unwrap();
    let ann = meta.annotations.as_ref().expect("scrape annotations");
    assert_eq!(
        ann.get("prometheus.io/scrape").map(String::as_str),
        Some("true")
    );
    assert_eq!(
        ann.get("prometheus.io/path").map(String::as_str),
        Some("/metrics")
    );
    // With two metrics ports a port annotation would hide one of them.
    assert!(!ann.contains_key("prometheus.io/port"), "{ann:?}");

    // Each container binds its metrics port on the pod's address, from the downward API,
    // and declares exactly that port (the annotation-based job scrapes every declared port).
    let pod = tmpl.spec.as_ref().unwrap();
    let mut named_ports = Vec::new();
    for (c, port) in pod.containers.iter().zip([9464, 9465]) {
        let cmd = c.command.as_ref().unwrap();
        assert!(
            cmd.contains(&format!("--metrics-addr=$(POD_IP):{port}")),
            "{}: {cmd:?}",
            c.name
        );
        let pod_ip = c
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "POD_IP")
            .unwrap_or_else(|| panic!("{} has no POD_IP", c.name));
        let field = pod_ip
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str());
        assert_eq!(field, Some("status.podIP"), "{}", c.name);
        let ports = c.ports.as_ref().unwrap();
        assert_eq!(ports.len(), 1, "{}", c.name);
        assert_eq!(ports[0].container_port, port, "{}", c.name);
        named_ports.push((ports[0].name.clone().unwrap(), port));
    }

    let svc = objs
        .iter()
        .find_map(|o| match o {
            Object::Service(s) => Some(s),
            _ => None,
        })
        .expect("a metrics Service");
    let sspec = svc.spec.as_ref().unwrap();
    assert_eq!(sspec.cluster_ip.as_deref(), Some("None"), "headless");
    let tmpl_labels = meta.labels.as_ref().unwrap();
    for (k, v) in sspec.selector.as_ref().unwrap() {
        assert_eq!(tmpl_labels.get(k), Some(v), "Service selector {k}={v}");
    }
    let sports = sspec.ports.as_ref().unwrap();
    for (name, port) in &named_ports {
        let sp = sports
            .iter()
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .unwrap_or_else(|| panic!("the Service lacks port {name}"));
        assert_eq!(sp.port, *port);
        let target = serde_json::to_value(sp.target_port.as_ref().unwrap()).unwrap();
        assert_eq!(target, Value::String(name.clone()), "{name}");
    }
    assert_eq!(svc.metadata.namespace, ds.metadata.namespace);

    let sm = objs
        .iter()
        .find_map(|o| match o {
            Object::ServiceMonitor(m) => Some(m),
            _ => None,
        })
        .expect("a ServiceMonitor");
    assert_eq!(sm.metadata.namespace, ds.metadata.namespace);
    let svc_labels = svc.metadata.labels.as_ref().unwrap();
    for (k, v) in sm.spec.selector.match_labels.as_ref().unwrap() {
        assert_eq!(
            svc_labels.get(k),
            Some(v),
            "ServiceMonitor selector {k}={v}"
        );
    }
    let ns = sm.spec.namespace_selector.as_ref().unwrap();
    assert_eq!(
        ns.match_names.as_deref(),
        Some(&[ds.metadata.namespace.clone().unwrap()][..])
    );
    let mut ports: Vec<&str> = sm.spec.endpoints.iter().map(|e| e.port.as_str()).collect();
    ports.sort_unstable();
    let mut want: Vec<&str> = named_ports.iter().map(|(n, _)| n.as_str()).collect();
    want.sort_unstable();
    assert_eq!(ports, want);
    for e in &sm.spec.endpoints {
        assert_eq!(e.path.as_deref(), Some("/metrics"));
        // Tenant pods' namespace/pod/container must survive the scrape as they are.
        assert_eq!(e.honor_labels, Some(true), "{}", e.port);
        for d in e.interval.iter().chain(&e.scrape_timeout) {
            assert!(is_duration(d), "{}: {d:?} is not a duration", e.port);
        }
    }
}

#[test]
fn a_service_monitor_with_an_unknown_field_is_refused() {
    let good = r#"
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: m
spec:
  selector:
    matchLabels:
      a: b
  endpoints:
    - port: metrics
      interval: 15s
"#;
    check_yaml(good).expect("the well-formed ServiceMonitor passes");
    let err = check_yaml(&good.replace("interval", "intervall")).unwrap_err();
    assert!(err.contains("intervall"), "{err}");
    let err = check_yaml(&good.replace("endpoints", "endpoint")).unwrap_err();
    assert!(err.contains("endpoint"), "{err}");
    assert!(is_duration("15s") && is_duration("1m30s") && !is_duration("15") && !is_duration("s"));
}

#[test]
fn a_misspelled_field_fails_the_check() {
    let good = r#"
apiVersion: v1
kind: Pod
metadata:
  name: p
spec:
  containers:
    - name: c
      image: busybox
      imagePullPolicy: IfNotPresent
"#;
    check_yaml(good).expect("the well-formed pod passes");
    let bad = good.replace("imagePullPolicy", "imagePullPolicyy");
    let err = check_yaml(&bad).unwrap_err();
    assert!(err.contains("imagePullPolicyy"), "{err}");

    // A misspelled top-level spec field, in the second document of a multi-document file.
    let two = format!("{good}---\n{}", good.replace("spec:", "specc:"));
    let err = check_yaml(&two).unwrap_err();
    assert!(err.starts_with("document 1"), "{err}");
    assert!(err.contains("specc"), "{err}");

    // A wrong type is caught by the typed deserialisation itself.
    let wrong = good.replace("name: c", "name: [c]");
    assert!(check_yaml(&wrong).unwrap_err().contains("schema"));
    // An unknown kind is refused rather than waved through.
    assert!(check_yaml("apiVersion: v1\nkind: Secrett\nmetadata:\n  name: x\n").is_err());
}

#[test]
fn the_doctor_job_runs_doctor_in_a_pod_with_30_shares() {
    // docs/install.md's proof that an install works: a pod like a user's, asking for shares.
    let all = all_manifests();
    let job = all
        .iter()
        .flat_map(|(_, objs)| objs)
        .find_map(|o| {
            if let Object::Job(j) = o {
                Some(j)
            } else {
                None
            }
        })
        .expect("deploy/doctor-job.yaml");
    let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
    let c = &pod.containers[0];
    assert_eq!(
        c.command.as_deref(),
        Some(&["tessera".to_owned(), "doctor".to_owned()][..])
    );
    let limits = c
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .unwrap();
    assert_eq!(
        limits.get("tessera.dev/gpu-shares").map(|q| q.0.as_str()),
        Some("30")
    );
}
