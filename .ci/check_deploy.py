#!/usr/bin/env python3
"""Checks the Helm chart and every manifest in deploy/ with the real tools.

1. `helm lint` through Helm v4's own library (the `helm-sdkpy` package): template errors,
   bad Chart.yaml, values that fail the chart's own `fail` checks are lint errors.
2. Render the chart with real Helm (defaults; every feature on, both plugins; the DRA plugin
   alone; and once more with --set values). helm-sdkpy has no `template` action, so the chart is
   *installed* (Helm's in-memory release storage) against a minimal fake Kubernetes API
   server in this process: it answers discovery, says no object exists yet and records each
   object Helm creates. The recorded objects are exactly what `helm install` sends.
3. Run every rendered container's command and arguments (the DaemonSet's, with the downward
   API's $(POD_IP) and $(NODE_NAME) filled in) through the matching built binary with
   `--check-config`: the binary parses and validates them as at start-up and exits 0, so every
   rendered combination is known to start (binaries from --binaries, default target/debug).
4. Render values the binaries would refuse (5000 shares per GPU, one metrics port for two
   containers, ...) and check that Helm refuses each at install time (values.schema.json or the
   templates' `fail`), with the expected reason.
5. Validate each rendered object and each document of deploy/*.yaml with
   `kubernetes-validate` (strict: unknown fields refused) for Kubernetes 1.34 and the newest
   version the package knows. Objects of CRDs (the Prometheus operator's ServiceMonitor) have
   no schema there: they are listed as not checked, never counted as passed.

Usage: check_deploy.py [--chart DIR] [--deploy DIR] [--binaries DIR] [--set KEY=JSON ...]
Exit 0 when everything checked passed; 1 with the reasons otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent

# Helm's caches in a temporary folder. Set before Helm's library is loaded: the Go runtime copies
# the environment once, when it starts.
_HELM_HOME = tempfile.mkdtemp(prefix="check-deploy-helm-")
for _name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
    os.environ[_name] = os.path.join(_HELM_HOME, _name.lower())
OLDEST_CHECKED = "1.34"

# Resources the fake API server advertises: (group, version, plural, kind, namespaced).
RESOURCES = [
    ("", "v1", "namespaces", "Namespace", False),
    ("", "v1", "serviceaccounts", "ServiceAccount", True),
    ("", "v1", "services", "Service", True),
    ("", "v1", "configmaps", "ConfigMap", True),
    ("", "v1", "secrets", "Secret", True),
    ("", "v1", "pods", "Pod", True),
    ("apps", "v1", "daemonsets", "DaemonSet", True),
    ("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False),
    ("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False),
    ("rbac.authorization.k8s.io", "v1", "roles", "Role", True),
    ("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True),
    ("scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", False),
    ("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", False),
    ("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies",
     "ValidatingAdmissionPolicy", False),
    ("admissionregistration.k8s.io", "v1", "validatingadmissionpolicybindings",
     "ValidatingAdmissionPolicyBinding", False),
    ("monitoring.coreos.com", "v1", "servicemonitors", "ServiceMonitor", True),
]


class FakeApi(BaseHTTPRequestHandler):
    """Just enough of the API server for `helm install`: discovery, 404 on every read, and
    created objects echoed back (and recorded)."""

    created: list[dict] = []
    unexpected: list[str] = []

    def log_message(self, *args):  # quiet
        pass

    def _send(self, code: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _not_found(self):
        self._send(404, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                         "status": "Failure", "reason": "NotFound", "code": 404,
                         "message": f"{self.path} not found"})

    def do_GET(self):
        path = self.path.split("?")[0]
        groups = sorted({(g, v) for g, v, *_ in RESOURCES if g})
        if path == "/version":
            return self._send(200, {"major": "1", "minor": "34", "gitVersion": "v1.34.0",
                                    "platform": "linux/amd64"})
        if path == "/api":
            return self._send(200, {"kind": "APIVersions", "versions": ["v1"],
                                    "serverAddressByClientCIDRs": []})
        if path == "/apis":
            return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                 "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v}}
                for g, v in groups]})
        for g, v in [("", "v1")] + groups:
            prefix = "/api/v1" if not g else f"/apis/{g}/{v}"
            if path == prefix:
                return self._send(200, {
                    "kind": "APIResourceList", "apiVersion": "v1",
                    "groupVersion": v if not g else f"{g}/{v}",
                    "resources": [
                        {"name": p, "singularName": k.lower(), "namespaced": ns, "kind": k,
                         "verbs": ["create", "delete", "get", "list", "patch", "update",
                                   "watch"]}
                        for rg, rv, p, k, ns in RESOURCES if (rg, rv) == (g, v)]})
        # A collection (Helm lists its release records by label): empty.
        parts = path.strip("/").split("/")
        if "labelSelector" in self.path or (parts and parts[-1] in {r[2] for r in RESOURCES}):
            return self._send(200, {"kind": "List", "apiVersion": "v1", "metadata": {},
                                    "items": []})
        # Any other read (an object, OpenAPI): nothing exists.
        self._not_found()

    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length)
        if self._release_record(raw, 201):
            return
        body = json.loads(raw or b"{}")
        FakeApi.created.append(body)
        self._send(201, body)

    def do_PUT(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if not self._release_record(raw, 200):
            self._refuse()

    def _release_record(self, raw: bytes, code: int) -> bool:
        """Helm keeps its release record in a Secret (sent as protobuf): echo it back, as the
        API server would, and do not count it as one of the chart's objects."""
        if not self.path.split("?")[0].endswith("/secrets") and "/secrets/sh.helm.release" \
                not in self.path:
            return False
        if b"owner" not in raw or b"helm" not in raw:
            return False
        self.send_response(code)
        self.send_header("Content-Type", self.headers.get("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)
        return True

    def _refuse(self):
        FakeApi.unexpected.append(f"{self.command} {self.path}")
        self._not_found()

    do_PATCH = do_DELETE = _refuse


def render(chart: Path, namespace: str, values: dict) -> list[dict]:
    """Installs `chart` into the fake API server and returns the objects Helm created."""
    import helm_sdkpy

    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApi)
    # serve_forever looks for shutdown() every poll_interval (0.5 s by default): at 15 renders
    # a run, the default was 7 of its 10 seconds.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01},
                     daemon=True).start()
    FakeApi.created = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = Path(tmp) / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {
                    "server": f"http://127.0.0.1:{server.server_address[1]}"}}],
                "users": [{"name": "fake", "user": {"token": "fake"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                          "namespace": namespace}}],
                "current-context": "fake",
            }))
            config = helm_sdkpy.Configuration(namespace=namespace, kubeconfig=str(kubeconfig))
            asyncio.run(helm_sdkpy.Install(config).run(
                "tessera", str(chart), values=values or None, wait=False, timeout=60))
    finally:
        server.shutdown()
        server.server_close()
    if FakeApi.unexpected:
        raise RuntimeError(f"helm made unexpected calls: {FakeApi.unexpected}")
    return list(FakeApi.created)


