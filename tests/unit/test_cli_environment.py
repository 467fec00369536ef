"""CSI_PMEM_* variables as the command lines read them: a bad value is a usage error
(exit 2) on one line that names the variable and the values it may take, and only the
command that reads it fails (``csi-pmem volume`` never reads ``serve``'s or
``gpu-copy``'s). A flag on the command line beats its variable."""

from __future__ import annotations

import argparse

import pytest

from csi_pmem import cli, cmdline
from csi_pmem.cmdline import Exit
from csi_pmem.driver import config, server
from csi_pmem.gpucopy import main as gpu_copy


@pytest.fixture
def no_start(monkeypatch):
    """`serve` and `gpu-copy` must fail before they start; if they did not, the test
    fails here instead of serving for ever."""
    def started(*_a, **_k):
        raise AssertionError("the command started although its configuration is bad")
    monkeypatch.setattr(server, "serve", started)
    monkeypatch.setattr("csi_pmem.gpucopy.service.CopyService.start", started)
    for key in config.DEFAULTS:
        monkeypatch.delenv(config.env_name(key), raising=False)
    for name, _, _ in gpu_copy.ENVIRONMENT.values():
        monkeypatch.delenv(name, raising=False)


# Every checked key of `serve`, with a bad value and what the message must offer.
SERVE_BAD = {
    **{key: ("nonsense", ", ".join(choices)) for key, choices in config.CHOICES.items()},
    "endpoint": ("localhost:1", "use unix:///path.sock or tcp://host:port"),
    "emulated_regions": ("0=lots", "invalid size 'lots'"),
    "memory_pools": ("0=150%", "at most 100% of the NUMA node's memory"),
    "erase_threads": ("x", "is not a whole number of 0 or more"),
    "grpc_workers": ("-1", "is not a whole number of 0 or more"),
    "erase_workers": ("0", "is not a positive whole number"),
    "device_poll_seconds": ("x", "is not a non-negative number of seconds"),
    "erase_wait_seconds": ("-1", "is not a non-negative number of seconds"),
    "delete_wait_seconds": ("nan", "is not a non-negative number of seconds"),
}


def test_every_checked_serve_key_is_covered():
    assert set(config.TYPES) | set(config.CHOICES) <= set(SERVE_BAD)


@pytest.mark.parametrize("key", sorted(SERVE_BAD))
def test_a_bad_serve_variable_names_itself_and_exits_2(key, no_start, monkeypatch, capsys):
    value, offer = SERVE_BAD[key]
    name = config.env_name(key)
    monkeypatch.setenv(name, value)
    assert cli.main(["serve"]) == Exit.USAGE == 2
    err = capsys.readouterr().err
    assert err.startswith(f"csi-pmem: environment variable {name}: "), err
    assert offer in err and err.count("\n") == 1 and "Traceback" not in err, err
    # The same value as a flag: the message names the flag instead.
    flag = config.flag(key)
    monkeypatch.delenv(name)
    code = None
    try:
        code = cli.main(["serve", f"{flag}={value}"])
    except SystemExit as exc:  # argparse's check
        code = exc.code
    err = capsys.readouterr().err
    assert code == Exit.USAGE and flag in err and name not in err, err


def test_the_examples_from_the_operator(no_start, monkeypatch, capsys):
    for name, value, line in [
            ("CSI_PMEM_LOG_LEVEL", "nonsense", "csi-pmem: environment variable "
             "CSI_PMEM_LOG_LEVEL: invalid choice 'nonsense' (use one of debug, info, "
             "warning, error)\n"),
            ("CSI_PMEM_BACKEND", "foo", "csi-pmem: environment variable CSI_PMEM_BACKEND: "
             "invalid choice 'foo' (use one of ndctl, daxctl, ndctl,daxctl, memory, "
             "emulated)\n"),
            ("CSI_PMEM_ERASE_WORKERS", "x", "csi-pmem: environment variable "
             "CSI_PMEM_ERASE_WORKERS: 'x' is not a positive whole number\n")]:
        monkeypatch.setenv(name, value)
        assert cli.main(["serve"]) == Exit.USAGE
        assert capsys.readouterr().err == line
        monkeypatch.delenv(name)


