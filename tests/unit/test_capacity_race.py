"""GetCapacity while a scrub carves its scratch namespace (issue 45 item 6).

A scrub changes two things one after the other: it carves a scratch namespace over the
free space (the listing then says the space is taken) and records it as held (GetCapacity
then adds it back as free). GetCapacity read the listing and then the held space; a
listing from before the carve with the held space from after it counted the space twice,
so the scheduler was told of memory that does not exist. On the soft-reserved guest this
was the scrub queued again after a CreateVolume, carving while the next GetCapacity
listed. Here the interleaving is forced with events on the daxctl back end over the fake
kernel of tests/unit/fake_daxctl.py: no sleeps, no timing.
"""

from __future__ import annotations

import threading

import pytest
from test_daxctl_driver import DaxNode, capacity

from csi_pmem.driver.erasing.cleanspace import CleanSpace
from csi_pmem.driver.erasing.namespace import NamespaceEraser
from csi_pmem.driver.erasing.scrub import job_key

from conftest import MiB
from inprocess import made_nodes

POOL = "dax1"  # NUMA node 1, 512 MiB, dirty at start (first seen): the start-up scrub runs
WAIT = 60.0  # a bound for a hang only; every wait below is for an event that must come


class _SignalsHeld(dict):
    """The scrubber's ``_held``: says when the scrub records the scratch space as held."""

    def __init__(self, *args, on_held: threading.Event) -> None:
        super().__init__(*args)
        self.on_held = on_held

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if key == POOL:
            self.on_held.set()


class Gate:
    """Stops the scrub of POOL after it wrote its intent and before it carves (the
    scrub-after-record step), until the test lets it go (``carve``)."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.carve = threading.Event()

    def reached(self, pool: str, names: list[str]) -> None:
        if pool == POOL and names and not self.asked.is_set():
            self.asked.set()
            if not self.carve.wait(WAIT):
                raise AssertionError("the test never let the scrub carve")


@pytest.fixture
def gated(monkeypatch):
    """(make a node, the gate): a daxctl node whose start-up scrub of POOL waits."""
    gate = Gate()
    set_scrub = CleanSpace.set_scrub

    def intent_then_gate(self, pool: str, names: list[str]) -> None:
        set_scrub(self, pool, names)
        gate.reached(pool, names)

    monkeypatch.setattr(CleanSpace, "set_scrub", intent_then_gate)
    # Scrubs end as soon as they are let go: the erase of scratch space is not the point.
    monkeypatch.setattr(NamespaceEraser, "erase", lambda self, ns, cancel=None: None)
    made = made_nodes(DaxNode)
    make = next(made)
    try:
        yield make, gate
    finally:
        gate.carve.set()
        next(made, None)


def test_capacity_is_not_over_reported_while_a_scrub_carves(gated):
    make, gate = gated
    node = make()
    assert node.driver is not None
    scrubber = node.driver.scrubber
    assert gate.asked.wait(WAIT)  # the start-up scrub of POOL is about to carve
    held = threading.Event()
    with scrubber._lock:
        scrubber._held = _SignalsHeld(scrubber._held, on_held=held)

    # GetCapacity lists the pools; before it goes on, the scrub carves all of POOL's
    # free space and records it as held.
    listing_thread = threading.get_ident()
    pools = node.backend.pools
    interleaved = []

    def pools_then_scrub():
        listed = pools()
        if threading.get_ident() == listing_thread and not interleaved:
            interleaved.append(True)
            gate.carve.set()
            assert held.wait(WAIT), "the scrub did not record its scratch namespace"
        return listed

    node.backend.pools = pools_then_scrub
    try:
        seen = capacity(node, numaNode="1")
    finally:
        gate.carve.set()
        node.backend.pools = pools
    assert interleaved == [True]
    # The region holds 512 MiB; the scrub's share of it counts as free, once.
    assert seen == 512 * MiB, f"GetCapacity reported {seen // MiB} MiB of a 512 MiB region"

    # Once the scrub is done, nothing is held and the listing says the same.
    assert node.driver.eraser.wait(job_key(POOL), WAIT)
    assert scrubber.held(POOL) == []
    assert capacity(node, numaNode="1") == 512 * MiB


class _SignalsWait(threading.Condition):
    """The scrubber's ``_settled``: says when a reader waits for a scrub's change to end."""

    def __init__(self, lock, on_wait: threading.Event) -> None:
        super().__init__(lock)
        self.on_wait = on_wait

    def wait(self, timeout: float | None = None) -> bool:
        self.on_wait.set()
        return super().wait(timeout)


def test_capacity_is_not_over_reported_while_a_scrub_gives_its_space_back(gated):
    make, gate = gated
    node = make()
    assert node.driver is not None
    scrubber = node.driver.scrubber
    assert gate.asked.wait(WAIT)
    # The scrub destroys its scratch namespace and stops there, before it forgets the
    # space it held, until GetCapacity has answered, or waits for the scrub (the fix).
    destroyed, released = threading.Event(), threading.Event()
    with scrubber._lock:
        scrubber._settled = _SignalsWait(scrubber._lock, on_wait=released)
    destroy = node.backend.destroy

    def destroy_then_stop(name: str) -> None:
        destroy(name)
        if name.startswith(f"csi-pmem-scrub-{POOL}-"):
            destroyed.set()
            assert released.wait(WAIT), "GetCapacity neither answered nor waited"

    node.backend.destroy = destroy_then_stop
    try:
        gate.carve.set()
        assert destroyed.wait(WAIT)
        seen = capacity(node, numaNode="1")
    finally:
        released.set()
    assert seen == 512 * MiB, f"GetCapacity reported {seen // MiB} MiB of a 512 MiB region"
    assert node.driver.eraser.wait(job_key(POOL), WAIT)
    assert capacity(node, numaNode="1") == 512 * MiB
