"""A committed model on an open volume: its files, parsed headers and tensor selection.

Why separate from the copy paths: the CPU views, the GPU pipeline and the CLI all need
the same answer to "which tensors, where on the volume", including tensor-parallel
subsets (a name list or a predicate), and the same refusal of anything not committed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from csi_pmem.weights.errors import LayoutError, LoaderError, NoModelError
from csi_pmem.weights.layout import FileEntry, ModelEntry, read_index
from csi_pmem.weights.stformat import Header, TensorInfo, parse_header
from csi_pmem.weights.volume import Volume, open_volume

Predicate = Callable[[str], bool]


@dataclass
class ModelView:
    volume: Volume
    model: ModelEntry
    headers: dict[str, Header]  # per safetensors file, offsets absolute in the volume

    def file(self, name: str) -> FileEntry:
        return self.model.file(name)

    def select(self, names: Iterable[str] | None = None,
               predicate: Predicate | None = None) -> dict[str, list[TensorInfo]]:
        """Tensors to load, per file (files with none are left out), in volume order."""
        wanted = None if names is None else set(names)
        if wanted is not None:
            known = {t for h in self.headers.values() for t in h.tensors}
            missing = sorted(wanted - known)
            if missing:
                shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
                raise LoaderError(f"model {self.model.label()} has no tensor(s) {shown}")
        out: dict[str, list[TensorInfo]] = {}
        for fname, header in self.headers.items():
            chosen = [t for t in header.tensors.values()
                      if (wanted is None or t.name in wanted)
                      and (predicate is None or predicate(t.name))]
            if chosen:
                out[fname] = chosen
        return out


def open_model(volume: Volume | str | os.PathLike[str], name: str | None = None,
               **open_kw: object) -> ModelView:
    """Read the index, pick the committed model and parse its safetensors headers.

    ``volume`` may be a path (opened read-only) or an open :class:`Volume`.
    """
    if not isinstance(volume, Volume):
        volume = open_volume(volume, **open_kw)  # type: ignore[arg-type]
    index = read_index(volume)
    if index is None:
        raise NoModelError(f"{volume.source} holds no staged model; run "
                           "csi-pmem-weights stage")
    model = index.select(name)
    headers: dict[str, Header] = {}
    seen: dict[str, str] = {}
    for f in model.safetensors:
        header = parse_header(volume.buffer, f.offset, f.length,
                              source=f"{volume.source}:{f.name}")
        for t in header.tensors:
            if t in seen:
                raise LayoutError(f"tensor {t!r} appears in both {seen[t]} and {f.name}")
            seen[t] = f.name
        headers[f.name] = header
    return ModelView(volume, model, headers)
