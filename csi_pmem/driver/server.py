"""Assemble and run the driver: back end, state, reconcile, gRPC, metrics, device watch.

One process serves Identity, Controller and Node: provisioning is node-local
(external-provisioner runs in the node DaemonSet), so there is no separate controller
deployment to keep in step.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
from concurrent import futures
from typing import TYPE_CHECKING

import grpc

from csi_pmem.csi import csi_pb2_grpc
from csi_pmem.driver.backends.base import Backend
from csi_pmem.driver.config import ServeConfig, grpc_address
from csi_pmem.driver.core import Driver
from csi_pmem.driver.daxsock import DaxSocketServer
from csi_pmem.driver.host.mounter import HostMounter, Mounter
from csi_pmem.driver.instance import AlreadyRunning, StateDirLock
from csi_pmem.driver.metrics import Metrics
from csi_pmem.driver.servicers import rpc as rpc_module
from csi_pmem.driver.servicers.controller import ControllerServicer
from csi_pmem.driver.servicers.identity import IdentityServicer
from csi_pmem.driver.servicers.node import NodeServicer
from csi_pmem.driver.state import StateStore
from csi_pmem.errors import InvalidArgument
from csi_pmem.fdpass import SocketInUse, claim
from csi_pmem.gpucopy.link import ServiceLink

if TYPE_CHECKING:
    from csi_pmem.driver.udev import DeviceWatcher  # imported when started: it needs pyudev

log = logging.getLogger(__name__)


def make_backend(cfg: ServeConfig, mounter: Mounter) -> Backend:
    """The back end ``--backend`` names; several (``ndctl,daxctl``) behind one
    :class:`~csi_pmem.driver.backends.composite.CompositeBackend`."""
    if len(cfg.backends) > 1:
        from csi_pmem.driver.backends.composite import CompositeBackend

        return CompositeBackend([_one_backend(cfg, name, mounter) for name in cfg.backends])
    return _one_backend(cfg, cfg.backend, mounter)


def _one_backend(cfg: ServeConfig, name: str, mounter: Mounter) -> Backend:
    if name == "ndctl":
        from csi_pmem.driver.backends.ndctl import NdctlBackend

        return NdctlBackend(ndctl=cfg.ndctl)
    if name == "daxctl":
        from csi_pmem.driver.backends.daxctl import DaxctlBackend

        return DaxctlBackend(daxctl=cfg.daxctl, cxl=cfg.cxl, setup=cfg.dax_setup,
                             state_path=os.path.join(cfg.state_dir, "daxctl-devices.json"))
    if name == "memory":
        from csi_pmem.driver.backends.memory import MemoryBackend
        from csi_pmem.driver.backends.memory_sizing import fit_pools, node_memory, parse_pools

        return MemoryBackend(cfg.memory_root, fit_pools(parse_pools(cfg.memory_pools),
                                                        node_memory()),
                             mounter, fs=cfg.memory_fs, pages=cfg.memory_pages)
    from csi_pmem.driver.backends.emulated import EmulatedBackend, parse_regions

    return EmulatedBackend(cfg.emulated_root, parse_regions(cfg.emulated_regions),
                           device_type=cfg.emulated_device, loops=mounter,
                           free_space=cfg.emulated_free_space, media=cfg.emulated_media)


def worker_count(cfg: ServeConfig) -> int:
    # Calls block on ndctl, erase and fsync, not on CPU: a few threads per core, with a
    # floor so 16 concurrent CreateVolume calls are all answered (most with ABORTED).
    return cfg.grpc_workers or max(16, 4 * (os.cpu_count() or 1))


class Server:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        # First, before any state is read or any device touched: a second driver on this
        # state dir stops here (csi_pmem.driver.instance says why).
        self.lock = StateDirLock(cfg.state_dir)
        # Then what another process may hold, still before the back end or the state is
        # touched: a driver that cannot serve leaves the devices and the pods' sockets
        # alone, and says why in one line.
        self._claim_endpoint(cfg.endpoint)
        self.metrics = Metrics(cfg.driver_name, backend=cfg.backend)
        if cfg.metrics_address:
            self._serve_metrics(cfg.metrics_address)
        self.mounter = HostMounter()
        self.backend = make_backend(cfg, self.mounter)
        os.makedirs(cfg.state_dir, exist_ok=True)
        self.dax = DaxSocketServer(on_event=lambda kind, path:
                                   self.metrics.dax_connections.labels(kind).inc())
        self.driver = Driver(
            cfg.driver_config(), self.backend, StateStore(cfg.state_dir), self.dax,
            on_erase=self.metrics.observe_erase,
            on_erase_error=self.metrics.erase_failures.inc,
            on_recreate=self.metrics.observe_recreate,
            gpu_copy=ServiceLink(cfg.gpu_copy_socket) if cfg.gpu_copy_socket else None,
            mounter=self.mounter)
        self.metrics.watch_pools(self.backend, lambda: self.driver.orphans)
        self.metrics.watch_erases(self.driver.eraser, self.driver.ledger, self.backend)
        rpc_module.observers.append(self.metrics.observe_rpc)
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=worker_count(cfg),
                                                           thread_name_prefix="csi"))
        csi_pb2_grpc.add_IdentityServicer_to_server(
            IdentityServicer(cfg.driver_name, self.backend.probe, pools=self.backend.pools),
            self.grpc)
        csi_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(self.driver), self.grpc)
        csi_pb2_grpc.add_NodeServicer_to_server(NodeServicer(self.driver), self.grpc)
        self.watcher: DeviceWatcher | None = None
        self._stopped = threading.Event()  # stop() has begun
        self._done = threading.Event()     # stop() has ended: the process may exit

    def start(self) -> None:
        started = time.monotonic()
        self.backend.setup_node()  # opt-in CXL regions, before volumes are matched
        self.driver.reconcile()
        address, _ = grpc_address(self.cfg.endpoint)
        # Said before the socket answers, so whoever sees the driver serving can also
        # find why a region is unusable in the log.
        ok, reason = self.backend.probe()
        if reason != "ok":
            log.warning("%s: %s", "not ready" if not ok else "serving with problems", reason)
        self.grpc.add_insecure_port(address)
        self.grpc.start()
        if "ndctl" in self.cfg.backends or "daxctl" in self.cfg.backends:
            self._start_watcher()  # nd and dax uevents
        log.info("csi-pmem %s serving %s on %s (node %s, back end %s, %s) in %.2f s",
                 self.cfg.driver_name, "Identity/Controller/Node", self.cfg.endpoint,
                 self.cfg.node_id, self.cfg.backend, f"{'ready' if ok else 'NOT READY'}: {reason}",
                 time.monotonic() - started)

    @staticmethod
    def _claim_endpoint(endpoint: str) -> None:
        _, path = grpc_address(endpoint)
        if not path:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            claim(path)  # a stale socket from a previous run goes; a live one stays
        except SocketInUse:
            raise AlreadyRunning(f"{path}: another process serves this endpoint; stop it, "
                                 "or give this driver its own --endpoint") from None

    def _serve_metrics(self, address: str) -> None:
        try:
            self.metrics.serve(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AlreadyRunning(
                    f"metrics address {address} is taken by another process; stop it, or "
                    "give this driver another --metrics-address") from None
            raise InvalidArgument(f"cannot serve metrics on {address}: "
                                  f"{exc.strerror or exc}") from None
        except ValueError as exc:  # a port that is not a number
            raise InvalidArgument(f"--metrics-address {address!r}: use host:port ({exc})") \
                from None

    def _start_watcher(self) -> None:
        from csi_pmem.driver.udev import DeviceWatcher

        abnormal: set[str] = set()

        def changed(action: str, device: str) -> None:
            """Re-read the devices; log volumes whose device vanished or came back."""
            self.backend.invalidate()
            for rec in self.driver.list_volumes():
                cond = self.driver.condition(rec)
                if cond.abnormal and rec.id not in abnormal:
                    abnormal.add(rec.id)
                    log.error("volume %s is abnormal: %s", rec.id, cond.message)
                elif not cond.abnormal and rec.id in abnormal:
                    abnormal.discard(rec.id)
                    log.info("volume %s is healthy again: %s", rec.id, cond.message)

        watcher = DeviceWatcher(changed, poll_interval=self.cfg.device_poll_seconds)
        watcher.start()
        self.watcher = watcher

    def wait(self) -> None:
        """Until stop() has ended, not just begun: the signal handler runs stop() in a
        daemon thread, and an interpreter that exits meanwhile would cut the driver's
        close short, with a background erase's ndctl destroy half done.

        In slices, not one wait: the kernel may deliver SIGTERM to any of the process's
        threads, and then only the main thread's next bytecode runs the handler; a main
        thread blocked in one untimed wait would never see the signal."""
        while not self._done.wait(0.5):
            pass

    def stop(self, grace: float = 5.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            self.grpc.stop(grace).wait()
            if self.watcher is not None:
                self.watcher.stop()
            self.driver.close()
            rpc_module.observers[:] = [o for o in rpc_module.observers
                                       if o != self.metrics.observe_rpc]
        finally:
            self.lock.release()
            self._done.set()


def serve(cfg: ServeConfig) -> int:
    server = Server(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(target=server.stop, daemon=True).start())
    server.start()
    server.wait()
    log.info("stopped; published volumes stay mounted and are served again on restart")
    return 0
