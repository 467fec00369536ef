# Pinned versions of everything the cluster test bed builds from the Go module proxy.
# Sourced by build.sh; the cache key of each binary set is a hash of these lines, so
# bumping a version rebuilds exactly what changed.
# shellcheck shell=bash disable=SC2034
K8S_VERSION=v1.36.3            # k8s.io/kubernetes; staging modules at the matching v0.36.x
K8S_STAGING_VERSION=v0.36.3
ETCD_VERSION=v3.6.16           # go.etcd.io/etcd/server/v3 (and etcdctl v3)
PROVISIONER_VERSION=v6.4.0     # github.com/kubernetes-csi/external-provisioner/v6
# node-driver-registrar and livenessprobe have v2 tags without a /v2 module path: the
# proxy serves them only as pseudo-versions of a tagged commit.
REGISTRAR_TAG=v2.15.0
REGISTRAR_COMMIT=
LIVENESSPROBE_TAG=v2.17.0
LIVENESSPROBE_COMMIT=
HELM_VERSION=v3.22.0           # helm.sh/helm/v3
