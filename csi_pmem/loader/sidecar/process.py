"""The sidecar process: a worker thread reconciles and re-verifies, the main thread waits
for signals and exits 0 on SIGTERM at once (staging is built to be interrupted).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from csi_pmem.loader.sidecar.events import SourceError, event, log
from csi_pmem.loader.sidecar.lock import volume_lock
from csi_pmem.loader.sidecar.probes import ProbeServer
from csi_pmem.loader.sidecar.reconcile import Outcome, ensure_model
from csi_pmem.loader.sidecar.revision import wanted
from csi_pmem.loader.sidecar.status import Progress, Status, classify, process_age
from csi_pmem.loader.sidecar.verify import damage, verify_model
from csi_pmem.loader.sources import is_s3
from csi_pmem.loader.staging import open_for_staging, scan_source
from csi_pmem.weights.errors import (
    ChecksumError,
    LoaderError,
    ReadOnlyVolumeError,
    VolumeError,
    VolumeTooSmallError,
)
from csi_pmem.weights.image import volume_image
from csi_pmem.weights.layout import COMMITTED, read_index
from csi_pmem.weights.volume import Volume, open_volume

MAX_BACKOFF = 60.0


@dataclass
class Config:
    volume: str
    source: str
    name: str
    revision: str | None = None
    fingerprint: str = "sample"
    listen: tuple[str, int] | None = ("", 8081)
    ready_file: str | None = None
    verify_interval: float = 0.0
    verify_on_start: str = "sample"
    threads: int | None = None
    once: bool = False


def _open_for_staging(path: str) -> tuple[Volume, str]:
    """The volume writable when it can be, else read-only plus the reason: a read-only
    volume that already holds the wanted revision needs no write to be ready. A
    directory volume's image file is created here when missing."""
    try:
        return open_for_staging(path), ""
    except ReadOnlyVolumeError as exc:
        try:
            return open_volume(path), str(exc)
        except VolumeError:
            if volume_image(path) is None:
                raise
            raise exc from None  # no image, and none can be made: say why not


