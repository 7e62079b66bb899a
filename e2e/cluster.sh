#!/usr/bin/env bash
# A one-node Kubernetes cluster from upstream parts, with Tessera on simulated GPUs: two 80 GiB
# cards that both plugins offer, and an H200 (MIG) that only the MIG tests offer (60_mig.sh).
#
#   e2e/cluster.sh up      build what is missing, start everything, wait until the node is Ready
#   e2e/cluster.sh down    stop everything, unmount, remove the cluster's folder
#   e2e/cluster.sh env     print the exports that point kubectl at the cluster
#   e2e/cluster.sh logs    copy every component's log to $E2E_LOGS (default target/e2e/logs)
#
# Upstream parts, built by e2e/build.sh from their Go modules (versions in e2e/versions.env):
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet (cgroupfs driver; cgroup
# v1 allowed), containerd 2 (CDI on, overlayfs) with Debian's runc, and the reference CNI
# loopback plugin (pods use the host's network, so no other CNI is needed).
# Tessera's parts, from `cargo build` (target/debug): the simulated GPUs (`tessera sim`, two
# 80 GiB cards and an H200; a CDI spec of kind nvidia.com/gpu stands for the one NVIDIA's
# container toolkit writes on a GPU node), the arbiter, the device plugin and the DRA plugin,
# run as host processes registering through the kubelet's real plugin folders. The arbiter sees
# all three GPUs; both plugins offer only GPUs 0 and 1 (`--gpus 0,1`), so the tests of one
# plugin see the two 80 GiB cards, and 60_mig.sh restarts the DRA plugin with the H200 (GPU 2)
# published as MIG partitions (`--gpus 0,1,2 --mig-dynamic 2`) and back.
#
# Needs root (as a kubelet does). Everything lives in E2E_DIR (default /tmp/tessera-e2e);
# nothing is installed on the host.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
D=${E2E_DIR:-/tmp/tessera-e2e}
BIN=${E2E_BIN:-$repo/target/e2e/bin}
RUST=${E2E_RUST_BIN:-${CARGO_TARGET_DIR:-$repo/target}/debug}
# The node's name is also the address the API server reaches the kubelet by (for logs and
# exec): the kubelet refuses a loopback --node-ip, and reports its name as the node's
# Hostname address, which the API server prefers. "localhost" keeps that on loopback.
NODE=${E2E_NODE:-localhost}
API_PORT=${E2E_API_PORT:-6443}
ETCD_PORT=${E2E_ETCD_PORT:-12379}
# GPU 2, the H200, has MIG (docs/simulator.md, "MIG"); the MIG tests name it by its index.
GPUS=2x80GiB,1xH200
# The GPUs both plugins offer (their `--gpus`; empty: the flag is left out, and they offer all).
PLUGIN_GPUS=${E2E_PLUGIN_GPUS-0,1}
# The kubelet's device manager ignores --root-dir: its folder is fixed
# (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1 DevicePluginPath).
DEVICE_PLUGINS=/var/lib/kubelet/device-plugins
RUNC=${E2E_RUNC:-$(command -v runc || echo /usr/sbin/runc)}
export PATH="$BIN:$PATH"

log() { echo "== $*"; }
die() { echo "e2e/cluster.sh: $*" >&2; exit 1; }

kc() { kubectl --kubeconfig "$D/admin.kubeconfig" "$@"; }

# Starts a long-running process in its own session, logging to $D/logs/NAME.log.
start() {
    local name=$1
    shift
    setsid "$@" >>"$D/logs/$name.log" 2>&1 </dev/null &
    echo $! >"$D/pids/$name"
}

# Waits up to $1 seconds for the command after it to succeed; shows $2 and the log on failure.
wait_for() {
    local secs=$1 what=$2 logname=$3
    shift 3
    local end=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        if [ $SECONDS -ge $end ]; then
            echo "e2e/cluster.sh: timed out after ${secs}s waiting for $what" >&2
            [ -n "$logname" ] && [ -f "$D/logs/$logname.log" ] && tail -n 40 "$D/logs/$logname.log" >&2
            return 1
        fi
        sleep 0.5
    done
}

kubeconfig() { # user token file
    cat >"$D/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $D/pki/ca.crt
users:
- name: $1
  user:
    token: $2
contexts:
- name: e2e
  context: {cluster: e2e, user: $1}
current-context: e2e
EOF
}

token() { # id user groups: a static token and a kubeconfig that sends it
    local tok
    tok=$(openssl rand -hex 16)
    echo "$tok,$2,$1,\"$3\"" >>"$D/pki/tokens.csv"
    kubeconfig "$1" "$tok"
}

pki() {
    mkdir -p "$D/pki"
    cd "$D/pki"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 \
        -subj "/CN=tessera-e2e-ca" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr \
        -subj "/CN=kube-apiserver" 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' >apiserver.ext
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
        -out apiserver.crt -days 2 -extfile apiserver.ext 2>/dev/null
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    cd - >/dev/null
    # Static tokens: each component, and the DRA plugin as the user of its service account, so
    # deploy/dra/rbac.yaml is what authorises it.
    : >"$D/pki/tokens.csv"
    token admin admin system:masters
    token kubelet "system:node:$NODE" system:nodes
    token scheduler system:kube-scheduler ""
    token controller-manager system:kube-controller-manager ""
    token dra system:serviceaccount:tessera-system:tessera-dra \
        system:serviceaccounts,system:serviceaccounts:tessera-system
    # The DRA plugin reads its token from a file that ends in a newline, as files usually do
    # (its kubeconfig names the file: `tokenFile`, which client-go trims).
    grep ',dra,' "$D/pki/tokens.csv" | cut -d, -f1 >"$D/pki/dra.token"
    sed -i "s|    token: .*|    tokenFile: $D/pki/dra.token|" "$D/dra.kubeconfig"
    chmod 600 "$D/pki/"*.key "$D/pki/tokens.csv" "$D/pki/dra.token" "$D"/*.kubeconfig
}

# A static pause binary (the sandbox's process) and an OCI image around a root folder.
build_images() {
    local img=$D/images
    mkdir -p "$img"
    cc -static -O2 -o "$img/pause" "$here/pause.c"
    # The pause image: /pause only.
    mkdir -p "$img/pause-root"
    cp "$img/pause" "$img/pause-root/pause"
    oci_image "$img/pause-root" localhost/tessera-e2e/pause:1 '["/pause"]' "$img/pause.tar"
    # The client image: busybox and Tessera's example clients with the glibc they link. The
    # driver (the simulated libcuda and NVML) is not in it: the node's CDI spec mounts it, as
    # NVIDIA's container toolkit does on a GPU node.
    local root=$img/client-root
    rm -rf "$root"
    mkdir -p "$root/bin" "$root/usr/local/bin" "$root/etc" "$root/tmp" "$root/etc/tessera"
    cp /bin/busybox "$root/bin/busybox"
    local a
    for a in sh ls cat echo sleep env grep head tail wc sed awk id mount ps kill true false \
        unshare nsenter readlink test date seq rm mkdir touch chmod; do
        ln -sf busybox "$root/bin/$a"
    done
    cp "$RUST/tenant" "$RUST/hello_gpu" "$root/usr/local/bin/"
    # Every library the example clients, the interposer and the simulated driver link, the
    # loader included (ldd lists it as a path of its own).
    local l
    for l in $(ldd "$RUST/tenant" "$RUST/hello_gpu" "$RUST/libtessera_interpose.so" \
        "$RUST/libtessera_sim_cuda.so" "$RUST/libtessera_sim_nvml.so" |
        awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && !/:$/ {print $1}' | sort -u); do
        mkdir -p "$root$(dirname "$l")"
        cp -L "$l" "$root$l"
    done
    echo 'root:x:0:0:root:/root:/bin/sh' >"$root/etc/passwd"
    echo 'root:x:0:' >"$root/etc/group"
    oci_image "$root" localhost/tessera-e2e/client:1 '["/bin/sh"]' "$img/client.tar"
    local t
    for t in pause client; do
        ctr --address "$D/containerd/containerd.sock" -n k8s.io images import "$img/$t.tar" \
            >/dev/null
    done
}

# oci_image ROOT NAME ENTRYPOINT_JSON OUT.tar: an OCI image layout of one uncompressed layer.
oci_image() {
    local root=$1 name=$2 entry=$3 out=$4 lay
    lay=$(mktemp -d "$D/images/layout.XXXXXX")
    mkdir -p "$lay/blobs/sha256"
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$root" -cf "$lay/layer.tar" .
    local ldig lsize cdig csize mdig msize
    ldig=$(sha256sum "$lay/layer.tar" | cut -d' ' -f1)
    lsize=$(stat -c %s "$lay/layer.tar")
    mv "$lay/layer.tar" "$lay/blobs/sha256/$ldig"
    printf '{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/usr/local/bin:/usr/bin:/bin"],"Entrypoint":%s},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
        "$entry" "$ldig" >"$lay/config.json"
    cdig=$(sha256sum "$lay/config.json" | cut -d' ' -f1)
    csize=$(stat -c %s "$lay/config.json")
    mv "$lay/config.json" "$lay/blobs/sha256/$cdig"
    printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%s}]}' \
        "$cdig" "$csize" "$ldig" "$lsize" >"$lay/manifest.json"
    mdig=$(sha256sum "$lay/manifest.json" | cut -d' ' -f1)
    msize=$(stat -c %s "$lay/manifest.json")
    mv "$lay/manifest.json" "$lay/blobs/sha256/$mdig"
    printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
        "$mdig" "$msize" "$name" "${name##*:}" >"$lay/index.json"
    echo '{"imageLayoutVersion":"1.0.0"}' >"$lay/oci-layout"
    tar -C "$lay" -cf "$out" oci-layout index.json blobs
    rm -rf "$lay"
}

# The node's driver as NVIDIA's toolkit would describe it (`nvidia-ctk cdi generate
# --device-name-strategy=uuid`): one device per GPU by UUID, the driver libraries mounted. Here
# the driver is the simulated one, with its shared state folder (the card) mounted beside it.
sim_cdi_spec() {
    local uuids
    uuids=$("$RUST/tessera" status --json --admin-socket "$D/tessera/admin.sock" | jq -r '.gpus[].uuid')
    [ -n "$uuids" ] || die "could not read the simulated GPUs' UUIDs from the arbiter"
    local devs="" i=0 u
    for u in $uuids; do
        [ -n "$devs" ] && devs+=","
        devs+="{\"name\":\"$u\",\"containerEdits\":{\"env\":[\"TESSERA_SIM_CARD_$i=$u\"]}}"
        i=$((i + 1))
    done
    local cuda nvml
    cuda=$(readlink -f "$RUST/libtessera_sim_cuda.so")
    nvml=$(readlink -f "$RUST/libtessera_sim_nvml.so")
    cat >"$D/cdi/nvidia.json" <<EOF
{"cdiVersion":"0.6.0","kind":"nvidia.com/gpu","devices":[$devs],
 "containerEdits":{
  "env":["TESSERA_SIM_DIR=/run/tessera-sim","TESSERA_SIM_GPUS=$GPUS","TESSERA_SIM_CONTEXT_MEMORY=300MiB"],
  "mounts":[
   {"hostPath":"$D/sim","containerPath":"/run/tessera-sim","options":["rbind","rw","nosuid","nodev"]},
   {"hostPath":"$cuda","containerPath":"/usr/lib/x86_64-linux-gnu/libcuda.so.1","options":["ro","rbind","nosuid","nodev"]},
   {"hostPath":"$nvml","containerPath":"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1","options":["ro","rbind","nosuid","nodev"]}]}}
EOF
    echo "$uuids" >"$D/gpus"
}

containerd_config() {
    mkdir -p "$D/containerd" "$D/cni/bin" "$D/cni/conf"
    cp "$BIN/loopback" "$D/cni/bin/loopback"
    cat >"$D/cni/conf/10-loopback.conflist" <<'EOF'
{"cniVersion":"1.0.0","name":"e2e-loopback","plugins":[{"type":"loopback"}]}
EOF
    cat >"$D/containerd/config.toml" <<EOF
version = 3
root = "$D/containerd/root"
state = "$D/containerd/state"
[grpc]
  address = "$D/containerd/containerd.sock"
[ttrpc]
  address = "$D/containerd/containerd.sock.ttrpc"
[plugins.'io.containerd.cri.v1.runtime']
  cdi_spec_dirs = ["$D/cdi"]
  # This VM's root may not lower a process's oom_score_adj (runc's init failed writing -998
  # for the sandbox: "failed to update /proc/self/oom_score_adj: Permission denied"); keep
  # every container's at or above containerd's own.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "$RUNC"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["$D/cni/bin"]
    conf_dir = "$D/cni/conf"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "localhost/tessera-e2e/pause:1"
EOF
}

kubelet_config() {
    cat >"$D/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This VM mounts cgroup v1; 1.36's kubelet refuses it unless told otherwise.
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$D/containerd/containerd.sock
address: 127.0.0.1
port: ${E2E_KUBELET_PORT:-10250}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: ${E2E_KUBELET_HEALTHZ_PORT:-10248}
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization:
  mode: AlwaysAllow
failSwapOn: false
podLogsDir: $D/pod-logs
volumePluginDir: $D/volume-plugins
staticPodPath: $D/static-pods
# Eviction off: CI's disk is shared with a 50 GB cargo target and has been seen nearly full, and
# a pressure taint (node.kubernetes.io/disk-pressure:NoSchedule) leaves every later pod Pending.
# The kubelet ignores a threshold of "0%" (pkg/kubelet/eviction/helpers.go parseThresholdStatement:
# "0%" and "100%" mean none), and an explicit map keeps the defaults from being filled in.
evictionHard: {memory.available: "0%", nodefs.available: "0%", nodefs.inodesFree: "0%", imagefs.available: "0%", imagefs.inodesFree: "0%"}
evictionPressureTransitionPeriod: 5s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
syncFrequency: 5s
fileCheckFrequency: 5s
nodeStatusUpdateFrequency: 5s
serializeImagePulls: false
EOF
}

up() {
    [ "$(id -u)" = 0 ] || die "needs root (it runs a kubelet and a container runtime)"
    [ -e "$D/pids" ] && die "$D exists: run '$0 down' first"
    # The device-plugin folder is the host's own (see DEVICE_PLUGINS): a kubelet already
    # running on this machine owns it, and `down` would sweep its sockets and pod cgroups.
    [ -S "$DEVICE_PLUGINS/kubelet.sock" ] &&
        die "$DEVICE_PLUGINS/kubelet.sock exists: another kubelet runs here (or a crashed cluster left it: remove it)"
    bash "$here/build.sh"
    for b in tessera tessera-arbiter tessera-device-plugin tessera-dra tenant hello_gpu \
        libtessera_interpose.so libtessera_sim_cuda.so libtessera_sim_nvml.so; do
        [ -e "$RUST/$b" ] || die "$RUST/$b is missing: run 'cargo build --workspace' first"
    done
    if [ -n "$PLUGIN_GPUS" ]; then
        local help
        for b in tessera-device-plugin tessera-dra; do
            help=$("$RUST/$b" --help 2>&1 || true)
            grep -q -- '--gpus' <<<"$help" ||
                die "$RUST/$b has no --gpus flag (the plugins offer GPUs $PLUGIN_GPUS of $GPUS): rebuild it ('cargo build --workspace')"
        done
    fi
    command -v "$RUNC" >/dev/null || die "runc is needed (Debian: apt-get install runc)"
    [ -x /bin/busybox ] || die "busybox is needed (Debian: apt-get install busybox-static)"
    mkdir -p "$D"/{logs,pids,cdi,static-pods,pod-logs,volume-plugins,kubelet,tessera/tenant,tessera/dra}
    chmod 755 "$D"
    pki
    containerd_config
    kubelet_config
    local t0=$SECONDS

    log "etcd"
    start etcd "$BIN/etcd" --data-dir "$D/etcd" --name e2e \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
        --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
        --initial-cluster "e2e=http://127.0.0.1:$((ETCD_PORT + 1))" --unsafe-no-fsync
    wait_for 60 etcd etcd curl -sf "http://127.0.0.1:$ETCD_PORT/health"

    log "kube-apiserver"
    start kube-apiserver "$BIN/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
        --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
        --tls-cert-file "$D/pki/apiserver.crt" --tls-private-key-file "$D/pki/apiserver.key" \
        --token-auth-file "$D/pki/tokens.csv" --authorization-mode Node,RBAC \
        --enable-admission-plugins NodeRestriction \
        --service-account-issuer https://kubernetes.default.svc \
        --service-account-key-file "$D/pki/sa.pub" \
        --service-account-signing-key-file "$D/pki/sa.key" \
        --service-cluster-ip-range 10.96.0.0/24 --allow-privileged=true
    wait_for 120 "the API server" kube-apiserver kc get --raw /readyz

    log "kube-controller-manager and kube-scheduler"
    start kube-controller-manager "$BIN/kube-controller-manager" \
        --kubeconfig "$D/controller-manager.kubeconfig" --bind-address 127.0.0.1 \
        --secure-port 0 --leader-elect=false \
        --service-account-private-key-file "$D/pki/sa.key" --root-ca-file "$D/pki/ca.crt" \
        --use-service-account-credentials=true --controllers '*,-nodeipam,-service-lb-controller,-cloud-node-lifecycle'
    start kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$D/scheduler.kubeconfig" \
        --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false

    log "containerd"
    start containerd "$BIN/containerd" --config "$D/containerd/config.toml"
    wait_for 60 containerd containerd ctr --address "$D/containerd/containerd.sock" version

    log "images (built here, imported with ctr)"
    build_images

    log "simulated GPUs ($GPUS) and Tessera's arbiter"
    mkdir -p "$D/sim"
    start sim-hold "$RUST/tessera" sim --gpus "$GPUS" --lib-dir "$RUST" --state-dir "$D/sim" -- \
        sleep infinity
    wait_for 30 "the simulated machine" sim-hold test -e "$D/sim/machine"
    start_arbiter
    wait_for 30 "the arbiter" tessera-arbiter test -S "$D/tessera/admin.sock"
    sim_cdi_spec

    log "kubelet"
    start kubelet "$BIN/kubelet" --config "$D/kubelet.yaml" \
        --kubeconfig "$D/kubelet.kubeconfig" --root-dir "$D/kubelet" \
        --cert-dir "$D/kubelet/pki" --hostname-override "$NODE" --v 2
    wait_for 120 "the node to register" kubelet kc get node "$NODE"

    log "Tessera's device plugin and DRA plugin"
    kc apply -f "$repo/deploy/namespace.yaml" -f "$repo/deploy/dra/rbac.yaml" >/dev/null
    # The chart's DeviceClasses, rendered by real Helm (.ci/test's Python has helm-sdkpy);
    # without it, deploy/dra's, and the log says which.
    local py=${TESSERA_PYTHON:-$repo/.venv/bin/python}
    if "$py" -c 'import helm_sdkpy, yaml' >/dev/null 2>&1; then
        "$py" "$here/chart_classes.py" "$repo" >"$D/deviceclasses.json"
        kc apply -f "$D/deviceclasses.json" >/dev/null
        log "DeviceClasses from the Helm chart: $(jq -r '[.items[].metadata.name] | join(", ")' "$D/deviceclasses.json")"
    else
        kc apply -f "$repo/deploy/dra/deviceclasses.yaml" >/dev/null
        log "DeviceClasses from deploy/dra/deviceclasses.yaml (no helm-sdkpy in $py to render the chart's)"
    fi
    start_device_plugin
    start_dra_plugin

    wait_for 180 "the node to be Ready" kubelet node_ready
    wait_for 60 "the default service account" kube-controller-manager kc -n default get sa default
    log "cluster up in $((SECONDS - t0)) s: export KUBECONFIG=$D/admin.kubeconfig"
}

node_ready() {
    [ "$(kc get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ]
}

# `--gpus LIST` when LIST is not empty.
gpus_flag() { [ -z "$1" ] || printf '%s\n' --gpus "$1"; }

# The plugins, also restarted on their own by the tests (e2e/lib.sh).
start_device_plugin() {
    # Extra flags for a test that restarts the plugin otherwise (50_tier: --latency-shares).
    local extra gpus
    read -r -a extra <<<"${E2E_DEVICE_PLUGIN_ARGS:-}"
    mapfile -t gpus < <(gpus_flag "$PLUGIN_GPUS")
    start tessera-device-plugin "$RUST/tessera" sim --lib-dir "$RUST" --state-dir "$D/sim" -- \
        "$RUST/tessera-device-plugin" --kubelet-dir "$DEVICE_PLUGINS" \
        --pod-resources-socket "$D/kubelet/pod-resources/kubelet.sock" \
        --admin-socket "$D/tessera/admin.sock" --tenant-socket "$D/tessera/tenant/tessera.sock" \
        --host-lib-dir "$D/tessera/lib" --host-identity-dir "$D/tessera/identity" \
        --interposer "$RUST/libtessera_interpose.so" --metrics-addr 127.0.0.1:19465 \
        --nvidia-cdi-kind nvidia.com/gpu --stale-grace 3 --stale-interval 1 "${gpus[@]}" "${extra[@]}"
    # Both plugins run on this node and share the arbiter (docs/kubernetes.md, "One mode per
    # node"): a deleted pod's device-plugin allocation is released after 3 s, not the default
    # 60, so the DRA tests do not wait for the device-plugin tests' GPUs.
}

start_arbiter() {
    start tessera-arbiter "$RUST/tessera" sim --lib-dir "$RUST" --state-dir "$D/sim" -- \
        "$RUST/tessera-arbiter" --state-dir "$D/tessera/state" \
        --admin-socket "$D/tessera/admin.sock" --tenant-socket "$D/tessera/tenant/tessera.sock" \
        --metrics-addr 127.0.0.1:19464 --enforce kill \
        --unknown-processes "${E2E_UNKNOWN_PROCESSES:-kill}" \
        --host-mount-ns /proc/self/ns/mnt --identity-dir "$D/tessera/identity"
}

# E2E_DRA_GPUS (default: the plugins' GPUs) and E2E_DRA_PLUGIN_ARGS (extra flags) for a test
# that restarts it otherwise (60_mig: E2E_DRA_GPUS=0,1,2 E2E_DRA_PLUGIN_ARGS="--mig-dynamic 2").
# Its state folder (the MIG checkpoint mig.json) is the cluster's, kept across its restarts.
start_dra_plugin() {
    local extra gpus
    read -r -a extra <<<"${E2E_DRA_PLUGIN_ARGS:-}"
    mapfile -t gpus < <(gpus_flag "${E2E_DRA_GPUS:-$PLUGIN_GPUS}")
    start tessera-dra "$RUST/tessera" sim --lib-dir "$RUST" --state-dir "$D/sim" -- \
        "$RUST/tessera-dra" --node-name "$NODE" \
        --registry-dir "$D/kubelet/plugins_registry" \
        --plugin-dir "$D/kubelet/plugins/gpu.tessera.dev" --cdi-dir "$D/cdi" \
        --kubeconfig "$D/dra.kubeconfig" \
        --admin-socket "$D/tessera/admin.sock" --tenant-socket "$D/tessera/tenant/tessera.sock" \
        --host-lib-dir "$D/tessera/lib" --host-identity-dir "$D/tessera/identity" \
        --interposer "$RUST/libtessera_interpose.so" --resync 5 --claim-check 5 \
        --state-dir "$D/tessera/dra" "${gpus[@]}" "${extra[@]}"
}

stop_one() {
    local f=$D/pids/$1 pid
    [ -f "$f" ] || return 0
    pid=$(cat "$f")
    # The whole session: `tessera sim` and the program it runs.
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$f"
}

down() {
    [ -d "$D" ] || { echo "nothing to take down ($D does not exist)"; return 0; }
    if [ -f "$D/pids/kube-apiserver" ] && [ -f "$D/pids/kubelet" ]; then
        kc delete pods --all -A --grace-period=0 --force --wait=false >/dev/null 2>&1 || true
    fi
    local p
    for p in kubelet tessera-dra tessera-device-plugin kube-scheduler kube-controller-manager; do
        stop_one "$p"
    done
    # Containers the kubelet left: kill their tasks before containerd goes.
    if [ -S "$D/containerd/containerd.sock" ]; then
        local c
        for c in $(ctr --address "$D/containerd/containerd.sock" -n k8s.io tasks ls -q 2>/dev/null); do
            ctr --address "$D/containerd/containerd.sock" -n k8s.io tasks kill -s KILL "$c" \
                >/dev/null 2>&1 || true
        done
        sleep 1
    fi
    for p in containerd tessera-arbiter sim-hold kube-apiserver etcd; do stop_one "$p"; done
    pkill -f "containerd-shim-runc-v2 .*$D" 2>/dev/null || true
    # Mounts under the folder (pod volumes, overlay roots, sandbox shm), deepest first.
    local m
    for m in $(awk -v d="$D" '$2 ~ "^"d {print $2}' /proc/mounts | sort -r); do
        umount -l "$m" 2>/dev/null || true
    done
    # The kubelet's pod cgroups (cgroupfs driver).
    for m in /sys/fs/cgroup/*/kubepods; do
        [ -d "$m" ] && find "$m" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    done
    rm -rf "$D"
    rm -f "$DEVICE_PLUGINS"/kubelet.sock "$DEVICE_PLUGINS"/tessera*.sock \
        "$DEVICE_PLUGINS"/kubelet_internal_checkpoint
    echo "== cluster down"
}

logs() {
    local out=${E2E_LOGS:-$repo/target/e2e/logs}
    mkdir -p "$out"
    cp "$D"/logs/*.log "$out/" 2>/dev/null || true
    if [ -f "$D/admin.kubeconfig" ]; then
        kc get all,resourceclaims,resourceslices -A -o wide >"$out/objects.txt" 2>&1 || true
        kc get events -A --sort-by=.lastTimestamp >"$out/events.txt" 2>&1 || true
        kc describe node "$NODE" >"$out/node.txt" 2>&1 || true
        kc describe pods -A >"$out/pods.txt" 2>&1 || true
        # CI shows only the end of the output: the node's taints and conditions, and the disk.
        echo "== node $NODE: taints and conditions"
        kc get node "$NODE" -o json 2>/dev/null |
            jq -r '(.spec.taints // [] | map("taint \(.key)=\(.value // ""):\(.effect)") | .[]),
                   (.status.conditions[] | "condition \(.type)=\(.status) \(.reason): \(.message)")' || true
    fi
    df -h "$D" "$repo/target" 2>/dev/null | sed 's/^/== df: /'
    grep -hE 'eviction|[Tt]aint|NotReady|PLEG|pressure' "$D"/logs/kubelet.log 2>/dev/null | tail -n 15 | sed 's/^/== kubelet: /'
    [ -d "$D/pod-logs" ] && cp -r "$D/pod-logs" "$out/" 2>/dev/null || true
    echo "== logs in $out"
}

case ${1:-} in
up) up ;;
down) down ;;
env) echo "export KUBECONFIG=$D/admin.kubeconfig PATH=$BIN:\$PATH" ;;
logs) logs ;;
start-device-plugin) start_device_plugin ;;
start-dra-plugin) start_dra_plugin ;;
start-arbiter) start_arbiter ;;
stop) stop_one "${2:?which component}" ;;
*) echo "usage: $0 up|down|env|logs|start-device-plugin|start-dra-plugin|start-arbiter|stop NAME" >&2; exit 2 ;;
esac
