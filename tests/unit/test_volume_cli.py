"""``csi-pmem volume`` as a person and a script use it, without root: the real client and
command line over a real gRPC socket, served by the driver in this process (emulated
back end, fake mounter). Output formats, exit codes, completion, help and pipes."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from csi_pmem import cli, cmdline
from csi_pmem.client import output as volume_output
from csi_pmem.cmdline import Exit
from csi_pmem.driver import config
from csi_pmem.loader import cli as weights_cli

from inprocess import DRIVER_NAME, served_fixture  # noqa: F401 (fixture)

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


def volume(node, capsys, *args: str, tty: bool = False,
           monkeypatch=None) -> tuple[int, str, str]:
    if monkeypatch is not None:
        monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
    code = cli.main(["volume", "--endpoint", node.endpoint, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_name_output_lets_a_script_keep_the_id(served, capsys):
    code, out, err = volume(served, capsys, "create", "llama", "--size", "100Mi",
                            "-p", "numaNode=1", "-o", "name")
    assert code == Exit.OK, err
    vid = out.strip()
    assert vid.startswith("pmem-") and "\n" not in vid
    assert volume(served, capsys, "list", "-o", "name")[1].split() == [vid]
    target = served.target("demo")
    code, out, _ = volume(served, capsys, "publish", vid, target, "-o", "name")
    assert (code, out.strip()) == (Exit.OK, vid)
    code, out, _ = volume(served, capsys, "unpublish", vid, target, "-o", "table")
    assert code == Exit.OK and out.strip() == f"volume {vid} unpublished"
    code, out, _ = volume(served, capsys, "delete", vid, "-o", "table")
    assert code == Exit.OK and out.strip() == f"volume {vid} deleted"


def test_json_for_scripts_and_a_table_on_a_terminal(served, capsys, monkeypatch):
    code, out, err = volume(served, capsys, "create", "llama", "--size", "256Mi",
                            monkeypatch=monkeypatch, tty=False)
    assert code == Exit.OK, err
    doc = json.loads(out)  # not a terminal: the JSON scripts already read, sizes as strings
    assert code == Exit.OK and doc["capacity_bytes"] == str(int(doc["capacity_bytes"]))
    vid = doc["volume_id"]
    code, out, _ = volume(served, capsys, "list", monkeypatch=monkeypatch, tty=True)
    header, row = out.splitlines()
    assert header.split() == ["VOLUME", "ID", "SIZE", "MODE", "NUMA", "ALIGN", "POOL",
                              "PUBLISHED", "ON", "CONDITION"]
    size = int(doc["capacity_bytes"]) / (1 << 20)
    assert row.split()[:4] == [vid, f"{size:.1f}", "MiB", "devdax"]
    assert row.split()[-1] == "ok"
    code, out, _ = volume(served, capsys, "capacity", monkeypatch=monkeypatch, tty=True)
    header, row = out.splitlines()
    assert header.split() == ["AVAILABLE", "LARGEST", "VOLUME"]
    assert [w for w in row.split() if not w[0].isdigit()] == ["MiB", "MiB"], row
    code, out, _ = volume(served, capsys, "info", "-o", "table")
    assert "ready:" in out and "yes" in out and f"{DRIVER_NAME}" in out
    # yaml is the same document as json
    j = json.loads(volume(served, capsys, "list", "-o", "json")[1])
    assert yaml.safe_load(volume(served, capsys, "list", "-o", "yaml")[1]) == j


def test_a_refusal_an_absent_driver_and_a_usage_error_exit_differently(served, capsys):
    code, _, err = volume(served, capsys, "create", "big", "--size", "10Gi")
    assert code == Exit.REFUSED == 4
    assert err.startswith("csi-pmem: OUT_OF_RANGE: a volume of 10.0 GiB (10737418240 bytes)")
    assert err.rstrip().endswith("this node (512.0 MiB (536870912 bytes))"), err
    code, _, err = volume(served, capsys, "create", "x", "--size", "1Gi", "-p", "numaNod=0")
    assert code == Exit.REFUSED and "INVALID_ARGUMENT" in err
    code = cli.main(["volume", "--endpoint", f"unix://{served.base}/nothing.sock", "list"])
    err = capsys.readouterr().err
    assert code == Exit.UNREACHABLE == 5 and "is the driver running" in err, err
    for bad in (["create", "x", "--size", "lots"], ["create", "x", "--size", "1Gi", "-p", "k"],
                ["list", "-o", "wide"], ["lisst"]):
        with pytest.raises(SystemExit) as usage:
            volume(served, capsys, *bad)
        assert usage.value.code == Exit.USAGE == 2, bad
        assert "usage: csi-pmem volume" in capsys.readouterr().err
    # -o name of an action without ids is refused before anything is sent
    code, _, err = volume(served, capsys, "capacity", "-o", "name")
    assert code == Exit.USAGE and "-o name prints volume ids" in err
    code, _, err = volume(served, capsys, "inspect", str(served.base / "nowhere"))
    assert code == Exit.ERROR and "does not exist" in err and "Traceback" not in err


def test_exit_codes_are_listed_in_help_from_the_one_table(capsys):
    with pytest.raises(SystemExit):
        cli.main(["volume", "--help"])
    out = capsys.readouterr().out
    for code in cli.EXIT_CODES:
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"{int(code)} "))
        assert cmdline.MEANING[code].split()[0] in line, line
    assert "-o json otherwise" in out


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _actions(parser) -> dict:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("build", [cli.build_parser, weights_cli.build_parser])
def test_help_renders_without_markup(build):
    """Docstring markup (``x``, :mod:`y`) in --help reads as noise; every page is clean."""
    pages = [p.format_help() for p in _parsers(build())]
    assert len(pages) > 5
    for page in pages:
        for markup in ("``", ":mod:", ":func:", ":class:", ":data:"):
            assert markup not in page, page


@pytest.mark.parametrize("main, prog", [(cli.main, "csi-pmem"),
                                        (weights_cli.main, "csi-pmem-weights")])
def test_version_is_the_package_version(main, prog, capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == \
        f"{prog} {importlib.metadata.version('csi-pmem')}"


def _complete(line: str, tmp_path: Path, prog: str = "csi-pmem") -> list[str]:
    out = tmp_path / "completions"
    env = dict(os.environ, PYTHONPATH=str(ROOT), _ARGCOMPLETE="1", COMP_LINE=line,
               COMP_POINT=str(len(line)), _ARGCOMPLETE_STDOUT_FILENAME=str(out),
               _ARGCOMPLETE_IFS="\n")
    module = "csi_pmem" if prog == "csi-pmem" else "csi_pmem.loader.cli"
    proc = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return out.read_text().split("\n")


def test_completion_offers_actions_flags_and_the_drivers_volume_ids(served, capsys,
                                                                    tmp_path):
    assert _complete("csi-pmem volume cr", tmp_path) == ["create "]
    assert "--output " in _complete("csi-pmem volume list --out", tmp_path)
    assert _complete("csi-pmem-weights st", tmp_path, "csi-pmem-weights") == ["stage "]
    code, out, _ = volume(served, capsys, "create", "c", "--size", "64Mi", "-o", "name")
    vid = out.strip()
    assert code == Exit.OK
    got = _complete(f"csi-pmem volume --endpoint {served.endpoint} delete pm", tmp_path)
    assert got == [vid + " "]


def test_a_closed_pipe_ends_quietly(served, capsys):
    for i in range(3):
        volume(served, capsys, "create", f"v{i}", "--size", "64Mi")
    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written: like `| head` done
    proc = subprocess.run([sys.executable, "-m", "csi_pmem", "volume", "--endpoint",
                           served.endpoint, "list"], stdout=w, stderr=subprocess.PIPE,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    os.close(w)
    assert (proc.returncode, proc.stderr) == (Exit.BROKEN_PIPE, "")


def test_renderers_cover_every_action():
    actions = set(_actions(_actions(cli.build_parser())["volume"]))
    assert actions == set(volume_output._TABLES)
    assert set(volume_output._NAMES) < actions


def test_tables_of_a_document(tmp_path):
    stats = {"usage": [{"unit": "BYTES", "total": "1073741824", "used": "536870912"},
                       {"unit": "INODES", "total": "65536", "used": "11", "available": "65525"}],
             "volume_condition": {"abnormal": True, "message": "device is gone"}}
    out = volume_output.render("stats", stats, "table").splitlines()
    assert out[0].split() == ["UNIT", "TOTAL", "USED", "AVAILABLE"]
    assert out[1].split() == ["BYTES", "1.0", "GiB", "512.0", "MiB", "0", "bytes"]
    assert out[2].split() == ["INODES", "65536", "11", "65525"]
    assert out[-1] == "condition: abnormal: device is gone"
    assert volume_output.render("list", {"entries": []}, "table") == "No volumes."
    assert volume_output.render("list", {}, "name") == ""


def test_the_readme_walkthrough_parses_and_needs_no_python():
    """The walkthrough is copied and pasted: every csi-pmem command in it must parse
    (flags renamed or removed would fail here) and ids come from -o name, not Python."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## A five-minute walkthrough", 1)[1].split("```sh\n", 1)[1]
    block = block.split("```", 1)[0]
    assert "python" not in block
    commands = []
    for line in block.splitlines():
        line = line.split("  #", 1)[0].strip()
        if "$(" in line:
            line = line.split("$(", 1)[1].rsplit(")", 1)[0]
        if line.startswith("csi-pmem "):
            commands.append(shlex.split(line.replace("$ID", "pmem-1").replace("$FS", "pmem-2")))
    assert len(commands) >= 15
    parser = cli.build_parser()
    for argv in commands:
        args = parser.parse_args(argv[1:])
        assert args.command == "volume", argv
    assert sum(a[-2:] == ["-o", "name"] for a in commands) == 2


