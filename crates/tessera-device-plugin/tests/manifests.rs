//! Every manifest in `deploy/` is valid Kubernetes: each YAML document is deserialised into
//! its `k8s-openapi` type, serialised back, and must equal the input exactly, so an unknown
//! or misspelled field (which serde would otherwise drop silently) fails the test. Plus a few
//! checks a schema cannot make (selectors, volume names, the example's request).

use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Pod, PodSpec, ServiceAccount};
use serde::Deserialize;
use serde::de::DeserializeOwned;
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
