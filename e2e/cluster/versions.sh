# Pinned versions of everything the cluster test bed builds from the Go module proxy.
# Sourced by build.sh; the cache key of each binary set is a hash of these lines, so
# bumping a version rebuilds exactly what changed.
# shellcheck shell=bash disable=SC2034
K8S_VERSION=v1.36.3            # k8s.io/kubernetes; staging modules at the matching v0.36.x
K8S_STAGING_VERSION=v0.36.3
ETCD_VERSION=v3.6.16           # go.etcd.io/etcd/server/v3 (and etcdctl v3)
PROVISIONER_VERSION=v6.4.0     # github.com/kubernetes-csi/external-provisioner/v6
# node-driver-registrar and livenessprobe have v2 tags without a /v2 module path, so a
# proxy could serve them only as pseudo-versions of a tagged commit; the one reachable
# here serves neither module at all (403 for @v/list, @latest and these commits), and
# the test bed runs stand-ins (sidecars/, README.md). The pins are the chart's images:
# the upstream tag and the commit it points at.
REGISTRAR_TAG=v2.17.0
REGISTRAR_COMMIT=c5794c45f34ce9c62e47dfd5a2b073c3824f2c79
LIVENESSPROBE_TAG=v2.19.0
LIVENESSPROBE_COMMIT=d2d15a5e8217cc9f8680821ee649b6a051b38d96
HELM_VERSION=v3.22.0           # helm.sh/helm/v3
# containerd 2.x for the NRI test bed (up.sh E2E_NRI=1): Debian's 1.6 has no NRI. Its
# runc stays Debian's (1.1.5). NRI_VERSION is the github.com/containerd/nri this
# containerd requires (its go.mod), which the plugin in nri/ pins too.
CONTAINERD_VERSION=v2.4.2     # github.com/containerd/containerd/v2
NRI_VERSION=v0.12.3
