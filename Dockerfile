# syntax=docker/dockerfile:1
# The csi-pmem image: the node plugin (`csi-pmem serve`, the chart's DaemonSet) and the
# weights tools (`csi-pmem-weights`, the staging sidecar in deploy/examples/).
#
#   docker build -t example.com/csi-pmem/csi-pmem:0.1.0 .
#
# Debian 12 with Debian's own python3 (3.11): the image matches the hosts we test on and
# the cluster test bed's image, which is built without Docker (e2e/cluster/images.sh:
# debootstrap minbase with e2e/cluster/image-packages.txt, then the same wheel install
# into a venv at /opt/csi-pmem). tests/test_chart.py keeps RUNTIME_PACKAGES and that
# list identical, and the install steps alike.
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
 && apt-get install -y --no-install-recommends python3 python3-pip \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY csi_pmem ./csi_pmem
# The project's wheel and the wheels of its dependencies (the driver extra: grpcio,
# protobuf, prometheus-client, pyudev; cuda-bindings for the optional GPU copy service
# container, `csi-pmem gpu-copy`; numpy and safetensors for the weights sidecar, whose
# wsum64 checksums are numpy reductions): the runtime stage installs from these.
RUN python3 -m pip wheel --wheel-dir /wheels ".[driver,gpu-copy,loader]"

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
# The same steps as the test bed's image: a venv from the builder's wheels (bind-mounted,
# so they are not left in a layer), the entry points also on the default PATH.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python3 -m venv /opt/csi-pmem \
 && /opt/csi-pmem/bin/pip install --no-cache-dir --no-index --find-links /wheels "csi-pmem[driver,gpu-copy,loader]" \
 && /opt/csi-pmem/bin/python -c "import csi_pmem.daxclient, grpc" \
 && ln -s /opt/csi-pmem/bin/csi-pmem /usr/local/bin/csi-pmem \
 && ln -s /opt/csi-pmem/bin/csi-pmem-weights /usr/local/bin/csi-pmem-weights \
 && csi-pmem serve --help >/dev/null
ENV PATH=/opt/csi-pmem/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 0:0
ENTRYPOINT ["csi-pmem", "serve"]
