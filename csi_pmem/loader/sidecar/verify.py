"""Verification of a staged model: every chunk, none, or a sample of constant cost.

Why a sample at start: the index already proves the model committed and complete, and
every load verifies the chunks it reads; a warm restart must not re-hash 100 GB.
"""

from __future__ import annotations

from typing import Any

from csi_pmem.sizes import MiB
from csi_pmem.weights import checksum
from csi_pmem.weights.layout import ModelEntry
from csi_pmem.weights.volume import Volume

SAMPLE_BUDGET = 256 * MiB  # what --verify-on-start sample hashes at most

VERIFY_MODES = ("sample", "full", "none")


def _spread(items: list[Any]) -> list[Any]:
    """``items`` reordered so that every prefix is spread over the whole list
    (bit-reversed positions: first, middle, quarters, ...)."""
    width = max(len(items) - 1, 1).bit_length()
    order = sorted(range(len(items)),
                   key=lambda i: (int(format(i, f"0{width}b")[::-1], 2), i))
    return [items[i] for i in order]


def _sample(chunks: list[checksum.Chunk], budget: int = SAMPLE_BUDGET) -> list[checksum.Chunk]:
    """First chunks (they hold the safetensors headers), then last chunks, spread over
    the files, until ``budget`` bytes: a constant cost whatever the model's size."""
    last = {c.file: c.index for c in chunks}
    firsts = [c for c in chunks if c.index == 0]
    lasts = [c for c in chunks if c.index and c.index == last[c.file]]
    picked: list[checksum.Chunk] = []
    used = 0
    for c in _spread(firsts) + _spread(lasts):
        if picked and used + c.length > budget:
            continue
        picked.append(c)
        used += c.length
    return picked


def verify_model(volume: Volume, model: ModelEntry, mode: str,
                 threads: int | None = None) -> tuple[list[checksum.Mismatch], int]:
    """(mismatches, bytes hashed): ``full``, ``none``, or ``sample`` (:func:`_sample`).

    The sample is cheap on purpose: the index already proved the model committed and
    complete, and every load verifies the chunks it reads (``start_load(verify=True)``).
    """
    if mode == "none":
        return [], 0
    chunks = checksum.model_chunks(model)
    if mode == "sample":
        chunks = _sample(chunks)
    bad = checksum.verify_chunks(volume, chunks, threads=threads)
    return bad, sum(c.length for c in chunks)


def damage(model: ModelEntry, bad: list[checksum.Mismatch]) -> str:
    return (f"{len(bad)} chunk(s) of {model.label()} do not match their staged checksums, "
            f"first: {bad[0]}")
