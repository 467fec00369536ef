"""One reconcile pass: make ``name@revision`` the committed, verified model on the volume.

Writes nothing when it already is (a warm restart); otherwise stages, resumes, repairs
or restores it under the space policy of :mod:`csi_pmem.loader.sidecar.space`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from csi_pmem.loader.sidecar.events import event
from csi_pmem.loader.sidecar.space import (
    SpacePlan,
    apply_plan,
    drop_retired,
    is_wanted,
    plan_space,
    restore,
    retired_name,
    same_files,
)
from csi_pmem.loader.sidecar.verify import damage, verify_model
from csi_pmem.loader.staging import adopt, repair, stage
from csi_pmem.weights import checksum
from csi_pmem.weights.errors import ChecksumError, ReadOnlyVolumeError
from csi_pmem.weights.layout import (
    STAGING,
    Index,
    ModelEntry,
    SourceFile,
    read_index,
    required_size,
)
from csi_pmem.weights.volume import Volume


@dataclass
class Outcome:
    """What a pass did: ``already-staged``, ``staged``, ``resumed``, ``repaired`` or
    ``restored``, with the bytes copied and reused, the revisions released and the
    seconds spent staging and verifying."""

    action: str
    model: ModelEntry
    copied: int = 0
    reused: int = 0
    released: list[str] = field(default_factory=list)
    space: str = ""
    verify_mode: str = ""
    verified_bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


_DOING = {"staged": "staging", "resumed": "resuming"}


def _needs_write(volume: Volume, why: str, readonly_reason: str) -> None:
    if volume.writable:
        return
    raise ReadOnlyVolumeError(
        f"{why}, and {readonly_reason or 'the volume is read-only'}. The sidecar's "
        "publish must be writable: leave the pod volume's persistentVolumeClaim.readOnly "
        "unset (false) and do not use a ReadOnlyMany claim; put readOnly: true on the "
        "serving container's volumeMount instead (its loads map the volume read-only)")


def _timed_verify(volume: Volume, model: ModelEntry, mode: str, threads: int | None,
                  seconds: dict[str, float]) -> tuple[list[checksum.Mismatch], int]:
    t = time.monotonic()
    try:
        return verify_model(volume, model, mode, threads)
    finally:
        seconds["verify"] = seconds.get("verify", 0.0) + time.monotonic() - t


def _repair(volume: Volume, index: Index, model: ModelEntry, sources: list[SourceFile],
            threads: int | None, progress: Callable[[int, int, str], None] | None,
            phase: Callable[[str], None], seconds: dict[str, float]) -> Outcome:
    """Copy again only the damaged chunks (staging's :func:`repair`, which
    ``csi-pmem-weights stage`` uses too), after a full check: a sample found damage,
    and there may be more. What was copied again is then verified once more."""
    phase("staging")
    t = time.monotonic()
    fixed = repair(volume, index, model, sources, threads=threads, progress=progress)
    seconds["stage"] = time.monotonic() - t
    phase("verifying")
    t = time.monotonic()
    again = [model.file(n) for n in fixed.files]
    chunks = checksum.model_chunks(model, again)
    bad = checksum.verify_chunks(volume, chunks, threads=threads)
    seconds["verify"] = seconds.get("verify", 0.0) + time.monotonic() - t
    if bad:
        raise ChecksumError(damage(model, bad) + " right after repairing; the volume may "
                            "have media errors (check the node's kernel log)")
    return Outcome("repaired", model, copied=fixed.copied, reused=model.size - fixed.copied,
                   released=drop_retired(volume, model.name), verify_mode="full",
                   verified_bytes=fixed.checked + sum(c.length for c in chunks),
                   seconds=seconds)


def ensure_model(volume: Volume, source: str, sources: list[SourceFile], name: str,
                 revision: str, *, verify_mode: str = "sample", threads: int | None = None,
                 progress: Callable[[int, int, str], None] | None = None,
                 readonly_reason: str = "",
                 on_phase: Callable[[str], None] | None = None,
                 fingerprint_mode: str | None = None) -> Outcome:
    """Make ``name@revision`` the committed, verified model ``name`` on the volume.

    Writes nothing when it already is (a warm restart); otherwise stages, resumes,
    repairs or restores it (see :class:`Outcome`) under the rules in the package
    docstring (:mod:`csi_pmem.loader.sidecar`). Raises a :class:`LoaderError` that
    says what to change when it cannot.
    ``on_phase`` hears "staging" and "verifying" as they start. ``fingerprint_mode``
    says that ``revision`` is the sources' fingerprint in that mode: a model ``name``
    staged without a revision (by an earlier ``csi-pmem-weights stage``) whose copy has
    that fingerprint is then adopted (its revision recorded), not copied again.
    """
    phase = on_phase or (lambda _: None)
    seconds: dict[str, float] = {}
    t = time.monotonic()
    index = read_index(volume) or Index(align=volume.align)
    seconds["index"] = time.monotonic() - t
    current = index.find(name)
    label = f"{name}@{revision}"
    if (fingerprint_mode and current is not None and volume.writable
            and adopt(volume, index, current, sources, revision, fingerprint_mode, threads)):
        event("the volume holds the source's content staged without a revision; "
              "recorded its fingerprint", model=label)
    if is_wanted(current, revision, sources):
        assert current is not None
        bad, hashed = _timed_verify(volume, current, verify_mode, threads, seconds)
        if not bad:
            released = drop_retired(volume, name) if volume.writable else []
            return Outcome("already-staged", current, reused=current.size, released=released,
                           verify_mode=verify_mode, verified_bytes=hashed, seconds=seconds)
        _needs_write(volume, damage(current, bad), readonly_reason)
        event("the staged copy is damaged; copying the damaged chunks again",
               logging.WARNING, model=label, bad_chunks=len(bad), first=str(bad[0]))
        return _repair(volume, index, current, sources, threads, progress, phase, seconds)
    else:
        what = (f"the volume holds {current.label()} ({current.state})"
                if current is not None else "the volume does not hold it")
        _needs_write(volume, f"{label} must be staged ({what})", readonly_reason)
        restored = restore(volume, index, name, revision, sources)
        if restored is not None:
            bad, hashed = _timed_verify(volume, restored, "full", threads, seconds)
            if bad:
                raise ChecksumError(damage(restored, bad) + "; restart to stage it again")
            event("restored the revision kept beside the current one", model=label)
            return Outcome("restored", restored, reused=restored.size, verify_mode="full",
                           released=drop_retired(volume, name), verified_bytes=hashed,
                           seconds=seconds)
        if (current is not None and current.state == STAGING
                and current.revision == revision and same_files(current, sources)):
            action, plan = "resumed", SpacePlan("fresh")
        else:
            if volume.growable:
                # An image file: room for the model beside the other models it holds,
                # so that releasing older revisions of this one is always enough.
                keep = [m for m in index.committed()
                        if m.name not in (name, retired_name(name))]
                volume.grow(required_size(Index(align=index.align, models=keep), sources))
            action, plan = "staged", plan_space(index, name, revision, sources, volume.size)
    released = apply_plan(volume, index, plan, name) if action == "staged" else []
    event(f"{_DOING[action]} {label}", model=name, revision=revision, space=plan.kind)
    phase("staging")
    t = time.monotonic()
    result = stage(volume, source, name=name, revision=revision, threads=threads,
                   progress=progress, scanned=sources)
    seconds["stage"] = time.monotonic() - t
    phase("verifying")
    bad, hashed = _timed_verify(volume, result.model, "full", threads, seconds)
    if bad:
        raise ChecksumError(damage(result.model, bad) + " right after staging; the "
                            "volume may have media errors (check the node's kernel log)")
    released += drop_retired(volume, name)
    return Outcome(action, result.model, copied=result.copied, reused=result.reused,
                   released=released, space=plan.why, verify_mode="full",
                   verified_bytes=hashed, seconds=seconds)