def lint(chart: Path) -> list[str]:
    """Helm's lint; every message at warning level or above is a failure."""
    import helm_sdkpy

    config = helm_sdkpy.Configuration(namespace="tessera-system")
    result = asyncio.run(helm_sdkpy.Lint(config).run(str(chart)))
    # helm-sdkpy serialises the error values as {}: keep severity and path.
    names = {1: "info", 2: "warning", 3: "error"}
    return [f"lint {names.get(m['Severity'], m['Severity'])}: {m['Path']}"
            for m in result.get("Messages") or [] if m["Severity"] >= 2] + \
        [f"lint error #{i}" for i, _ in enumerate(result.get("Errors") or [])
         if not any(m["Severity"] >= 2 for m in result.get("Messages") or [])]


def versions() -> list[str]:
    newest = kubernetes_validate.utils.latest_version()
    return sorted({OLDEST_CHECKED, kubernetes_validate.utils.major_minor(newest)},
                  key=lambda v: tuple(map(int, v.split("."))))


def validate(obj: dict, where: str, failures: list[str], unchecked: list[str]) -> int:
    """Validates one object for every version; returns how many versions passed."""
    kind = f"{obj.get('apiVersion')}/{obj.get('kind')}"
    if not isinstance(obj, dict) or not obj.get("apiVersion") or not obj.get("kind"):
        failures.append(f"{where}: not a Kubernetes object (no apiVersion or kind)")
        return 0
    passed = 0
    for version in versions():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
            passed += 1
        except kubernetes_validate.SchemaNotFoundError:
            unchecked.append(f"{where}: {kind} (no schema in kubernetes-validate {version})")
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            failures.append(f"{where}: {kind} for Kubernetes {version}: {e.message} at {path}")
    return passed


