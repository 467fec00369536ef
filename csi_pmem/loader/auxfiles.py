"""The staged auxiliary files (config.json, tokenizer files, generation_config.json)
read back from the volume, checked against their staged checksums.

Why: ``csi-pmem-weights stage`` copies every file of the model directory, not only the
safetensors, so the config and tokenizer a server builds from are the ones staged with
its weights, of the same revision, and need no second source mount. Servers that take
them as bytes (:mod:`csi_pmem.loader.transformers`) read them here; servers that insist
on a directory (vLLM reads ``--hf-config-path``/``--tokenizer`` before any model loader
runs) get one from :func:`export_config`:

    python -m csi_pmem.loader.auxfiles /models /run/llama-config [--model llama]

Every read is verified (the files are small: one chunk each, microseconds), so a
damaged config is an error, never a silently different model.
"""

from __future__ import annotations

import argparse
import logging
import os

from csi_pmem.cmdline import Exit
from csi_pmem.loader.model import ModelView, open_model
from csi_pmem.weights import checksum
from csi_pmem.weights.errors import ChecksumError, LoaderError
from csi_pmem.weights.layout import KIND_AUX, FileEntry
from csi_pmem.weights.volume import Volume

log = logging.getLogger(__name__)


def aux_files(view: ModelView) -> list[FileEntry]:
    """The model's staged files that are not safetensors, in staging order."""
    return [f for f in view.model.files if f.kind == KIND_AUX]


def read_aux(view: ModelView, name: str) -> bytes:
    """One staged auxiliary file's bytes (``name`` relative to the model directory, as
    ``csi-pmem-weights ls`` shows it), verified against its checksums."""
    entry = next((f for f in aux_files(view) if f.name == name), None)
    if entry is None:
        have = ", ".join(f.name for f in aux_files(view)) or "none"
        raise LoaderError(f"model {view.model.label()} on {view.volume.source} has no "
                          f"staged file {name!r} (staged beside its weights: {have}); "
                          "stage the model directory with it")
    bad = checksum.verify_chunks(view.volume, checksum.model_chunks(view.model, [entry]),
                                 threads=1)
    if bad:
        raise ChecksumError(f"{name} of model {view.model.label()} on {view.volume.source} "
                            f"does not match its staged checksum ({bad[0]}); the volume "
                            "copy is damaged, stage the model again")
    return bytes(view.volume.view(entry.offset, entry.length))


def export_config(volume: Volume | ModelView | str | os.PathLike[str], dest: str,
                  model: str | None = None) -> list[str]:
    """Write every staged auxiliary file of the model under ``dest`` (created if
    missing), verified; returns the paths written. Files already there with the same
    bytes are left alone, others are replaced atomically, so running it at every start
    of a pod is cheap and never leaves a half-written config. Weights are not written.
    """
    view = volume if isinstance(volume, ModelView) else open_model(volume, model)
    try:
        return _export(view, dest)
    finally:
        if not isinstance(volume, ModelView | Volume):
            view.volume.close()  # opened here: unmap it now, not at garbage collection


def _export(view: ModelView, dest: str) -> list[str]:
    files = aux_files(view)
    if not files:
        raise LoaderError(f"model {view.model.label()} on {view.volume.source} was staged "
                          "without config or tokenizer files; stage the whole model "
                          "directory (config.json beside the *.safetensors)")
    written = []
    for f in files:
        data = read_aux(view, f.name)
        target = os.path.join(dest, *f.name.split("/"))
        written.append(target)
        try:
            with open(target, "rb") as existing:
                if existing.read() == data:
                    continue
        except FileNotFoundError:
            pass
        os.makedirs(os.path.dirname(target), exist_ok=True)
        partial = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.partial")
        with open(partial, "wb") as out:
            out.write(data)
        os.replace(partial, target)
        log.info("wrote %s (%d bytes)", target, len(data))
    return written


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments (for a ``csi-pmem-weights export-config`` subcommand)."""
    p.add_argument("volume", metavar="VOLUME", help="the volume (published directory, "
                   "device or image file)")
    p.add_argument("dest", metavar="DIR", help="directory to write the files into")
    p.add_argument("--model", help="model name (default: the only one)")


def run(args: argparse.Namespace) -> int:
    for path in export_config(args.volume, args.dest, args.model):
        print(path)
    return Exit.OK
