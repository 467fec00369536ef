#!/usr/bin/env bash
# Bring up a real Kubernetes of one or two nodes on this host, everything under one temp
# root: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, and per node a
# containerd + runc (own config, root, state, socket), a kubelet (cgroupfs driver, cgroup
# v1 allowed, root dir under the temp root) and a CNI bridge with its own pod subnet.
# Each node's containerd and kubelet run in a PID and mount namespace of the node's own,
# whose PID 1 is node-init.sh and where /var/lib/kubelet is that node's kubelet dir
# (node-init.sh says why).
# Every process started is recorded in $E2E_ROOT/pids and stopped by down.sh, which also
# runs on any failure here.
#
# Usage: e2e/cluster/up.sh BIN_DIR IMAGES_ENV     (outputs of build.sh and images.sh)
# Env:   E2E_ROOT  temp root (default /tmp/csi-pmem-e2e); must not exist or be a
#                  leftover that down.sh cleans first
#        E2E_NODES 1 or 2 (default 2): node A only, or node A and node B (net.sh,
#                  node_vars: node B's pieces live below $E2E_ROOT/node-b)
# Writes $E2E_ROOT/cluster.env (KUBECONFIG, KUBELET_DIR, NODE_NAME, images, and for
# node B NODE_B_NAME, NODE_B_KUBELET_DIR, ...).
#
# Network hygiene: apiserver and kubelet listen on the cluster bridge's own address,
# etcd and the controllers on loopback; pods get a route to the bridge subnet and the
# service CIDR only (no default route, no DNS server, no masquerade, no IP forwarding);
# the service CIDR is routed to a dummy interface, and the one service pods need (the
# "kubernetes" service) is DNATed to the apiserver by a chain of our own, since there is
# no kube-proxy.
set -euo pipefail
shopt -s inherit_errexit
here="$(cd "$(dirname "$0")" && pwd)"
bindir="$(readlink -f "${1:?usage: up.sh BIN_DIR IMAGES_ENV}")"
images_env="$(readlink -f "${2:?usage: up.sh BIN_DIR IMAGES_ENV}")"
# shellcheck source=net.sh
. "${here}/net.sh"
ROOT="${E2E_ROOT:-/tmp/csi-pmem-e2e}"
NODES="${E2E_NODES:-2}"
node_vars "${ROOT}" 0
NODE_NAME="${N_NAME}"
# containerd's device_ownership_from_security_context; false shows what users without
# it get (test_cluster.py then expects EACCES on Block devices).
DEVICE_OWNERSHIP="${E2E_DEVICE_OWNERSHIP:-true}"
# E2E_NRI=1: containerd 2.x from E2E_CONTAINERD_BIN (build.sh containerd) with NRI on,
# its socket at $ROOT/nri/nri.sock (nri_config below); Debian's runc either way.
NRI="${E2E_NRI:-0}"
export PATH="${bindir}:${PATH}"
log() { echo "up: [$(date +%T)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ "$(id -u)" == 0 ]] || die "run as root (mounts, cgroups, network interfaces)"
[[ "${NODES}" =~ ^[0-9]+$ ]] && ((NODES >= 1 && NODES <= MAX_NODES)) \
  || die "E2E_NODES must be 1 to ${MAX_NODES}, not ${NODES}"
[[ "${DEVICE_OWNERSHIP}" == true || "${DEVICE_OWNERSHIP}" == false ]] \
  || die "E2E_DEVICE_OWNERSHIP must be true or false, not ${DEVICE_OWNERSHIP}"
[[ "${NRI}" == 0 || "${NRI}" == 1 ]] || die "E2E_NRI must be 0 or 1, not ${NRI}"
if [[ "${NRI}" == 1 ]]; then
  [[ -x "${E2E_CONTAINERD_BIN:-}/containerd" ]] \
    || die "E2E_NRI=1 needs E2E_CONTAINERD_BIN, the directory build.sh containerd prints"
  PATH="$(readlink -f "${E2E_CONTAINERD_BIN}"):${PATH}"
fi
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl; do
  [[ -x "${bindir}/${b}" ]] || die "${bindir}/${b} missing: run e2e/cluster/build.sh"
done
for b in containerd containerd-shim-runc-v2 runc ctr openssl iptables ip; do
  command -v "${b}" >/dev/null || die "${b} missing: run e2e/cluster/build.sh debs"
done
if [[ -e "${ROOT}/pids" || -e "${ROOT}/state.env" ]]; then
  for p in "${ROOT}"/pids/*.pid; do
    [[ -f "${p}" ]] && kill -0 "$(cat "${p}")" 2>/dev/null \
      && die "a cluster is running in ${ROOT} ($(basename "${p}" .pid) is alive): stop it" \
        "with E2E_ROOT=${ROOT} ${here}/down.sh, or use another E2E_ROOT"
  done
  log "leftover ${ROOT} of a dead cluster: cleaning it with down.sh first"
  E2E_ROOT="${ROOT}" "${here}/down.sh"
fi

on_fail() {
  local rc=$?
  ((rc)) || return 0
  log "failed (rc ${rc}); last lines of the logs:"
  for f in "${ROOT}"/logs/*.log; do
    [[ -f "${f}" ]] && { echo "--- ${f}" >&2; tail -5 "${f}" >&2; }
  done
  [[ -n "${E2E_KEEP_ON_FAILURE:-}" ]] || E2E_ROOT="${ROOT}" "${here}/down.sh" || true
  exit "${rc}"
}
# On EXIT, not ERR: die and a failure inside a function (errexit) end here too.
trap on_fail EXIT

t_up=$(date +%s)
mkdir -p "${ROOT}"/{pids,logs,pki,etcd}
for ((i = 0; i < NODES; i++)); do
  node_vars "${ROOT}" "${i}"
  mkdir -p "${N_ROOT}"/{containerd,cni/net.d,cni/ipam,kubelet,pod-logs,runc}
done
echo "ROOT=${ROOT}" > "${ROOT}/state.env"
echo "NODES=${NODES}" >> "${ROOT}/state.env"
# Two host paths are fixed in the components: kubelet's /var/log/containers symlinks and
# the containerd shims' socket directory /run/containerd/s. down.sh removes what we add
# there, and the directories themselves when they did not exist before.
for d in /var/log/containers /run/containerd; do
  [[ -e "${d}" ]] || echo "${d}" >> "${ROOT}/created-dirs"
done
# /var/lib/kubelet: the mount point of each node's own kubelet dir, in that node's mount
# namespace only (node-init.sh). The host's stays as it is.
if [[ ! -e /var/lib/kubelet ]]; then
  mkdir /var/lib/kubelet
  echo /var/lib/kubelet >> "${ROOT}/created-dirs"
fi

# A shared mount at the root: kubelet's dir needs Bidirectional propagation for the
# driver's tmpfs mounts (the host's / is private here), and down.sh unmounts below it.
mount --bind "${ROOT}" "${ROOT}"
mount --make-rshared "${ROOT}"
echo "ROOT_BIND=1" >> "${ROOT}/state.env"

# ---------------------------------------------------------------- network
for m in overlay bridge veth dummy br_netfilter; do modprobe -q "${m}" 2>/dev/null || true; done
net_up "${ROOT}" "${NODES}"

# ---------------------------------------------------------------- certificates
pki="${ROOT}/pki"
(
  cd "${pki}"
  exec 2>"${ROOT}/logs/openssl.log"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 \
    -subj "/CN=csi-pmem-e2e-ca"
  openssl genrsa -out sa.key 2048
  openssl rsa -in sa.key -pubout -out sa.pub
  cert() {  # cert NAME SUBJECT [SAN]
    openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2"
    local ext="extendedKeyUsage=serverAuth,clientAuth"
    [[ -n "${3:-}" ]] && ext+=$'\n'"subjectAltName=$3"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
      -out "$1.crt" -extfile <(printf '%s\n' "${ext}")
  }
  cert apiserver "/CN=kube-apiserver" \
    "IP:${APISERVER_IP},IP:${KUBERNETES_SVC_IP},IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost"
  cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
  cert admin "/O=system:masters/CN=csi-pmem-e2e-admin"
  cert controller-manager "/CN=system:kube-controller-manager"
  cert scheduler "/CN=system:kube-scheduler"
  for ((i = 0; i < NODES; i++)); do
    node_vars "${ROOT}" "${i}"
    cert "kubelet${N_SUFFIX}-client" "/O=system:nodes/CN=system:node:${N_NAME}"
    cert "kubelet${N_SUFFIX}" "/CN=${N_NAME}" "IP:${N_IP},DNS:${N_NAME}"
  done
)
server="https://${APISERVER_IP}:${APISERVER_PORT}"
kubeconfig() {  # kubeconfig NAME CERT
  cat > "${ROOT}/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {server: "${server}", certificate-authority: "${pki}/ca.crt"}
users:
- name: $1
  user: {client-certificate: "${pki}/$2.crt", client-key: "${pki}/$2.key"}
contexts:
- name: e2e
  context: {cluster: e2e, user: $1}
current-context: e2e
EOF
}
kubeconfig admin admin
kubeconfig controller-manager controller-manager
kubeconfig scheduler scheduler
for ((i = 0; i < NODES; i++)); do
  node_vars "${ROOT}" "${i}"
  kubeconfig "kubelet${N_SUFFIX}" "kubelet${N_SUFFIX}-client"
done
export KUBECONFIG="${ROOT}/admin.kubeconfig"

start() {  # start NAME CMD... : run in its own session, record the PID
  local name=$1; shift
  setsid "$@" > "${ROOT}/logs/${name}.log" 2>&1 < /dev/null 9>&- &
  echo $! > "${ROOT}/pids/${name}.pid"
  log "${name} started (pid $!)"
}
first_child() {  # first_child PID: the PID of PID's first child, once it has one
  local i c
  for i in $(seq 200); do
    c=$(cat "/proc/$1/task/$1/children" 2>/dev/null) || true
    [[ -n "${c}" ]] && { echo "${c%% *}"; return 0; }
    kill -0 "$1" 2>/dev/null || break
    sleep 0.05
  done
  return 1
}
# node_up I: node I's namespaces, PID 1 node-init.sh (unshare forks it: the recorded PID
# is the child, this host's PID of the node's init, which SIGTERM ends with the node).
node_up() {
  node_vars "${ROOT}" "$1"
  local name="node${N_SUFFIX}" ready="${N_ROOT}/node-init.ready" outer init
  setsid unshare --pid --kill-child --mount --mount-proc --propagation unchanged -- \
    "${here}/node-init.sh" "${N_ROOT}/kubelet" "${ready}" \
    > "${ROOT}/logs/${name}.log" 2>&1 < /dev/null 9>&- &
  outer=$!
  init=$(first_child "${outer}") || die "${name}: unshare started no init (see ${ROOT}/logs)"
  echo "${init}" > "${ROOT}/pids/${name}.pid"
  wait_for "${name}'s namespaces (init pid ${init})" 30 test -e "${ready}"
}
# start_in_node NAME CMD...: as start, inside the namespaces of the node node_vars last
# named. nsenter forks the command into the PID namespace and waits for it; the PID
# recorded is the command's own (kill it, and the nsenter that waits goes too).
start_in_node() {
  local name=$1; shift
  local init outer pid
  init=$(cat "${ROOT}/pids/node${N_SUFFIX}.pid")
  setsid nsenter --target "${init}" --pid --mount -- "$@" \
    > "${ROOT}/logs/${name}.log" 2>&1 < /dev/null 9>&- &
  outer=$!
  pid=$(first_child "${outer}") || die "${name}: nsenter into node${N_SUFFIX} failed" \
    "($(tail -2 "${ROOT}/logs/${name}.log"))"
  echo "${pid}" > "${ROOT}/pids/${name}.pid"
  log "${name} started in node${N_SUFFIX} (pid ${pid})"
}
wait_for() {  # wait_for WHAT SECONDS CMD...
  local what=$1 secs=$2; shift 2
  local t0; t0=$(date +%s)
  until "$@" >/dev/null 2>&1; do
    (( $(date +%s) - t0 < secs )) || die "${what} not ready after ${secs} s"
    for p in "${ROOT}"/pids/*.pid; do
      kill -0 "$(cat "${p}")" 2>/dev/null || die "$(basename "${p}" .pid) exited (see ${ROOT}/logs)"
    done
    sleep 0.5
  done
  log "${what} ready after $(( $(date +%s) - t0 )) s"
}

# ---------------------------------------------------------------- etcd
start etcd etcd --name e2e --data-dir "${ROOT}/etcd" \
  --listen-client-urls "http://127.0.0.1:${ETCD_PORT}" \
  --advertise-client-urls "http://127.0.0.1:${ETCD_PORT}" \
  --listen-peer-urls "http://127.0.0.1:${ETCD_PEER_PORT}" \
  --initial-advertise-peer-urls "http://127.0.0.1:${ETCD_PEER_PORT}" \
  --initial-cluster "e2e=http://127.0.0.1:${ETCD_PEER_PORT}" \
  --listen-metrics-urls "" --log-level warn --unsafe-no-fsync
wait_for etcd 60 curl -sf "http://127.0.0.1:${ETCD_PORT}/health"

# ---------------------------------------------------------------- containerd
# The NRI section of containerd's config (E2E_NRI=1; containerd 2.x reads the version 2
# config below and migrates it). No plugin_path: the only plugin is the chart's, which
# connects to the socket itself.
nri_socket=""
[[ "${NRI}" == 1 ]] && nri_socket="${ROOT}/nri/nri.sock"
nri_config() {  # after node_vars: each node its own NRI socket (node A: nri_socket)
  [[ "${NRI}" == 1 ]] || return 0
  mkdir -p "${N_ROOT}/nri"
  cat <<EOF
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  socket_path = "${N_ROOT}/nri/nri.sock"
  plugin_path = ""
  plugin_config_path = ""
EOF
}
# One per node, each with its own config, root, state, socket, runc root and CNI
# config. Started early: importing the images overlaps with the control plane's start.
# shellcheck disable=SC1090
. "${images_env}"
# (The bodies of containerd_up and kubelet_up are the single-node script's lines, not
# re-indented, with the node's names from node_vars.)
containerd_up() {  # containerd_up I: start node I's containerd, import the images
node_vars "${ROOT}" "$1"
local ctrd="${N_ROOT}/containerd"
cat > "${ctrd}/config.toml" <<EOF
version = 2
root = "${ctrd}/root"
state = "${ctrd}/state"
plugin_dir = ""
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "${ctrd}/containerd.sock"
[ttrpc]
  address = "${ctrd}/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "${ctrd}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "${PAUSE_IMAGE}"
  # root here lacks CAP_SYS_RESOURCE: never lower a container's oom_score_adj below ours.
  restrict_oom_score_adj = true
  # Device nodes of Block volumes (volumeDevices) belong to the pod's runAsUser and
  # runAsGroup instead of root: without it an unprivileged pod cannot open them
  # (EACCES). A setting users need too (docs/install.md, "fsdax claims").
  device_ownership_from_security_context = ${DEVICE_OWNERSHIP}
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    discard_unpacked_layers = false
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "${N_ROOT}/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "${N_ROOT}/cni/net.d"
    max_conf_num = 1
EOF
nri_config >> "${ctrd}/config.toml"
write_cni_conf "${N_ROOT}"
node_up "$1"
start_in_node "containerd${N_SUFFIX}" containerd --config "${ctrd}/config.toml" --log-level warn
wait_for "containerd${N_SUFFIX}" 30 ctr --address "${ctrd}/containerd.sock" version
import_images "${ctrd}/containerd.sock" > "${ROOT}/logs/import${N_SUFFIX}.log" 2>&1 &
import_pids+=("$!")
}
import_images() {  # import_images SOCKET: every image into one node's containerd
  local t0; t0=$(date +%s)
  ctr_() { ctr --address "$1" -n k8s.io "${@:2}"; }
  local v
  for v in PAUSE DRIVER WORKLOAD PROVISIONER REGISTRAR LIVENESSPROBE NRI MODEL; do
    local a="${v}_IMAGE_ARCHIVE"
    # NRI and MODEL: only when images.sh made them (E2E_NRI=1)
    [[ "${v}" == NRI || "${v}" == MODEL ]] && [[ -z "${!a:-}" ]] && continue
    ctr_ "$1" images import --no-unpack=false "${!a}" > /dev/null
  done
  # Pin the sandbox image so kubelet's image GC never removes it.
  ctr_ "$1" images label "${PAUSE_IMAGE}" io.cri-containerd.pinned=pinned > /dev/null
  echo "$(( $(date +%s) - t0 ))"
}
import_pids=()
for ((i = 0; i < NODES; i++)); do containerd_up "${i}"; done

# ---------------------------------------------------------------- control plane
start kube-apiserver kube-apiserver \
  --etcd-servers "http://127.0.0.1:${ETCD_PORT}" \
  --bind-address "${APISERVER_IP}" --advertise-address "${APISERVER_IP}" \
  --secure-port "${APISERVER_PORT}" \
  --service-cluster-ip-range "${SERVICE_CIDR}" \
  --tls-cert-file "${pki}/apiserver.crt" --tls-private-key-file "${pki}/apiserver.key" \
  --client-ca-file "${pki}/ca.crt" \
  --kubelet-client-certificate "${pki}/apiserver-kubelet-client.crt" \
  --kubelet-client-key "${pki}/apiserver-kubelet-client.key" \
  --kubelet-preferred-address-types InternalIP \
  --service-account-key-file "${pki}/sa.pub" \
  --service-account-signing-key-file "${pki}/sa.key" \
  --service-account-issuer "https://kubernetes.default.svc.cluster.local" \
  --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
  --allow-privileged=true --profiling=false --v=1
wait_for kube-apiserver 120 kubectl get --raw /readyz
start kube-controller-manager kube-controller-manager \
  --kubeconfig "${ROOT}/controller-manager.kubeconfig" \
  --authentication-kubeconfig "${ROOT}/controller-manager.kubeconfig" \
  --authorization-kubeconfig "${ROOT}/controller-manager.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "${KCM_PORT}" --leader-elect=false \
  --service-account-private-key-file "${pki}/sa.key" --root-ca-file "${pki}/ca.crt" \
  --use-service-account-credentials=true --service-cluster-ip-range "${SERVICE_CIDR}" \
  --allocate-node-cidrs=false --profiling=false --v=1
start kube-scheduler kube-scheduler \
  --kubeconfig "${ROOT}/scheduler.kubeconfig" \
  --authentication-kubeconfig "${ROOT}/scheduler.kubeconfig" \
  --authorization-kubeconfig "${ROOT}/scheduler.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "${SCHED_PORT}" --leader-elect=false \
  --profiling=false --v=1

# ---------------------------------------------------------------- kubelet
# kubelet's pods go below a cgroup of our own in every v1 hierarchy (and the unified
# one): down.sh removes it, and nothing of ours lands in the host's top-level cgroups.
# Node B's is below node A's (net.sh, node_vars), so one sweep of it finds every pod.
for c in /sys/fs/cgroup/*/; do
  for ((i = 0; i < NODES; i++)); do
    node_vars "${ROOT}" "${i}"
    mkdir -p "${c}${N_CGROUP}"
    if [[ -f "${c}cpuset.cpus" ]]; then
      cat "${c}cpuset.cpus" > "${c}${N_CGROUP}/cpuset.cpus"
      cat "${c}cpuset.mems" > "${c}${N_CGROUP}/cpuset.mems"
    fi
  done
done
echo "CGROUP_ROOT=${CGROUP_ROOT}" >> "${ROOT}/state.env"
: > "${ROOT}/resolv.conf"   # hostNetwork pods with dnsPolicy Default: no server at all
kubelet_up() {  # kubelet_up I: start node I's kubelet
node_vars "${ROOT}" "$1"
local ctrd="${N_ROOT}/containerd"
cat > "${N_ROOT}/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /${N_CGROUP}
containerRuntimeEndpoint: unix://${ctrd}/containerd.sock
address: ${N_IP}
port: ${KUBELET_PORT}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: ${N_HEALTHZ_PORT}
tlsCertFile: ${pki}/kubelet${N_SUFFIX}.crt
tlsPrivateKeyFile: ${pki}/kubelet${N_SUFFIX}.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: ${pki}/ca.crt}
authorization: {mode: Webhook}
resolvConf: ${ROOT}/resolv.conf
clusterDomain: cluster.local
clusterDNS: [${CLUSTER_DNS_IP}]
podLogsDir: ${N_ROOT}/pod-logs
volumePluginDir: ${N_ROOT}/kubelet/volume-plugins
makeIPTablesUtilChains: false
failSwapOn: false
staticPodPath: ""
syncFrequency: 10s
fileCheckFrequency: 10s
nodeStatusUpdateFrequency: 5s
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
enforceNodeAllocatable: [pods]
maxPods: 50
EOF
start_in_node "kubelet${N_SUFFIX}" kubelet --config "${N_ROOT}/kubelet-config.yaml" \
  --kubeconfig "${ROOT}/kubelet${N_SUFFIX}.kubeconfig" --root-dir "${N_ROOT}/kubelet" \
  --hostname-override "${N_NAME}" --node-ip "${N_IP}" --v=1
}
for ((i = 0; i < NODES; i++)); do kubelet_up "${i}"; done
for ((i = 0; i < NODES; i++)); do
  node_vars "${ROOT}" "${i}"
  wait "${import_pids[i]}" \
    || die "image import failed: $(tail -5 "${ROOT}/logs/import${N_SUFFIX}.log")"
  log "images imported into containerd${N_SUFFIX} in" \
    "$(tail -1 "${ROOT}/logs/import${N_SUFFIX}.log") s"
