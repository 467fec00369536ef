"""``csi-pmem gpu-copy``: run the node's GPU copy service (its own container).

Its flags fall back on CSI_PMEM_GPU_COPY_* (and the driver's CSI_PMEM_LOG_*) variables,
as the chart sets them; :func:`resolve` reads those when the command runs, so a bad
value is a usage error naming the variable (:func:`csi_pmem.cmdline.from_env`).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from csi_pmem.cmdline import from_env, one_of, positive_int, positive_seconds

ENV = "CSI_PMEM_GPU_COPY_"
COPIERS = ("cuda", "fake")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


def _env(name: str, default: str, check: Callable[[str], Any]) -> tuple[str, str, Any]:
    """One row of ENVIRONMENT (a call with the literal name, which the chart's tests
    find in this file: tests/test_chart.py, gpu_copy_env_names)."""
    return name, default, check


# The flags that fall back on a variable: dest -> (variable, default, how it is read).
# Read by run(), not while the parser is built, so a bad value is a usage error that
# names the variable, and breaks only this command.
ENVIRONMENT = {
    "socket": _env(ENV + "SOCKET", "/csi/gpu-copy.sock", str),
    "copier": _env(ENV + "COPIER", "cuda", one_of(COPIERS)),
    "poll_seconds": _env(ENV + "POLL_SECONDS", "2", positive_seconds),
    "max_clients": _env(ENV + "MAX_CLIENTS", "32", positive_int),
    "log_level": _env("CSI_PMEM_LOG_LEVEL", "info", one_of(LOG_LEVELS)),
    "log_format": _env("CSI_PMEM_LOG_FORMAT", "text", one_of(LOG_FORMATS)),
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=None,
                        help="control socket the node plugin connects to "
                             f"[env {ENV}SOCKET, default /csi/gpu-copy.sock]; give the node "
                             "plugin the same path as --gpu-copy-socket")
    parser.add_argument("--copier", choices=COPIERS, default=None,
                        help="cuda (cuda-python, the GPUs this container sees) or fake "
                             "(memcpy into memfd allocations: tests) "
                             f"[env {ENV}COPIER, default cuda]")
    parser.add_argument("--poll-seconds", type=positive_seconds, default=None,
                        help="how often prepared volumes' indexes are checked for newly "
                             f"staged models to register [env {ENV}POLL_SECONDS, default 2]")
    parser.add_argument("--client-timeout", type=positive_seconds, default=30.0,
                        help="seconds a pod may stay silent before its connection is closed")
    parser.add_argument("--max-clients", type=positive_int, default=None,
                        help="pods served at once; more are told the service is busy and "
                             f"load in-pod [env {ENV}MAX_CLIENTS, default 32]")
    parser.add_argument("--fake-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--log-level", default=None, choices=LOG_LEVELS,
                        help="[env CSI_PMEM_LOG_LEVEL, default info]")
    parser.add_argument("--log-format", default=None, choices=LOG_FORMATS,
                        help="[env CSI_PMEM_LOG_FORMAT, default text]")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every flag not given read from its variable or its default; raises
    :class:`csi_pmem.cmdline.UsageError` naming a variable whose value is bad."""
    values = {dest: from_env(getattr(args, dest, None), name, default, check)
              for dest, (name, default, check) in ENVIRONMENT.items()}
    return argparse.Namespace(**(vars(args) | values))


def run(args: argparse.Namespace) -> int:
    from csi_pmem import logs
    from csi_pmem.fdpass import SocketInUse
    from csi_pmem.gpucopy.copier import Copier, CopyError, FakeCopier
    from csi_pmem.gpucopy.service import CopyService

    args = resolve(args)
    logs.setup(args.log_format, args.log_level)
    # First: a SIGTERM while the copier starts (CUDA takes seconds) ends the service
    # cleanly once it is up, instead of killing it half made.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    copier: Copier
    try:
        if args.copier == "fake":
            copier = FakeCopier(delay=args.fake_delay)
        else:
            try:
                from csi_pmem.gpucopy.cuda import CudaCopier
                copier = CudaCopier()
            except ImportError as exc:
                print(f"csi-pmem gpu-copy: cuda-python is not installed ({exc}); install "
                      "csi-pmem[gpu-copy]", file=sys.stderr)
                return 1
        service = CopyService(args.socket, copier, poll_seconds=args.poll_seconds,
                              client_timeout=args.client_timeout,
                              max_clients=args.max_clients).start()
    except SocketInUse as exc:  # one copy service per node: the live one is left alone
        print(f"csi-pmem gpu-copy: {exc.filename}: another copy service listens on it; "
              "stop it first, or give this one its own --socket", file=sys.stderr)
        return 2
    except (CopyError, OSError) as exc:
        print(f"csi-pmem gpu-copy: {exc}", file=sys.stderr)
        return 1
    # In slices: a signal the kernel delivers to another thread runs its handler only
    # when the main thread next runs bytecode, which one untimed wait never does.
    while not stop.wait(0.5):
        pass
    service.stop()
    return 0
