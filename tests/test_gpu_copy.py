"""The GPU copy service without a GPU: the fake copier behind the same interface as the
CUDA one moves real bytes into memfd "allocations" passed over real unix sockets.

Covered: the protocol end to end (dax.sock-style forwarding by the node plugin's socket
server, the service, the pod's client), registration that follows the volume's index,
bad fds, short allocations, out-of-bounds copies and malformed messages refused with
nothing written, progress never ahead of the bytes, pods on two volumes served at once,
authentication by the pod's cgroup, a silent or absent service, a service killed
mid-copy, a pod reset mid-copy (the volume's release waits for the copy), a refusal
the pod meets on its next request, a peer that drips bytes, pods beyond the service's
bound, bad fds and sizes on the control socket, threads that cannot start, and the
driver serving gpu.sock next to dax.sock and releasing the volume.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from csi_pmem.driver.daxsock import DaxSocketServer
from csi_pmem.driver.node.devdax import SOCKET_FILE
from csi_pmem.gpucopy import protocol
from csi_pmem.gpucopy.copier import FAKE_GPU, FakeCopier
from csi_pmem.gpucopy.link import ServiceLink, ServiceUnavailable
from csi_pmem.gpucopy.service import CopyService
from csi_pmem.loader import open_model, open_volume, stage
from csi_pmem.loader.gpu.chunks import place, runs
from csi_pmem.loader.gpu.nodecopy import NodeCopyError, Session, request_copies, service_socket
from csi_pmem.loader.gpu.nodepool import NodePool
from csi_pmem.weights import layout

import loader_models as lm

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def work(tmp_path) -> Iterator[Path]:
    with lm.shm_scratch(tmp_path, "csi-pmem-gpucopy-") as d:
        yield d


def staged(work: Path, name: str = "m", volume: str = "vol",
           shards: int = 3) -> tuple[Path, dict]:
    src = work / f"src-{name}"
    ref = lm.sharded_model(src, shards=shards)
    vol = lm.staged_volume(src, work / volume, size=64 * MiB, name=name)
    return vol, ref


def meta(vol: Path, vid: str = "csi-0123") -> dict:
    return {"volume_id": vid, "usable_size": os.path.getsize(vol), "align": 2 * MiB,
            "numa_node": 0, "device": str(vol)}


class Node:
    """The node side as deployed: the socket server answering gpu.sock (as the driver
    does) forwarding to a copy service on its control socket."""

    def __init__(self, work: Path, vol: Path, copier: FakeCopier | None = None,
                 pod_uid: str | None = None, proc_root: str = "/proc",
                 control: str | None = None, volume_id: str = "csi-0123",
                 published: str = "published"):
        self.vol = vol
        self.dir = work / published
        self.dir.mkdir(exist_ok=True)
        self.copier = copier or FakeCopier()
        self.control = control or str(work / "gpu-copy.sock")
        self.service = None if control else CopyService(
            self.control, self.copier, poll_seconds=0.05, client_timeout=5).start()
        self.link = ServiceLink(self.control, timeout=2)
        self.dax = DaxSocketServer(proc_root=proc_root)
        self.meta = meta(vol, volume_id)
        self.sock = str(self.dir / protocol.SOCKET_NAME)
        self.dax.serve(self.sock, self.meta, lambda: os.open(vol, os.O_RDONLY | os.O_CLOEXEC),
                       pod_uid=pod_uid,
                       forward=lambda conn, fd: self.link.forward(self.meta, conn, fd))

    def prepare(self) -> bool:
        fd = os.open(self.vol, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return self.link.prepare(self.meta, fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.dax.close()
        if self.service is not None:
            self.service.stop()


@pytest.fixture
def node_factory(work):
    made: list[Node] = []

    def make(*a, **kw) -> Node:
        n = Node(work, *a, **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def allocation(size: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("fake-gpu-allocation", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED)


def whole_model_copies(vol: Path) -> tuple[list[protocol.Copy], int, dict[str, tuple]]:
    """Copies a loader would send for every tensor, and where each tensor lands."""
    copies, where, base = [], {}, 0
    with open_volume(vol) as v:
        view = open_model(v)
        for tensors in view.select().values():
            placements, size = place(tensors)
            for p in placements:
                where[p.name] = (base + p.dst, p.nbytes, p.src)
            copies += [protocol.Copy(s, base + d, n) for s, d, n in runs(placements)]
            base += -(-size // 4096) * 4096
    return copies, base, where


def counts(svc: CopyService, **want: int) -> dict[str, int]:
    """The service's counters named in ``want``, once they equal it (or after 5 s): it
    counts a pod after its last message, which the pod may read first."""
    deadline = time.monotonic() + 5
    while True:
        got = {k: getattr(svc, k) for k in want}
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def test_copies_land_bit_exact_with_progress(work, node_factory):
    vol, _ = staged(work)
    node = node_factory(vol)
    assert node.prepare()
    copies, size, where = whole_model_copies(vol)
    fd, out = allocation(size)
    seen: list[int] = []
    data = Path(vol).read_bytes()

    def progress(k: int) -> None:
        # Reported done means landed: the first k copies' bytes are there already.
        for c in copies[:k]:
            assert out[c.dst:c.dst + c.nbytes] == data[c.src:c.src + c.nbytes], c
        seen.append(k)

    report = request_copies(node.sock, fd, FAKE_GPU, size, copies, progress)
    assert report["ok"] and report["bytes"] == sum(c.nbytes for c in copies)
    assert seen == sorted(seen) and seen[-1] == len(copies)
    for dst, n, src in where.values():
        assert out[dst:dst + n] == data[src:src + n]
    assert node.dax.served == 1 and counts(node.service, served=1) == {"served": 1}
    assert node.copier.outstanding == 0


def test_the_pods_allocation_is_let_go_before_the_reply(work, node_factory):
    """When the pod hears "ok" the service holds none of its allocations: a real one's
    device memory is freed only once both sides let go, and a batched load allocates
    its next batch as soon as it hears it."""
    vol, _ = staged(work)
    node = node_factory(vol)
    assert node.prepare()
    copies, size, _ = whole_model_copies(vol)
    for _ in range(20):  # a race, were it one: the reply first, the close after
        fd, out = allocation(size)
        try:
            report = request_copies(node.sock, fd, FAKE_GPU, size, copies, lambda k: None)
            assert report["ok"] and node.copier.open_targets == 0
        finally:
            os.close(fd)
            out.close()


def wait_registered(node: Node, vol: Path) -> list:
    """The committed model's safetensors files, once the service registered them all."""
    with open_volume(vol) as v:
        files = layout.read_index(v).select().safetensors
    deadline = time.monotonic() + 10
    while len(node.copier.registered) < len(files) and time.monotonic() < deadline:
        time.sleep(0.02)
    return files


