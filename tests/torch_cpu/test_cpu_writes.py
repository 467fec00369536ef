"""What a write into a CPU-loaded tensor does, on each kind of volume this host has,
in a fresh process as a user meets it.

Why fresh processes: the failure this guards against was a SIGSEGV (``mul_`` on a
tensor viewing a read-only mapping), which no in-process test can observe. Each child
loads, writes every tensor, and checks its writes took; the parent then loads the
volume again and compares it with the source bit for bit, so a write that reached the
volume fails too. devdax cannot be mapped copy-on-write (the kernel allows only shared
mappings); the VM tier checks that on real devices, and the refusal path is checked
here with the reason a devdax volume carries.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tiny
import torch
from safetensors.torch import load_file

from csi_pmem.loader import LoaderError, load_safetensors, open_volume, stage
from csi_pmem.weights.mapping import buffer_address, private_refusal
from csi_pmem.weights.volume import Volume

import loader_models as lm

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


def reference(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_volume_unchanged(volume: str, src: Path) -> None:
    got = load_safetensors(volume, device="cpu", writes="readonly")
    ref = reference(src)
    assert ref and got.keys() == ref.keys()
    for name, want in ref.items():
        assert torch.equal(got[name].view(-1).view(torch.uint8),
                           want.contiguous().view(-1).view(torch.uint8)), name


def child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "PATH": "/usr/bin:/bin"})


WRITE_EVERY_TENSOR = """
    import sys, torch
    from csi_pmem.loader import load_safetensors
    got = load_safetensors(sys.argv[1] if len(sys.argv) > 1 else {volume!r},
                           device="cpu"{kw})
    before = {{k: t.clone() for k, t in got.items()}}
    for t in got.values():
        # Through the bytes: every dtype (fp8 included) has an in-place add on uint8.
        t.view(-1).view(torch.uint8).add_(1)
    filled = [k for k, t in got.items() if t.numel()]
    changed = sum(not torch.equal(got[k], before[k]) for k in filled)
    assert filled and changed == len(filled), (changed, len(filled))
    print("wrote", changed)
"""


@contextlib.contextmanager
def medium(kind: str, tmp_path: Path, src: Path):
    """A staged volume of ``kind``: a file on a disk file system, a file on tmpfs, or a
    loop block device (an fsdax ``volumeMode: Block`` volume's stand-in)."""
    if kind == "disk-file":
        yield str(lm.staged_volume(src, tmp_path / "vol"))
    elif kind == "tmpfs-file":
        path = SHM / f"csi-pmem-cpu-writes-{tmp_path.name}.img"
        try:
            yield str(lm.staged_volume(src, path))
        finally:
            path.unlink(missing_ok=True)
    else:
        if not lm.can_make_loop_devices():
            pytest.skip("a loop device needs root and losetup")
        backing = lm.volume_file(tmp_path / "backing.img")
        with lm.loop_device(backing) as device:
            with open_volume(device, writable=True) as v:
                stage(v, str(src))
            yield device


KINDS = ["disk-file", "tmpfs-file", "block-device"]


@pytest.fixture
def src(tmp_path: Path) -> Path:
    d = tmp_path / "src"
    lm.bf16_model(d)
    return d


@pytest.mark.parametrize("kind", KINDS)
def test_a_write_lands_in_a_private_copy_and_never_on_the_volume(tmp_path, src, kind):
    with medium(kind, tmp_path, src) as volume:
        with open_volume(volume) as v:
            assert v.private_refused_reason is None, v.private_refused_reason
        proc = child(WRITE_EVERY_TENSOR.format(volume=volume, kw=""))
        assert proc.returncode == 0, (proc.returncode, proc.stderr)
        assert proc.stdout.startswith("wrote "), proc.stdout
        assert_volume_unchanged(volume, src)


@pytest.mark.parametrize("kind", KINDS)
def test_readonly_views_are_the_shared_mapping_and_a_write_kills(tmp_path, src, kind):
    """The explicit zero-copy choice does what its name and the docs say."""
    with medium(kind, tmp_path, src) as volume:
        proc = child(WRITE_EVERY_TENSOR.format(volume=volume, kw=', writes="readonly"'))
        assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr)
        assert_volume_unchanged(volume, src)


