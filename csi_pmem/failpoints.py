"""Fail points: let crash-safety tests kill the driver between two steps.

Why in the product: the only honest test of "a SIGKILL between writing the record and
calling ndctl loses nothing" is to SIGKILL the real process at that exact point. The
points are named in ``CSI_PMEM_FAILPOINTS`` (comma separated); when unset, ``hit`` is a
dictionary lookup and nothing else.

``name=stall`` instead of ``name`` stops the process at that point without killing it:
it prints ``failpoint NAME stalled`` on stderr and sleeps until it is killed. The VM
tier uses it to power the whole machine off (QEMU killed) with a stage stopped at a
known step, which tests what is on the persistent memory then, not what a dying
process's kernel still writes back.

``name=sleep:SECONDS`` pauses there and then goes on (printing ``failpoint NAME
sleeping``): it holds a step open long enough for a test to stop the driver in the
middle of it, which is how the shutdown tests catch a stop cutting a step short.

``name=errno:ENOSPC`` (any errno name) raises that OSError there instead, naming the
path the step works on: how the tests reach the error paths of a failure a real file
system cannot be made to produce on cue (EIO while writing a state record).

``name=ACTION@N`` (``weights-after-chunk=kill@3``, ``weights-after-file=stall@2``) acts
only the Nth time this process reaches the point and passes the earlier ones: how a
test stops a stage after a known number of chunks or files, counted, not timed.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time


def _parse(text: str) -> dict[str, str]:
    active = {}
    for item in text.split(","):
        name, _, action = item.strip().partition("=")
        if name:
            active[name] = action or "kill"
    return active


_ACTIVE = _parse(os.environ.get("CSI_PMEM_FAILPOINTS", ""))
_HITS: dict[str, int] = {}

CREATE_AFTER_RECORD = "create-after-record"
CREATE_AFTER_NAMESPACE = "create-after-namespace"
DELETE_AFTER_RECORD = "delete-after-record"
DELETE_AFTER_ERASE = "delete-after-erase"
DELETE_AFTER_DESTROY = "delete-after-destroy"
PUBLISH_AFTER_RECORD = "publish-after-record"
PUBLISH_AFTER_MOUNT = "publish-after-mount"
PUBLISH_AFTER_SOCKET = "publish-after-socket"
UNPUBLISH_AFTER_UMOUNT = "unpublish-after-umount"
STAGE_AFTER_MKFS = "stage-after-mkfs"
# Weight staging (csi_pmem.loader.staging, layout): the commit protocol's steps.
WEIGHTS_AFTER_PLAN = "weights-after-plan"          # plan on the volume, no data yet
WEIGHTS_AFTER_COPY = "weights-after-copy"          # a file's bytes persisted, not recorded
WEIGHTS_AFTER_FILE = "weights-after-file"          # one file recorded done, others not
WEIGHTS_AFTER_CHUNK = "weights-after-chunk"        # a chunk recorded (hit once per chunk)
WEIGHTS_BEFORE_COMMIT = "weights-before-commit"    # every file done, model not committed
WEIGHTS_INDEX_BODY = "weights-index-body"          # a new index body persisted, no header
WEIGHTS_AFTER_COMMIT = "weights-after-commit"      # commit record persisted
# In a copy thread, before a chunk's read (``sleep:S@N`` holds the Nth chunk's copy open,
# so a signal lands mid-copy); not a step of the commit protocol, so not in WEIGHTS.
WEIGHTS_BEFORE_CHUNK = "weights-before-chunk"
WEIGHTS = (WEIGHTS_AFTER_PLAN, WEIGHTS_AFTER_COPY, WEIGHTS_AFTER_FILE, WEIGHTS_AFTER_CHUNK,
           WEIGHTS_BEFORE_COMMIT, WEIGHTS_INDEX_BODY, WEIGHTS_AFTER_COMMIT)
# The clean-space ledger and the background eraser (tests/test_clean_space.py).
ERASE_MID = "erase-mid"                    # an erase's first chunk zeroed, others not
DELETE_AFTER_DIRTY = "delete-after-dirty"  # region marked dirty, namespace not destroyed
SCRUB_AFTER_RECORD = "scrub-after-record"  # scrub intent written, no scratch namespace
SCRUB_AFTER_CREATE = "scrub-after-create"  # scratch namespaces exist, not erased
SCRUB_AFTER_ERASE = "scrub-after-erase"    # scratch erased, not destroyed
# A state record written, not yet fsynced (csi_pmem.driver.state.write_atomic): for errno:NAME.
STATE_WRITE = "state-write"
# ndctl's two-step destroy (csi_pmem.driver.backends.ndctl): disabled, not yet destroyed.
DESTROY_MID = "destroy-mid"
ALL = (CREATE_AFTER_RECORD, CREATE_AFTER_NAMESPACE, DELETE_AFTER_RECORD, DELETE_AFTER_ERASE,
       DELETE_AFTER_DESTROY, PUBLISH_AFTER_RECORD, PUBLISH_AFTER_MOUNT, PUBLISH_AFTER_SOCKET,
       UNPUBLISH_AFTER_UMOUNT)
# Fail points on the fsdax paths (tested by the fsdax crash tests, not the devdax ones).
FSDAX = (STAGE_AFTER_MKFS, PUBLISH_AFTER_RECORD, PUBLISH_AFTER_MOUNT, UNPUBLISH_AFTER_UMOUNT)


def hit(name: str, path: str | os.PathLike | None = None) -> None:
    """SIGKILL this process if fail point ``name`` is active (or stall it there, or
    raise the OSError it names for ``path``)."""
    action = _ACTIVE.get(name)
    if action is None:
        return
    action, at, nth = action.partition("@")
    if at:
        _HITS[name] = _HITS.get(name, 0) + 1
        if _HITS[name] != int(nth):
            return
    if action.startswith("errno:"):
        code = getattr(errno, action.removeprefix("errno:"))
        raise OSError(code, os.strerror(code), os.fspath(path) if path is not None else None)
    if action == "stall":
        print(f"failpoint {name} stalled", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    if action.startswith("sleep:"):
        print(f"failpoint {name} sleeping", file=sys.stderr, flush=True)
        time.sleep(float(action.removeprefix("sleep:")))
        return
    os.kill(os.getpid(), signal.SIGKILL)