# Values each rendered container must start with, and values Helm must refuse at install time:
# (name, values, text the refusal must contain). The ranges are the binaries' own.
REFUSED = [
    ("5000 shares per GPU", {"devicePlugin": {"sharesPerGpu": 5000}},
     "at '/devicePlugin/sharesPerGpu': maximum: got 5,000, want 1,000"),
    ("0 shares per GPU", {"devicePlugin": {"sharesPerGpu": 0}}, "sharesPerGpu"),
    ("one metrics port for two containers", {"arbiter": {"metricsPort": 9465}},
     "arbiter.metricsPort and devicePlugin.metricsPort are both 9465"),
    ("a latency split that leaves best-effort nothing", {"devicePlugin": {"latencyShares": 100}},
     "devicePlugin.latencyShares must be 0 (off) up to sharesPerGpu - 1"),
    ("DRA memory off the 256 MiB step", {"dra": {"enabled": True, "defaultMemoryMiB": 1000}},
     "defaultMemoryMiB"),
    ("a tier the DRA driver does not know",
     {"dra": {"enabled": True, "deviceClasses": [{"name": "x.tessera.dev", "tier": "urgent"}]}},
     "tier"),
    ("a resource name without a domain", {"devicePlugin": {"resourceName": "gpu-shares"}},
     "resourceName"),
    ("a port out of range", {"devicePlugin": {"metricsPort": 70000}}, "metricsPort"),
    ("a GPU list with an empty item", {"devicePlugin": {"gpus": "0,,1"}}, "gpus"),
]