# --------------------------------------------------------------------------- flags


def _parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["volume", *argv])


def test_endpoint_and_timeout_go_before_or_after_the_action(monkeypatch):
    """As kubectl's and helm's flags do: before the action, after it, or both (the later
    one counts); a value before the action is never replaced by the action's default,
    and CSI_PMEM_ENDPOINT is the default of both places."""
    monkeypatch.delenv("CSI_PMEM_ENDPOINT", raising=False)
    before = _parse("--endpoint", "unix:///a.sock", "--timeout", "7", "list")
    assert (cli.endpoint(before), before.timeout) == ("unix:///a.sock", 7.0)
    after = _parse("list", "--endpoint", "unix:///b.sock", "--timeout", "5")
    assert (cli.endpoint(after), after.timeout) == ("unix:///b.sock", 5.0)
    both = _parse("--endpoint", "unix:///a.sock", "--timeout", "7", "delete", "v",
                  "--endpoint", "unix:///b.sock")
    assert (cli.endpoint(both), both.timeout) == ("unix:///b.sock", 7.0)
    neither = _parse("list")
    assert (cli.endpoint(neither), neither.timeout) == (config.DEFAULTS["endpoint"],
                                                      cli.DEFAULT_TIMEOUT)
    monkeypatch.setenv("CSI_PMEM_ENDPOINT", "unix:///env.sock")
    assert cli.endpoint(_parse("list")) == "unix:///env.sock"
    assert cli.endpoint(_parse("--endpoint", "unix:///a.sock", "list")) == "unix:///a.sock"
    assert cli.endpoint(_parse("list", "--endpoint", "unix:///b.sock")) == "unix:///b.sock"


