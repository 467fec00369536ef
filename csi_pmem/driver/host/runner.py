"""The one way the driver runs external commands (ndctl, mount, umount, ...).

Why a module of its own: every external command must behave the same way (docs/design.md
§8): an argv list (never a shell), a timeout that really kills the command, a
fixed ``LC_ALL=C`` locale so error texts can be classified, a debug log line with the
duration, and one exception type (:class:`csi_pmem.errors.CommandError`) carrying argv,
exit status and stderr. The :class:`Runner` class exists so back ends can take a runner
in their constructor and unit tests can substitute a fake that replays recorded output.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from csi_pmem.errors import CommandError, CsiPmemError, ResourceExhausted, from_os_error

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0
# Bound on how long we wait for a killed command's pipes to close; a process that
# survives SIGKILL of its whole group is stuck in the kernel and we stop waiting.
_REAP_TIMEOUT = 5.0


class Runner:
    """Runs commands; back ends receive one so tests can pass a fake instead.

    ``env`` entries are added to (and override) the inherited environment;
    ``LC_ALL=C`` is always forced because error classification matches English texts.
    """

    def __init__(self, env: Mapping[str, str] | None = None):
        self._extra_env = dict(env or {})

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self._extra_env)
        env["LC_ALL"] = "C"
        env["LANG"] = "C"
        return env

    def run(self, argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT, check: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv``; raise :class:`CommandError` on failure (if ``check``) or timeout.

        A timeout always raises, even with ``check=False``: there is no exit status to
        hand back, and the command's whole process group has been killed.
        """
        argv = _validate_argv(argv)
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self._env(),
                text=True, errors="replace", close_fds=True,
                # A session of its own lets a timeout kill helpers the command spawned.
                start_new_session=True)
        except OSError as e:
            log.debug("run %s: cannot start: %s", argv, e)
            if e.errno in _SHORT_OF:
                # The node or the driver is short of something, not the command broken:
                # say what (RESOURCE_EXHAUSTED), not a failure of the command.
                raise _SHORT_OF[e.errno](e, f"cannot start {' '.join(argv[:3])}") from e
            raise CommandError(argv, 127, str(e), message=f"cannot be started ({e.strerror})") \
                from e
        try:
            stdout, stderr = proc.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = _kill(proc)
            elapsed = time.monotonic() - started
            log.debug("run %s: killed after %.3fs (timeout %ss)", argv, elapsed, timeout)
            raise CommandError(argv, None, stderr or "",
                               message=f"timed out after {timeout:g}s and was killed") from None
        elapsed = time.monotonic() - started
        log.debug("run %s: exit %d in %.3fs", argv, proc.returncode, elapsed)
        result = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
        if check and proc.returncode != 0:
            raise CommandError(argv, proc.returncode, stderr)
        return result

    def run_json(self, argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT) -> Any:
        """Run ``argv`` and parse its stdout as JSON; empty output means ``[]``.

        ndctl prints nothing at all (not ``[]``) when a listing matches no device.
        """
        result = self.run(argv, timeout=timeout)
        return parse_json_output(list(argv), result.stdout, result.stderr)


def parse_json_output(argv: list[str], stdout: str, stderr: str = "") -> Any:
    """Parse a command's JSON stdout (empty means ``[]``); bad JSON is a CommandError."""
    if not stdout.strip():
        return []
    try:
        return json.loads(stdout)
    except json.JSONDecodeError as e:
        raise CommandError(argv, 0, stderr,
                           message=f"printed output that is not JSON ({e.msg} at "
                                   f"line {e.lineno} column {e.colno})") from None


def _validate_argv(argv: Sequence[str]) -> list[str]:
    # A plain string would be split into characters by Popen's argv handling on some
    # paths or run through a shell by careless callers: refuse it outright.
    if isinstance(argv, (str, bytes)) or not argv:
        raise TypeError(f"argv must be a non-empty list of strings, got {argv!r}")
    out = [str(a) for a in argv]
    if any("\0" in a for a in out):
        raise ValueError(f"argv contains a NUL byte: {out!r}")
    return out


def _kill(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Kill the command's process group and collect whatever it printed."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:
        proc.kill()
    try:
        return proc.communicate(timeout=_REAP_TIMEOUT)
    except subprocess.TimeoutExpired:
        log.warning("pid %d did not exit after SIGKILL (stuck in the kernel?)", proc.pid)
        return "", ""


def _out_of_processes(exc: OSError, doing: str) -> CsiPmemError:
    return ResourceExhausted(
        f"{doing}: the driver cannot fork ({exc.strerror}); it has hit its process or "
        "thread limit: raise the pids limit of its container (or RLIMIT_NPROC)")


# fork/exec errors that mean a resource is short, with what to say about each.
_SHORT_OF: dict[int, Callable[[OSError, str], CsiPmemError]] = {
    errno.EMFILE: from_os_error, errno.ENFILE: from_os_error, errno.ENOMEM: from_os_error,
    errno.EAGAIN: _out_of_processes,
}

_default = Runner()


def default_runner() -> Runner:
    """The process-wide runner used by the module-level helpers."""
    return _default


def run(argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT, check: bool = True,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with the default runner (see :meth:`Runner.run`)."""
    return _default.run(argv, timeout=timeout, check=check, input=input)


def run_json(argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Run ``argv`` with the default runner and parse stdout as JSON (empty: ``[]``)."""
    return _default.run_json(argv, timeout=timeout)