def check_configs(objs: list[dict], binaries: Path, where: str) -> tuple[list[str], list[str]]:
    """Runs each container of each rendered DaemonSet through its binary's `--check-config`.
    Returns (the containers checked, failures)."""
    checked, failures = [], []
    for ds in objs:
        if ds.get("kind") != "DaemonSet":
            continue
        spec = ds["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            # The kubelet expands $(POD_IP) and $(NODE_NAME) from the downward API.
            cmd = [a.replace("$(POD_IP)", "10.0.0.5").replace("$(NODE_NAME)", "node-a")
                   for a in c["command"] + c.get("args", [])]
            exe = binaries / cmd[0]
            name = f"{where} {ds['metadata']['name']}/{c['name']}"
            if not exe.is_file():
                failures.append(f"{name}: no {exe} to run --check-config with (cargo build first)")
                continue
            out = subprocess.run([str(exe), *cmd[1:], "--check-config"], capture_output=True,
                                 text=True, timeout=60, env={**os.environ, "NODE_NAME": ""})
            if out.returncode != 0 or out.stdout.strip() != "config ok":
                failures.append(f"{name}: {' '.join(cmd)} --check-config exited "
                                f"{out.returncode}: {(out.stderr or out.stdout).strip()}")
            else:
                checked.append(name)
    return checked, failures


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chart", type=Path, default=ROOT / "deploy/helm/tessera")
    ap.add_argument("--deploy", type=Path, default=ROOT / "deploy")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="a value for one extra render (dotted key, JSON value)")
    ap.add_argument("--print", action="store_true", help="print the rendered objects")
    ap.add_argument("--binaries", type=Path,
                    default=Path(os.environ.get("TESSERA_BINARIES", ROOT / "target/debug")),
                    help="folder of the built tessera-* binaries (--check-config)")
    args = ap.parse_args()

    failures: list[str] = []
    unchecked: list[str] = []
    checked = 0

    failures += lint(args.chart)
    containers = 0

    # Defaults, everything on (both plugins), DRA only, the device plugin with a latency
    # split, and whatever --set asks for.
    everything = {"metrics": {"serviceMonitor": {"enabled": True}},
                  "grafana": {"dashboard": {"enabled": True}},
                  "dra": {"enabled": True}}
    dra_only = {"dra": {"enabled": True}, "devicePlugin": {"enabled": False}}
    latency = {"devicePlugin": {"latencyShares": 30}}
    # The binaries' edges: every unit of a GPU split, the last port, a whole GPU's memory step,
    # a latency class, the CDI kind set, the GPUs split between the two plugins.
    edges = {"devicePlugin": {"sharesPerGpu": 1000, "latencyShares": 999,
                              "nvidiaCdiKind": "nvidia.com/gpu", "metricsPort": 65535,
                              "staleGraceSeconds": 0,
                              "gpus": "0,GPU-5a4d7f6e-1b2c-4d3e-8f90-a1b2c3d4e5f6"},
             "arbiter": {"metricsPort": 1, "unknownProcesses": "kill", "enforce": "report",
                         "backstopIntervalMs": 0, "computeBypassMs": 0},
             "dra": {"enabled": True, "defaultMemoryMiB": 256, "claimCheckSeconds": 0.5,
                     "resyncSeconds": 0, "nvidiaCdiKind": "example.com/gpu", "gpus": "2"}}
    tiers = {"dra": {"enabled": True, "deviceClasses": [
        {"name": "gpu.tessera.dev"}, {"name": "gpu-latency.tessera.dev", "tier": "latency"},
        {"name": "large.gpu.tessera.dev", "tier": "best-effort",
         "expression": 'device.capacity["gpu.tessera.dev"].memory.compareTo(quantity("40Gi")) >= 0'}]},
        "devicePlugin": {"enabled": False}}
    extra: dict = {}
    for item in args.set:
        key, _, value = item.partition("=")
        node = extra
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = json.loads(value)
    renders = [("defaults", {}), ("all features", everything), ("dra", dra_only),
               ("latency split", latency), ("edges", edges), ("tiers", tiers)] + \
        ([("--set", extra)] if extra else [])
    for name, values in renders:
        try:
            objs = render(args.chart, "tessera-system", values)
        except Exception as e:  # the Helm error text is the message
            failures.append(f"render ({name}): {e}")
            continue
        if not objs:
            failures.append(f"render ({name}): Helm created no object")
        started, refused = check_configs(objs, args.binaries, f"chart ({name})")
        containers += len(started)
        failures += refused
        for obj in objs:
            where = f"chart ({name}) {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
            if args.print:
                print(f"--- # {where}\n{yaml.safe_dump(obj, sort_keys=False)}")
            checked += validate(obj, where, failures, unchecked) > 0

    # Values the binaries would refuse on the node are refused by Helm, with the reason.
    refused_at_install = 0
    for name, values, reason in REFUSED:
        try:
            render(args.chart, "tessera-system", values)
            failures.append(f"refuse ({name}): Helm installed {values}")
        except RuntimeError as e:
            failures.append(f"refuse ({name}): {e}")
        except Exception as e:  # Helm's refusal: the schema's or a template's `fail`
            if reason not in str(e):
                failures.append(f"refuse ({name}): refused without {reason!r}: {e}")
            else:
                refused_at_install += 1

    # Every manifest under deploy/, but not the files of a Helm chart (rendered above).
    charts = [c.parent for c in args.deploy.rglob("Chart.yaml")]
    files = sorted(p for p in args.deploy.rglob("*") if p.suffix in (".yaml", ".yml")
                   and not any(c in p.parents for c in charts))
    for f in files:
        try:
            docs = [d for d in yaml.safe_load_all(f.read_text()) if d is not None]
        except yaml.YAMLError as e:
            failures.append(f"{f}: YAML: {e}")
            continue
        if not docs:
            failures.append(f"{f}: no documents")
        for i, doc in enumerate(docs):
            checked += validate(doc, f"{f.relative_to(args.deploy.parent)}[{i}]", failures,
                                unchecked) > 0

    print(f"check_deploy: Kubernetes {', '.join(versions())}; {checked} objects valid; "
          f"{containers} rendered containers passed --check-config; "
          f"{refused_at_install} of {len(REFUSED)} bad values refused at install")
    for u in sorted(set(unchecked)):
        print(f"  not checked: {u}")
    for f in failures:
        print(f"  FAILED: {f}")
    return 1 if failures or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
