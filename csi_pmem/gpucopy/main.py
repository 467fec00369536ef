"""``csi-pmem gpu-copy``: run the node's GPU copy service (its own container)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from csi_pmem.cmdline import positive_int

ENV = "CSI_PMEM_GPU_COPY_"


def add_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--socket", default=env(ENV + "SOCKET", "/csi/gpu-copy.sock"),
                        help="control socket the node plugin connects to "
                             f"[env {ENV}SOCKET]; give the node plugin the same path as "
                             "--gpu-copy-socket")
    parser.add_argument("--copier", choices=("cuda", "fake"),
                        default=env(ENV + "COPIER", "cuda"),
                        help="cuda (cuda-python, the GPUs this container sees) or fake "
                             "(memcpy into memfd allocations: tests) "
                             f"[env {ENV}COPIER]")
    parser.add_argument("--poll-seconds", type=float,
                        default=float(env(ENV + "POLL_SECONDS", "2")),
                        help="how often prepared volumes' indexes are checked for newly "
                             "staged models to register")
    parser.add_argument("--client-timeout", type=float, default=30.0,
                        help="seconds a pod may stay silent before its connection is closed")
    parser.add_argument("--max-clients", type=positive_int,
                        default=env(ENV + "MAX_CLIENTS", "32"),
                        help="pods served at once; more are told the service is busy and "
                             f"load in-pod [env {ENV}MAX_CLIENTS]")
    parser.add_argument("--fake-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--log-level", default=env("CSI_PMEM_LOG_LEVEL", "info"),
                        choices=("debug", "info", "warning", "error"))
    parser.add_argument("--log-format", default=env("CSI_PMEM_LOG_FORMAT", "text"),
                        choices=("text", "json"))


def run(args: argparse.Namespace) -> int:
    from csi_pmem import logs
    from csi_pmem.gpucopy.copier import Copier, CopyError, FakeCopier
    from csi_pmem.gpucopy.service import CopyService

    logs.setup(args.log_format, args.log_level)
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
    except (CopyError, OSError) as exc:
        print(f"csi-pmem gpu-copy: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    service.stop()
    return 0
