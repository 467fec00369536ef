"""One driver per node: a second instance stops before it touches anything of the first.

A second ``csi-pmem serve`` on the same state dir (a second ``make run``, a node plugin
started by hand, a rollout that surges) used to reconcile the shared state, unlink the
live driver's csi.sock and take over every published volume's dax.sock. These tests
start the second instance against a live first one and check that it exits 2 with one
line, and that the first one still serves its csi.sock, dax.sock and gpu.sock.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from csi_pmem import daxclient, fdpass
from csi_pmem.csi import csi_pb2
from csi_pmem.driver.instance import AlreadyRunning, StateDirLock

from conftest import ROOT, DriverProcess, needs_root

pytestmark = needs_root()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def second(first: DriverProcess, *, state: Path | None = None, endpoint: Path | None = None,
           extra: list[str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run another ``serve`` beside ``first``: its state dir and endpoint unless given."""
    d = DriverProcess(base=first.base, extra=list(extra or []))
    argv = d.argv()
    if state is not None:
        argv[argv.index("--state-dir") + 1] = str(state)
    if endpoint is not None:
        argv[argv.index("--endpoint") + 1] = f"unix://{endpoint}"
    return subprocess.run(argv, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture
def gpu_copy(tmp_path):
    """The node's GPU copy service (fake copier), so that publications serve gpu.sock."""
    control = tmp_path / "gpu-copy.sock"
    log = tmp_path / "gpu-copy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "csi_pmem", "gpu-copy", "--socket",
                                 str(control), "--copier", "fake"],
                                env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=out)
    deadline = time.monotonic() + 30
    while fdpass.socket_state(str(control)) != fdpass.LIVE:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    yield control
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log.read_text()


def assert_first_unharmed(first: DriverProcess, target: str) -> None:
    first.identity.Probe(csi_pb2.ProbeRequest(), timeout=10)
    assert first.proc is not None and first.proc.poll() is None
    meta, fd = daxclient.open_volume(target)
    try:
        assert os.fstat(fd).st_size >= 0 and meta["volume_id"]
    finally:
        os.close(fd)
    assert fdpass.socket_state(os.path.join(target, "gpu.sock")) == fdpass.LIVE


def test_a_second_driver_on_the_state_dir_exits_2_and_the_first_keeps_serving(
        driver_factory, gpu_copy, tmp_path):
    port = free_port()
    first = driver_factory(extra=["--gpu-copy-socket", str(gpu_copy),
                                  "--metrics-address", f"127.0.0.1:{port}"]).start()
    vid = first.create("shared").volume.volume_id
    target = first.target("pod-a")
    first.publish(vid, target)
    records = sorted(p.read_bytes() for p in (first.state / "volumes").glob("*.json"))

    # Same state dir, its own endpoint and no metrics: the lock alone stops it.
    proc = second(first, endpoint=tmp_path / "other.sock")
    assert proc.returncode == 2
    line = one_line(proc)
    assert f"pid {first.proc.pid}" in line and str(first.state) in line, line
    assert not (tmp_path / "other.sock").exists()
    assert sorted(p.read_bytes() for p in (first.state / "volumes").glob("*.json")) == records
    assert_first_unharmed(first, target)

    # And exactly as a second `make run` would: the same flags, endpoint included.
    proc = second(first, extra=["--gpu-copy-socket", str(gpu_copy),
                                "--metrics-address", f"127.0.0.1:{port}"])
    assert proc.returncode == 2 and "holds the state dir" in one_line(proc)
    assert_first_unharmed(first, target)

    # A killed driver holds nothing: its successor takes the lock and serves again.
    first.kill()
    first.start()
    assert_first_unharmed(first, target)


def test_a_live_endpoint_is_never_unlinked(driver_factory, tmp_path):
    first = driver_factory().start()
    proc = second(first, state=tmp_path / "state2")
    assert proc.returncode == 2
    line = one_line(proc)
    assert str(first.socket) in line and "another process serves this endpoint" in line
    assert first.socket.exists()
    first.identity.Probe(csi_pb2.ProbeRequest(), timeout=10)


def test_a_taken_metrics_port_fails_in_one_line_before_reconcile(driver_factory, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        d = driver_factory(extra=["--metrics-address", f"127.0.0.1:{port}"])
        d.kubelet.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(d.argv(), env=dict(os.environ, PYTHONPATH=str(ROOT)),
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"metrics address 127.0.0.1:{port} is taken" in one_line(proc)
    # Nothing was served or carved: no socket, no pool files, no region records.
    assert not d.socket.exists()
    assert not (d.base / "pools").exists() or not list((d.base / "pools").rglob("*.dax"))


def test_a_stale_endpoint_of_a_killed_driver_is_replaced(driver_factory):
    d = driver_factory()
    d.base.mkdir(parents=True, exist_ok=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(d.socket))
    stale.close()  # the file stays, nobody listens: what a SIGKILL leaves
    assert fdpass.socket_state(str(d.socket)) == fdpass.STALE
    d.start()
    d.identity.Probe(csi_pb2.ProbeRequest(), timeout=10)


def test_the_state_dir_lock_names_its_holder_and_is_free_after_release(tmp_path):
    first = StateDirLock(str(tmp_path / "state"))
    with pytest.raises(AlreadyRunning, match=rf"pid {os.getpid()} on .*holds the state dir"):
        StateDirLock(str(tmp_path / "state"))
    first.release()
    again = StateDirLock(str(tmp_path / "state"))
    again.release()


def test_claim_leaves_live_sockets_and_other_files_alone(tmp_path):
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(tmp_path / "live.sock"))
    live.listen(1)
    try:
        with pytest.raises(fdpass.SocketInUse):
            fdpass.claim(str(tmp_path / "live.sock"))
        assert (tmp_path / "live.sock").exists()
    finally:
        live.close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        fdpass.claim(str(tmp_path / "file"))
    assert (tmp_path / "file").read_text() == "x"
    fdpass.claim(str(tmp_path / "absent.sock"))  # nothing there: nothing to do
