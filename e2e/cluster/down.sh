#!/usr/bin/env bash
# Tear down what up.sh started, by recorded PID, and everything it left behind on every
# node: pod containers and their containerd shims, every mount below the temp root (kubelet pod
# volumes, the driver's tmpfs publishes, overlay roots, netns files), the cgroups, the
# interfaces and iptables chains it created. Safe to run twice, and after a failed or
# half-finished up.sh. Copies the logs to $E2E_LOG_DIR (default build/e2e-cluster/logs)
# before deleting the temp root.
#
# Usage: e2e/cluster/down.sh      Env: E2E_ROOT (default /tmp/csi-pmem-e2e), E2E_LOG_DIR
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=net.sh
. "${here}/net.sh"
ROOT="${E2E_ROOT:-/tmp/csi-pmem-e2e}"
LOG_DIR="${E2E_LOG_DIR:-${here}/../../build/e2e-cluster/logs}"
log() { echo "down: [$(date +%T)] $*" >&2; }
[[ -d "${ROOT}" ]] || { log "nothing to do (${ROOT} does not exist)"; exit 0; }

# stop_pid NAME PID [MATCH]: TERM, wait up to 10 s, KILL. MATCH (a string that must be
# in the process's command line) guards against a recycled PID.
stop_pid() {
  local name=$1 pid=$2 match=${3:-}
  [[ "${pid}" =~ ^[0-9]+$ ]] || return 0
  kill -0 "${pid}" 2>/dev/null || return 0
  if [[ -n "${match}" ]] && ! tr '\0' ' ' < "/proc/${pid}/cmdline" 2>/dev/null \
      | grep -qF -- "${match}"; then
    log "pid ${pid} (${name}) is no longer ours; leaving it"
    return 0
  fi
  kill -TERM "${pid}" 2>/dev/null
  local i
  for i in $(seq 100); do kill -0 "${pid}" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "${pid}" 2>/dev/null; then
    log "${name} (pid ${pid}) ignored SIGTERM; SIGKILL"
    kill -KILL "${pid}" 2>/dev/null
    for i in $(seq 50); do kill -0 "${pid}" 2>/dev/null || break; sleep 0.1; done
  fi
  log "stopped ${name} (pid ${pid})"
}
# procs_of STRING: PIDs of the processes whose command line contains STRING (not this
# script's).
procs_of() {
  local p
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [[ "${p}" == "$$" ]] && continue
    tr '\0' ' ' < "/proc/${p}/cmdline" 2>/dev/null | grep -qF -- "$1" && echo "${p}"
  done
  return 0
}
stop_recorded() {  # stop_recorded NAME
  local f="${ROOT}/pids/$1.pid"
  [[ -f "${f}" ]] || return 0
  stop_pid "$1" "$(cat "${f}")" "$2"
  rm -f "${f}"
}

# 1. kubelets and the controllers first, so nothing restarts the pods we stop next.
#    Every node up.sh may have started (MAX_NODES, net.sh), recorded or not.
for ((n = 0; n < MAX_NODES; n++)); do
  node_vars "${ROOT}" "${n}"
  stop_recorded "kubelet${N_SUFFIX}" kubelet
done
stop_recorded kube-controller-manager kube-controller-manager
stop_recorded kube-scheduler kube-scheduler

# 2. Pod containers, node by node: kill every task through the node's containerd while
#    it still runs, then stop the shims, found by the socket on their command line (the
#    PIDs containerd records in the bundles are numbered in the node's PID namespace,
#    not this host's; containerd 1.x writes none for a pod's grouped shim). The node's
#    init, stopped last, takes whatever is left of the node with it.
for ((n = 0; n < MAX_NODES; n++)); do
node_vars "${ROOT}" "${n}"
ctrd="${N_ROOT}/containerd"
sock="${ctrd}/containerd.sock"
if [[ -S "${sock}" ]] \
    && kill -0 "$(cat "${ROOT}/pids/containerd${N_SUFFIX}.pid" 2>/dev/null)" 2>/dev/null
then
  ctr_() { timeout 20 ctr --address "${sock}" -n k8s.io "$@"; }
  for t in $(ctr_ tasks ls -q 2>/dev/null); do
    ctr_ tasks kill -a -s SIGKILL "${t}" >/dev/null 2>&1
  done
  for i in $(seq 50); do
    [[ -z "$(ctr_ tasks ls 2>/dev/null | awk 'NR>1 && $3!="STOPPED"')" ]] && break
    sleep 0.2
  done
  for t in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks rm -f "${t}" >/dev/null 2>&1; done
fi
for pid in $(procs_of "-address ${sock}"); do
  stop_pid "shim ${pid}" "${pid}" "${sock}"
done
stop_recorded "containerd${N_SUFFIX}" "${ctrd}/config.toml"
# The node's init (up.sh, node-init.sh): on SIGTERM it exits, and the kernel kills
# whatever of the node is still running in its PID namespace.
stop_recorded "node${N_SUFFIX}" node-init.sh
done

# 3. Control plane.
stop_recorded kube-apiserver kube-apiserver
stop_recorded etcd etcd
# Anything else recorded (a driver started by hand, port-forwards, ...).
for f in "${ROOT}"/pids/*.pid; do
  [[ -f "${f}" ]] || continue
  stop_recorded "$(basename "${f}" .pid)" ""
done

# 4. Any process still in our cgroups (pods whose shim died early) is ours: stop it.
for c in /sys/fs/cgroup/*/"${CGROUP_ROOT}"; do
  [[ -d "${c}" ]] || continue
  for p in $(find "${c}" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u); do
    kill -KILL "${p}" 2>/dev/null && log "killed leftover pod process ${p}"
  done
done