done
node_ready() {
  [[ "$(kubectl get node "$1" \
    -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" == True ]]
}
for ((i = 0; i < NODES; i++)); do
  node_vars "${ROOT}" "${i}"
  wait_for "node ${N_NAME}" 120 node_ready "${N_NAME}"
done
wait_for "default service account" 60 kubectl -n default get serviceaccount default

cat > "${ROOT}/cluster.env" <<EOF
E2E_ROOT=${ROOT}
KUBECONFIG=${ROOT}/admin.kubeconfig
KUBELET_DIR=${ROOT}/kubelet
NODE_NAME=${NODE_NAME}
BIN_DIR=${bindir}
CONTAINERD_SOCK=${ROOT}/containerd/containerd.sock
STATE_DIR=${ROOT}/csi-pmem-state
DEVICE_OWNERSHIP_FROM_SECURITY_CONTEXT=${DEVICE_OWNERSHIP}
NRI=${NRI}
NRI_SOCKET=${nri_socket}
CONTAINERD_VERSION=$(containerd --version | cut -d' ' -f3)
NODES=${NODES}
EOF
if ((NODES > 1)); then
  node_vars "${ROOT}" 1
  cat >> "${ROOT}/cluster.env" <<EOF
NODE_B_NAME=${N_NAME}
NODE_B_KUBELET_DIR=${N_ROOT}/kubelet
NODE_B_STATE_DIR=${N_ROOT}/csi-pmem-state
NODE_B_CONTAINERD_SOCK=${N_ROOT}/containerd/containerd.sock
EOF
fi
grep -E '^[A-Z_]+_IMAGE=' "${images_env}" >> "${ROOT}/cluster.env"
trap - EXIT
log "cluster up in $(( $(date +%s) - t_up )) s; env: ${ROOT}/cluster.env"
echo "${ROOT}/cluster.env"
