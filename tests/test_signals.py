"""The driver and the GPU copy service stop on SIGTERM whichever thread the kernel picks.

A signal sent to a process goes to any of its threads. CPython runs the Python handler
only in the main thread, at its next bytecode, so a main thread parked in one untimed
``Event.wait()`` never ran it when the signal landed on a worker thread: the process
ignored kubelet's SIGTERM until the SIGKILL after the grace period (seen with the copy
service). tgkill() sends the signal to one chosen thread, so the test is deterministic.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from csi_pmem import fdpass

from conftest import ROOT, needs_root

SYS_TGKILL = 234  # x86_64
_libc = ctypes.CDLL(None, use_errno=True)


def tgkill_workers(pid: int, sig: int) -> int:
    """Send ``sig`` to every thread of ``pid`` but the main one; how many got it."""
    sent = 0
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        if tid != pid and _libc.syscall(SYS_TGKILL, pid, tid, sig) == 0:
            sent += 1
    return sent


def wait_live(proc: subprocess.Popen, path: Path, log: Path) -> None:
    deadline = time.monotonic() + 60
    while fdpass.socket_state(str(path)) != fdpass.LIVE:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def run(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                stdout=out, stderr=out)


def test_gpu_copy_stops_on_a_sigterm_to_a_worker_thread(tmp_path):
    control, log = tmp_path / "gpu-copy.sock", tmp_path / "gpu-copy.log"
    proc = run([sys.executable, "-m", "csi_pmem", "gpu-copy", "--socket", str(control),
                "--copier", "fake"], log)
    try:
        wait_live(proc, control, log)
        assert tgkill_workers(proc.pid, signal.SIGTERM) >= 1
        assert proc.wait(20) == 0, log.read_text()
        assert not control.exists()
    finally:
        proc.kill()


@needs_root()
def test_the_driver_stops_on_a_sigterm_to_a_worker_thread(driver_factory):
    d = driver_factory().start()
    assert d.proc is not None
    # A published devdax volume: its sealed (read-only) tmpfs keeps dax.sock on disk, and
    # the stop must say nothing of it (an unlink there raised EROFS, a traceback, and cut
    # the driver's close short).
    d.publish(d.create("sealed").volume.volume_id, d.target("pod"))
    assert tgkill_workers(d.proc.pid, signal.SIGTERM) >= 1
    assert d.proc.wait(30) == 0, d.log.read_text()
    log = d.log.read_text()
    assert "stopped; published volumes stay mounted" in log and "Traceback" not in log, log


def test_a_second_gpu_copy_service_exits_2_and_leaves_the_first_alone(tmp_path):
    control = tmp_path / "gpu-copy.sock"
    first = run([sys.executable, "-m", "csi_pmem", "gpu-copy", "--socket", str(control),
                 "--copier", "fake"], tmp_path / "first.log")
    try:
        wait_live(first, control, tmp_path / "first.log")
        second = subprocess.run([sys.executable, "-m", "csi_pmem", "gpu-copy", "--socket",
                                 str(control), "--copier", "fake"],
                                env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr
        assert "another copy service listens on it" in second.stderr
        assert fdpass.socket_state(str(control)) == fdpass.LIVE
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)