# Last, anything that still names the root on its command line (a shim, a daemon whose
# PID file was lost) is ours.
for pid in $(procs_of "${ROOT}/"); do
  kill -KILL "${pid}" 2>/dev/null && log "killed leftover process ${pid}"
done

# 5. Loop devices of the test bed: backed by a file below the root (the driver's fsdax
#    volumes, kubelet's loop over a Block volume's global map path) or by one of those
#    (the driver's read-only views). losetup -d of one still in use (mounted, or under
#    another loop) only marks it autoclear: the kernel frees it once the unmounts below
#    release it. Other loop devices of the host are left alone.
our_loops() {
  local f b
  declare -A back=() ours=()
  for f in /sys/block/loop*/loop/backing_file; do
    [[ -f "${f}" ]] || continue
    b=$(cat "${f}" 2>/dev/null) || continue
    f=${f#/sys/block/}; back["/dev/${f%%/*}"]=${b% (deleted)}
  done
  for f in "${!back[@]}"; do [[ "${back[${f}]}" == "${ROOT}/"* ]] && ours["${f}"]=1; done
  local grew=1
  while ((grew)); do
    grew=0
    for f in "${!back[@]}"; do
      [[ -z "${ours[${f}]:-}" && -n "${ours[${back[${f}]}]:-}" ]] && { ours["${f}"]=1; grew=1; }
    done
  done
  ((${#ours[@]})) && printf '%s\n' "${!ours[@]}"
  return 0
}
for d in $(our_loops); do
  losetup -d "${d}" 2>/dev/null && log "detached loop device ${d}"
done

# 6. Unmount everything below the root, deepest first; lazily if busy. Repeat: mounts
#    that propagated into several places can need more than one pass.
for pass in 1 2 3; do
  mapfile -t mps < <(awk -v r="${ROOT}" '$5 == r || index($5, r "/") == 1 {print $5}' \
    /proc/self/mountinfo | awk '{print length, $0}' | sort -rn | cut -d' ' -f2- | uniq)
  ((${#mps[@]})) || break
  for m in "${mps[@]}"; do
    m=$(printf '%b' "${m}")   # mountinfo escapes spaces as \040
    umount "${m}" 2>/dev/null || umount -l "${m}" 2>/dev/null || true
  done
done
left=$(awk -v r="${ROOT}" '$5 == r || index($5, r "/") == 1' /proc/self/mountinfo | wc -l)
((left == 0)) || log "WARNING: ${left} mounts below ${ROOT} could not be removed"

# Anything of the test bed still there after this is a leak, and fails the tear-down
# (and so the run): test_node_crash.py leaves a dead node with a pod on it for this.
leaked=0
for i in $(seq 25); do  # autoclear loops go once their last user does: give it 5 s
  left_loops=$(our_loops | xargs)
  [[ -z "${left_loops}" ]] && break
  sleep 0.2
done
[[ -z "${left_loops}" ]] || { log "LEAK: loop devices of the test bed still attached:" \
  "${left_loops}"; leaked=1; }

for i in $(seq 25); do  # killed above: give them 5 s to go
  left_procs=$(procs_of "${ROOT}/" | xargs)
  [[ -z "${left_procs}" ]] && break
  sleep 0.2
done
[[ -z "${left_procs}" ]] || { log "LEAK: processes of the test bed still running:" \
  "${left_procs}"; leaked=1; }

# 7. Cgroups (children first), interfaces, iptables chains.
for c in /sys/fs/cgroup/*/"${CGROUP_ROOT}"; do
  [[ -d "${c}" ]] || continue
  for i in $(seq 25); do  # processes killed in step 4 may still be exiting
    find "${c}" -depth -type d -exec rmdir {} \; 2>/dev/null
    [[ -d "${c}" ]] || break
    sleep 0.2
  done
  [[ -d "${c}" ]] && { log "LEAK: cgroup ${c} still has members"; leaked=1; }
done
net_down "${ROOT}"

# 8. Kubelet's symlinks to our pod logs, and host directories we created.
for l in /var/log/containers/*.log; do
  [[ -L "${l}" && "$(readlink "${l}")" == "${ROOT}/"* ]] && rm -f "${l}"
done
if [[ -f "${ROOT}/created-dirs" ]]; then
  while read -r d; do
    case "${d}" in
      /var/log/containers) rmdir "${d}" 2>/dev/null ;;
      /run/containerd) rmdir "${d}/s" "${d}" 2>/dev/null ;;
      /var/lib/kubelet) rmdir "${d}" 2>/dev/null ;;
    esac
  done < "${ROOT}/created-dirs"
fi

# 9. Keep the logs, drop the root (on a different file system than the repo, mv fails).
if [[ -d "${ROOT}/logs" ]]; then
  rm -rf "${LOG_DIR}"; mkdir -p "${LOG_DIR}"
  cp -r "${ROOT}/logs/." "${LOG_DIR}/" 2>/dev/null
  find "${ROOT}/pod-logs" "${ROOT}"/node-*/pod-logs -name '*.log' 2>/dev/null \
      | while read -r f; do
    d="${LOG_DIR}/pods/$(basename "$(dirname "$(dirname "${f}")")")"
    mkdir -p "${d}"; cp "${f}" "${d}/$(basename "$(dirname "${f}")")-$(basename "${f}")"
  done
fi
if [[ -z "$(awk -v r="${ROOT}" '$5 == r || index($5, r "/") == 1' /proc/self/mountinfo)" ]]
then
  rm -rf "${ROOT}"
  log "removed ${ROOT}; logs in $(readlink -f "${LOG_DIR}")"
  exit "${leaked}"
else
  log "WARNING: left ${ROOT} in place (mounts remain)"
  exit 1
fi
