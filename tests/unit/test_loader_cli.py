"""``csi-pmem-weights`` end to end on plain-file volumes, and the benchmark scripts'
CPU-only smoke runs (what CI can run without a GPU)."""

from __future__ import annotations

import argparse
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from csi_pmem.loader import cli as weights_cli
from csi_pmem.loader import load_numpy, open_volume, progress
from csi_pmem.weights import layout
from csi_pmem.weights.stformat import read_header_file

import loader_models as lm

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


def cli(*argv: str) -> int:
    return weights_cli.main([str(a) for a in argv])


def test_stage_ls_verify_export(tmp_path, capsys):
    lm.sharded_model(tmp_path / "src")
    vol = tmp_path / "vol.img"
    assert cli("stage", tmp_path / "src", vol, "--size", "64Mi", "--name", "llm",
               "--revision", "r1", "-o", "table") == 0
    out, err = capsys.readouterr()
    assert "staged llm@r1: 6 files" in out and err == ""  # stderr is no terminal here
    assert cli("stage", tmp_path / "src", vol, "--name", "llm", "--revision", "r1",
               "-o", "table") == 0
    assert "already staged" in capsys.readouterr().out

    assert cli("ls", vol, "-o", "table") == 0
    out = capsys.readouterr().out
    assert "llm@r1  [committed]  6 files" in out and "tokenizer/vocab.txt" in out
    assert cli("ls", vol, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["models"][0]["state"] == "committed"
    assert all(len(d) == 64 for d in doc["models"][0]["digests"].values())

    assert cli("verify", vol, "-q", "-o", "table") == 0
    assert "llm@r1: OK" in capsys.readouterr().out
    assert cli("export", vol, tmp_path / "out", "-q") == 0
    assert lm.tree_digest(tmp_path / "out") == lm.tree_digest(tmp_path / "src")
    assert cli("export", vol, tmp_path / "out", "-q") == 1
    assert "exists; pass --overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("bar", ["tqdm", "plain"])
def test_progress_shows_rate_and_eta_when_asked(tmp_path, capsys, monkeypatch, bar):
    """--progress draws on stderr also when it is no terminal; tqdm's bar when it is
    installed, else a plain line with the same numbers; stdout keeps only the result."""
    if bar == "plain":  # tqdm is in the test extra; this is an install without it
        monkeypatch.setattr(progress, "_tqdm", lambda: None)
    lm.sharded_model(tmp_path / "src")
    vol = tmp_path / "vol.img"
    assert cli("stage", tmp_path / "src", vol, "--size", "64Mi", "--progress",
               "-o", "table") == 0
    out, err = capsys.readouterr()
    assert out.startswith("staged src@fp-") and "%" not in out and "ETA" not in out
    if bar == "tqdm":
        assert "stage: 100%|" in err and "B/s" in err, err
    else:
        last = err.strip().splitlines()[-1]
        assert last.startswith("stage: ") and "(100%)" in last and "/s, ETA 0:00" in last
    for verb, argv in (("verify", ["verify", vol]),
                       ("export", ["export", vol, tmp_path / "out"])):
        assert cli(*argv, "--progress") == 0
        err = capsys.readouterr().err
        assert err.lstrip("\r").startswith(f"{verb}:"), err
        assert cli(*argv, "--no-progress", *(["--overwrite"] if verb == "export" else [])) == 0
        assert capsys.readouterr().err == ""


def test_plain_progress_counts_only_this_runs_bytes():
    """A resumed stage first reports the bytes it reuses: not throughput, so the rate
    and ETA start from there."""
    out = io.StringIO()
    bar = progress.Progress("stage", True, stream=out, use_tqdm=False, interval=0)
    bar(600 * lm.MiB, 1000 * lm.MiB, "reused 3 verified files")
    bar.started -= 2.0  # two seconds later ...
    bar(800 * lm.MiB, 1000 * lm.MiB, "model.safetensors")  # ... 200 MiB more
    line = out.getvalue().splitlines()[-1]
    rate = float(line.split(", ")[1].split()[0])
    assert 99 < rate < 101 and "MiB/s" in line, line  # 200 MiB in 2 s, not 800
    assert "ETA 0:02" in line and "(80%)" in line, line
    assert progress.eta(0, 10, 1.0) == "?" and progress.eta(10, 10, 1.0) == "0:00"
    assert progress.eta(1, 3601, 1.0) == "1:00:00"
    assert not progress.wanted(None, io.StringIO()) and progress.wanted(True, io.StringIO())


def test_log_level_is_checked_and_a_closed_pipe_is_quiet(tmp_path, capsys):
    with pytest.raises(SystemExit) as usage:
        cli("--log-level", "foo", "ls", tmp_path / "x")
    assert usage.value.code == 2
    err = capsys.readouterr().err
    assert "argument --log-level: invalid level 'foo': use one of debug, info" in err
    assert cli("--log-level", "debug", "ls", tmp_path / "missing") == 1
    lm.sharded_model(tmp_path / "src")
    vol = lm.staged_volume(tmp_path / "src", tmp_path / "vol")
    r, w = os.pipe()
    os.close(r)  # `| head` has gone before anything is written
    for argv in (["ls", "--json", vol], ["ls", vol]):
        proc = subprocess.run([sys.executable, "-m", "csi_pmem.loader.cli", *map(str, argv)],
                              stdout=w, stderr=subprocess.PIPE, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert (proc.returncode, proc.stderr) == (141, ""), argv
    os.close(w)


def test_verify_reports_damage_with_its_own_exit_code(tmp_path, capsys):
    lm.save_numpy_model(tmp_path / "src", lm.numpy_tensors())
    vol = lm.staged_volume(tmp_path / "src", tmp_path / "vol")
    with open_volume(vol) as v:
        f = layout.read_index(v).models[0].files[0]
    with open(vol, "r+b") as fh:
        fh.seek(f.offset + 200)
        fh.write(b"\xaa\xbb\xcc")
    assert cli("verify", vol, "-q", "-o", "table") == weights_cli.EXIT_MISMATCH
    assert "1 bad chunk(s)" in capsys.readouterr().out


def test_refusals_are_clear(tmp_path, capsys):
    lm.large_model(tmp_path / "big", 16 * lm.MiB)
    assert cli("stage", tmp_path / "big", tmp_path / "small.img", "--size", "16Mi", "-q") == 1
    err = capsys.readouterr().err
    assert err.startswith("csi-pmem-weights: error: model big does not fit: it needs")
    assert "free" in err and "Traceback" not in err
    assert cli("ls", tmp_path / "missing.img") == 1
    assert "does not exist" in capsys.readouterr().err
    odd = tmp_path / "odd.img"
    odd.write_bytes(bytes(3 * lm.MiB + 1))
    assert cli("ls", odd) == 1
    assert "not a multiple of the volume align" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        cli("stage", tmp_path / "big", tmp_path / "x.img", "--size", "lots")
    assert usage.value.code == 2


def test_sizes_are_kubernetes_quantities(tmp_path, capsys):
    """The same grammar as manifests and ``csi-pmem volume create``: 16G is decimal, 16Gi
    binary, and 500m (a milli-quantity) is refused with the spelling that was meant."""
    assert weights_cli.parse_size("16G") == 16 * 10**9
    assert weights_cli.parse_size("16Gi") == 16 << 30
    vol = tmp_path / "k.img"
    lm.sharded_model(tmp_path / "src")
    assert cli("stage", tmp_path / "src", vol, "--size", "64M", "-q") == 0
    assert vol.stat().st_size == 31 * 2 * lm.MiB  # 64*10^6 rounded up to the 2 MiB align
    capsys.readouterr()
    with pytest.raises(SystemExit) as usage:
        cli("stage", tmp_path / "src", tmp_path / "m.img", "--size", "500m")
    assert usage.value.code == 2
    err = capsys.readouterr().err
    assert "argument --size: invalid size '500m'" in err and "500Mi" in err, err
    assert not (tmp_path / "m.img").exists()


def test_bench_cli(tmp_path, capsys):
    lm.sharded_model(tmp_path / "src")
    vol = lm.staged_volume(tmp_path / "src", tmp_path / "vol")
    assert cli("bench", vol, "--json", "--repeat", "1", "--buffer-size", "1Mi",
               "--buffers", "3") == 0
    rows = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in rows]
    assert any(n.startswith("bounce fill") for n in names)
    assert all({"bytes", "seconds", "GB/s"} <= r.keys() and r["bytes"] > 0 for r in rows)


def test_make_model_writes_a_consistent_sharded_model(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_model.py"),
                           "--size-gb", "0.03", "--shard-gb", "0.01", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, check=True)
    info = json.loads(proc.stdout)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) == info["shards"] > 1
    names = {}
    for s in shards:
        names.update({t: s.name for t in read_header_file(str(s)).tensors})
    assert names == index["weight_map"]
    assert sum(s.stat().st_size for s in shards) >= info["bytes"]


