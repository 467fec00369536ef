"""The command runner: argv only, LC_ALL=C, timeouts that kill, CommandError, JSON."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import pytest

from csi_pmem.driver.host import runner
from csi_pmem.driver.host.runner import Runner
from csi_pmem.errors import BackendError, CommandError

PY = sys.executable


def py(code: str) -> list[str]:
    return [PY, "-c", code]


def test_run_returns_output_and_status():
    result = Runner().run(py("import sys; print('out'); print('err', file=sys.stderr)"))
    assert result.returncode == 0
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert result.args == [PY, "-c", "import sys; print('out'); print('err', file=sys.stderr)"]


def test_run_forces_c_locale_and_keeps_extra_env(monkeypatch):
    monkeypatch.setenv("LC_ALL", "de_DE.UTF-8")
    out = Runner(env={"CSI_PMEM_TEST": "yes"}).run(py(
        "import os; print(os.environ['LC_ALL'], os.environ['LANG'], "
        "os.environ['CSI_PMEM_TEST'])")).stdout
    assert out.split() == ["C", "C", "yes"]


def test_failure_raises_command_error_with_details():
    with pytest.raises(CommandError) as info:
        Runner().run(py("import sys; print('first'); sys.stderr.write('bad thing\\n'); "
                        "sys.exit(3)"))
    err = info.value
    assert isinstance(err, BackendError)
    assert err.returncode == 3
    assert err.stderr == "bad thing\n"
    assert err.argv[0] == PY
    assert "exited with status 3" in str(err) and "bad thing" in str(err)


def test_check_false_returns_the_failure():
    result = Runner().run(py("import sys; sys.exit(5)"), check=False)
    assert result.returncode == 5


def test_timeout_kills_the_command_and_its_children(tmp_path: Path):
    pidfile = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    started = time.monotonic()
    with pytest.raises(CommandError) as info:
        Runner().run(py(code), timeout=1.0)
    assert time.monotonic() - started < 10
    assert info.value.returncode is None
    assert "timed out after 1s" in str(info.value)
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child), "the grandchild survived the timeout"


def _alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie waiting for its new parent counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def test_timeout_raises_even_without_check():
    with pytest.raises(CommandError) as info:
        Runner().run(py("import time; time.sleep(30)"), timeout=0.3, check=False)
    assert info.value.returncode is None


def test_missing_binary_is_a_command_error():
    with pytest.raises(CommandError) as info:
        Runner().run(["/nonexistent/ndctl", "list"])
    assert info.value.returncode == 127
    assert "cannot be started" in str(info.value)


def test_input_goes_to_stdin():
    out = Runner().run(py("import sys; print(sys.stdin.read().upper())"), input="abc").stdout
    assert out == "ABC\n"


def test_stdin_is_closed_without_input():
    # A command that waits for input must not hang the driver.
    out = Runner().run(py("import sys; print(repr(sys.stdin.read()))"), timeout=10).stdout
    assert out == "''\n"


@pytest.mark.parametrize("argv", ["ndctl list", b"ndctl", [], ()])
def test_argv_must_be_a_list(argv):
    with pytest.raises(TypeError):
        Runner().run(argv)


def test_argv_with_nul_is_refused():
    with pytest.raises(ValueError):
        Runner().run(["echo", "a\0b"])


def test_no_shell_interpretation(tmp_path: Path):
    marker = tmp_path / "pwned"
    out = Runner().run(["echo", f"$(touch {marker}); `touch {marker}`"]).stdout
    assert "$(touch" in out
    assert not marker.exists()


def test_run_json_parses_stdout():
    assert Runner().run_json(py("print('[{\"dev\": \"region0\", \"size\": 16777216}]')")) == \
        [{"dev": "region0", "size": 16777216}]


@pytest.mark.parametrize("stdout", ["", "\n", "   \n"])
def test_run_json_empty_output_is_an_empty_list(stdout):
    # ndctl list prints nothing at all when nothing matches.
    assert Runner().run_json(py(f"print({stdout!r}, end='')")) == []


def test_run_json_rejects_non_json():
    with pytest.raises(CommandError) as info:
        Runner().run_json(py("print('{\"dev\": ')"))
    assert info.value.returncode == 0
    assert "not JSON" in str(info.value)


def test_run_json_propagates_failures():
    with pytest.raises(CommandError) as info:
        Runner().run_json(py("import sys; sys.exit(2)"))
    assert info.value.returncode == 2


def test_every_command_is_logged_with_its_duration(caplog):
    with caplog.at_level(logging.DEBUG, logger="csi_pmem.driver.host.runner"):
        Runner().run(py("pass"))
    record = next(r for r in caplog.records if r.name == "csi_pmem.driver.host.runner")
    assert record.levelno == logging.DEBUG
    message = record.getMessage()
    assert PY in message
    assert "exit 0 in" in message and message.rstrip().endswith("s")


def test_module_helpers_use_the_default_runner():
    assert runner.run(py("print(42)")).stdout == "42\n"
    assert runner.run_json(py("print('{\"a\": 1}')"), timeout=10) == {"a": 1}
    assert isinstance(runner.default_runner(), Runner)


def test_environment_of_the_parent_is_untouched():
    before = dict(os.environ)
    Runner(env={"X_CSI": "1"}).run(py("pass"))
    assert dict(os.environ) == before
