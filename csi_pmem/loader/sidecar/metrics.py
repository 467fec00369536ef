"""The sidecar's ``/metrics``: staging bytes and seconds, readiness, verification results.

Why a collector over :class:`.status.Status`: ``/status`` and ``/readyz`` already read
one consistent snapshot of what the worker did; the metrics are the same snapshot in
Prometheus' text format, so the three can never disagree and the worker holds no
metric objects.

Why prometheus-client is imported here and only here, lazily: the loader's import
(``import csi_pmem.loader``, ``csi_pmem.loader.sidecar``) must stay free of it, since
inference pods import the loader without serving anything. prometheus-client is in the
``loader`` extra, so ``csi-pmem-weights sidecar`` normally serves ``/metrics``; where it
is not installed, ``/metrics`` answers 501 and says what to install (the probes work
either way). pyproject.toml's import contract allows this one module to import it.
"""

from __future__ import annotations

from typing import Any

CONTENT_TYPE_TEXT = "text/plain; charset=utf-8"
MISSING = ("/metrics needs prometheus-client, which is not installed: "
           "pip install 'csi-pmem[loader]' (or prometheus-client)\n")


class StatusCollector:
    """Metric families from one :meth:`Status.snapshot`, built at scrape time."""

    def __init__(self, snapshot: Any) -> None:
        self.snapshot = snapshot  # a callable returning the /status dict

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.snapshot()
        model = str(snap.get("model") or "")
        lv = [model]

        def gauge(name: str, help_: str, value: float | None, **extra: str):
            fam = GaugeMetricFamily(f"csi_pmem_weights_{name}", help_,
                                    labels=["model", *extra])
            if value is not None:
                fam.add_metric([*lv, *extra.values()], value)
            return fam

        yield gauge("ready", "1 when the wanted revision is staged, committed and verified "
                    "(what /readyz says), else 0", 1 if snap["ready"] else 0)
        yield gauge("healthy", "0 after an internal error (/healthz fails; kubelet restarts "
                    "the sidecar), else 1", 1 if snap["healthy"] else 0)
        state = GaugeMetricFamily("csi_pmem_weights_state", "1 for the sidecar's current "
                                  "state (/status state)", labels=["model", "state"])
        state.add_metric([*lv, str(snap["state"])], 1)
        yield state
        error = GaugeMetricFamily(
            "csi_pmem_weights_error", "1 while the last attempt failed, labelled with the "
            "failure kind (source, read-only, too-small, volume, dax-socket, checksum, "
            "layout, superseded, damaged, error, internal); the log has the message",
            labels=["model", "kind"])
        if snap["last_error"]:
            error.add_metric([*lv, str(snap["error_kind"] or "error")], 1)
        yield error
        yield gauge("model_bytes", "Size of the model (all files) being staged or staged",
                    snap["bytes"])
        yield gauge("stage_bytes_done", "Bytes of the current or last staging pass done "
                    "(copied or found intact)", snap["bytes_done"])
        for name, key, help_ in (
                ("copied_bytes", "copied_total", "Bytes copied from the source to the volume"),
                ("reused_bytes", "reused_total", "Bytes found staged already and kept"),
                ("verified_bytes", "verified_total", "Bytes hashed by verifications"),
                ("attempts", "attempts", "Staging passes started (retries included)")):
            fam = CounterMetricFamily(f"csi_pmem_weights_{name}", help_, labels=["model"])
            fam.add_metric(lv, snap[key])
            yield fam
        phases = GaugeMetricFamily(
            "csi_pmem_weights_phase_seconds", "Seconds the last pass spent per phase (scan, "
            "fingerprint, open, lock, stage, verify, ..., total)", labels=["model", "phase"])
        for phase, seconds in sorted(snap["phases"].items()):
            phases.add_metric([*lv, phase], seconds)
        yield phases
        yield gauge("startup_seconds", "Seconds from process start to first ready",
                    snap["startup_seconds"])
        yield gauge("last_verified_timestamp_seconds", "Unix time of the last verification "
                    "that found the model intact", snap["last_verified"])
        verifications = CounterMetricFamily(
            "csi_pmem_weights_verifications", "Verifications by mode (sample, full) and "
            "result (ok: intact; damaged: checksums differ; error: could not read)",
            labels=["model", "mode", "result"])
        for mode, by_result in sorted(snap["verifications"].items()):
            for result, count in sorted(by_result.items()):
                verifications.add_metric([*lv, mode, result], count)
        yield verifications


def render(snapshot: Any) -> tuple[int, str, bytes]:
    """(HTTP code, content type, body) for ``GET /metrics``."""
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    except ImportError:
        return 501, CONTENT_TYPE_TEXT, MISSING.encode()
    registry = CollectorRegistry()
    registry.register(StatusCollector(snapshot))
    return 200, CONTENT_TYPE_LATEST, generate_latest(registry)
