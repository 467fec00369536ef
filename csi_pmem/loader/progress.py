"""Progress of ``csi-pmem-weights stage|verify|export`` on stderr: bytes, rate and ETA.

Why its own module: staging reports progress as ``progress(done, total, what)``
(:mod:`csi_pmem.loader.staging`), and the command line decides how a person sees it.
tqdm's bar is the look users know from ``huggingface-cli download``; it is used when
installed (the ``loader`` extra brings it), and a plain line with the same numbers
otherwise, so the command line works without it. Shown only when stderr is a terminal
unless asked for (``--progress``), so logs and pipes stay clean.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from csi_pmem.sizes import human_size


def wanted(flag: bool | None, stream: TextIO | None = None) -> bool:
    """``--progress`` / ``--no-progress`` when given, else whether ``stream`` (stderr)
    is a terminal."""
    if flag is not None:
        return flag
    return (stream or sys.stderr).isatty()


def eta(done: int, total: int, seconds: float) -> str:
    """Time left at the average rate so far, as ``m:ss`` (``h:mm:ss`` past an hour)."""
    if done <= 0 or seconds <= 0 or total <= done:
        return "0:00" if total <= done else "?"
    left = round((total - done) * seconds / done)
    hours, rest = divmod(left, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """A ``progress(done, total, what)`` callback that draws on ``stream``.

    Rate and ETA count only bytes moved by this run: the first report's ``done`` (files a
    resumed stage reuses after verifying them) is the starting point, not throughput.
    """

    def __init__(self, verb: str, enabled: bool, stream: TextIO | None = None,
                 use_tqdm: bool = True, interval: float = 0.5):
        self.verb, self.enabled, self.interval = verb, enabled, interval
        self.stream = stream or sys.stderr
        self.tqdm: Any = None
        self._tqdm_cls = _tqdm() if use_tqdm else None
        self.started = self.last = 0.0
        self.base = 0
        self.drawn = False

    def __call__(self, done: int, total: int, what: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.started:
            self.started, self.base = now, done
            if self._tqdm_cls is not None:
                # A terminal that says it is 0x0 (some ptys: script, CI runners) would
                # get no bar at all from tqdm: 80x24 then.
                width = ({"dynamic_ncols": True} if _columns(self.stream)
                         else {"ncols": 80, "nrows": 24})
                self.tqdm = self._tqdm_cls(
                    total=total, initial=done, desc=self.verb, unit="B", unit_scale=True,
                    unit_divisor=1024, file=self.stream, mininterval=self.interval,
                    leave=True, **width)
        if self.tqdm is not None:
            if total != self.tqdm.total:
                self.tqdm.total = total
            self.tqdm.set_postfix_str(what, refresh=False)
            self.tqdm.update(done - self.tqdm.n)
            return
        if now - self.last < self.interval and done < total:
            return
        self.last = now
        self._line(done, total, what, now - self.started)

    def _line(self, done: int, total: int, what: str, seconds: float) -> None:
        moved = done - self.base
        rate = moved / seconds if seconds > 0 else 0.0
        pct = 100 * done / total if total else 100
        line = (f"{self.verb}: {human_size(done)} / {human_size(total)} ({pct:.0f}%), "
                f"{human_size(int(rate))}/s, ETA {eta(moved, total - self.base, seconds)}"
                f"  {what}")
        tty = self.stream.isatty()
        self.stream.write(("\r" + line + "\033[K") if tty else line + "\n")
        self.stream.flush()
        self.drawn = tty

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
            self.tqdm = None
        elif self.drawn:
            self.stream.write("\n")
            self.drawn = False


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError):
        return 0


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm
