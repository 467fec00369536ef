#!/usr/bin/env bash
# PID 1 of one test-bed node's own PID and mount namespaces (up.sh starts it with
# unshare; containerd and kubelet are started into its namespaces with nsenter).
#
# Why a node gets namespaces of its own: on a real machine PID 1 is the node's init and
# /var/lib/kubelet is kubelet's directory, and tools built for nodes rely on both.
# Kubernetes' storage e2e suite runs commands "on the node" from a privileged pod with
# nsenter --mount=/rootfs/proc/1/ns/mnt and looks for pod volumes below
# /var/lib/kubelet/pods. This host's own PID 1 is the VM's init, whose namespaces even
# root may not open, and two nodes cannot share one /var/lib/kubelet. Here, in each
# node's namespaces, PID 1 is this script and /var/lib/kubelet is that node's kubelet
# directory; hostPID pods see their own node's processes only.
#
# Mounts: the namespace starts as a copy of the host's. The test bed's root is a shared
# mount (up.sh), so its copy here is a peer of the host's: every mount made below it
# (publishes, pod volumes, netns files) shows on the host as before, which is where the
# tests and down.sh look. The bind on /var/lib/kubelet is made under a mount turned
# private here first, so it stays in this namespace.
#
# Life: it reaps the orphans the kernel hands it (containerd's shims re-parent to PID 1)
# and waits. SIGTERM ends it, and with it every process of the node: the kernel kills
# what is left in a PID namespace whose init exits.
#
# Usage: node-init.sh KUBELET_DIR READY_FILE
set -euo pipefail
kubelet_dir=${1:?usage: node-init.sh KUBELET_DIR READY_FILE}
ready=${2:?usage: node-init.sh KUBELET_DIR READY_FILE}
(($$ == 1)) || { echo "node-init: not PID 1 of a PID namespace of its own" >&2; exit 1; }
[[ -d /var/lib/kubelet ]] || { echo "node-init: /var/lib/kubelet missing (up.sh makes it)" >&2; exit 1; }
mount --make-private "$(findmnt -n -o TARGET -T /var/lib/kubelet)"
mount --bind "${kubelet_dir}" /var/lib/kubelet
echo "node-init: /var/lib/kubelet is ${kubelet_dir} here" >&2
: > "${ready}"
trap 'exit 0' TERM INT
while :; do
  sleep 3600 &
  wait $! || true
done
