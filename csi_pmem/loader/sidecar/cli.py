"""The sidecar's command line (``csi-pmem-weights sidecar``) and its log set-up."""

from __future__ import annotations

import argparse
import logging
import sys

from csi_pmem import logs
from csi_pmem.loader.sidecar.probes import parse_listen
from csi_pmem.loader.sidecar.process import Config, Sidecar
from csi_pmem.loader.sidecar.revision import FINGERPRINTS
from csi_pmem.loader.sidecar.verify import VERIFY_MODES
from csi_pmem.loader.sources import SourceError, check_location


def configure_logging(fmt: str) -> None:
    """The project's log format (:mod:`csi_pmem.logs`) on the handlers already set up,
    at INFO at least: the sidecar's events are what its operators read."""
    root = logging.getLogger()
    formatter = logs.formatter(fmt)
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
    for handler in root.handlers:
        handler.setFormatter(formatter)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}")
    return value


def _source(text: str) -> str:
    try:
        return check_location(text)
    except SourceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--volume", required=True, metavar="PATH",
                   help="the PMEM volume: its mount directory (a devdax volume's, with "
                        "dax.sock, or an fsdax file system volume's, which gets the image "
                        "file csi-pmem-weights.img), a device or a plain file; must be "
                        "writable to stage")
    p.add_argument("--source", required=True, metavar="DIR|s3://BUCKET/PREFIX/",
                   type=_source,
                   help="the model files: a directory (a read-only PVC, an image volume) "
                        "or an S3-compatible store's prefix (credentials and endpoint "
                        "from the standard AWS_* variables, e.g. from a Secret)")
    p.add_argument("--name", required=True, metavar="NAME", help="model name on the volume")
    p.add_argument("--revision", default=None, metavar="REV",
                   help="wanted revision (default: a fingerprint of the source)")
    p.add_argument("--fingerprint", choices=FINGERPRINTS, default="sample",
                   help="without --revision: sample (headers plus a few MiB of data; "
                        "for s3://, the objects' ETags and sizes; default) or full (hash "
                        "every byte of the source)")
    p.add_argument("--listen", type=parse_listen, default=("", 8081), metavar="[HOST]:PORT",
                   help="HTTP address for /readyz, /healthz, /status and /metrics (default :8081)")
    p.add_argument("--ready-file", default=None, metavar="PATH",
                   help="write this file (JSON: model, revision) while ready")
    p.add_argument("--verify-interval", type=_seconds, default=0.0, metavar="SECONDS",
                   help="re-verify every byte of the model every SECONDS (0: never)")
    p.add_argument("--verify-on-start", choices=VERIFY_MODES, default="sample",
                   help="checks of an already staged model at start: sample (at most "
                        "256 MiB of checksum chunks, headers first; default), full, none")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="copy and hash threads")
    p.add_argument("--once", action="store_true",
                   help="stage/verify, print the status as JSON and exit (0 when ready)")
    p.add_argument("--log-format", choices=("json", "text"), default="json")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    cfg = Config(volume=args.volume, source=args.source, name=args.name,
                 revision=args.revision, fingerprint=args.fingerprint,
                 listen=None if args.once else args.listen, ready_file=args.ready_file,
                 verify_interval=args.verify_interval, verify_on_start=args.verify_on_start,
                 threads=args.threads, once=args.once)
    return Sidecar(cfg).run()
