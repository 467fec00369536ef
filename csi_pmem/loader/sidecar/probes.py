"""The HTTP endpoints kubelet probes: ``/readyz``, ``/healthz`` and ``/status``, and
Prometheus' ``/metrics`` (:mod:`.metrics`).

Why the standard library's server: four GET paths answered from a snapshot need no
framework, and the sidecar must run with the loader's dependencies only.
"""

from __future__ import annotations

import argparse
import json
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from csi_pmem.loader.sidecar import metrics
from csi_pmem.loader.sidecar.events import log
from csi_pmem.loader.sidecar.status import Status


def parse_listen(text: str) -> tuple[str, int]:
    """``:8081``, ``0.0.0.0:8081``, ``127.0.0.1:0`` or ``[::]:8081`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--listen {text!r}: expected HOST:PORT or :PORT")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"--listen {text!r}: invalid port {port!r}")
    return host.strip("[]"), number


class ProbeServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], status: Status):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.status = status
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: ProbeServer
    server_version = "csi-pmem-sidecar"

    def do_GET(self) -> None:
        snap = self.server.status.snapshot()
        path = self.path.split("?", 1)[0]
        if path == "/readyz":
            reason = snap["last_error"] or f"state {snap['state']}"
            self._send(200 if snap["ready"] else 503,
                       "ok\n" if snap["ready"] else f"not ready: {reason}\n")
        elif path == "/healthz":
            self._send(200 if snap["healthy"] else 500,
                       "ok\n" if snap["healthy"] else f"unhealthy: {snap['last_error']}\n")
        elif path == "/status":
            self._send(200, json.dumps(snap, indent=1) + "\n", "application/json")
        elif path == "/metrics":
            code, ctype, body = metrics.render(lambda: snap)
            self._send(code, body, ctype)
        else:
            self._send(404, "not found: try /readyz, /healthz, /status or /metrics\n")

    def _send(self, code: int, body: str | bytes,
              ctype: str = "text/plain; charset=utf-8") -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)
