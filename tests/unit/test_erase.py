"""Tests for csi_pmem.erase: a deleted volume's bytes must never reach the next tenant.

The tests use regular files on tmpfs (/dev/shm when it exists) because they map and
zero exactly like a devdax device does in this module: MAP_SHARED, no write().
"""

from __future__ import annotations

import ctypes
import itertools
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from csi_pmem import erase
from csi_pmem.errors import BackendError

MiB = 1 << 20


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="test-erase-", dir=base) as d:
        yield Path(d)


def pattern(length: int) -> bytes:
    """Non-zero, position-dependent data: a skipped or misplaced chunk cannot hide."""
    block = bytes((i * 7 + 1) % 255 + 1 for i in range(4096))
    return (block * (length // len(block) + 1))[:length]


def make_file(path: Path, length: int, extra: int = 0) -> Path:
    path.write_bytes(pattern(length + extra))
    return path


def test_zeroes_and_verifies(shm_dir: Path) -> None:
    f = make_file(shm_dir / "vol", 8 * MiB)
    res = erase.zero_path(f, 8 * MiB, chunk=2 * MiB, threads=2)
    assert (res.bytes, res.threads, res.verified, res.verify) == (8 * MiB, 2, True, "full")
    # A regular file is no persistent memory: nothing claims the zeros are durable.
    assert res.persisted is False
    assert res.method == ("pmem_memset" if erase.pmem_memset() else "memset")
    assert res.seconds > 0
    assert f.read_bytes() == bytes(8 * MiB)


def test_only_the_requested_range_is_touched(shm_dir: Path) -> None:
    f = make_file(shm_dir / "vol", 4 * MiB, extra=MiB)
    erase.zero_path(f, 4 * MiB, chunk=MiB)
    data = f.read_bytes()
    assert data[: 4 * MiB] == bytes(4 * MiB)
    assert data[4 * MiB:] == pattern(5 * MiB)[4 * MiB:]


@pytest.mark.parametrize("length", [1, 4095, 4097, 3 * MiB + 123, 5 * MiB - 1])
def test_lengths_not_multiple_of_page_or_chunk(shm_dir: Path, length: int) -> None:
    f = make_file(shm_dir / "vol", length, extra=100)
    res = erase.zero_path(f, length, chunk=MiB, threads=3)
    assert res.bytes == length and res.verified
    data = f.read_bytes()
    assert data[:length] == bytes(length)
    assert data[length:] == pattern(length + 100)[length:]


def test_one_thread_and_many_threads_give_the_same_result(shm_dir: Path) -> None:
    length = 6 * MiB + 4096
    a = make_file(shm_dir / "a", length)
    b = make_file(shm_dir / "b", length)
    ra = erase.zero_path(a, length, threads=1, chunk=MiB)
    rb = erase.zero_path(b, length, threads=4, chunk=MiB)
    assert ra.threads == 1 and rb.threads == 4
    assert a.read_bytes() == b.read_bytes() == bytes(length)


def test_threads_capped_by_chunk_count(shm_dir: Path) -> None:
    f = make_file(shm_dir / "vol", 2 * MiB)
    assert erase.zero_path(f, 2 * MiB, threads=8, chunk=MiB).threads == 2


def test_default_threads_is_sane() -> None:
    n = erase.default_threads()
    assert 1 <= n <= erase.MAX_DEFAULT_THREADS


def _nth_call(n: int, real: Callable[[int, int], None],
              after: Callable[[int, int], None]) -> Callable[[int, int], None]:
    """Wrap the zeroing function: on call number ``n`` (0-based) run ``after`` instead
    of / after it. With threads=1 the pool runs chunks in ascending offset order."""
    calls = itertools.count()

    def wrapper(addr: int, size: int) -> None:
        if next(calls) == n:
            after(addr, size)
        else:
            real(addr, size)
    return wrapper


def test_verification_reports_first_nonzero_offset(shm_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    length, chunk = 8 * MiB, 2 * MiB
    f = make_file(shm_dir / "vol", length)
    # Skip the third chunk entirely.
    monkeypatch.setattr(erase, "_zero_range",
                        _nth_call(2, erase._zero_range, lambda addr, size: None))
    with pytest.raises(BackendError) as exc:
        erase.zero_path(f, length, chunk=chunk, threads=1)
    # pattern() has no zero byte, so the first survivor is the chunk's first byte.
    assert f"offset {2 * chunk} " in str(exc.value)
    assert "1 of 4 chunks" in str(exc.value)


def test_verification_finds_a_single_surviving_byte(shm_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    length, chunk = 4 * MiB, MiB
    f = make_file(shm_dir / "vol", length)
    real = erase._zero_range

    def zero_but_one_byte(addr: int, size: int) -> None:
        # Simulate a byte that did not take the store (e.g. a bad media cell).
        real(addr, size)
        ctypes.memset(addr + 12345, 0x5A, 1)

    monkeypatch.setattr(erase, "_zero_range", _nth_call(3, real, zero_but_one_byte))
    with pytest.raises(BackendError, match=f"offset {3 * MiB + 12345} "):
        erase.zero_path(f, length, chunk=chunk, threads=1)


def test_verify_false_skips_the_check(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = make_file(shm_dir / "vol", 2 * MiB)
    monkeypatch.setattr(erase, "_zero_range", lambda addr, size: None)
    res = erase.zero_path(f, 2 * MiB, verify=False)
    assert res.verified is False
    assert f.read_bytes() == pattern(2 * MiB)  # nothing zeroed, nothing checked


def test_length_zero_maps_nothing(shm_dir: Path) -> None:
    f = make_file(shm_dir / "vol", 4096)
    res = erase.zero_path(f, 0)
    assert res.bytes == 0 and res.seconds == 0.0 and res.threads == 0
    assert f.read_bytes() == pattern(4096)


def test_empty_file_length_zero(shm_dir: Path) -> None:
    f = shm_dir / "empty"
    f.touch()
    assert erase.zero_path(f, 0).bytes == 0


def test_file_shorter_than_length_is_refused_not_sigbus(shm_dir: Path) -> None:
    f = make_file(shm_dir / "vol", MiB)
    with pytest.raises(BackendError, match="shorter than"):
        erase.zero_path(f, 2 * MiB)
    assert f.read_bytes() == pattern(MiB)


def test_read_only_fd_is_a_backend_error(shm_dir: Path) -> None:
    f = make_file(shm_dir / "vol", MiB)
    fd = os.open(f, os.O_RDONLY)
    try:
        with pytest.raises(BackendError, match="cannot map"):
            erase.zero_fd(fd, MiB)
    finally:
        os.close(fd)


def test_missing_path_is_a_backend_error(shm_dir: Path) -> None:
    with pytest.raises(BackendError, match="cannot open"):
        erase.zero_path(shm_dir / "nope", MiB)


@pytest.mark.parametrize("kw", [{"threads": 0}, {"chunk": 0}])
def test_bad_arguments(shm_dir: Path, kw: dict[str, int]) -> None:
    f = make_file(shm_dir / "vol", MiB)
    with pytest.raises(ValueError):
        erase.zero_path(f, MiB, **kw)
    with pytest.raises(ValueError):
        erase.zero_path(f, -1)


def test_char_device_length_must_be_2mib_multiple() -> None:
    # /dev/zero is a character device like /dev/daxX.Y; the alignment check fires
    # before anything is mapped.
    if not os.path.exists("/dev/zero") or not stat.S_ISCHR(os.stat("/dev/zero").st_mode):
        pytest.skip("no /dev/zero character device")
    with pytest.raises(BackendError, match="multiple of 2 MiB"):
        erase.zero_path("/dev/zero", MiB)


def test_worker_exception_propagates_and_mapping_is_released(
        shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = make_file(shm_dir / "vol", 4 * MiB)

    def boom(addr: int, size: int) -> None:
        raise OSError("simulated")

    monkeypatch.setattr(erase, "_zero_range", boom)
    # If a ctypes export outlived the mmap, close() would raise BufferError instead.
    with pytest.raises(OSError, match="simulated"):
        erase.zero_path(f, 4 * MiB, chunk=MiB, threads=2)
    monkeypatch.undo()
    erase.zero_path(f, 4 * MiB, chunk=MiB)
    assert f.read_bytes() == bytes(4 * MiB)


# ------------------------------------------------------------------ sampled verification
def test_sampled_verification_always_finds_a_skipped_chunk(shm_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    length, chunk = 8 * MiB, 2 * MiB
    f = make_file(shm_dir / "vol", length)
    monkeypatch.setattr(erase, "_zero_range",
                        _nth_call(1, erase._zero_range, lambda addr, size: None))
    with pytest.raises(BackendError, match=f"offset {chunk} "):
        erase.zero_path(f, length, chunk=chunk, threads=1, verify=erase.SAMPLED)


def test_sampled_verification_finds_any_surviving_run_of_a_stride(
        shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stated guarantee: a non-zero run of STRIDE bytes anywhere is always found."""
    length = 8 * MiB
    real = erase._zero_range
    for start in (12345, erase.STRIDE - 1, 3 * erase.STRIDE + erase.SAMPLE + 7,
                  length - erase.STRIDE):
        f = make_file(shm_dir / f"vol{start}", length)

        def leave_a_run(addr: int, size: int, start: int = start) -> None:
            real(addr, size)
            ctypes.memset(addr + start, 0x5A, erase.STRIDE)

        monkeypatch.setattr(erase, "_zero_range", _nth_call(0, real, leave_a_run))
        with pytest.raises(BackendError, match="verification failed"):
            erase.zero_path(f, length, chunk=length, threads=1, verify=erase.SAMPLED)


def test_sampled_verification_reads_a_sixteenth(shm_dir: Path) -> None:
    windows = erase._windows(0, 64 * MiB, erase.SAMPLED)
    read = sum(n for _, n in windows)
    assert 64 * MiB // 16 <= read <= 64 * MiB // 16 + 2 * erase.SAMPLE
    assert windows[0][0] == 0 and windows[-1][0] + windows[-1][1] == 64 * MiB
    f = make_file(shm_dir / "vol", 4 * MiB)
    res = erase.zero_path(f, 4 * MiB, verify=erase.SAMPLED)
    assert res.verify == erase.SAMPLED and res.verified
    assert f.read_bytes() == bytes(4 * MiB)


def test_cancel_stops_between_chunks(shm_dir: Path) -> None:
    import threading

    f = make_file(shm_dir / "vol", 4 * MiB)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(erase.EraseCancelled):
        erase.zero_path(f, 4 * MiB, chunk=MiB, threads=1, cancel=cancel)
    assert f.read_bytes() == pattern(4 * MiB), "a cancelled erase must not start"


def test_worker_threads_pin_themselves(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    pinned: list[tuple[int, list[int]]] = []
    real = os.sched_setaffinity
    monkeypatch.setattr(os, "sched_setaffinity",
                        lambda pid, cpus: (pinned.append((threading.get_ident(), list(cpus))),
                                           real(pid, cpus)))
    cpus = sorted(os.sched_getaffinity(0))[:1]
    f = make_file(shm_dir / "vol", 4 * MiB)
    erase.zero_path(f, 4 * MiB, chunk=MiB, threads=2, cpus=cpus)
    assert pinned and all(c == cpus for _, c in pinned)
    assert threading.get_ident() not in {t for t, _ in pinned}, "the caller was pinned"