def test_flags_after_the_action_reach_the_driver(served, capsys, monkeypatch):
    vid = volume(served, capsys, "create", "c", "--size", "64Mi", "-o", "name")[1].strip()
    code = cli.main(["volume", "list", "-o", "name", "--endpoint", served.endpoint,
                     "--timeout", "30"])
    assert (code, capsys.readouterr().out.split()) == (Exit.OK, [vid])
    monkeypatch.setenv("CSI_PMEM_ENDPOINT", served.endpoint)
    assert cli.main(["volume", "list", "-o", "name"]) == Exit.OK
    assert capsys.readouterr().out.split() == [vid]
    # a flag after the action beats the variable: nothing listens there
    gone = f"unix://{served.base}/gone.sock"
    assert cli.main(["volume", "list", "--endpoint", gone]) == Exit.UNREACHABLE
    assert "gone.sock" in capsys.readouterr().err


def test_a_bad_endpoint_variable_is_a_usage_error_naming_it(capsys, monkeypatch):
    monkeypatch.setenv("CSI_PMEM_ENDPOINT", "localhost:1234")
    assert cli.main(["volume", "list"]) == Exit.USAGE
    err = capsys.readouterr().err
    assert err.startswith("csi-pmem: environment variable CSI_PMEM_ENDPOINT: endpoint "
                          "'localhost:1234': use unix:///path.sock or tcp://host:port"), err
    assert err.count("\n") == 1
    with pytest.raises(SystemExit) as usage:
        cli.main(["volume", "list", "--endpoint", "localhost:1234"])
    assert usage.value.code == Exit.USAGE
    assert "argument --endpoint: endpoint 'localhost:1234'" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "-0.5", "-1e3", "nan", "inf", "soon", ""])