class Sidecar:
    """The worker thread reconciles and re-verifies; the main thread waits for signals."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.status = Status(model=cfg.name, volume=cfg.volume, source=cfg.source)
        self.stop = threading.Event()
        self.done = threading.Event()
        self.wake = threading.Event()  # set by a signal or by the worker ending
        self.busy = threading.Event()  # set while the worker may be writing the volume
        self.exit_code = 0
        self.server: ProbeServer | None = None

    # One pass: scan, fingerprint, open, lock, ensure, report.
    def reconcile(self, verify_mode: str | None = None) -> Outcome:
        cfg, st = self.cfg, self.status
        started = time.monotonic()
        st.update(state="scanning", phases={})
        with self._phase("scan"):
            if not is_s3(cfg.source) and not os.path.isdir(cfg.source):
                missing = "does not exist" if not os.path.exists(cfg.source) else \
                    "is not a directory"
                raise SourceError(
                    f"source {cfg.source} {missing}: mount the model files there (a "
                    "read-only PVC, an image volume) or fix --source")
            try:
                sources = scan_source(cfg.source)
            except LoaderError as exc:  # its messages name the file already
                raise SourceError(str(exc)) from exc
        with self._phase("fingerprint"):
            revision, revision_from = wanted(cfg.revision, sources, cfg.fingerprint,
                                             cfg.threads)
        st.update(revision=revision, bytes=sum(s.size for s in sources),
                  revision_from=revision_from)
        with self._phase("open"):
            volume, readonly_reason = _open_for_staging(cfg.volume)
        with volume, volume_lock(cfg.volume) as waited:
            st.phase("lock", waited)
            volume.refresh()  # an image file another stager grew while we waited
            st.update(state="checking")
            self.busy.set()
            try:
                outcome = ensure_model(
                    volume, cfg.source, sources, cfg.name, revision,
                    verify_mode=verify_mode or cfg.verify_on_start, threads=cfg.threads,
                    progress=Progress(st), readonly_reason=readonly_reason,
                    on_phase=lambda name: st.update(state=name),
                    fingerprint_mode=None if cfg.revision else cfg.fingerprint)
            finally:
                self.busy.clear()
            writable = volume.writable
        for phase, secs in outcome.seconds.items():
            st.phase(phase, secs)
        st.phase("total", time.monotonic() - started)
        event("model ready", model=cfg.name, revision=revision, action=outcome.action,
               bytes=outcome.model.size, copied=outcome.copied, reused=outcome.reused,
               released=outcome.released, verify=outcome.verify_mode,
               verified_bytes=outcome.verified_bytes, phases=st.get("phases"),
               writable=writable)
        return outcome

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        t = time.monotonic()
        try:
            yield
        finally:
            self.status.phase(name, time.monotonic() - t)

    def _attempt(self, verify_mode: str | None = None) -> bool:
        st = self.status
        st.update(attempts=st.get("attempts") + 1)
        try:
            outcome = self.reconcile(verify_mode)
        except (LoaderError, OSError) as exc:
            if isinstance(exc, ChecksumError):
                st.verified(verify_mode or self.cfg.verify_on_start, "damaged")
            self._not_ready("error", exc)
            return False
        st.add(copied_total=outcome.copied, reused_total=outcome.reused)
        if outcome.verify_mode and outcome.verify_mode != "none":
            st.verified(outcome.verify_mode, "ok", outcome.verified_bytes)
        age = process_age()
        st.update(state="ready", ready=True, last_error=None, error_kind=None,
                  needed=None, available=None, action=outcome.action,
                  bytes=outcome.model.size, bytes_done=outcome.model.size,
                  bytes_copied=outcome.copied, bytes_reused=outcome.reused,
                  released=outcome.released, space=outcome.space,
                  verify_mode=outcome.verify_mode, last_verified=time.time())
        if st.get("startup_seconds") is None:
            st.update(startup_seconds=round(age, 3) if age is not None else None)
            event("ready", startup_seconds=st.get("startup_seconds"),
                   action=outcome.action, phases=st.get("phases"))
        self._ready_file(True)
        return True

    def _not_ready(self, state: str, exc: BaseException | str) -> None:
        message = str(exc)
        kind = classify(exc) if isinstance(exc, BaseException) else state
        extra = {}
        if isinstance(exc, VolumeTooSmallError):
            extra = {"needed": exc.needed, "available": exc.available}
        self.status.update(state=state, ready=False, last_error=message, error_kind=kind,
                           **extra)
        self._ready_file(False)
        event("not ready", logging.ERROR, state=state, error_kind=kind, error=message,
               **extra)

    def _ready_file(self, ready: bool) -> None:
        path = self.cfg.ready_file
        if not path:
            return
        if not ready:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        snap = self.status.snapshot()
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"model": snap["model"], "revision": snap["revision"],
                       "ready_at": time.time()}, f)
        os.replace(tmp, path)

    def _recheck(self) -> None:
        """Periodic: is our revision still the committed one, and are its bytes intact?"""
        cfg, st = self.cfg, self.status
        revision = st.get("revision")
        started = time.monotonic()
        try:
            with open_volume(cfg.volume) as volume:
                index = read_index(volume)
                model = index.find(cfg.name) if index else None
                if model is None or model.state != COMMITTED or model.revision != revision:
                    have = model.label() + f" ({model.state})" if model else "nothing"
                    self._not_ready("superseded", f"{cfg.name}@{revision} is no longer the "
                                    f"committed model on the volume (it holds {have}); "
                                    "another stager replaced it. Restart this pod to "
                                    "stage its revision again")
                    return
                bad, hashed = verify_model(volume, model, "full", cfg.threads)
        except (LoaderError, OSError) as exc:
            st.verified("full", "error")
            self._not_ready("error", exc)
            return
        st.verified("full", "damaged" if bad else "ok", hashed)
        if bad:
            self._not_ready("damaged", ChecksumError(damage(model, bad)))
            self._attempt("full")  # copies the damaged files again (when writable)
            return
        seconds = time.monotonic() - started
        if not st.get("ready"):
            self._attempt()
        st.update(last_verified=time.time(), verify_mode="full")
        event("re-verified", model=model.label(), bytes=hashed, seconds=round(seconds, 3))

    def _work(self) -> None:
        """Reconcile until ready (retrying with backoff), then re-verify or idle."""
        try:
            delay = 1.0
            while not self.stop.is_set() and not self._attempt():
                if self.cfg.once:
                    self.exit_code = 1
                    return
                self.status.update(retry_in=delay)
                if self.stop.wait(delay):
                    return
                delay = min(delay * 2, MAX_BACKOFF)
            self.status.update(retry_in=None)
            if self.cfg.once:
                return
            if not self.cfg.verify_interval:
                self.stop.wait()
            while not self.stop.wait(self.cfg.verify_interval):
                self._recheck()
        except BaseException as exc:  # a bug: say so and exit non-zero; kubelet restarts us
            log.exception("sidecar worker failed")
            self.status.update(healthy=False, ready=False, state="failed",
                               last_error=f"internal error: {exc!r}", error_kind="internal")
            self.exit_code = 1
        finally:
            self.done.set()
            self.wake.set()

    def _serve(self) -> bool:
        if self.cfg.listen is None:
            return True
        try:
            self.server = ProbeServer(self.cfg.listen, self.status)
        except OSError as exc:
            event("cannot listen", logging.ERROR, listen=list(self.cfg.listen),
                   error=str(exc))
            return False
        host, port = self.server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host
        event("listening", address=f"{host}:{port}", port=port)
        threading.Thread(target=self.server.serve_forever, name="http", daemon=True).start()
        return True

    def run(self) -> int:
        cfg = self.cfg
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._signalled)
        self._ready_file(False)  # a file left by an earlier run says nothing about now
        event("sidecar starting", volume=cfg.volume, source=cfg.source, model=cfg.name,
               revision=cfg.revision or f"(fingerprint: {cfg.fingerprint})",
               verify_on_start=cfg.verify_on_start, verify_interval=cfg.verify_interval,
               pid=os.getpid())
        if not self._serve():
            return 1
        threading.Thread(target=self._work, name="sidecar", daemon=True).start()
        while not self.wake.wait(1.0):
            pass
        if self.stop.is_set():
            self._shutdown()
        if cfg.once:
            print(json.dumps(self.status.snapshot(), indent=1), flush=True)
        return self.exit_code

    def _signalled(self, signum: int, _frame: object) -> None:
        self.stop_signal = signal.Signals(signum).name
        self.state_at_stop = self.status.get("state")
        self.status.update(state="stopping", ready=False)
        self.stop.set()
        self.wake.set()

    def _shutdown(self) -> None:
        """Exit 0 at once. A copy in flight is abandoned, which staging is built for: the
        entry stays ``staging`` (loads refuse it) and the next start resumes it. No
        thread is waited for: copy and hash pools would hold the exit for minutes."""
        event("stopping", signal=getattr(self, "stop_signal", "?"),
               state=getattr(self, "state_at_stop", None), interrupted=self.busy.is_set())
        self._ready_file(False)
        if self.server is not None:
            self.server.server_close()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