def test_registration_follows_the_index(work, node_factory):
    vol, _ = staged(work)
    node = node_factory(vol)
    node.prepare()
    files = wait_registered(node, vol)
    state = node.service.volumes["csi-0123"]
    assert sorted(off - state.address for off in node.copier.registered) == \
        [f.offset for f in files]
    # A second model staged into the volume is registered by the poller, without a
    # new prepare; releasing the volume unregisters everything.
    lm.sharded_model(work / "src-b")
    with open_volume(vol, writable=True) as v:
        stage(v, str(work / "src-b"), name="b")
    deadline = time.monotonic() + 10
    while len(node.copier.registered) < 2 * len(files) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(node.copier.registered) == 2 * len(files)
    node.link.release("csi-0123")
    assert node.copier.registered == {} and "csi-0123" not in node.service.volumes


def test_an_unchanged_index_is_not_read_again(work, node_factory, monkeypatch):
    """Every pod's first request refreshes the registrations: with the index as it was,
    that compares the slot headers and reads nothing else (it used to hash and parse
    the whole index on the way to the first copy)."""
    from csi_pmem.gpucopy import service as service_mod

    vol, _ = staged(work)
    node = node_factory(vol)
    node.prepare()
    files = wait_registered(node, vol)
    assert len(node.copier.registered) == len(files)
    reads: list[int] = []
    real = service_mod.read_index
    monkeypatch.setattr(service_mod, "read_index", lambda v: reads.append(1) or real(v))
    state = node.service.volumes["csi-0123"]
    state.refresh()
    time.sleep(0.3)  # the poller (every 0.05 s) refreshes too
    assert reads == []
    lm.sharded_model(work / "src-b")
    with open_volume(vol, writable=True) as v:
        stage(v, str(work / "src-b"), name="b")
    state.refresh()
    assert reads and len(node.copier.registered) == 2 * len(files)


def test_index_heads_change_with_every_index_write(work):
    vol, _ = staged(work)
    with open_volume(vol, writable=True) as v:
        before = layout.index_heads(v)
        assert layout.index_heads(v) == before
        index = layout.read_index(v)
        layout.write_index(v, index)
        assert layout.index_heads(v) != before


def test_a_client_that_never_prepared_is_served_from_the_forwarded_fd(work, node_factory):
    vol, _ = staged(work)
    node = node_factory(vol)  # no prepare: e.g. the service restarted since publish
    copies, size, _ = whole_model_copies(vol)
    fd, out = allocation(size)
    request_copies(node.sock, fd, FAKE_GPU, size, copies, lambda k: None)
    data = Path(vol).read_bytes()
    c = copies[0]
    assert out[c.dst:c.dst + c.nbytes] == data[c.src:c.src + c.nbytes]


@pytest.mark.parametrize("case", ["pipe-fd", "file-fd", "read-only", "short", "past-alloc",
                                  "past-volume", "other-gpu", "no-fd", "garbage", "nested"])
