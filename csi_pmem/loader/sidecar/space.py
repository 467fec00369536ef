"""Revisions and space: where a new revision goes, and which older ones are released.

The policy (the package docstring, :mod:`csi_pmem.loader.sidecar`, says why): an older
revision of the same model stays, under a retired name, beside the new one while there
is room, and is released first when there is not; another model is never touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from csi_pmem.loader.sidecar.events import event
from csi_pmem.sizes import describe_size
from csi_pmem.weights.errors import VolumeTooSmallError
from csi_pmem.weights.layout import (
    COMMITTED,
    Index,
    ModelEntry,
    SourceFile,
    allocate,
    read_index,
    write_index,
)
from csi_pmem.weights.volume import Volume

RETIRED_PREFIX = ".retired/"


def retired_name(name: str) -> str:
    return RETIRED_PREFIX + name


def same_files(model: ModelEntry, sources: list[SourceFile]) -> bool:
    return (sorted((s.name, s.size, s.kind) for s in sources)
            == sorted((f.name, f.length, f.kind) for f in model.files))


def is_wanted(model: ModelEntry | None, revision: str, sources: list[SourceFile]) -> bool:
    return (model is not None and model.state == COMMITTED and model.revision == revision
            and same_files(model, sources))


@dataclass
class SpacePlan:
    """How room is made for a new revision: ``fresh`` (no older revision on the volume),
    ``beside`` (older revisions stay until the new one commits) or ``release`` (older
    revisions are dropped first); ``why`` is the sentence the logs and /status show."""

    kind: str
    release: list[ModelEntry] = field(default_factory=list)
    why: str = ""


def _fits(align: int, keep: list[ModelEntry], name: str, revision: str,
          sources: list[SourceFile], volume_size: int) -> VolumeTooSmallError | None:
    try:
        allocate(Index(align=align, models=list(keep)), name, revision, sources, volume_size)
        return None
    except VolumeTooSmallError as exc:
        return exc


def plan_space(index: Index, name: str, revision: str, sources: list[SourceFile],
               volume_size: int) -> SpacePlan:
    """Decide where the new revision goes, or raise :class:`VolumeTooSmallError`.

    Pure: reads the index, writes nothing. The layout places a new model after the last
    committed one, so only space at the end can be reused.
    """
    committed = index.committed()
    olds = [m for m in committed if m.name in (name, retired_name(name))]
    others = [m for m in committed if m not in olds]
    label = f"{name}@{revision}"
    old_labels = ", ".join(m.label() for m in olds)
    if _fits(index.align, committed, name, revision, sources, volume_size) is None:
        if not olds:
            return SpacePlan("fresh")
        return SpacePlan("beside", why=(
            f"{label} fits beside {old_labels}: the older revision stays readable until "
            f"{label} is committed, then its space is released"))
    if olds and _fits(index.align, others, name, revision, sources, volume_size) is None:
        return SpacePlan("release", olds, why=(
            f"no room for {label} beside {old_labels}: released the older revision(s) of "
            f"{name} first (pods on this node still reading them must reload)"))
    alone = _fits(index.align, [], name, revision, sources, volume_size)
    if alone is not None:
        raise VolumeTooSmallError(f"model larger than the volume: {alone}",
                                  needed=alone.needed, available=alone.available)
    blocked = _fits(index.align, others, name, revision, sources, volume_size)
    assert blocked is not None  # else "release" (or "beside") above would have fit
    other_labels = ", ".join(m.label() for m in others)
    freed = (f"; releasing the older revision(s) of {name} ({old_labels}) would not "
             "help, because a new model is placed after the last committed one and "
             f"{other_labels} sits after them" if olds else "")
    raise VolumeTooSmallError(
        f"no room for {label}: it needs {describe_size(blocked.needed)} but only "
        f"{describe_size(blocked.available)} are free after the other model(s) on this "
        f"volume ({other_labels}). The sidecar never removes another model{freed}. Give "
        f"{name} a volume of its own or a larger one, or clear this one with "
        "csi-pmem-weights stage --replace (discards every model on it)",
        needed=blocked.needed, available=blocked.available)


def apply_plan(volume: Volume, index: Index, plan: SpacePlan, name: str) -> list[str]:
    """Make the index match the plan before staging; returns the labels released."""
    released = [m.label().replace(RETIRED_PREFIX, "", 1) for m in plan.release]
    if plan.why:
        event(plan.why, space=plan.kind, released=released)
    current = index.find(name)
    if plan.release:
        index.models = [m for m in index.models if m not in plan.release]
    elif current is not None and current.state == COMMITTED:
        current.name = retired_name(name)  # keeps its bytes out of the allocator's way
    else:
        return released
    write_index(volume, index)
    return released


def drop_retired(volume: Volume, name: str) -> list[str]:
    index = read_index(volume)
    if index is None:
        return []
    gone = [m for m in index.models if m.name == retired_name(name)]
    if not gone:
        return []
    index.models = [m for m in index.models if m not in gone]
    write_index(volume, index)
    labels = [f"{name}@{m.revision}" for m in gone]
    event("released older revision(s) now that the wanted one is committed",
           released=labels)
    return labels


def restore(volume: Volume, index: Index, name: str, revision: str,
             sources: list[SourceFile]) -> ModelEntry | None:
    """A rollback to the revision kept beside the current one: swap names, copy nothing."""
    for m in index.models:
        if m.name == retired_name(name) and is_wanted(m, revision, sources):
            current = index.find(name)
            if current is not None and current.state == COMMITTED:
                current.name = retired_name(name)
            elif current is not None:
                index.models.remove(current)  # an abandoned staging entry
            m.name = name
            write_index(volume, index)
            return m
    return None