def test_bench_loader_cpu_only_smoke(tmp_path):
    result = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_loader.py"),
                           "--cpu-only", "--size-gb", "0.02", "--work", str(tmp_path / "w"),
                           "--repeat", "1", "--json", str(result)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(result.read_text())["rows"]
    assert [r["method"].split(" ")[0] for r in rows] == ["(e)"] * len(rows)
    assert any("memcpy baseline" in r["method"] for r in rows)
    assert "GB/s" in proc.stdout
    # The staged volume is a normal staged model: the loader reads it back.
    assert load_numpy(str(tmp_path / "w" / "volume.img"))


def test_a_negative_size_is_a_size_error(tmp_path, capsys):
    """argparse took "-1Gi" for a flag ("expected one argument")."""
    for flag in ("--size", "--align"):
        with pytest.raises(SystemExit) as usage:
            cli("stage", tmp_path / "src", tmp_path / "v.img", flag, "-1Gi")
        assert usage.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: invalid size '-1Gi': a size cannot be negative" in err, err
    assert not (tmp_path / "v.img").exists()


def test_ctrl_c_exits_130_with_one_line(tmp_path):
    """Ctrl-C while the node plugin does not answer: a dax.sock that listens and never
    accepts. The command has connected (the listener turns readable) and waits."""
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(tmp_path / "dax.sock"))
        listener.listen(8)
        proc = subprocess.Popen([sys.executable, "-m", "csi_pmem.loader.cli", "ls",
                                 str(tmp_path)], stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            connected, _, _ = select.select([listener], [], [], 120)
            assert connected, "the command never connected"
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == weights_cli.Exit.INTERRUPTED == 130, err
    assert err == "csi-pmem-weights: interrupted; run the same command again to resume\n"


# --- stage repairs what verify finds ------------------------------------------------------

def flip(vol: Path, offset: int) -> None:
    with open(vol, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_stage_repairs_a_flipped_byte_copying_only_its_chunk(tmp_path, capsys, monkeypatch):
    """verify exits 3 and export refuses; stage then copies the one damaged 64 MiB chunk
    again (here the file's last, 4 MiB), not the file, and says how many bytes."""
    lm.large_model(tmp_path / "m", 132 * lm.MiB)  # chunks of 64, 64 and 4 MiB
    vol = tmp_path / "vol.img"
    assert cli("stage", tmp_path / "m", vol, "--size", "160Mi", "-q") == 0
    capsys.readouterr()
    with open_volume(vol) as v:
        (f,) = layout.read_index(v).models[0].files
    last = f.length - 2 * layout.CHUNK_SIZE
    flip(vol, f.offset + f.length - 1000)
    assert cli("verify", vol, "-q", "-o", "table") == weights_cli.EXIT_MISMATCH
    assert "1 bad chunk(s)" in capsys.readouterr().out
    assert cli("export", vol, tmp_path / "out", "-q") == 1
    assert "stage the model again" in capsys.readouterr().err

    read = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: read.append(
        sum(len(b) for b in bufs)) or real(fd, bufs, off))
    assert cli("stage", tmp_path / "m", vol, "-q", "-o", "json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["action"] == "repaired" and doc["copied"] == sum(read) == last
    assert doc["repaired"] == {"chunks": 1, "files": ["model.safetensors"],
                               "whole_files": [], "bytes": last}
    assert doc["reused"] == f.length - last and doc["checked"] == f.length
    assert cli("verify", vol, "-q", "-o", "json") == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True

    flip(vol, f.offset + 5)  # the first chunk this time: the table says what it copied
    assert cli("stage", tmp_path / "m", vol, "-q", "-o", "table") == 0
    out = capsys.readouterr().out
    assert out.startswith("repaired m@fp-"), out
    assert (": 1 chunk of 1 file, 64.0 MiB (67108864 bytes) copied (68.0 MiB "
            f"({f.length - layout.CHUNK_SIZE} bytes) checked intact)") in out, out
    assert cli("export", vol, tmp_path / "out", "-q") == 0
    assert lm.tree_digest(tmp_path / "out") == lm.tree_digest(tmp_path / "m")
    assert cli("stage", tmp_path / "m", vol, "-q", "-o", "table") == 0
    assert "every chunk checked, nothing copied" in capsys.readouterr().out


def test_a_source_that_no_longer_holds_the_staged_bytes_is_copied_whole(tmp_path, capsys):
    """Same revision named by hand, other bytes in the source: the damaged chunk read
    again does not match its checksum, so the file is copied again whole (new checksums)
    and the copy is the source's."""
    lm.save_numpy_model(tmp_path / "src", lm.numpy_tensors())
    vol = tmp_path / "vol.img"
    assert cli("stage", tmp_path / "src", vol, "--size", "64Mi", "--revision", "r1",
               "-q") == 0
    with open_volume(vol) as v:
        f = layout.read_index(v).models[0].safetensors[0]
    flip(vol, f.offset + f.length - 1)
    flip(tmp_path / "src" / f.name, f.length - 1)
    capsys.readouterr()
    assert cli("stage", tmp_path / "src", vol, "--revision", "r1", "-q", "-o", "json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["repaired"]["whole_files"] == [f.name]
    assert doc["copied"] == 2 * f.length  # the chunk (the whole file here), then the file
    assert cli("export", vol, tmp_path / "out", "-q") == 0
    assert lm.tree_digest(tmp_path / "out") == lm.tree_digest(tmp_path / "src")


# --- one -o across both command lines -------------------------------------------------------

def test_output_formats_and_the_json_alias(tmp_path, capsys, monkeypatch):
    lm.sharded_model(tmp_path / "src")
    vol = lm.staged_volume(tmp_path / "src", tmp_path / "vol")
    outputs = {}
    for fmt in ("table", "json", "yaml", "name"):
        assert cli("ls", vol, "-o", fmt) == 0
        outputs[fmt] = capsys.readouterr().out
    assert outputs["name"] == "m\n"
    assert json.loads(outputs["json"])["models"][0]["name"] == "m"
    assert yaml.safe_load(outputs["yaml"]) == json.loads(outputs["json"])
    assert "m  [committed]" in outputs["table"]
    assert cli("ls", vol, "--json") == 0
    assert capsys.readouterr().out == outputs["json"]
    # No -o: JSON when stdout is no terminal (as here), a table on one; csi-pmem's rule.
    assert cli("ls", vol) == 0
    assert capsys.readouterr().out == outputs["json"]
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert cli("ls", vol) == 0
    assert capsys.readouterr().out == outputs["table"]
    assert cli("verify", vol, "-q", "-o", "name") == 0
    assert capsys.readouterr().out == "m\n"
    assert cli("stage", tmp_path / "src", vol, "--name", "m", "-q", "-o", "name") == 0
    assert capsys.readouterr().out == "m\n"
    assert cli("export", vol, tmp_path / "out", "-q", "-o", "name") == 0
    written = capsys.readouterr().out.split()
    assert sorted(written) == sorted(str(p) for p in (tmp_path / "out").rglob("*")
                                     if p.is_file())
    with pytest.raises(SystemExit) as usage:  # bench answers with no names
        cli("bench", vol, "-o", "name")
    assert usage.value.code == 2


def test_yaml_without_pyyaml_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # an install without PyYAML
    assert cli("ls", tmp_path / "missing.img", "-o", "yaml") == 1
    err = capsys.readouterr().err
    assert "-o yaml needs PyYAML" in err and "pip install pyyaml" in err


def test_both_command_lines_share_the_output_flag(monkeypatch):
    """csi-pmem volume and csi-pmem-weights offer the same -o, with the same default."""
    from csi_pmem import cli as volume_cli
    from csi_pmem.client import output

    def choices(parser, *argv):
        for sub in argv:
            parser = next(a for a in parser._actions
                          if isinstance(a, argparse._SubParsersAction)).choices[sub]
        return next(a for a in parser._actions if "-o" in a.option_strings).choices

    assert choices(weights_cli.build_parser(), "ls") == choices(
        volume_cli.build_parser(), "volume", "list") == output.FORMATS
    for tty, want in ((True, "table"), (False, "json")):
        monkeypatch.setattr(sys.stdout, "isatty", lambda tty=tty: tty)
        assert output.default_format() == weights_cli.default_output() == want