def test_bad_requests_are_refused_and_nothing_is_written(work, node_factory, case):
    vol, _ = staged(work)
    node = node_factory(vol)
    copies, size, _ = whole_model_copies(vol)
    fd, out = allocation(size)
    gpu = FAKE_GPU
    expect = {"pipe-fd": "not an exported GPU allocation",
              "file-fd": "not an exported GPU allocation",
              "read-only": "cannot be mapped writable", "short": "smaller than",
              "past-alloc": "outside the allocation", "past-volume": "outside the volume",
              "other-gpu": "cannot reach", "no-fd": "exactly one fd",
              "garbage": "not a JSON message", "nested": "nested too deeply"}[case]
    if case == "pipe-fd":
        r, w = os.pipe()
        os.close(w)
        fd = r
    elif case == "file-fd":  # the volume's own fd, say: a file, not an allocation
        fd, before = os.open(vol, os.O_RDWR), Path(vol).read_bytes()
    elif case == "read-only":
        fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    elif case == "short":
        fd, out = allocation(size // 2 // 4096 * 4096)
    elif case == "past-alloc":
        copies = [*copies, protocol.Copy(copies[0].src, size - 10, 100)]
    elif case == "past-volume":
        copies = [protocol.Copy(os.path.getsize(vol) - 10, 0, 100)]
    elif case == "other-gpu":
        gpu = "GPU-ffffffff-0000-0000-0000-000000000000"
    if case in ("no-fd", "garbage", "nested", "other-gpu"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(node.sock)
        reader = protocol.Reader(sock)
        hello = reader.read()
        assert hello["gpus"] == [FAKE_GPU]
        req = protocol.CopyRequest(gpu, size, tuple(copies)).to_json()
        if case == "garbage":
            sock.sendall(b"{not json\n")
        elif case == "nested":  # json recurses: a RecursionError, not a ValueError
            sock.sendall(b"[" * 100_000 + b"\n")
        else:
            protocol.send(sock, req, [] if case == "no-fd" else [fd])
        reply = reader.read()
        sock.close()
        assert expect in reply["error"], reply
    else:
        with pytest.raises(NodeCopyError, match=expect):
            request_copies(node.sock, fd, gpu, size, copies, lambda k: None)
    if case != "pipe-fd":
        assert out[:] == bytes(len(out))  # nothing written
    if case == "file-fd":
        assert Path(vol).read_bytes() == before
    assert node.service.failed == 1


@pytest.mark.parametrize("member", [False, True])
def test_the_pod_must_belong_to_the_volume_pod(work, node_factory, member):
    vol, _ = staged(work)
    pod = str(uuid.uuid4())
    proc = work / "proc"
    (proc / str(os.getpid())).mkdir(parents=True)
    (proc / str(os.getpid()) / "cgroup").write_text(
        f"0::/kubepods/pod{pod if member else 'other'}/c\n")
    node = node_factory(vol, pod_uid=pod, proc_root=str(proc))
    copies, size, where = whole_model_copies(vol)
    fd, out = allocation(size)
    if member:
        request_copies(node.sock, fd, FAKE_GPU, size, copies, lambda k: None)
        data = Path(vol).read_bytes()
        assert all(out[d:d + n] == data[s:s + n] for d, n, s in where.values())
        assert node.dax.refused == 0 and counts(node.service, served=1) == {"served": 1}
        return
    with pytest.raises(NodeCopyError, match="not in that pod's cgroup"):
        request_copies(node.sock, fd, FAKE_GPU, size, copies, lambda k: None)
    assert node.dax.refused == 1 and node.service.served == 0
    assert out[:] == bytes(size)


def test_an_absent_service_is_a_clear_error(work, node_factory):
    vol, _ = staged(work)
    node = node_factory(vol, control=str(work / "nobody.sock"))
    assert not node.prepare()
    fd, _ = allocation(4096)
    with pytest.raises(NodeCopyError, match=r"GPU copy service on this node .* is not reachable"):
        request_copies(node.sock, fd, FAKE_GPU, 4096, [], lambda k: None)
    with pytest.raises(ServiceUnavailable):
        node.link.forward(node.meta, socket.socket(socket.AF_UNIX), 0)


def test_a_silent_service_times_out(work, node_factory):
    vol, _ = staged(work)
    node = node_factory(vol, copier=FakeCopier(delay=2.0))
    copies, size, _ = whole_model_copies(vol)
    fd, _ = allocation(size)
    started = time.monotonic()
    with pytest.raises(NodeCopyError, match="timed out") as info:
        request_copies(node.sock, fd, FAKE_GPU, size, copies, lambda k: None, timeout=0.5)
    assert time.monotonic() - started < 5 and info.value.done < len(copies)


def wait_spent(copier: FakeCopier, seconds: float = 10) -> int:
    """The copier's unspent tokens once the service has finished with the connection:
    its tokens spent and its targets let go. The pod may hear of a failure before the
    service has settled (it is told at once), so a test that asserts either waits."""
    deadline = time.monotonic() + seconds
    while (copier.outstanding or copier.open_targets) and time.monotonic() < deadline:
        time.sleep(0.02)
    return copier.outstanding


def whole_model_request(work: Path, node_factory, copier: FakeCopier):
    """A node over a staged model with ``copier``, the copies of the whole model (at
    least three) and an allocation for them."""
    vol, _ = staged(work)
    node = node_factory(vol, copier=copier)
    copies, size, _ = whole_model_copies(vol)
    assert len(copies) >= 3
    fd, out = allocation(size)
    return node, copies, size, fd, out


def test_a_copy_that_fails_on_the_device_spends_every_token(work, node_factory):
    """The copies queued behind a failed one are never waited for; each of their
    tokens (an event of the CUDA copier's pool) is discarded, none leaked."""
    copier = FakeCopier(fail_at=2)
    node, copies, size, fd, out = whole_model_request(work, node_factory, copier)
    seen: list[int] = []
    with pytest.raises(NodeCopyError, match="fake fault") as info:
        request_copies(node.sock, fd, FAKE_GPU, size, copies, seen.append)
    assert info.value.done <= 1 and all(k <= 1 for k in seen)
    assert wait_spent(copier) == 0
    for c in copies[1:]:  # the failed copy and those behind it wrote nothing
        assert not any(out[c.dst:c.dst + c.nbytes])
    # Told at once, before the service counts it.
    assert counts(node.service, failed=1) == {"failed": 1}


def test_a_pod_that_goes_away_mid_copy_leaks_no_token(work, node_factory):
    copier = FakeCopier(delay=0.1)
    node, copies, size, fd, _ = whole_model_request(work, node_factory, copier)

    def progress(k: int) -> None:
        raise RuntimeError("the pod is gone")  # its socket closes with the session

    with pytest.raises(RuntimeError, match="the pod is gone"):
        request_copies(node.sock, fd, FAKE_GPU, size, copies, progress)
    assert wait_spent(copier) == 0
    assert node.service.served == 0


class GatedCopier(FakeCopier):
    """Copies that land only once the test opens ``gate``. Each first checks that its
    source is still registered (a release unregisters before it unmaps) and counts
    itself in ``unsafe`` instead of reading memory that may be gone."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()
        self.unsafe = 0

    def wait(self, token: Any) -> None:
        self.entered.set()
        self.gate.wait(10)
        src = token[1][0]
        with self._lock:
            live = any(a <= src < a + n for a, n in self.registered.items())
        if not live:
            self.unsafe += 1
            self.discard(token)
            return
        super().wait(token)


def test_a_release_waits_for_the_copy_a_reset_pod_left(work, node_factory):
    """A pod that resets its connection mid-copy (the hello unread) fails the service's
    next read; the copy the waiter is in still reads the volume, so the volume's
    release (the pod's unpublish) must wait for it."""
    copier = GatedCopier()
    node, copies, size, fd, _ = whole_model_request(work, node_factory, copier)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(node.sock)
    protocol.send(sock, protocol.CopyRequest(FAKE_GPU, size, tuple(copies)).to_json(), [fd])
    assert copier.entered.wait(10)
    sock.close()  # unread data: the service's next read is reset
    time.sleep(0.3)  # it sees the reset while the copy is held
    release = threading.Thread(target=node.service.release, args=(node.meta["volume_id"],))
    release.start()
    release.join(0.5)
    held = release.is_alive()
    copier.gate.set()
    release.join(10)
    assert held, "the volume was released under a running copy"
    assert not release.is_alive() and copier.unsafe == 0
    assert wait_spent(copier) == 0 and node.service.failed == 1


def test_a_refused_first_request_is_reported_when_the_next_one_meets_a_closed_socket(
        work, node_factory):
    """Multi-file loads send one request per allocation; the service answers a refused
    one with its reason and closes, so the pod's next send fails. The pod must report
    the reason, not the broken pipe."""
    node, copies, size, _, out = whole_model_request(work, node_factory, FakeCopier())
    short, _ = allocation(size // 2 // 4096 * 4096)
    fd, _ = allocation(size)
    session = Session(node.sock, timeout=5)

    def requests() -> Iterator[tuple[int, protocol.CopyRequest]]:
        yield short, protocol.CopyRequest(FAKE_GPU, size, tuple(copies))
        deadline = time.monotonic() + 10
        while not node.service.failed and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # the service closes after its answer
        yield fd, protocol.CopyRequest(FAKE_GPU, size, tuple(copies))

    try:
        with pytest.raises(NodeCopyError, match=r"refused: .*smaller than"):
            session.copy(requests(), lambda k: None)
    finally:
        session.close()
    assert out[:] == bytes(len(out))


def test_pods_on_two_volumes_are_served_at_once_each_from_its_own(work, node_factory):
    """One service, two published volumes holding different models, two pods on each
    at the same time: every pod gets its own volume's bytes."""
    first = node_factory(*staged(work, "a")[:1], copier=FakeCopier(delay=0.005))
    vol_b, _ = staged(work, "b", volume="vol-b", shards=2)
    second = node_factory(vol_b, control=first.control, volume_id="csi-0456",
                          published="published-b")
    assert Path(first.vol).read_bytes() != Path(vol_b).read_bytes()
    results: dict[tuple[int, int], object] = {}

    def pod(node: Node, index: int) -> None:
        copies, size, where = whole_model_copies(node.vol)
        fd, out = allocation(size)
        try:
            request_copies(node.sock, fd, FAKE_GPU, size, copies, lambda k: None)
            data = Path(node.vol).read_bytes()
            results[id(node), index] = all(out[d:d + n] == data[s:s + n]
                                           for d, n, s in where.values())
        except BaseException as exc:  # reported below, with the others
            results[id(node), index] = exc
        finally:
            os.close(fd)

    pods = [threading.Thread(target=pod, args=(n, i)) for n in (first, second)
            for i in range(2)]
    for t in pods:
        t.start()
    for t in pods:
        t.join(30)
    assert len(results) == 4 and all(r is True for r in results.values()), results
    assert counts(first.service, served=4, failed=0) == {"served": 4, "failed": 0}
    assert sorted(first.service.volumes) == ["csi-0123", "csi-0456"]


def test_a_service_killed_mid_copy_reports_what_landed(work, node_factory):
    vol, _ = staged(work)
    control = str(work / "proc-service.sock")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "csi_pmem", "gpu-copy", "--socket", control,
                             "--copier", "fake", "--fake-delay", "0.3"], env=env,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(control):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        node = node_factory(vol, control=control)
        copies, size, _ = whole_model_copies(vol)
        assert len(copies) >= 3
        fd, out = allocation(size)
        seen: list[int] = []

        def progress(k: int) -> None:
            seen.append(k)
            if k == 1:
                proc.send_signal(signal.SIGKILL)

        with pytest.raises(NodeCopyError) as info:
            request_copies(node.sock, fd, FAKE_GPU, size, copies, progress)
        assert info.value.done == 1 and seen == [1]
        data = Path(vol).read_bytes()
        c = copies[0]
        assert out[c.dst:c.dst + c.nbytes] == data[c.src:c.src + c.nbytes]
    finally:
        proc.kill()
        proc.wait(10)


def test_a_peer_that_drips_bytes_times_out_per_message():
    """The timeout bounds a whole message: a byte every 0.1 s must not keep a
    connection (and the service's thread for it) alive past it."""
    ours, theirs = socket.socketpair()
    stop = threading.Event()

    def drip() -> None:  # for 4 s: a reader that waits per byte times out after it
        until = time.monotonic() + 4
        while not stop.wait(0.1) and time.monotonic() < until:
            with contextlib.suppress(OSError):
                theirs.send(b" ")

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        ours.settimeout(0.5)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            protocol.Reader(ours).read()
        assert time.monotonic() - started < 2.5
        assert ours.gettimeout() == 0.5  # the socket's own timeout is left as it was
    finally:
        stop.set()
        dripper.join()
        ours.close()
        theirs.close()


def test_pods_beyond_max_clients_are_told_the_service_is_busy(work, node_factory):
    copier = GatedCopier()
    node, copies, size, fd, _ = whole_model_request(work, node_factory, copier)
    node.service.max_clients = 1
    first: list[object] = []
    pod = threading.Thread(target=lambda: first.append(request_copies(
        node.sock, fd, FAKE_GPU, size, copies, lambda k: None)))
    pod.start()
    try:
        assert copier.entered.wait(10)
        other, _ = allocation(size)
        with pytest.raises(NodeCopyError, match="busy"):
            request_copies(node.sock, other, FAKE_GPU, size, copies, lambda k: None)
    finally:
        copier.gate.set()
        pod.join(10)
    assert first and first[0]["ok"]
    want = {"served": 1, "failed": 1, "clients": 0}
    assert counts(node.service, **want) == want


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_control_socket_refuses_bad_fds_and_sizes_and_keeps_none(work, node_factory):
    """The node plugin's control messages: a client fd that is no socket, a size mmap
    cannot take. Each gets an error reply; no fd stays open in the service."""
    vol, _ = staged(work)
    node = node_factory(vol)

    def control(doc: dict, fds: list[int]) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(5)
            c.connect(node.control)
            protocol.send(c, doc, fds)
            return protocol.Reader(c).read()

    vol_fd = os.open(vol, os.O_RDONLY)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        control({"op": protocol.OP_PREPARE, **node.meta}, [vol_fd])  # mapped once
        before = open_fds()
        for _ in range(5):
            reply = control({"op": protocol.OP_CLIENT, **node.meta}, [vol_fd, null])
            assert "socket" in reply["error"].lower(), reply
        reply = control({"op": protocol.OP_PREPARE, **dict(node.meta, usable_size=2**70)},
                        [vol_fd])
        assert "invalid usable_size" in reply["error"]
        assert wait_until_fds(before) <= before
    finally:
        os.close(vol_fd)
        os.close(null)


def wait_until_fds(target: int, seconds: float = 5) -> int:
    deadline = time.monotonic() + seconds
    while open_fds() > target and time.monotonic() < deadline:
        time.sleep(0.02)
    return open_fds()


def test_out_of_threads_costs_one_connection_not_the_service(work, node_factory,
                                                            monkeypatch):
    """A thread that cannot start (pid or memory limits) in the node plugin's socket
    server, the service's control loop or its per-pod waiter refuses that one pod with
    a reason; the next pod is served."""
    vol, _ = staged(work)
    node = node_factory(vol)
    copies, size, where = whole_model_copies(vol)
    fd, out = allocation(size)
    real = threading.Thread.start
    failing = ["forward", "control-conn", "copy-wait"]

    def start(self: threading.Thread) -> None:
        if failing and self.name == failing[0]:
            failing.pop(0)
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    # The service's control thread failing closes the plugin's connection unanswered:
    # the pod hears that the service is not reachable.
    for expect in ["cannot start a thread", "not reachable|closed", "cannot start a thread"]:
        with pytest.raises(NodeCopyError, match=expect):
            request_copies(node.sock, fd, FAKE_GPU, size, copies, lambda k: None)
    assert not failing
    request_copies(node.sock, fd, FAKE_GPU, size, copies, lambda k: None)
    data = Path(vol).read_bytes()
    assert all(out[d:d + n] == data[s:s + n] for d, n, s in where.values())
    assert counts(node.service, served=1) == {"served": 1}


def test_service_socket_lookup(work, monkeypatch):
    vol, _ = staged(work)
    with open_volume(vol) as v:
        assert service_socket(v) is None  # a plain file has no gpu.sock
        monkeypatch.setenv("CSI_PMEM_GPU_COPY", "/x/gpu.sock")
        assert service_socket(v) == "/x/gpu.sock"
        monkeypatch.setenv("CSI_PMEM_GPU_COPY", "off")
        assert service_socket(v) is None


def test_protocol_limits():
    with pytest.raises(protocol.ProtocolError, match="non-negative"):
        protocol.parse_copy_request({"op": "copy", "gpu": "g", "size": 10,
                                     "copies": [[0, -1, 3]]}, 100)
    with pytest.raises(protocol.ProtocolError, match="invalid allocation size"):
        protocol.parse_copy_request({"op": "copy", "gpu": "g", "size": 0, "copies": []}, 100)
    with pytest.raises(protocol.ProtocolError, match="invalid volume_id"):
        protocol.volume_meta({"volume_id": "../x", "usable_size": 1})
    req = protocol.parse_copy_request(json.loads(json.dumps(
        protocol.CopyRequest("g", 10, (protocol.Copy(1, 2, 3),)).to_json())), 100)
    assert req.copies == (protocol.Copy(1, 2, 3),) and req.nbytes == 3


@pytest.mark.parametrize("entry, expect", [
    ([0, 0, 12, 0, 8], "rows must be at least 1"),
    ([0, 0, 12, 5, 8], "divide the bytes"),
    ([0, 0, 12, 3, 3], "not overlap"),
    ([0, 0, 12, 3, 46], "outside the volume"),  # the last row ends at 96: past 95
    ([0, 0, 12, 3, 4, 1], "non-negative integers"),
])
def test_copies_of_rows_are_checked(entry, expect):
    """A 2D copy reads its last row where it ends, not rows x pitch: a rank's stretch
    at the end of the volume fits, one byte past does not."""
    doc = {"op": "copy", "gpu": "g", "size": 12, "copies": [entry]}
    with pytest.raises(protocol.ProtocolError, match=expect):
        protocol.parse_copy_request(doc, 95)
    ok = protocol.parse_copy_request(dict(doc, copies=[[0, 0, 12, 3, 46]]), 96)
    assert ok.copies == (protocol.Copy(0, 0, 12, 3, 46),) and ok.copies[0].end == 96
    assert ok.copies[0].to_json() == [0, 0, 12, 3, 46] and ok.nbytes == 12


def test_copies_of_rows_land_packed(work, node_factory):
    """A rank's stretch of every row (a row-parallel cut) is one copy: its rows land
    one after the other, and only those bytes are read."""
    vol, _ = staged(work)
    node = node_factory(vol)
    assert node.prepare()
    data = Path(vol).read_bytes()
    rows, width, pitch, src = 37, 1000, 4096, 3 * MiB + 100
    fd, out = allocation(64 * 1024)
    copies = [protocol.Copy(src, 512, rows * width, rows, pitch),
              protocol.Copy(src, 40_000, 300)]
    report = request_copies(node.sock, fd, FAKE_GPU, len(out), copies, lambda k: None)
    assert report["ok"] and report["bytes"] == rows * width + 300
    want = b"".join(data[src + r * pitch:src + r * pitch + width] for r in range(rows))
    assert out[512:512 + rows * width] == want
    assert out[:512] == bytes(512) and out[512 + rows * width:40_000] == bytes(
        40_000 - 512 - rows * width)
    assert out[40_000:40_300] == data[src:src + 300]
    session = Session(node.sock)
    try:
        assert session.hello() == [FAKE_GPU] and session.copies_rows
    finally:
        session.close()


def test_a_pool_tells_its_watchers_what_landed_and_when_nothing_will(
        work, node_factory, fake_allocations):
    vol, _ = staged(work)
    node = node_factory(vol)
    assert node.prepare()
    make, _ = fake_allocations
    pool = NodePool(node.sock, 0, 8 * MiB, allocate=make)
    told: list[int | None] = []
    pool.watchers.append(told.append)
    try:
        assert pool.greeted.wait(5) and pool.session.copies_rows
        slot = pool.acquire(MiB)
        start, end = pool.submit(slot, [protocol.Copy(0, 0, 4096),
                                        protocol.Copy(4096, 4096, 4096)])
        list(pool.progress(start, end))
        assert told and told[-1] == end == pool.landed == 2 and None not in told
        pool.spend(NodeCopyError("stopped by the test"))
        # Once at the failure, and once more at most as the reader ends; no count
        # after it.
        assert told[-1] is None and told.index(None) == 2 and told.count(None) <= 2
        pool.give_back(slot)
    finally:
        pool.close()
    assert told.count(None) <= 2 and told[-1] is None


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for tmpfs mounts")
def test_the_driver_serves_gpu_sock_and_releases_the_volume(driver_factory, work):
    from csi_pmem.loader import cli as weights_cli

    control = str(work / "svc.sock")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = open(work / "service.log", "wb")
    svc = subprocess.Popen([sys.executable, "-m", "csi_pmem", "gpu-copy", "--socket", control,
                            "--copier", "fake", "--poll-seconds", "0.1", "--log-level", "debug"],
                           env=env, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(control):
            assert svc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        driver = driver_factory(extra=["--gpu-copy-socket", control]).start()
        lm.sharded_model(work / "src")
        vid = driver.create("weights", size=64 * MiB).volume.volume_id
        rw = driver.target("stager")
        driver.publish(vid, rw)
        assert os.path.exists(os.path.join(rw, protocol.SOCKET_NAME))
        assert weights_cli.main(["stage", str(work / "src"), rw, "-q"]) == 0
        driver.unpublish(vid, rw)

        ro = driver.target("server")
        driver.publish(vid, ro, readonly=True)  # read-only publications may use it
        with open_volume(ro) as v:
            assert service_socket(v) == os.path.join(ro, protocol.SOCKET_NAME)
            view = open_model(v)
            placements, size = place([t for ts in view.select().values() for t in ts][:1])
            data = bytes(v.view(placements[0].src, placements[0].nbytes))
        fd, out = allocation(4096 * (1 + size // 4096))
        request_copies(os.path.join(ro, protocol.SOCKET_NAME), fd, FAKE_GPU, len(out),
                       [protocol.Copy(placements[0].src, 0, placements[0].nbytes)],
                       lambda k: None)
        assert out[:placements[0].nbytes] == data
        # gpu.sock is served as dax.sock is: the same mode, the same pod check.
        socks = [os.path.join(ro, n) for n in (SOCKET_FILE, protocol.SOCKET_NAME)]
        assert len({stat.S_IMODE(os.stat(p).st_mode) for p in socks}) == 1
        driver.unpublish(vid, ro)
        assert not os.path.exists(ro)
        other = driver.target("other-pod")
        driver.publish(vid, other, readonly=True,
                       context={"csi.storage.k8s.io/pod.uid": str(uuid.uuid4())})
        with pytest.raises(NodeCopyError, match="not in that pod's cgroup"):
            request_copies(os.path.join(other, protocol.SOCKET_NAME), fd, FAKE_GPU,
                           len(out), [protocol.Copy(placements[0].src, 0, 4096)],
                           lambda k: None)
        driver.unpublish(vid, other)
        driver.delete(vid)
    finally:
        svc.send_signal(signal.SIGTERM)
        assert svc.wait(15) == 0
        log.close()
    text = (work / "service.log").read_text()
    assert "registered" in text and f"volume {vid} released" in text


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_max_clients_must_be_a_positive_number(value):
    proc = subprocess.run([sys.executable, "-m", "csi_pmem", "gpu-copy", "--copier", "fake",
                           "--socket", "/nonexistent/gpu-copy.sock", "--max-clients", value],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert f"--max-clients: {value!r} is not a positive whole number" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- slots: one connection and reused allocations for a batched load ------------------


class FakeAllocation:
    """A memfd standing in for ``ExportableAllocation`` in :class:`NodePool`: the fake
    copier maps it as the CUDA one imports a real one. ``live`` counts the bytes of all
    fake allocations not freed, ``peak`` its most."""

    live = peak = 0

    def __init__(self, nbytes: int):
        self.uuid = FAKE_GPU
        self.size = -(-nbytes // (64 * 1024)) * 64 * 1024
        self.fd, self.map = allocation(self.size)
        self.syncs = 0
        FakeAllocation.live += self.size
        FakeAllocation.peak = max(FakeAllocation.peak, FakeAllocation.live)

    @property
    def address(self) -> int:
        return 0  # never dereferenced: the tests read the mapping

    def export_fd(self, index: int = 0) -> int:
        return os.dup(self.fd)

    def synchronize(self) -> None:
        self.syncs += 1

    def free(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.map.close()
            self.fd = -1
            FakeAllocation.live -= self.size


@pytest.fixture
def fake_allocations():
    FakeAllocation.live = FakeAllocation.peak = 0
    made: list[FakeAllocation] = []

    def make(n: int) -> FakeAllocation:
        made.append(FakeAllocation(n))
        return made[-1]

    yield make, made
    for a in made:
        a.free()


def fill(pool: NodePool, data: bytes, src: int, n: int) -> tuple[Any, FakeAllocation]:
    """One batch: a slot of ``n`` bytes filled from volume offset ``src``, checked."""
    slot = pool.acquire(n)
    start, end = pool.submit(slot, [protocol.Copy(src, 0, n // 2),
                                    protocol.Copy(src + n // 2, n // 2, n - n // 2)])
    assert list(pool.progress(start, end))[-1] == 2
    assert slot.alloc.map[:n] == data[src:src + n]
    return slot, slot.alloc


def test_a_pool_reuses_its_allocations_within_its_cap(work, node_factory,
                                                      fake_allocations):
    """Batches of like sizes reuse the slots (sent once, their fds never again); a
    batch that needs more than the free slots give has them let go on both sides
    first, so the allocations never hold more than the cap."""
    vol, _ = staged(work)
    node = node_factory(vol)
    assert node.prepare()
    data = Path(vol).read_bytes()
    make, made = fake_allocations
    cap = 3 * MiB
    pool = NodePool(node.sock, 0, cap, allocate=make)
    try:
        # The batched load's window keeps the held batches and the next within the cap.
        sizes = [MiB] * 6 + [2 * MiB] + [MiB] * 3
        held: list[Any] = []
        for i, n in enumerate(sizes):
            slot, _ = fill(pool, data, (i * 4096) % (len(data) - n), n)
            held.append(slot)
            if len(held) > 1:  # two batches held at once: the one read, the next
                pool.give_back(held.pop(0))
            assert FakeAllocation.live <= cap
        pool.give_back(held.pop())
        assert pool.reused == 7 and pool.made == 3 and pool.let_go == 1
        # A reused slot waited for this process's reads of its last batch.
        assert sum(a.syncs for a in made) == pool.reused
        # The service let go of the forgotten slots: it holds the live ones only.
        deadline = time.monotonic() + 5
        while node.copier.open_targets > len(pool.slots) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert node.copier.open_targets == len(pool.slots) <= 2
    finally:
        pool.close()
    assert FakeAllocation.live == 0 and FakeAllocation.peak <= cap
    assert pool.report is not None and pool.report["requests"] == len(sizes)
    assert counts(node.service, served=1) == {"served": 1}
    assert node.copier.open_targets == 0 and node.copier.outstanding == 0


def test_a_slot_still_in_use_at_the_end_is_freed_with_its_last_view(
        work, node_factory, fake_allocations):
    vol, _ = staged(work)
    node = node_factory(vol)
    data = Path(vol).read_bytes()
    make, _ = fake_allocations
    pool = NodePool(node.sock, 0, 4 * MiB, allocate=make)
    slot, _ = fill(pool, data, 0, MiB)
    lease = pool.lease(slot, MiB)
    pool.close()
    assert FakeAllocation.live == MiB  # the server still reads it
    del lease
    assert FakeAllocation.live == 0


def test_a_failed_copy_fails_the_pool_with_the_services_reason(
        work, node_factory, fake_allocations):
    vol, _ = staged(work)
    node = node_factory(vol, copier=FakeCopier(fail_at=3))
    data = Path(vol).read_bytes()
    make, _ = fake_allocations
    pool = NodePool(node.sock, 0, 4 * MiB, allocate=make)
    try:
        slot, _ = fill(pool, data, 0, MiB)
        pool.give_back(slot)
        slot = pool.acquire(MiB)
        start, end = pool.submit(slot, [protocol.Copy(0, 0, MiB // 2),
                                        protocol.Copy(MiB // 2, MiB // 2, MiB // 2)])
        with pytest.raises(NodeCopyError, match="fake fault"):
            list(pool.progress(start, end))
        pool.give_back(slot)  # freed at once: a failed pool keeps nothing
        with pytest.raises(NodeCopyError, match="fake fault"):
            pool.acquire(MiB)  # spent: the loader goes the per-load way from here
        pool.shed()
        assert FakeAllocation.live == 0  # before the load ends, not after
    finally:
        pool.close()
    assert FakeAllocation.live == 0
    assert wait_spent(node.copier) == 0 and node.copier.open_targets == 0


@pytest.mark.parametrize("case", ["unknown-slot", "other-size", "bad-slot", "forget-fd",
                                  "forget-unheld"])
def test_bad_slot_messages_are_refused(work, node_factory, case):
    vol, _ = staged(work)
    node = node_factory(vol)
    fd, out = allocation(MiB)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(node.sock)
    reader = protocol.Reader(sock)
    assert reader.read()["gpus"] == [FAKE_GPU]
    copies = (protocol.Copy(0, 0, 4096),)
    expect = {"unknown-slot": "holds no allocation", "other-size": "holds an allocation of",
              "bad-slot": "invalid slot", "forget-fd": "carries no fd",
              "forget-unheld": "holds no allocation"}[case]
    try:
        if case == "unknown-slot":
            protocol.send(sock, protocol.CopyRequest(FAKE_GPU, MiB, copies, 3).to_json())
        elif case == "other-size":
            protocol.send(sock, protocol.CopyRequest(FAKE_GPU, MiB, copies, 1,
                                                     True).to_json(), [fd])
            protocol.send(sock, protocol.CopyRequest(FAKE_GPU, MiB // 2, copies,
                                                     1).to_json())
        elif case == "bad-slot":
            protocol.send(sock, protocol.CopyRequest(FAKE_GPU, MiB, copies,
                                                     protocol.MAX_SLOTS, True).to_json(),
                          [fd])
        elif case == "forget-fd":  # an fd with a message that says it carries none
            protocol.send(sock, {**protocol.forget(0), "fd": True}, [fd])
        else:  # a free keepalive, were it accepted
            protocol.send(sock, protocol.forget(2))
        while "error" not in (reply := reader.read() or {"error": "closed"}):
            pass
        assert expect in reply["error"], reply
    finally:
        sock.close()
        os.close(fd)
        out.close()
    assert counts(node.service, failed=1) == {"failed": 1}
    assert node.copier.open_targets == 0


def test_a_slot_let_go_with_copies_queued_waits_for_them(work, node_factory):
    """A forget (or a new fd for a held slot) right behind the slot's copies: the
    service lets go of the allocation after they landed, never under them."""
    vol, _ = staged(work)
    node = node_factory(vol, copier=FakeCopier(delay=0.05))
    data = Path(vol).read_bytes()
    fd, out = allocation(MiB)
    fd2, out2 = allocation(MiB)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(node.sock)
    reader = protocol.Reader(sock)
    copies = (protocol.Copy(0, 0, MiB // 2), protocol.Copy(MiB // 2, MiB // 2, MiB // 2))
    try:
        protocol.send(sock, protocol.CopyRequest(FAKE_GPU, MiB, copies, 0, True).to_json(),
                      [fd])
        protocol.send(sock, protocol.CopyRequest(FAKE_GPU, MiB, copies, 0, True).to_json(),
                      [fd2])  # slot 0 now holds the second allocation
        protocol.send(sock, protocol.forget(0))
        sock.shutdown(socket.SHUT_WR)
        while "ok" not in (reply := reader.read() or {"ok": False}):
            assert "error" not in reply, reply
        assert reply["ok"] and reply["requests"] == 2
    finally:
        sock.close()
    assert out[:] == data[:MiB] and out2[:] == data[:MiB]
    assert node.copier.open_targets == 0 and node.copier.outstanding == 0
    os.close(fd)
    os.close(fd2)


def test_a_batch_waits_for_a_slot_rather_than_pass_the_cap(work, node_factory,
                                                          fake_allocations):
    """Reused slots larger than their batches: the next batch waits for one to come
    back instead of making a new one beyond the cap."""
    vol, _ = staged(work)
    node = node_factory(vol)
    data = Path(vol).read_bytes()
    make, _ = fake_allocations
    pool = NodePool(node.sock, 0, 3 * MiB, allocate=make)
    try:
        slots = [fill(pool, data, 0, MiB)[0] for _ in range(3)]
        for s in slots:
            pool.give_back(s)
        small = [fill(pool, data, 0, 256 * 1024)[0] for _ in range(3)]
        assert pool.made == 3 and FakeAllocation.live == 3 * MiB
        timer = threading.Timer(0.01, pool.give_back, [small[0]])
        timer.start()
        slot, _ = fill(pool, data, 0, MiB)
        timer.join()
        assert pool.made == 3 and FakeAllocation.peak == 3 * MiB
        pool.give_back(slot)
    finally:
        pool.close()


def test_batches_that_start_together_count_each_others_new_slots(work, node_factory,
                                                                 fake_allocations):
    """Two batches started at once each make a slot, outside the pool's lock: the one
    made second counts the first as held, so the free slot that would take the pool
    past its cap is let go (the H100 run held 1258 MiB against 1 GiB before this)."""
    vol, _ = staged(work)
    node = node_factory(vol)
    make, _ = fake_allocations
    making = threading.Event()

    def slow(n: int) -> FakeAllocation:
        making.set()
        time.sleep(0.2)  # the first batch is still making its slot
        return make(n)

    pool = NodePool(node.sock, 0, 3 * MiB, allocate=slow)
    try:
        small = pool.acquire(MiB)
        pool.give_back(small)  # free, and too small for the batches below
        nbytes = MiB + MiB // 4
        got: list[Any] = []
        first = threading.Thread(target=lambda: got.append(pool.acquire(nbytes)))
        first.start()
        assert making.wait(5)
        got.append(pool.acquire(nbytes))
        first.join(5)
        assert len(got) == 2 and pool.made == 3 and pool.let_go == 1
        assert FakeAllocation.peak <= 3 * MiB, FakeAllocation.peak
        for slot in got:
            pool.give_back(slot)
    finally:
        pool.close()
    assert FakeAllocation.live == 0 and not pool.slots


def test_a_slot_given_back_after_close_leaves_the_pool(work, node_factory,
                                                       fake_allocations):
    vol, _ = staged(work)
    node = node_factory(vol)
    make, _ = fake_allocations
    pool = NodePool(node.sock, 0, 4 * MiB, allocate=make)
    slot = pool.acquire(MiB)
    pool.close()
    assert pool.slots == [slot] and FakeAllocation.live == MiB
    pool.give_back(slot)
    assert not pool.slots and FakeAllocation.live == 0


def slow_service_close(monkeypatch: pytest.MonkeyPatch, delay: float) -> threading.Event:
    """The fake service's let-go of an allocation takes ``delay`` seconds, as an unmap
    of a big one does; the event is set when one starts."""
    from csi_pmem.gpucopy.copier import FakeTarget

    close = FakeTarget.close
    closing = threading.Event()

    def slow_close(self: Any) -> None:
        closing.set()
        time.sleep(delay)
        close(self)

    monkeypatch.setattr(FakeTarget, "close", slow_close)
    return closing


def counting_pool(node: Any, make: Any, cap: int) -> tuple[NodePool, list[tuple[int, int]]]:
    """A pool that records, at each allocation it makes, how many allocations the
    service holds and how many of the pool's slots it was sent: the service must
    never hold one the pod has let go of."""
    held_by_service: list[tuple[int, int]] = []
    pool: NodePool

    def counted(n: int) -> FakeAllocation:
        held_by_service.append((node.copier.open_targets,
                                sum(s.known for s in pool.slots)))
        return make(n)

    pool = NodePool(node.sock, 0, cap, allocate=counted)
    return pool, held_by_service


def test_a_new_slot_is_made_after_the_service_let_go_of_the_old(
        work, node_factory, fake_allocations, monkeypatch):
    """Device memory is freed once both sides let go: a pod that made its next
    allocation as soon as it sent the forget held both for a while (306 MiB more than
    the bound on an H100). The service says when it let go; the pod waits for that."""
    vol, _ = staged(work)
    node = node_factory(vol)
    data = Path(vol).read_bytes()
    make, _ = fake_allocations
    slow_service_close(monkeypatch, 0.05)  # the service's unmap takes a while
    pool, held_by_service = counting_pool(node, make, 3 * MiB)
    try:
        for n in (2 * MiB, 2 * MiB + MiB // 2, 3 * MiB):  # each too big for the last
            slot, _ = fill(pool, data, 0, n)
            pool.give_back(slot)
        assert pool.let_go >= 2
        assert all(service <= pod for service, pod in held_by_service), held_by_service
    finally:
        pool.close()


def test_a_slot_is_made_for_the_largest_batch_that_would_reuse_it(
        work, node_factory, fake_allocations):
    """Told the load's batch sizes, a slot made for a batch is as large as the largest
    near size (within the reuse margin, and the cap): the larger batch after it reuses
    it instead of having it let go and made again."""
    vol, _ = staged(work)
    node = node_factory(vol)
    data = Path(vol).read_bytes()
    make, made = fake_allocations
    big = MiB + MiB // 4
    far = 4 * MiB  # too far above to share a slot with a 1 MiB batch
    pool = NodePool(node.sock, 0, 3 * MiB, sizes=[MiB, big, far], allocate=make)
    try:
        for n in (MiB, big, MiB):
            slot, _ = fill(pool, data, 0, n)
            pool.give_back(slot)
        assert pool.made == 1 and pool.reused == 2 and pool.let_go == 0
        assert [a.size for a in made] == [big]
        # Where the larger size would pass the cap beside the busy slots, the batch's own.
        busy = [fill(pool, data, 0, MiB)[0]]
        tight = NodePool(node.sock, 0, big + MiB, sizes=[MiB, big], allocate=make)
        try:
            held = fill(tight, data, 0, MiB)[0]
            second = fill(tight, data, 0, MiB)[0]
            assert held.size == big and second.size == MiB
            for s in (held, second):
                tight.give_back(s)
        finally:
            tight.close()
        for s in busy:
            pool.give_back(s)
    finally:
        pool.close()
    assert FakeAllocation.live == 0


def test_no_batch_allocates_while_the_service_holds_a_slot_let_go_of(
        work, node_factory, fake_allocations, monkeypatch):
    """One batch lets go of a slot and waits for the service to say it did; a second
    batch that needs a new slot meanwhile waits too, instead of allocating beside
    memory the service still holds (a 1 GiB bound peaked at 1350 MiB on an H100)."""
    vol, _ = staged(work)
    node = node_factory(vol)
    data = Path(vol).read_bytes()
    make, _ = fake_allocations
    closing = slow_service_close(monkeypatch, 0.1)
    pool, held_by_service = counting_pool(node, make, 3 * MiB)
    try:
        slot, _ = fill(pool, data, 0, 2 * MiB)
        pool.give_back(slot)
        got: list[Any] = []
        first = threading.Thread(target=lambda: got.append(pool.acquire(2 * MiB + MiB // 2)))
        first.start()
        assert closing.wait(5)  # the service is letting go of the 2 MiB slot
        got.append(pool.acquire(MiB // 4))
        first.join(5)
        assert len(got) == 2 and pool.let_go == 1
        assert all(service <= pod for service, pod in held_by_service), held_by_service
        for s in got:
            pool.give_back(s)
    finally:
        pool.close()
    assert FakeAllocation.live == 0


def test_a_free_slot_is_let_go_of_without_waiting_for_other_slots_copies(
        work, node_factory, fake_allocations):
    """The service lets go of a forgotten slot with no copy queued into it at once, not
    behind the copies queued into the pod's other slots: the pod allocates its next
    slot only then, and the link would idle until they all landed."""
    vol, _ = staged(work)
    node = node_factory(vol, copier=FakeCopier(delay=0.5))  # 1 s for the busy slot's
    make, _ = fake_allocations
    pool = NodePool(node.sock, 0, 14 * MiB, allocate=make)
    try:
        free = pool.acquire(4 * MiB)
        start, end = pool.submit(free, [protocol.Copy(0, 0, 4096)])
        assert list(pool.progress(start, end))[-1] == 1
        pool.give_back(free)
        busy = pool.acquire(8 * MiB)
        start, end = pool.submit(busy, [protocol.Copy(0, 0, 4096), protocol.Copy(0, 4096, 4096)])
        t0 = time.monotonic()
        slot = pool.acquire(5 * MiB)  # lets go of the free slot first
        took = time.monotonic() - t0
        assert pool.session.acks_forget and pool.let_go == 1
        assert took < 0.5, f"waited {took:.2f} s for the service"
        assert list(pool.progress(start, end))[-1] == 2
        for s in (slot, busy):
            pool.give_back(s)
    finally:
        pool.close()
    assert FakeAllocation.live == 0


def test_a_service_that_does_not_answer_forgets_costs_no_wait(
        work, node_factory, fake_allocations, monkeypatch):
    """A node's service older than the pod's loader (its hello without ``forgot``):
    the pod lets go of slots without waiting for an answer that never comes."""
    vol, _ = staged(work)
    node = node_factory(vol)
    data = Path(vol).read_bytes()
    make, _ = fake_allocations
    hello = Session.hello

    def old_hello(self: Session) -> list[str]:
        gpus = hello(self)
        self.acks_forget = False
        return gpus

    monkeypatch.setattr(Session, "hello", old_hello)
    pool = NodePool(node.sock, 0, 3 * MiB, allocate=make)
    try:
        t0 = time.monotonic()
        for n in (2 * MiB, 2 * MiB + MiB // 2, 3 * MiB):  # each too big for the last
            slot, _ = fill(pool, data, 0, n)
            pool.give_back(slot)
        assert pool.let_go == 2 and time.monotonic() - t0 < 1.5
    finally:
        pool.close()
    assert FakeAllocation.live == 0