def test_a_flag_beats_its_variable(no_start, monkeypatch):
    monkeypatch.setenv("CSI_PMEM_LOG_LEVEL", "nonsense")
    monkeypatch.setenv("CSI_PMEM_ERASE_WORKERS", "3")
    parser = cli.build_parser()
    cfg = config.from_args(parser.parse_args(["serve", "--log-level", "debug"]))
    assert (cfg.log_level, cfg.erase_workers) == ("debug", 3)
    cfg = config.from_args(parser.parse_args(["serve", "--log-level", "warning",
                                              "--erase-workers", "5"]))
    assert (cfg.log_level, cfg.erase_workers) == ("warning", 5)


@pytest.mark.parametrize("name, value, offer", [
    ("CSI_PMEM_GPU_COPY_COPIER", "foo", "invalid choice 'foo' (use one of cuda, fake)"),
    ("CSI_PMEM_GPU_COPY_POLL_SECONDS", "x", "'x' is not a positive number of seconds"),
    ("CSI_PMEM_GPU_COPY_POLL_SECONDS", "0", "'0' is not a positive number of seconds"),
    ("CSI_PMEM_GPU_COPY_MAX_CLIENTS", "0", "'0' is not a positive whole number"),
    ("CSI_PMEM_LOG_LEVEL", "x", "invalid choice 'x' (use one of debug, info, warning"),
    ("CSI_PMEM_LOG_FORMAT", "xml", "invalid choice 'xml' (use one of text, json)"),
])
def test_a_bad_gpu_copy_variable_names_itself_and_exits_2(name, value, offer, no_start,
                                                          monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    assert cli.main(["gpu-copy"]) == Exit.USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"csi-pmem: environment variable {name}: {offer}"), err
    assert err.count("\n") == 1


def test_gpu_copy_flags_beat_their_variables(monkeypatch):
    monkeypatch.setenv("CSI_PMEM_GPU_COPY_POLL_SECONDS", "x")
    monkeypatch.setenv("CSI_PMEM_GPU_COPY_MAX_CLIENTS", "4")
    monkeypatch.delenv("CSI_PMEM_GPU_COPY_COPIER", raising=False)
    args = cli.build_parser().parse_args(["gpu-copy", "--poll-seconds", "0.5"])
    got = gpu_copy.resolve(args)
    assert (got.poll_seconds, got.max_clients, got.copier) == (0.5, 4, "cuda")


def test_a_bad_variable_breaks_only_the_command_that_reads_it(monkeypatch, capsys):
    """CSI_PMEM_GPU_COPY_POLL_SECONDS=x used to crash every csi-pmem command with a
    ValueError while the parser was built."""
    for name in ("CSI_PMEM_GPU_COPY_POLL_SECONDS", "CSI_PMEM_LOG_LEVEL", "CSI_PMEM_BACKEND",
                 "CSI_PMEM_ERASE_WORKERS"):
        monkeypatch.setenv(name, "x")
    code = cli.main(["volume", "list", "--endpoint", "unix:///nonexistent/csi.sock"])
    assert code == Exit.UNREACHABLE, capsys.readouterr().err


def test_from_env_reads_the_flag_then_the_variable_then_the_default(monkeypatch):
    monkeypatch.delenv("CSI_PMEM_TEST_X", raising=False)
    read = cmdline.from_env
    assert read(None, "CSI_PMEM_TEST_X", "3", cmdline.positive_int) == 3
    monkeypatch.setenv("CSI_PMEM_TEST_X", "4")
    assert read(None, "CSI_PMEM_TEST_X", "3", cmdline.positive_int) == 4
    assert read(5, "CSI_PMEM_TEST_X", "3", cmdline.positive_int) == 5
    monkeypatch.setenv("CSI_PMEM_TEST_X", "four")
    with pytest.raises(cmdline.UsageError) as bad:
        read(None, "CSI_PMEM_TEST_X", "3", cmdline.positive_int)
    assert str(bad.value) == ("environment variable CSI_PMEM_TEST_X: 'four' is not a "
                              "positive whole number")


@pytest.mark.parametrize("text, ok", [("1", 1.0), ("0.25", 0.25), ("1e2", 100.0),
                                      ("0", None), ("-1", None), ("nan", None),
                                      ("inf", None), ("", None), ("1s", None)])
def test_positive_seconds(text, ok):
    if ok is None:
        with pytest.raises(argparse.ArgumentTypeError, match="not a positive number"):
            cmdline.positive_seconds(text)
    else:
        assert cmdline.positive_seconds(text) == ok
