"""Tests for csi_pmem.driver.erasing.erase: a deleted volume's bytes must never reach the
next tenant.

The tests use regular files on tmpfs (/dev/shm when it exists) because they map and
zero exactly like a devdax device does in this module: MAP_SHARED, no write().
"""

from __future__ import annotations

import ctypes
import itertools
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from csi_pmem.driver.erasing import erase
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


# ------------------------------------------------------------------ bounded read-back buffers
# Block devices (fsdax) are zeroed by BLKZEROOUT and read back with pread. A regular file
# answers that ioctl with ENOTTY, so zero_block_fd falls back to pwrite of zeros: the same
# code paths (_pwrite_zeros, _verify_block) without needing a loop device.

def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def _block_erase(path: Path, length: int, **kw: object) -> erase.EraseResult:
    fd = os.open(path, os.O_RDWR)
    try:
        return erase.zero_block_fd(fd, length, **kw)  # type: ignore[arg-type]
    finally:
        os.close(fd)


@pytest.mark.parametrize("verify", [erase.FULL, erase.SAMPLED])
def test_block_erase_buffers_come_from_the_bounded_pool(
        shm_dir: Path, monkeypatch: pytest.MonkeyPatch, verify: str) -> None:
    """Concurrent block erases with more threads than the pool's limit: never more than
    the limit mapped at once, none left mapped afterwards, every file zeroed."""
    import threading

    pool = erase.ScratchBuffers(erase.BLOCK_CHUNK, 2)
    monkeypatch.setattr(erase, "READ_BUFFERS", pool)
    length = 3 * erase.BLOCK_CHUNK + MiB  # a short last chunk too
    files = [make_file(shm_dir / f"vol{i}", length) for i in range(3)]
    errors: list[BaseException] = []

    def run(f: Path) -> None:
        try:
            for _ in range(2):
                res = _block_erase(f, length, threads=4, verify=verify)
                assert (res.method, res.verify, res.verified) == ("pwrite", verify, True)
        except BaseException as exc:  # re-raised in the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f,)) for f in files]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert 1 <= pool.peak <= pool.limit == 2
    assert pool.mapped == 0, "a read-back buffer stayed mapped after the erases"
    assert pool.made <= 3 * 2 * 4  # one per worker per erase at most, none per window
    for f in files:
        assert f.read_bytes() == bytes(length)


def test_block_erase_allocates_no_large_python_buffers(shm_dir: Path) -> None:
    """The zeros written and compared with and the read-back buffers are anonymous
    mappings, not bytes/bytearray (those live in glibc's per-thread arenas and their
    memory stayed with the driver after every fsdax erase)."""
    import tracemalloc

    length = 2 * erase.BLOCK_CHUNK
    f = make_file(shm_dir / "vol", length)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        for verify in (erase.FULL, erase.SAMPLED):
            _block_erase(f, length, threads=2, verify=verify)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MiB, f"block erases allocated {peak} bytes of Python objects at once"
    assert f.read_bytes() == bytes(length)


def test_repeated_block_erases_do_not_grow_resident_memory(shm_dir: Path) -> None:
    """32 fsdax-style erases (8 fresh worker threads each time, sampled and full verify)
    leave the process's resident memory where it was (+16 KiB measured). Before the
    pool, the 16 MiB buffers of each thread stayed in glibc's arenas: +128 to +207 MiB
    for these cycles on 2 CPUs. Not timed: a bound on memory, far from both."""
    length = 4 * erase.BLOCK_CHUNK
    f = shm_dir / "vol"
    with open(f, "wb") as fh:
        fh.truncate(length)
    _block_erase(f, length, threads=1, verify=erase.FULL)  # first-use costs (threads, libs)
    before = _rss_kib()
    for verify in (erase.SAMPLED, erase.FULL):
        for _ in range(16):
            _block_erase(f, length, threads=8, verify=verify)
    grown = _rss_kib() - before
    assert grown < 32 * 1024, f"resident memory grew by {grown} KiB over 32 block erases"


@pytest.mark.parametrize("verify", [erase.FULL, erase.SAMPLED])
def test_block_verification_names_the_first_nonzero_byte(shm_dir: Path, verify: str) -> None:
    """The read-back finds a byte left behind in a later chunk, at a sampled window, and
    names its offset; the lowest offset wins when several chunks are affected."""
    length = 3 * erase.BLOCK_CHUNK
    f = shm_dir / "vol"
    with open(f, "wb") as fh:
        fh.truncate(length)
    first = erase.BLOCK_CHUNK + 5 * erase.STRIDE + 1234  # inside a sampled window
    for off in (2 * erase.BLOCK_CHUNK + 7, first):
        with open(f, "r+b") as fh:
            fh.seek(off)
            fh.write(b"\x01")
    fd = os.open(f, os.O_RDONLY)
    try:
        with pytest.raises(BackendError, match=rf"byte at offset {first} .*2 of \d+ chunks"):
            erase._verify_block(fd, length, 3, verify)
    finally:
        os.close(fd)


def test_erasing_a_file_holds_a_bounded_part_of_it_mapped(tmp_path):
    """A file's zeroed and checked pages leave the eraser's mapping step by step, so the
    driver's peak RSS does not grow with the volume (two 80 MiB emulated volumes being
    erased held 160 MiB of the driver's RSS). Run in a child, whose peak RSS (VmHWM)
    is reset first, then read after a 192 MiB erase with full verification."""
    size = 192 << 20
    path = tmp_path / "volume.dax"
    with open(path, "wb") as f:
        f.truncate(size)
    child = textwrap.dedent(f"""
        import os
        from csi_pmem.driver.erasing import erase

        def hwm():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) << 10

        fd = os.open({str(path)!r}, os.O_RDWR)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak to the RSS now
        before = hwm()
        erase.zero_fd(fd, {size}, threads=2, verify="full")
        print(hwm() - before)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         check=True, timeout=300)
    grew = int(out.stdout)
    assert grew < 64 << 20, f"the erase's peak RSS grew by {grew >> 20} MiB"
