"""Notice namespaces and dax devices appearing or vanishing without polling ndctl.

Why: regions get disabled, namespaces get destroyed by an administrator, and dax
device nodes appear after the driver started (intel/pmem-csi#136). Re-reading ndctl
on every change keeps capacity and health current; a netlink monitor on the ``nd``
and ``dax`` subsystems says when. Where netlink uevents are unavailable (no libudev,
a container without the host's network namespace, no udevd for the "udev" source),
a polling thread calls back periodically instead, so callers need one code path.

The callback runs on a daemon thread and gets ``(action, device_name)``: the uevent
action ("add", "remove", "change", "bind", ...) and the kernel name (``dax0.1``,
``namespace0.1``), or ``("poll", "")`` for a periodic tick. Callback errors are
logged and never stop the watcher.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

OnChange = Callable[[str, str], None]
SUBSYSTEMS = ("nd", "dax")
# How long one netlink wait blocks: bounds how late stop() takes effect.
_WAKE_INTERVAL = 0.5


class _Monitor(Protocol):
    def poll(self, timeout: float | None = None) -> Any: ...


def netlink_monitor(subsystems: Sequence[str], source: str = "udev") -> _Monitor:
    """A started pyudev netlink monitor filtered to ``subsystems`` (raises if unavailable)."""
    import pyudev  # imported here: a missing libudev must only disable this mode

    context = pyudev.Context()
    monitor = pyudev.Monitor.from_netlink(context, source=source)
    for subsystem in subsystems:
        monitor.filter_by(subsystem=subsystem)
    monitor.start()
    return monitor


class DeviceWatcher:
    """Calls ``on_change`` when nd/dax devices change (netlink), or every interval (polling).

    ``poll_interval``: seconds between ticks in polling mode. ``resync_interval``: in
    netlink mode, also tick this often (None: never) because uevents can be lost (socket
    overruns) or never arrive (a network namespace without them). ``use_netlink=False``
    forces polling. ``monitor_factory`` builds the netlink monitor (tests pass a fake).
    """

    def __init__(self, on_change: OnChange, poll_interval: float = 10.0,
                 resync_interval: float | None = 60.0, subsystems: Sequence[str] = SUBSYSTEMS,
                 use_netlink: bool = True, source: str = "udev",
                 monitor_factory: Callable[[Sequence[str], str], _Monitor] | None = None):
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be positive, got {poll_interval}")
        self._on_change = on_change
        self._poll_interval = poll_interval
        self._resync_interval = resync_interval
        self._subsystems = tuple(subsystems)
        self._use_netlink = use_netlink
        self._source = source
        self._factory = monitor_factory or netlink_monitor
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.mode: str | None = None  # "netlink" or "polling" once started

    def start(self) -> None:
        """Start watching (idempotent). Never raises for a missing netlink: it polls."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        monitor = self._open_monitor() if self._use_netlink else None
        target: Callable[[], None]
        if monitor is not None:
            self.mode = "netlink"
            target = functools.partial(self._netlink_loop, monitor)
            log.info("watching %s devices through netlink uevents (source %s)",
                     "/".join(self._subsystems), self._source)
        else:
            self.mode = "polling"
            target = self._polling_loop
            log.info("watching %s devices by polling every %gs",
                     "/".join(self._subsystems), self._poll_interval)
        self._thread = threading.Thread(target=target, name="csi-pmem-udev", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait up to ``timeout`` seconds for it to end."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("device watcher thread did not stop within %gs", timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _open_monitor(self) -> _Monitor | None:
        try:
            return self._factory(self._subsystems, self._source)
        except (ImportError, OSError, ValueError) as e:  # no pyudev/libudev; netlink refused
            log.info("netlink uevents unavailable (%s: %s); falling back to polling",
                     type(e).__name__, e)
            return None

    def _emit(self, action: str, name: str) -> None:
        try:
            self._on_change(action, name)
        except Exception:
            log.exception("device change callback failed for %s %s", action, name or "(poll)")

    def _polling_loop(self) -> None:
        while not self._stop.wait(self._poll_interval):
            self._emit("poll", "")

    def _netlink_loop(self, monitor: _Monitor) -> None:
        last_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                device = monitor.poll(timeout=_WAKE_INTERVAL)
            except (OSError, ValueError) as e:
                # A broken socket must not leave the driver blind: poll from now on.
                log.warning("netlink monitor failed (%s); falling back to polling", e)
                self.mode = "polling"
                self._polling_loop()
                return
            if device is not None:
                self._emit(str(getattr(device, "action", None) or "change"),
                           str(getattr(device, "sys_name", "") or ""))
            now = time.monotonic()
            if self._resync_interval is not None and now - last_tick >= self._resync_interval:
                last_tick = now
                self._emit("poll", "")
