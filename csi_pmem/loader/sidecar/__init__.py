"""The staging sidecar: keep one model revision staged, verified and announced on a volume.

Why a long-running process: in a pod it runs as a native sidecar (an init container with
``restartPolicy: Always``, Kubernetes >= 1.29). Kubelet starts the serving container only
once the sidecar's startupProbe passes, so ``/readyz`` is the gate between "the weights
on this node's volume are the wanted revision, committed and checked" and "load them".
After that it keeps answering probes, re-verifies when asked, and exits 0 on SIGTERM.

Why it exists at all: the point of a PMEM volume is that weights stay resident on the
node across pod restarts. So start-up must first find out, cheaply, whether the volume
already holds what the source holds, and only copy when it does not:

- The wanted revision is ``--revision`` when given (a Hugging Face commit, an image
  digest: the cheapest and most exact answer). Otherwise it is a fingerprint of the
  source: file names, sizes and kinds, every safetensors header in full (names, dtypes,
  shapes, offsets, ``__metadata__``), and a sample of the data (4 KiB at the start of
  each tensor, up to 1024 tensors per file, plus 32 evenly spaced 4 KiB blocks and the
  tail of every file; small auxiliary files whole). That reads a few MiB of a 100 GB
  model. Re-hashing the whole source (what the staging checksums would need: they are
  wsum64 over 64 MiB chunks of every byte) costs minutes per pod start on network
  storage; mtimes are free but change with every copy or re-download, which would
  re-copy 100 GB for nothing. The sample catches a new fine-tune (every tensor
  changes, same names and sizes) and any header change; it misses a change confined to
  bytes no sample reaches, for which ``--revision`` or ``--fingerprint full`` exist.
  ``csi-pmem-weights stage`` records the same fingerprint when given no revision
  (:mod:`csi_pmem.loader.fingerprint`), so neither copies again what the other staged.
- An already staged model is checked with its index (header checksum, committed flag,
  file list) and, by default, a sample of its checksum chunks of at most 256 MiB
  whatever the model's size (first chunks, which hold the safetensors headers, spread
  over the shards): no copy, no full re-hash (``--verify-on-start full`` asks for
  one). Fresh copies are verified in full before the sidecar says ready.

Old revisions of the same model: the index holds one entry per model name and
name-less loads need exactly one committed model, so the previous revision is kept
under a retired name only while the new one is staged beside it (pods on the node still
reading it keep valid bytes), then released. When the new revision does not fit beside
it, older revisions of that model are released first. Another model is never touched:
if only removing it would make room, the sidecar refuses and says so.

Crash safety comes from the staging code (plan written first, files marked done,
commit last); this module adds an advisory lock on the volume so two sidecars on one
node do not stage into the same volume at once.

A directory volume (an fsdax ``Filesystem`` volume: no ``dax.sock``) is its image file
``csi-pmem-weights.img``: created when missing, grown to what the model needs beside the
other models it holds (older revisions of this one are released rather than kept when
the image has no room for both: growing to keep them would grow it at every new
revision, since a model is placed after the last committed one), never shrunk.

The package, one module per job: :mod:`.revision` (the wanted revision), :mod:`.lock`,
:mod:`.space` (revisions and space), :mod:`.verify`, :mod:`.reconcile` (one pass),
:mod:`.status` (``/status``, failure kinds, progress), :mod:`.probes` (HTTP), :mod:`.metrics`,
:mod:`.process` (threads and signals), :mod:`.cli`; :mod:`.events` is the log events.
"""

from __future__ import annotations

from csi_pmem.loader.sidecar.cli import add_arguments, configure_logging, run
from csi_pmem.loader.sidecar.events import SourceError
from csi_pmem.loader.sidecar.lock import volume_lock
from csi_pmem.loader.sidecar.process import Config, Sidecar
from csi_pmem.loader.sidecar.reconcile import Outcome, ensure_model
from csi_pmem.loader.sidecar.revision import fingerprint
from csi_pmem.loader.sidecar.space import SpacePlan, plan_space, retired_name
from csi_pmem.loader.sidecar.status import FP_STAGE_HALF, classify
from csi_pmem.loader.sidecar.verify import verify_model

__all__ = ["FP_STAGE_HALF", "Config", "Outcome", "Sidecar", "SourceError", "SpacePlan",
           "add_arguments", "classify", "configure_logging", "ensure_model", "fingerprint",
           "plan_space", "retired_name", "run", "verify_model", "volume_lock"]
