# syntax=docker/dockerfile:1
# The csi-pmem image: the node plugin (`csi-pmem serve`, the chart's DaemonSet) and the
# weights tools (`csi-pmem-weights`, the staging sidecar in deploy/examples/).
#
#   make image     (buildah, no daemon or registry: scripts/build-image.sh)
#   docker build -t example.com/csi-pmem/csi-pmem:0.1.0 .
#
# Debian 12 with Debian's own python3 (3.11): the image matches the hosts we test on.
# make image makes the base, debian:12-slim, with debootstrap (there is no registry to
# pull it from), passes the source revision, source and build time for the OCI labels at
# the end, and writes a docker-archive; the cluster test bed (e2e/cluster) runs exactly
# that archive.
#
# One image for the node plugin and the weights sidecar, on purpose: the sidecar is the
# driver's own code (csi_pmem.loader, daxclient) and must match the plugin's dax.sock
# protocol, so it runs the plugin's image tag (deploy/examples/); a second image would
# be a second build and tag to keep in step for the ~5 MB that ndctl, daxctl, xfsprogs
# and their libraries install, of ~420 MB (the venv is ~160 MB: numpy, cuda-bindings,
# grpcio). The sidecar needs libpmem1 (pmem_persist) from the same package set.
#
# Runs as root, and cannot run as anyone else: the node plugin mounts tmpfs into
# kubelet's pod directories (Bidirectional propagation needs a privileged container),
# opens /dev/dax*, runs ndctl against libnvdimm's sysfs and attaches loop devices. It is
# the authorisation point for the device: unprivileged pods get an fd from it over
# dax.sock after it checks their cgroup. Pods that use the weights tools or
# csi_pmem.daxclient from this image run them as any user (nothing here needs root).

ARG DEBIAN_IMAGE=debian:12-slim

FROM ${DEBIAN_IMAGE} AS builder
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-pip python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY csi_pmem ./csi_pmem
# The project's wheel and the wheels of its dependencies (the driver extra: grpcio,
# protobuf, prometheus-client, pyudev; cuda-bindings for the optional GPU copy service
# container, `csi-pmem gpu-copy`; numpy and safetensors for the weights sidecar, whose
# wsum64 checksums are numpy reductions): the runtime stage installs from these.
# Behind a TLS-intercepting proxy, pip needs its CA: make image passes the host's bundle
# as the secret pip-ca (scripts/build-image.sh); a build without it uses the image's own.
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && python3 -m pip wheel --wheel-dir /wheels ".[driver,gpu-copy,loader,s3]" \
 && python3 -m venv /opt/csi-pmem \
 && /opt/csi-pmem/bin/pip install --no-cache-dir --no-index --find-links /wheels "csi-pmem[driver,gpu-copy,loader,s3]"

FROM ${DEBIAN_IMAGE}
ARG DEBIAN_IMAGE
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="csi-pmem" \
      org.opencontainers.image.description="Kubernetes CSI driver for persistent memory: devdax namespaces per volume, NUMA-aware pools, fd delivery to unprivileged pods" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${DEBIAN_IMAGE}"
# Everything the image needs from Debian, in one place (equal to
# e2e/cluster/image-packages.txt): python3 and python3-venv for the venv; ndctl and
# daxctl carve and list namespaces; util-linux and mount give mount, umount, losetup
# and findmnt (blkid probes fsdax volumes); e2fsprogs and xfsprogs make the ext4/xfs
# file systems of fsdax volumes; libudev1 lets pyudev watch device events; libpmem1 makes
# the weights sidecar's stores into device-dax durable (pmem_persist).
ARG RUNTIME_PACKAGES="python3 python3-venv util-linux mount ndctl daxctl libudev1 libpmem1 e2fsprogs xfsprogs"
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends ${RUNTIME_PACKAGES} \
 && rm -rf /var/lib/apt/lists/*
# The venv the builder made from its wheels (same Debian, same /usr/bin/python3), copied:
# COPY --from's layer cache follows the content, so a changed csi_pmem/ always reaches
# the image. (The install used to run here with the wheels bind-mounted from the builder;
# buildah's layer cache does not look at a bind mount's content, so a changed source
# got the previous install layer back, and with a cached builder stage it has nothing
# to mount at all.) The entry points also on the default PATH.
COPY --from=builder /opt/csi-pmem /opt/csi-pmem
RUN /opt/csi-pmem/bin/python -c "import csi_pmem.daxclient, grpc" \
 && ln -s /opt/csi-pmem/bin/csi-pmem /usr/local/bin/csi-pmem \
 && ln -s /opt/csi-pmem/bin/csi-pmem-weights /usr/local/bin/csi-pmem-weights \
 && csi-pmem serve --help >/dev/null
ENV PATH=/opt/csi-pmem/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 0:0
ENTRYPOINT ["csi-pmem", "serve"]
# Last, so that a new revision or build time reuses every layer above (make image passes
# these: scripts/build-image.sh).
ARG REVISION=unknown
ARG SOURCE=https://example.com/csi-pmem/csi-pmem
ARG CREATED
ARG BASE_DIGEST
LABEL org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}"
