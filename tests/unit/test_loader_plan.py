"""Copy planning (csi_pmem.loader.gpu.chunks) against the obvious, slow definitions.

Why: the plan is built on the clock before a load's first byte moves, so it is written
for speed (one pass over the runs, bisection instead of per-chunk tables). These tests
hold it to what it must mean: every tensor byte is copied exactly once to the right
place, no transfer overflows a buffer, and a tensor is reported finished exactly once,
when the last transfer that touches it is done, in whatever order transfers finish.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from csi_pmem.loader.gpu import chunks as planning
from csi_pmem.weights.stformat import TensorInfo


@st.composite
def tensors(draw: st.DrawFn) -> list[TensorInfo]:
    """Tensors of one file in offset order, with gaps; maybe a subset (tensor
    parallelism), in any order."""
    out, offset = [], draw(st.integers(0, 300))
    for i in range(draw(st.integers(0, 10))):
        n = draw(st.sampled_from([0, 1, 7, 8, 256, 4096]) | st.integers(0, 20000))
        out.append(TensorInfo(f"t{i}", "U8", (n,), offset, n))
        offset += n + draw(st.sampled_from([0, 0, 1, 3, 64, 300]))
    if out and draw(st.booleans()):
        out = draw(st.permutations(out))[:draw(st.integers(1, len(out)))]
    return out


def _written(chunks: list[planning.Chunk]) -> dict[int, int]:
    """device offset -> volume offset, for every byte the pieces copy."""
    dev: dict[int, int] = {}
    for c in chunks:
        for p in c.pieces:
            for k in range(p.nbytes):
                assert c.dst + p.buf_off + k not in dev, "a device byte written twice"
                dev[c.dst + p.buf_off + k] = p.src + k
    return dev


@settings(max_examples=300, deadline=None)
@given(ts=tensors(), buffer_size=st.sampled_from([1, 8, 64, 1000, 4096, 8192]),
       first_seq=st.integers(0, 5))
def test_bounce_chunks_copy_every_tensor_byte_once_within_a_buffer(
        ts: list[TensorInfo], buffer_size: int, first_seq: int) -> None:
    placements, size = planning.place(ts)
    chunks = planning.bounce_chunks(placements, buffer_size, target=3, first_seq=first_seq)
    assert [c.seq for c in chunks] == list(range(first_seq, first_seq + len(chunks)))
    assert all(c.target == 3 for c in chunks)
    for c in chunks:
        assert 0 < c.nbytes <= buffer_size
        assert all(0 <= p.buf_off and p.buf_off + p.nbytes <= c.nbytes for p in c.pieces)
        assert max(p.buf_off + p.nbytes for p in c.pieces) == c.nbytes
    # Packed: a window closes only when the next piece does not fit in it.
    for a, b in itertools.pairwise(chunks):
        assert b.dst + b.pieces[0].nbytes - a.dst > buffer_size
    spans = sorted((c.dst, c.dst + c.nbytes) for c in chunks)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    want = {p.dst + k: p.src + k for p in placements for k in range(p.nbytes)}
    assert _written(chunks) == want
    assert all(p.dst + p.nbytes <= size for p in placements)


@settings(max_examples=300, deadline=None)
@given(ts=tensors(), limit=st.sampled_from([1, 8, 64, 1000, 4096]), data=st.data())
def test_direct_chunks_stop_at_device_cuts(ts: list[TensorInfo], limit: int,
                                           data: st.DataObject) -> None:
    """Device ``cuts`` (where one allocation ends and the next begins): no chunk crosses
    one, none is over the limit, and the chunks still write every byte once."""
    placements, size = planning.place(ts)
    cuts = sorted(data.draw(st.lists(st.integers(0, size + 1), max_size=3)))
    chunks = planning.direct_chunks(placements, limit, [], cuts=cuts)
    for c in chunks:
        assert 0 < c.nbytes <= limit
        assert not any(c.dst < cut < c.dst + c.nbytes for cut in cuts), (c, cuts)
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    want = {p.dst + k: p.src + k for p in placements for k in range(p.nbytes)}
    assert _written(chunks) == want


@settings(max_examples=300, deadline=None)
@given(ts=tensors(), split=st.sampled_from(["bounce", "direct"]),
       limit=st.sampled_from([1, 8, 64, 1000, 4096]), data=st.data())
def test_completion_finishes_each_tensor_once_after_its_last_chunk(
        ts: list[TensorInfo], split: str, limit: int, data: st.DataObject) -> None:
    placements, _ = planning.place(ts)
    if split == "bounce":
        chunks = planning.bounce_chunks(placements, limit)
    else:
        top = max((p.src + p.nbytes for p in placements), default=0)
        cuts = data.draw(st.lists(st.integers(0, top), max_size=3))
        chunks = planning.direct_chunks(placements, limit, sorted(cuts))
    completion = planning.Completion(placements, chunks)
    assert sorted(completion.ready) == sorted(p.name for p in placements if p.nbytes == 0)

    waiting = {p.name: {c.seq for c in chunks
                        if c.dst < p.dst + p.nbytes and p.dst < c.dst + c.nbytes}
               for p in placements if p.nbytes}
    order = data.draw(st.permutations(chunks))
    if order:  # a chunk reported twice finishes nothing the second time
        order.insert(data.draw(st.integers(0, len(order))), order[0])
    finished: list[str] = []
    done: set[int] = set()
    for c in order:
        got = completion.done(c)
        done.add(c.seq)
        assert sorted(got) == sorted(name for name, seqs in waiting.items()
                                     if c.seq in seqs and seqs <= done
                                     and name not in finished)
        finished += got
    assert sorted(finished) == sorted(waiting)


def test_overlapping_chunks_are_refused() -> None:
    p = planning.Placement("t", 0, 0, 100)
    chunks = [planning.Chunk(0, 0, 0, 64, (planning.Piece(0, 0, 64),)),
              planning.Chunk(1, 0, 32, 68, (planning.Piece(32, 0, 68),))]
    with pytest.raises(ValueError, match="overlap"):
        planning.Completion([p], chunks)