def test_private_views_share_pages_until_written(tmp_path, src):
    """No copy on load: the tensors point into the private mapping of the volume."""
    volume = lm.staged_volume(src, tmp_path / "vol")
    with open_volume(volume) as v:
        got = load_safetensors(v, device="cpu")
        base = buffer_address(v.private_mapping())
        filled = [t for t in got.values() if t.numel()]  # an empty tensor has no bytes
        assert filled and all(base <= t.data_ptr() < base + v.size for t in filled)
        ro = load_safetensors(v, device="cpu", writes="readonly")
        assert all(v.address <= t.data_ptr() < v.address + v.size
                   for t in ro.values() if t.numel())


def test_copies_are_outside_the_mapping(tmp_path, src):
    volume = lm.staged_volume(src, tmp_path / "vol")
    with open_volume(volume) as v:
        got = load_safetensors(v, device="cpu", writes="copy")
        base = buffer_address(v.private_mapping())
        for t in got.values():
            assert not v.address <= t.data_ptr() < v.address + v.size
            assert not base <= t.data_ptr() < base + v.size
            t.zero_()
    assert_volume_unchanged(volume, src)


def test_a_volume_without_private_mappings_gets_copies_by_default(tmp_path, src, monkeypatch,
                                                                  caplog):
    """devdax's case (its reason as private_refusal gives it for a character device):
    the default is writable copies, "private" is refused saying why and what to use."""
    with open("/dev/zero", "rb") as chardev:
        reason = private_refusal(chardev.fileno())
    assert reason is not None and "devdax" in reason
    volume = lm.staged_volume(src, tmp_path / "vol")
    with open_volume(volume) as v:
        monkeypatch.setattr(v, "private_refused_reason", reason)
        monkeypatch.setattr(Volume, "private_mapping",
                            lambda self: pytest.fail("mapped privately"))
        with caplog.at_level("INFO", logger="csi_pmem.loader.cpu"):
            got = load_safetensors(v, device="cpu")
        assert "copies in ordinary memory" in caplog.text and reason in caplog.text
        for t in got.values():
            assert not v.address <= t.data_ptr() < v.address + v.size
            t.zero_()
        with pytest.raises(LoaderError, match=r"writes='private' is not possible.*devdax"):
            load_safetensors(v, device="cpu", writes="private")
    assert_volume_unchanged(volume, src)


def test_a_bad_writes_value_is_refused(tmp_path, src):
    volume = lm.staged_volume(src, tmp_path / "vol")
    with pytest.raises(LoaderError, match="writes='rw' is not one of auto, private, copy"):
        load_safetensors(volume, device="cpu", writes="rw")
    with pytest.raises(LoaderError, match="is for CPU loads"):
        load_safetensors(volume, device="cuda:0", writes="copy")


def test_nn_init_after_load_state_dict_assign(tmp_path):
    """The issue's second crash: a transformers model filled with assign=True, then
    re-initialised in place, in a fresh process."""
    src = tiny.llama_dir(tmp_path / "llama")
    volume = lm.staged_volume(src, tmp_path / "vol")
    proc = child(f"""
        import torch
        from csi_pmem.loader import load_transformers
        model = load_transformers({str(volume)!r}, device="cpu")
        for p in model.parameters():
            torch.nn.init.zeros_(p)
        assert all(not p.any() for p in model.parameters())
        print("zeroed", sum(1 for _ in model.parameters()))
    """)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert proc.stdout.startswith("zeroed "), proc.stdout
    assert_volume_unchanged(str(volume), src)