@pytest.mark.parametrize("where", ["before", "after"])
def test_a_timeout_must_be_a_positive_number(value, where, capsys):
    """0 used to be sent, and came back as DEADLINE_EXCEEDED, which reads as worth a
    retry (exit 5); it is a usage error, found before anything is sent."""
    flags = ["--timeout", value, "--endpoint", "unix:///nowhere.sock"]
    argv = ["volume", *flags, "list"] if where == "before" else ["volume", "list", *flags]
    with pytest.raises(SystemExit) as usage:
        cli.main(argv)
    assert usage.value.code == Exit.USAGE
    err = capsys.readouterr().err
    assert f"argument --timeout: {value!r} is not a positive number of seconds" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--size", "-1Gi"], "argument --size: invalid size '-1Gi': a size cannot be negative"),
    (["--size=-1Gi"], "argument --size: invalid size '-1Gi': a size cannot be negative"),
    (["--size", "-1"], "argument --size: invalid size '-1': a size cannot be negative"),
    (["--size", "1Gi", "--limit", "-1Gi"],
     "argument --limit: invalid size '-1Gi': a size cannot be negative"),
    (["--size", "-.5Gi"], "argument --size: invalid size '-.5Gi': a size cannot be negative"),
    (["--size", "1Gi", "-p", "-1"], "argument --param/-p: parameter '-1' must look like"),
    (["--size", "-o"], "argument --size: expected one argument"),  # a flag stays a flag
])
def test_a_negative_size_is_a_size_error(argv, message, capsys):
    """argparse took "-1Gi" for a flag ("expected one argument"); the size's own check
    now says what is wrong with it."""
    with pytest.raises(SystemExit) as usage:
        cli.main(["volume", "create", "x", *argv, "--endpoint", "unix:///nowhere.sock"])
    assert usage.value.code == Exit.USAGE
    assert message in capsys.readouterr().err


def test_negative_values_are_joined_only_to_flags_that_take_one():
    parser = cli.build_parser()
    join = cmdline.attach_negative_values
    assert join(parser, ["volume", "create", "x", "--size", "-1Gi", "--limit", "-2"]) == \
        ["volume", "create", "x", "--size=-1Gi", "--limit=-2"]
    # a flag's value is not looked at as a flag; nothing after -- is touched; flags
    # without a value (--block) are left alone, as is a word that is no number
    assert join(parser, ["--param", "--size", "-1Gi"]) == ["--param", "--size", "-1Gi"]
    assert join(parser, ["--", "--size", "-1Gi"]) == ["--", "--size", "-1Gi"]
    assert join(parser, ["--block", "-1Gi", "--size", "-x"]) == \
        ["--block", "-1Gi", "--size", "-x"]
    assert join(parser, ["--size"]) == ["--size"]


def test_delete_says_the_space_may_come_back_after_it_returns():
    """DeleteVolume returns after --delete-wait-seconds with the erase still running;
    the help must not promise the space is free when it returns."""
    page = _actions(_actions(cli.build_parser())["volume"])["delete"].format_help()
    assert "background" in page and "then frees" not in page


def test_ctrl_c_exits_130_with_one_line(tmp_path):
    """Ctrl-C while the driver does not answer: a socket that listens and never accepts.
    The client has connected (the listener turns readable) and waits for its answer."""
    sock = tmp_path / "csi.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(sock))
        listener.listen(8)
        proc = subprocess.Popen([sys.executable, "-m", "csi_pmem", "volume", "list",
                                 "--endpoint", f"unix://{sock}"], stderr=subprocess.PIPE,
                                text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            connected, _, _ = select.select([listener], [], [], 120)
            assert connected, "the client never connected"
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == Exit.INTERRUPTED == 130, err
    assert err.startswith("csi-pmem: interrupted") and err.count("\n") == 1, err
    assert "Traceback" not in err
