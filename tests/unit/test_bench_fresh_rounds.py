"""bench_fresh.py's round loop: interleaving, saving after each round, and the time
budget that ends a run with whole rounds (a lent GPU host kills a command at its limit,
and a run killed mid-round used to lose every result)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_fresh  # noqa: E402

ENTRIES = [("a", "a", None), ("b", "b", None), ("c", "c", None)]


def fake_measure(clock, cost=10.0, missing=()):
    def measure(label, base, volume, rnd):
        clock[0] += cost
        status = "not installed" if label in missing else "ok"
        return {"method": label, "round": rnd, "status": status, "GB/s": 1.0,
                "seconds": 1.0, "wall_s": cost, "exact": True, "returncode": 0}
    return measure


def test_every_round_is_saved_and_rotated(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(bench_fresh.time, "monotonic", lambda: clock[0])
    saved = []
    recs = bench_fresh.run_rounds(ENTRIES, 3, fake_measure(clock, missing={"c"}),
                                  on_round=lambda r, n: saved.append((n, len(r))))
    assert saved == [(1, 3), (2, 5), (3, 7)]  # c: not installed, not run again
    assert [r["method"] for r in recs if r["round"] == 1] != \
        [r["method"] for r in recs if r["round"] == 2]


def test_the_budget_stops_before_a_round_that_would_pass_it(monkeypatch, capsys):
    clock = [0.0]
    monkeypatch.setattr(bench_fresh.time, "monotonic", lambda: clock[0])
    saved = []
    # Each round costs 30 s: after two (60 s), a third would end at 90 > 80.
    recs = bench_fresh.run_rounds(ENTRIES, 5, fake_measure(clock), budget_s=80,
                                  on_round=lambda r, n: saved.append(n))
    assert saved == [1, 2]
    assert {r["round"] for r in recs} == {1, 2}
    assert "stopping after round 2 of 5" in capsys.readouterr().err


def test_without_a_budget_every_round_runs(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(bench_fresh.time, "monotonic", lambda: clock[0])
    recs = bench_fresh.run_rounds(ENTRIES, 4, fake_measure(clock, cost=1000.0))
    assert len(recs) == 12
