"""The background eraser: one queue of erase jobs served by a few worker threads.

Why: zeroing a 200 GiB namespace takes tens of seconds even at the media's speed, far
beyond what external-provisioner waits for a DeleteVolume. So DeleteVolume writes its
intent (the volume's DELETING record), queues the erase here and returns; the job
zeroes the namespace, destroys it, and only then is the space free, so GetCapacity
(and with it CSIStorageCapacity) reports it only once it is erased. A restart finds the
DELETING records and queues them again. Scrubs of dirty regions
(:mod:`csi_pmem.driver.erasing.scrub`) go through the same queue, so erases never
compete with each other for more bandwidth than the workers allow.

A job is a callable that gets a cancel event (set on shutdown, or when a scrub must
give way to a CreateVolume); it owns its own crash safety. A job that fails is retried
with a growing delay: its space stays unavailable rather than being released unerased.
Each job has a key (the volume id, or ``scrub:<region>``); submitting a key that is
queued or running returns that job, so a retried DeleteVolume queues nothing twice.
A submit with ``rerun`` while that job runs asks for one more run after it: a scrub
that is already past the space a new dirtying freed must look at the region again.

Stopping (:meth:`EraseQueue.close`) cancels every job and waits, within a bound, for
the running ones to reach a safe point: an erase stops at its next chunk, a namespace
create or destroy already started runs to its end (cutting ndctl off in the middle of
writing labels is what leaks a label slot). What a job leaves unfinished is in its
intent in the state store (a volume's DELETING record, a scrub's scratch names), which
the next start resumes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from csi_pmem.driver.erasing.erase import EraseCancelled

log = logging.getLogger(__name__)

DELETE, SCRUB = "delete", "scrub"
RETRY_FIRST, RETRY_MAX = 5.0, 600.0  # seconds between attempts of a failed job
# How long close() waits for running jobs: within Kubernetes' default 30 s grace period
# after gRPC's own 5 s, and well above one ndctl destroy (about 1 s even under TCG).
STOP_TIMEOUT = 20.0


@dataclass
class Job:
    key: str
    kind: str
    pool: str
    nbytes: int
    run: Callable[[threading.Event], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    attempts: int = 0
    error: str = ""
    running: bool = False  # in a worker now (guarded by the queue's condition)
    rerun: bool = False    # run once more when this run ends (guarded likewise)


class EraseQueue:
    """Jobs in FIFO order on ``workers`` threads; see the module docstring."""

    def __init__(self, workers: int = 2,
                 on_done: Callable[[Job, float], None] | None = None) -> None:
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._jobs: dict[str, Job] = {}  # queued, running or waiting for a retry
        self._cond = threading.Condition()
        self._closed = False
        self._timers: list[threading.Timer] = []
        self.on_done = on_done or (lambda job, seconds: None)
        self._threads = [threading.Thread(target=self._work, name=f"eraser-{i}", daemon=True)
                         for i in range(max(1, workers))]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ submit
    def submit(self, key: str, kind: str, pool: str, nbytes: int,
               run: Callable[[threading.Event], None], rerun: bool = False) -> Job:
        """Queue ``run`` under ``key``; the job already queued or running under that key
        if there is one (with ``rerun``, a running one runs once more afterwards)."""
        with self._cond:
            job = self._jobs.get(key)
            if job is not None:
                if rerun and job.running and not job.cancel.is_set():
                    job.rerun = True
                return job
            job = Job(key=key, kind=kind, pool=pool, nbytes=nbytes, run=run)
            if self._closed:
                return job  # shutting down: the intent in the state store resumes it
            self._jobs[key] = job
            self._queue.put(job)
            self._cond.notify_all()
        return job

    # ------------------------------------------------------------------ queries
    def get(self, key: str) -> Job | None:
        with self._cond:
            return self._jobs.get(key)

    def jobs(self, kind: str | None = None) -> list[Job]:
        with self._cond:
            return [j for j in self._jobs.values() if kind is None or j.kind == kind]

    def pending_bytes(self, pools: set[str] | None = None, kind: str = DELETE) -> int:
        """Bytes that queued or running jobs of ``kind`` will free in ``pools``."""
        return sum(j.nbytes for j in self.jobs(kind) if pools is None or j.pool in pools)

    def wait(self, key: str, timeout: float) -> bool:
        """Wait until no job with ``key`` is left; False if one still is at the timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while key in self._jobs:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def wait_any(self, timeout: float) -> None:
        """Wait until some job finishes (or the timeout passes)."""
        with self._cond:
            self._cond.wait(timeout)

    def cancel(self, key: str) -> Job | None:
        """Ask the job with ``key`` to stop: a running one stops at its next chunk; one
        that is queued or waiting for a retry is done at once (whoever waits for it, a
        CreateVolume giving way to nothing, must not wait for a worker or a timer)."""
        with self._cond:
            job = self._jobs.get(key)
            if job is not None:
                job.cancel.set()
                if not job.running:
                    self._finish(job)
        return job

    # ------------------------------------------------------------------ workers
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._cond:
                if job.cancel.is_set() or job.done.is_set():
                    self._finish(job)
                    continue
                job.running = True
            job.started_at = time.monotonic()
            job.attempts += 1
            try:
                job.run(job.cancel)
            except EraseCancelled:
                log.info("%s job %s stopped before its end; it resumes later", job.kind,
                         job.key)
                self._end(job, self._finish)
            except Exception as exc:  # a job must never kill its worker
                job.error = str(exc) or type(exc).__name__
                log.exception("%s job %s failed (attempt %d); retrying later, its space "
                              "stays unavailable", job.kind, job.key, job.attempts)
                self._end(job, self._retry)
            else:
                self.on_done(job, time.monotonic() - job.queued_at)
                self._end(job, self._finish)

    def _end(self, job: Job, then: Callable[[Job], None]) -> None:
        """A run is over: run it again if that was asked for meanwhile, else ``then``."""
        with self._cond:
            job.running = False
            again = job.rerun and not job.cancel.is_set() and not self._closed
            job.rerun = False
            if again:
                log.info("%s job %s runs again: it was asked for while it ran", job.kind,
                         job.key)
                job.queued_at = time.monotonic()
                self._queue.put(job)
                return
        then(job)

    def _finish(self, job: Job) -> None:
        with self._cond:
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            job.done.set()
            self._cond.notify_all()

    def _retry(self, job: Job) -> None:
        delay = min(RETRY_MAX, RETRY_FIRST * 2 ** (job.attempts - 1))

        def again() -> None:
            with self._cond:
                if self._closed:
                    return
                if job.cancel.is_set():
                    self._finish(job)  # cancelled while it waited: nothing more to do
                    return
                self._queue.put(job)

        with self._cond:
            if self._closed:
                return
            timer = threading.Timer(delay, again)
            timer.daemon = True
            self._timers.append(timer)
            timer.start()

    # ------------------------------------------------------------------ stop
    def close(self, timeout: float = STOP_TIMEOUT) -> list[Job]:
        """Stop: cancel every job and wait up to ``timeout`` seconds for the running
        ones to stop at a safe point (see the module docstring). Returns the jobs still
        running at the timeout; their intents in the state store resume them at the
        next start."""
        with self._cond:
            if self._closed:
                return []
            self._closed = True
            jobs = list(self._jobs.values())
            timers, self._timers = self._timers, []
        for t in timers:
            t.cancel()
        for job in jobs:
            job.cancel.set()
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            return [j for j in jobs if j.running]
