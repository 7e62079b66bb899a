#!/usr/bin/env bash
# Builds the end-to-end cluster's upstream programs from their published Go modules, at the
# versions of e2e/versions.env and e2e/k8s/go.mod, into target/e2e/bin (E2E_BIN):
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl (k8s.io/kubernetes
#   and the etcd server it requires), containerd, containerd-shim-runc-v2 and ctr (containerd/v2).
# Nothing else is downloaded: the Go module proxy serves the sources; the Go build cache makes a
# second build take seconds. A stamp of the versions skips the build when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
. e2e/versions.env
bin=${E2E_BIN:-$PWD/target/e2e/bin}
mkdir -p "$bin"
progs=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl containerd
    containerd-shim-runc-v2 ctr loopback)
stamp=$(cat e2e/versions.env e2e/k8s/go.mod e2e/k8s/go.sum e2e/k8s/cmd/etcd/main.go | sha256sum)
missing=0
for p in "${progs[@]}"; do [ -x "$bin/$p" ] || missing=1; done
if [ "$missing" = 0 ] && [ "$(cat "$bin/.stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "== e2e programs up to date in $bin"
    exit 0
fi
command -v go >/dev/null || { echo "e2e/build.sh: Go 1.26 is needed (go not on PATH)" >&2; exit 1; }
rm -f "$bin/.stamp"
start=$SECONDS
minor=${KUBERNETES_VERSION#v1.}
minor=${minor%%.*}
ld="-s -w -X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION"
ld+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
ld+=" -X k8s.io/component-base/version.gitTreeState=clean"
echo "== building Kubernetes $KUBERNETES_VERSION and etcd (go build; the first build takes a while)"
(cd e2e/k8s && go build -trimpath -ldflags "$ld" -o "$bin/" ./cmd/etcd \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl)
echo "== building containerd $CONTAINERD_VERSION"
cd_ld="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
for p in containerd containerd-shim-runc-v2 ctr; do
    GOBIN="$bin" CGO_ENABLED=0 go install -trimpath -tags no_btrfs -ldflags "$cd_ld" \
        "github.com/containerd/containerd/v2/cmd/$p@$CONTAINERD_VERSION"
done
echo "== building the CNI loopback plugin $CNI_PLUGINS_VERSION"
GOBIN="$bin" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" \
    "github.com/containernetworking/plugins/plugins/main/loopback@$CNI_PLUGINS_VERSION"
echo "$stamp" >"$bin/.stamp"
echo "== e2e programs built in $((SECONDS - start)) s"
