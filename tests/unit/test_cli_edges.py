"""The edges a new user met (issue 45, items 2 and 5): flag values that must be usage
errors, answers that must say what happened, and failures that must be one precise line.
The volume commands run against the driver in this process (``served`` in
test_volume_cli), the file-system steps against the emulated back end and fake mounter
with the real :func:`csi_pmem.driver.host.filesystems.make` in front of it."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from test_volume_cli import volume

from csi_pmem import numa
from csi_pmem.cmdline import Exit
from csi_pmem.csi import csi_pb2
from csi_pmem.driver.host import filesystems
from csi_pmem.driver.servicers.status import status_for
from csi_pmem.errors import CommandError, FailedPrecondition, InvalidArgument
from csi_pmem.loader import cli as weights_cli

from conftest import MiB, mount_cap
from inprocess import node_fixture, served_fixture  # noqa: F401 (fixtures)

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
XFS_REFUSES = ("Filesystem must be larger than 300MB.\nUsage: mkfs.xfs\n"
               "<value> is xxx (512 byte blocks).\n")


class _Mkfs:
    """A runner standing in for mkfs: records the argv, fails when told to."""

    def __init__(self, stderr: str = "") -> None:
        self.calls: list[list[str]] = []
        self.stderr = stderr

    def run(self, argv, timeout=0.0, check=True):
        self.calls.append(list(argv))
        if self.stderr:
            raise CommandError(list(argv), 1, self.stderr)


# ---------------------------------------------------------------- item 2: fsdax and xfs
def test_xfs_below_its_minimum_is_refused_at_create(served, capsys):
    code, _, err = volume(served, capsys, "create", "x1", "--size", "256Mi",
                          "-p", "deviceMode=fsdax", "--fs-type", "xfs")
    assert code == Exit.REFUSED, err  # CreateVolume's INVALID_ARGUMENT, one rule
    assert "INVALID_ARGUMENT" in err and "xfs needs a volume of at least 300.0 MiB" in err, err
    assert "use ext4" in err, err
    assert volume(served, capsys, "list", "-o", "name")[1].strip() == ""  # none made
    code, _, err = volume(served, capsys, "create", "x2", "--size", "300Mi",
                          "-p", "deviceMode=fsdax", "--fs-type", "xfs", "-o", "name")
    assert code == Exit.OK, err


def test_mkfs_of_a_device_too_small_for_xfs_is_invalid_argument(tmp_path):
    device = tmp_path / "dev"
    with open(device, "wb") as f:
        f.truncate(256 * MiB)
    runner = _Mkfs()
    with pytest.raises(InvalidArgument) as info:
        filesystems.make(runner, str(device), "xfs")  # type: ignore[arg-type]
    assert runner.calls == []  # refused before mkfs ran
    assert "xfs needs a volume of at least 300.0 MiB" in str(info.value)
    assert status_for(info.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
    filesystems.make(runner, str(device), "ext4")  # type: ignore[arg-type]
    assert runner.calls[0][0] == "mkfs.ext4"


def test_a_failing_mkfs_is_failed_precondition_with_its_own_words(tmp_path):
    device = tmp_path / "dev"
    with open(device, "wb") as f:
        f.truncate(512 * MiB)
    with pytest.raises(FailedPrecondition) as info:
        filesystems.make(_Mkfs(XFS_REFUSES), str(device), "xfs")  # type: ignore[arg-type]
    text = str(info.value)
    assert "mkfs.xfs on" in text and "Filesystem must be larger than 300MB" in text, text
    assert "512 byte blocks" not in text
    assert status_for(info.value)[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert isinstance(info.value, CommandError)  # what every Mounter raises (contract)
    assert info.value.stderr == XFS_REFUSES and info.value.returncode == 1


def test_stage_of_xfs_on_a_small_fsdax_volume_is_one_precise_error(served, capsys,
                                                                   caplog):
    """The real driver in process: the stage is refused before mkfs, INVALID_ARGUMENT,
    and the driver logs no ERROR (no traceback); the volume stages as ext4 after."""
    code, out, err = volume(served, capsys, "create", "x1", "--size", "256Mi",
                            "-p", "deviceMode=fsdax", "-o", "name")
    assert code == Exit.OK, err
    vid = out.strip()
    real = served.fake.make_fs
    runner = _Mkfs()

    def make_fs(device: str, fs_type: str) -> None:
        filesystems.make(runner, device, fs_type)  # type: ignore[arg-type]
        real(device, fs_type)

    served.fake.make_fs = make_fs  # type: ignore[method-assign]
    staging = served.staging("x1")
    with caplog.at_level(logging.INFO):
        code, _, err = volume(served, capsys, "stage", vid, staging, "--fs-type", "xfs")
    assert code == Exit.REFUSED, err
    assert err.startswith("csi-pmem: INVALID_ARGUMENT: cannot make xfs on"), err
    assert "use ext4 for it, or a volume of at least 300Mi for xfs" in err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert runner.calls == []
    code, out, err = volume(served, capsys, "stage", vid, staging, "-o", "table")
    assert code == Exit.OK, err
    assert out.strip() == f"volume {vid} staged at {staging} as ext4"


def test_fs_type_given_at_create_is_what_stage_makes(served, capsys):
    """`volume create --fs-type xfs`, then `volume stage` without one: xfs, said so in
    the answer; `stage --fs-type ext4` of it is refused before anything is made."""
    code, out, err = volume(served, capsys, "create", "x3", "--size", "320Mi",
                            "-p", "deviceMode=fsdax", "--fs-type", "xfs", "-o", "name")
    assert code == Exit.OK, err
    vid = out.strip()
    staging = served.staging("x3")
    code, _, err = volume(served, capsys, "stage", vid, staging, "--fs-type", "ext4")
    assert code == Exit.REFUSED, err
    assert f"INVALID_ARGUMENT: volume {vid} was created for xfs (CreateVolume's fsType), " \
        "not ext4: stage it as xfs, or leave fsType empty" in err, err
    code, out, err = volume(served, capsys, "stage", vid, staging, "-o", "table")
    assert code == Exit.OK, err
    assert out.strip() == f"volume {vid} staged at {staging} as xfs"
    assert served.fake.find(staging).fstype == "xfs"


# ---------------------------------------------------------------- item 5: csi-pmem volume
def test_a_size_of_zero_is_a_usage_error(served, capsys):
    for size in ("0", "0Gi"):
        with pytest.raises(SystemExit) as usage:
            volume(served, capsys, "create", "z", "--size", size)
        assert usage.value.code == Exit.USAGE
        err = capsys.readouterr().err
        assert "argument --size: '0" in err and "is no size" in err, err


def test_inspect_of_a_volume_whose_driver_is_gone_is_worth_a_retry(served, capsys):
    code, out, _ = volume(served, capsys, "create", "v", "--size", "64Mi", "-o", "name")
    vid = out.strip()
    target = served.target("p")
    assert volume(served, capsys, "publish", vid, target)[0] == Exit.OK
    assert volume(served, capsys, "inspect", target)[0] == Exit.OK
    sock = os.path.join(target, "dax.sock")
    served.dax.close()  # the driver is gone: nobody serves dax.sock any more
    code, _, err = volume(served, capsys, "inspect", target)
    assert code == Exit.UNREACHABLE, err
    assert "no dax.sock" in err and "retry" in err and "Traceback" not in err
    # A socket file that nobody listens on (the driver killed, not stopped).
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(sock)
    code, _, err = volume(served, capsys, "inspect", target)
    assert code == Exit.UNREACHABLE and "nothing is listening" in err, err
    # Not a volume at all stays an error on this side.
    code, _, err = volume(served, capsys, "inspect", str(served.base))
    assert code == Exit.ERROR, err


def test_delete_takes_several_ids_and_says_which_were_not_there(served, capsys):
    ids = [volume(served, capsys, "create", n, "--size", "64Mi", "-o", "name")[1].strip()
           for n in ("a", "b")]
    code, out, err = volume(served, capsys, "delete", *ids, "pmem-nonexist",
                            "-o", "table")
    assert code == Exit.OK, err
    assert out.splitlines() == [f"volume {ids[0]} deleted", f"volume {ids[1]} deleted",
                                "volume pmem-nonexist not found, nothing to do"]
    assert volume(served, capsys, "list", "-o", "name")[1].strip() == ""
    code, out, _ = volume(served, capsys, "delete", ids[0], "-o", "json")
    assert code == Exit.OK and json.loads(out) == {"deleted": [], "not_found": [ids[0]]}


def test_stage_of_a_devdax_volume_says_there_is_nothing_to_stage(served, capsys):
    vid = volume(served, capsys, "create", "d", "--size", "64Mi", "-o", "name")[1].strip()
    staging = served.staging("d")
    code, out, err = volume(served, capsys, "stage", vid, staging, "-o", "table")
    assert code == Exit.OK, err
    assert out.startswith(f"volume {vid} is a devdax volume: nothing to stage"), out
    assert "staged at" not in out
    code, out, _ = volume(served, capsys, "stage", vid, staging, "-o", "json")
    assert json.loads(out)["nothing_to_stage"] is True


# ---------------------------------------------------------------- item 5: csi-pmem-weights
def weights(*argv: object) -> int:
    return weights_cli.main([str(a) for a in argv])


def test_a_bad_align_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    with pytest.raises(SystemExit) as usage:
        weights("stage", tmp_path / "src", tmp_path / "v.img", "--size", "64Mi",
                "--align", "3Mi")
    assert usage.value.code == Exit.USAGE
    assert "'3Mi' is not a power of two of at least 4Ki" in capsys.readouterr().err
    assert not (tmp_path / "v.img").exists()


def test_size_of_a_volume_that_is_no_plain_file_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    devdax = tmp_path / "published"
    devdax.mkdir()
    (devdax / "volume.json").write_text("{}")  # a devdax publication (its socket aside)
    assert weights("stage", tmp_path / "src", devdax, "--size", "2Gi") == Exit.USAGE
    err = capsys.readouterr().err
    assert "--size applies to a plain-file VOLUME" in err and "drop --size" in err, err


def test_stage_onto_a_missing_file_says_that_size_creates_it(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    assert weights("stage", tmp_path / "src", tmp_path / "vol.img") == Exit.ERROR
    err = capsys.readouterr().err
    assert "vol.img does not exist: pass --size" in err and "to create it" in err, err


def test_a_checksum_error_is_printed_once_without_logging(tmp_path):
    """No logging configured: the ChecksumError shows in the traceback only, not also
    as a log line of Python's handler of last resort."""
    script = f"""
import sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
from pathlib import Path
import loader_models as lm
from csi_pmem.loader import load_numpy, open_volume
from csi_pmem.weights import layout
lm.save_numpy_model(Path({str(tmp_path / 'src')!r}), lm.numpy_tensors())
vol = lm.staged_volume(Path({str(tmp_path / 'src')!r}), Path({str(tmp_path / 'vol')!r}))
with open_volume(vol) as v:
    f = layout.read_index(v).models[0].files[0]
with open(vol, "r+b") as fh:
    fh.seek(f.offset + f.length - 16)
    fh.write(b"\\xaa\\xbb\\xcc")
load_numpy(vol)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's csi_pmem
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert res.returncode == 1
    assert "ChecksumError" in res.stderr, res.stderr
    assert res.stderr.count("do not match their staged checksums") == 1, res.stderr


def test_the_loaders_warnings_still_reach_an_unconfigured_program(capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's own, put back
    logging.getLogger("csi_pmem.loader.gpu.loader").warning("slower path: %s", "why")
    err = capsys.readouterr().err
    assert "slower path: why" in err, err


# ---------------------------------------------------------------- item 5: make run, NUMA
def test_setup_says_what_it_does_before_each_slow_step():
    lines = (ROOT / "scripts" / "setup.sh").read_text().splitlines()
    slow = [i for i, ln in enumerate(lines)
            if re.search(r"-m venv |pip install|apt-get install", ln)]
    assert len(slow) == 4
    for i in slow:
        before = [ln.strip() for ln in lines[max(0, i - 3):i]]
        assert any(ln.startswith("echo \"setup: ") for ln in before), lines[i]


def test_an_unreadable_cpulist_is_said_once_per_node(tmp_path, caplog):
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "cpulist").write_text("0\n")
    with caplog.at_level(logging.DEBUG, logger="csi_pmem.numa"):
        for _ in range(9):
            numa.node_cpus(1, sysfs=str(tmp_path))
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "cannot read its cpulist" in warned[0].getMessage()
    assert len(caplog.records) == 9  # the rest at DEBUG
    assert os.sched_getaffinity(0)  # and every call still answered


def test_create_volume_refuses_xfs_below_its_minimum_over_grpc(node):
    """The CO's path (no CLI in front): CreateVolume itself refuses an fsdax volume whose
    mount capability asks for xfs below 300 MiB, before anything is carved."""
    def request(size: int, fs: str) -> csi_pb2.CreateVolumeRequest:
        cap = mount_cap()
        cap.mount.fs_type = fs
        return csi_pb2.CreateVolumeRequest(
            name=f"x-{fs}-{size}", volume_capabilities=[cap],
            parameters={"deviceMode": "fsdax"},
            capacity_range=csi_pb2.CapacityRange(required_bytes=size))
    with pytest.raises(grpc.RpcError) as info:
        node.controller.CreateVolume(request(256 * MiB, "xfs"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "xfs needs a volume of at least 300.0 MiB" in info.value.details()
    assert not node.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries
    node.controller.CreateVolume(request(256 * MiB, "ext4"))  # ext4 fits there
    node.controller.CreateVolume(request(300 * MiB, "xfs"))
