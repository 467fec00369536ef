"""Where a tensor-parallel slice lies in the mapping (:func:`rankslots.rows_of`): the
one plain or 2D copy the node's copy service makes of it, or none."""

from __future__ import annotations

import torch

from csi_pmem.loader.gpu.rankslots import Rows, rows_of


def test_the_cuts_vllm_makes_are_rows_of_the_mapping():
    base = torch.zeros(1 << 20, dtype=torch.uint8)
    start, span = base.data_ptr(), base.numel()
    w = base[4096:4096 + 64 * 48 * 2].view(torch.bfloat16).view(64, 48)
    # A column-parallel cut: whole rows, one run.
    assert rows_of(w.narrow(0, 16, 16), start, span) == Rows(4096 + 16 * 96, 1, 16 * 96, 0)
    # A row-parallel cut: a stretch of every row.
    assert rows_of(w.narrow(1, 24, 24), start, span) == Rows(4096 + 48, 64, 48, 96)
    # The whole tensor, a single row, a single element, a 3D block of rows.
    assert rows_of(w, start, span) == Rows(4096, 1, 64 * 96, 0)
    assert rows_of(w[3], start, span) == Rows(4096 + 3 * 96, 1, 96, 0)
    assert rows_of(w[3, 5], start, span) == Rows(4096 + 3 * 96 + 10, 1, 2, 0)
    cube = w.view(4, 16, 48).narrow(2, 0, 8)
    assert rows_of(cube, start, span) == Rows(4096, 64, 16, 96)


def test_what_is_not_rows_is_refused():
    base = torch.zeros(1 << 16, dtype=torch.uint8)
    start = base.data_ptr()
    w = base[:64 * 48 * 2].view(torch.bfloat16).view(64, 48)
    assert rows_of(w.t(), start, base.numel()) is None  # strided last dimension
    assert rows_of(w[::2, ::2], start, base.numel()) is None
    # Two strides between rows: every other block of rows, a stretch of each.
    assert rows_of(w.view(4, 16, 48)[::2].narrow(2, 0, 8), start, base.numel()) is None
    assert rows_of(w, start, 64 * 96 - 1) is None  # past the mapping's end
    assert rows_of(w, start + 2, base.numel()) is None  # before its start
