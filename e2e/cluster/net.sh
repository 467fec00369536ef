# Addresses, ports and the network pieces of the test bed; sourced by up.sh and down.sh.
# Everything created here is named cpe2e* / CSIPMEM-E2E so that down.sh removes exactly
# what we made, and nothing else.
# shellcheck shell=bash disable=SC2034
BRIDGE=cpe2e0                    # node A's CNI bridge; its address is the node's address
POD_CIDR=10.88.77.0/24
APISERVER_IP=10.88.77.1          # node A's bridge address
MAX_NODES=2                      # node A (index 0) and node B (index 1): node_vars
SERVICE_CIDR=10.97.77.0/24
KUBERNETES_SVC_IP=10.97.77.1     # first address of the service CIDR
# Pods' nameserver: an address in the service CIDR with nothing behind it, so lookups
# fail on our own bridge (containerd would otherwise copy the host's resolv.conf, whose
# server is off the machine).
CLUSTER_DNS_IP=10.97.77.10
NAT_CHAIN=CSIPMEM-E2E
FWD_CHAIN=CSIPMEM-E2E-FWD
CGROUP_ROOT=csi-pmem-e2e
ETCD_PORT=12379
ETCD_PEER_PORT=12380
APISERVER_PORT=16443
KCM_PORT=20257
SCHED_PORT=20259
KUBELET_PORT=20250               # on each node's own address
KUBELET_HEALTHZ_PORT=20248       # loopback: node A 20248, node B 20246

# node_vars ROOT I: the names of node I (0: node A, the single node of E2E_NODES=1; 1:
# node B). Each node has its own bridge and pod subnet (10.88.77+I.0/24, the bridge's
# address is the node's address), its own containerd and kubelet below N_ROOT (node A:
# the root itself, where the single-node test bed always kept them), and its own PID and
# log names (kubelet, containerd; kubelet-b, containerd-b). down.sh uses the same
# function, so it finds what a failed up.sh left of either node.
node_vars() {
  local root=$1 i=$2
  N_INDEX=${i}
  N_BRIDGE=cpe2e${i}
  N_CIDR=10.88.$((77 + i)).0/24
  N_IP=10.88.$((77 + i)).1
  N_RANGE=10.88.$((77 + i))
  N_HEALTHZ_PORT=$((KUBELET_HEALTHZ_PORT - 2 * i))
  if ((i == 0)); then
    N_SUFFIX="" N_ROOT=${root} N_NAME=${E2E_NODE_NAME:-csi-pmem-e2e-node}
    N_CGROUP=${CGROUP_ROOT} N_NET=csi-pmem-e2e
  else
    local letters=(a b c d) letter; letter=${letters[i]}
    N_SUFFIX=-${letter} N_ROOT=${root}/node-${letter}
    N_NAME=${E2E_NODE_NAME:-csi-pmem-e2e-node}-${letter}
    # Below node A's cgroup: down.sh's sweep of CGROUP_ROOT covers it too.
    N_CGROUP=${CGROUP_ROOT}/node-${letter} N_NET=csi-pmem-e2e-${letter}
  fi
}

net_up() {  # net_up ROOT NODES
  local root=$1 nodes=${2:-1} i
  for ((i = 0; i < nodes; i++)); do
    node_vars "${root}" "${i}"
    ip link add "${N_BRIDGE}" type bridge
    ip addr add "${N_IP}/24" dev "${N_BRIDGE}"
    ip link set "${N_BRIDGE}" up
  done
  # The service CIDR goes to our own bridge, never to the default route. (A dummy
  # interface would do too, but this kernel has no dummy driver: "Unknown device type".)
  ip route add "${SERVICE_CIDR}" dev "${BRIDGE}"
  # No kube-proxy: the one service pods use, "kubernetes", goes to the apiserver. A pod
  # of node B reaches it the same way: DNATed to node A's address, which is local, so
  # nothing is forwarded between the bridges.
  iptables -w -t nat -N "${NAT_CHAIN}"
  iptables -w -t nat -A "${NAT_CHAIN}" -d "${KUBERNETES_SVC_IP}/32" -p tcp --dport 443 \
    -j DNAT --to-destination "${APISERVER_IP}:${APISERVER_PORT}"
  iptables -w -t nat -I OUTPUT -d "${SERVICE_CIDR}" -j "${NAT_CHAIN}"
  iptables -w -t nat -I PREROUTING -d "${SERVICE_CIDR}" -j "${NAT_CHAIN}"
  # Pods never leave their bridge: nothing from any of ours is forwarded anywhere (not
  # to the other node's bridge either; no scenario needs pod-to-pod traffic).
  iptables -w -N "${FWD_CHAIN}"
  iptables -w -A "${FWD_CHAIN}" -i "cpe2e+" -j DROP
  iptables -w -A "${FWD_CHAIN}" -o "cpe2e+" -j DROP
  iptables -w -I FORWARD -j "${FWD_CHAIN}"
}

write_cni_conf() {  # write_cni_conf NODE_ROOT (after node_vars: the node's bridge)
  # isGateway false: the bridge plugin would otherwise switch on host-wide IP
  # forwarding. The gateway address is set on the bridge by net_up; pods get a route to
  # the service CIDR through it and no default route.
  cat > "$1/cni/net.d/10-${N_NET}.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "${N_NET}",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "${N_BRIDGE}",
      "isGateway": false,
      "ipMasq": false,
      "hairpinMode": false,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "${N_CIDR}", "gateway": "${N_IP}",
                     "rangeStart": "${N_RANGE}.10", "rangeEnd": "${N_RANGE}.250"}]],
        "routes": [{"dst": "${SERVICE_CIDR}", "gw": "${N_IP}"}],
        "dataDir": "$1/cni/ipam"
      }
    }
  ]
}
EOF
}

net_down() {  # net_down ROOT: remove what net_up recorded (safe to repeat)
  local root=$1
  iptables -w -t nat -D OUTPUT -d "${SERVICE_CIDR}" -j "${NAT_CHAIN}" 2>/dev/null || true
  iptables -w -t nat -D PREROUTING -d "${SERVICE_CIDR}" -j "${NAT_CHAIN}" 2>/dev/null || true
  iptables -w -D FORWARD -j "${FWD_CHAIN}" 2>/dev/null || true
  # By name: net_up may have failed before recording what it made.
  iptables -w -t nat -F "${NAT_CHAIN}" 2>/dev/null && iptables -w -t nat -X "${NAT_CHAIN}"
  iptables -w -F "${FWD_CHAIN}" 2>/dev/null && iptables -w -X "${FWD_CHAIN}"
  # veths of pods whose netns is already gone vanish with it; any left on a bridge go.
  # Every node's bridge, whether or not up.sh got as far as recording the node count.
  local veth i
  for ((i = 0; i < MAX_NODES; i++)); do
    node_vars "${root}" "${i}"
    for veth in $(ip -o link show master "${N_BRIDGE}" 2>/dev/null | awk -F': ' '{print $2}' \
        | cut -d@ -f1); do
      ip link del "${veth}" 2>/dev/null || true
    done
    ip link del "${N_BRIDGE}" 2>/dev/null || true
  done
  return 0
}
