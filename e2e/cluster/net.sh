# Addresses, ports and the network pieces of the test bed; sourced by up.sh and down.sh.
# Everything created here is named cpe2e* / CSIPMEM-E2E so that down.sh removes exactly
# what we made, and nothing else.
# shellcheck shell=bash disable=SC2034
BRIDGE=cpe2e0                    # the CNI bridge; its address is the node's address
POD_CIDR=10.88.77.0/24
APISERVER_IP=10.88.77.1          # the bridge's own address
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
KUBELET_PORT=20250
KUBELET_HEALTHZ_PORT=20248

net_up() {  # net_up ROOT
  local root=$1
  ip link add "${BRIDGE}" type bridge
  ip addr add "${APISERVER_IP}/24" dev "${BRIDGE}"
  ip link set "${BRIDGE}" up
  # The service CIDR goes to our own bridge, never to the default route. (A dummy
  # interface would do too, but this kernel has no dummy driver: "Unknown device type".)
  ip route add "${SERVICE_CIDR}" dev "${BRIDGE}"
  # No kube-proxy: the one service pods use, "kubernetes", goes to the apiserver.
  iptables -w -t nat -N "${NAT_CHAIN}"
  iptables -w -t nat -A "${NAT_CHAIN}" -d "${KUBERNETES_SVC_IP}/32" -p tcp --dport 443 \
    -j DNAT --to-destination "${APISERVER_IP}:${APISERVER_PORT}"
  iptables -w -t nat -I OUTPUT -d "${SERVICE_CIDR}" -j "${NAT_CHAIN}"
  iptables -w -t nat -I PREROUTING -d "${SERVICE_CIDR}" -j "${NAT_CHAIN}"
  # Pods never leave the bridge: nothing from it is forwarded anywhere.
  iptables -w -N "${FWD_CHAIN}"
  iptables -w -A "${FWD_CHAIN}" -i "${BRIDGE}" -j DROP
  iptables -w -A "${FWD_CHAIN}" -o "${BRIDGE}" -j DROP
  iptables -w -I FORWARD -j "${FWD_CHAIN}"
}

write_cni_conf() {  # write_cni_conf ROOT
  # isGateway false: the bridge plugin would otherwise switch on host-wide IP
  # forwarding. The gateway address is set on the bridge by net_up; pods get a route to
  # the service CIDR through it and no default route.
  cat > "$1/cni/net.d/10-csi-pmem-e2e.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "csi-pmem-e2e",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "${BRIDGE}",
      "isGateway": false,
      "ipMasq": false,
      "hairpinMode": false,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "${POD_CIDR}", "gateway": "${APISERVER_IP}",
                     "rangeStart": "10.88.77.10", "rangeEnd": "10.88.77.250"}]],
        "routes": [{"dst": "${SERVICE_CIDR}", "gw": "${APISERVER_IP}"}],
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
  # veths of pods whose netns is already gone vanish with it; any left on the bridge go.
  local veth
  for veth in $(ip -o link show master "${BRIDGE}" 2>/dev/null | awk -F': ' '{print $2}' \
      | cut -d@ -f1); do
    ip link del "${veth}" 2>/dev/null || true
  done
  ip link del "${BRIDGE}" 2>/dev/null || true
  return 0
}
