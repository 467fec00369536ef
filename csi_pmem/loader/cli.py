# PYTHON_ARGCOMPLETE_OK (argcomplete's global completion looks for this marker)
"""``csi-pmem-weights``: stage, verify, list, export and benchmark models on a volume, and
run the staging sidecar (``sidecar``: see :mod:`csi_pmem.loader.sidecar`).

Why a CLI beside the library: staging is an operator's (or a sidecar's) job, and it
must say clearly why it refuses (too small, read-only, corrupt) and how far it got.
VOLUME is a published volume directory (with ``dax.sock``), a devdax device, an fsdax
block device, a plain file (tmpfs, hugetlbfs, an emulated volume's backing file), or any
other directory, such as an fsdax file system volume's mount: its volume is then the
image file ``csi-pmem-weights.img`` in it, which ``stage`` creates and grows to fit.

What it prints: results on stdout; progress (bytes, rate, ETA) on stderr when that is
a terminal or with ``--progress`` (:mod:`csi_pmem.loader.progress`); exit codes and the
conventions both command lines share are :mod:`csi_pmem.cmdline`'s. The help texts are
written out here, not taken from docstrings, so ``--help`` shows no markup.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from csi_pmem.cmdline import (
    COMPLETION_HELP,
    LOG_LEVELS,
    Exit,
    HelpFormatter,
    add_version,
    attach_negative_values,
    enable_completion,
    exit_codes_epilog,
    log_level,
    quiet_broken_pipe,
    quiet_interrupt,
)
from csi_pmem.cmdline import quantity as parse_size
from csi_pmem.loader import sidecar, staging
from csi_pmem.loader.progress import Progress, wanted
from csi_pmem.sizes import MiB, describe_size, round_up
from csi_pmem.weights import errors
from csi_pmem.weights.image import volume_image
from csi_pmem.weights.layout import INDEX_AREA, read_index
from csi_pmem.weights.volume import DEFAULT_ALIGN, open_volume

EXIT_ERROR, EXIT_MISMATCH = Exit.ERROR, Exit.MISMATCH
EXIT_CODES = (Exit.OK, Exit.ERROR, Exit.USAGE, Exit.MISMATCH, Exit.INTERRUPTED,
              Exit.BROKEN_PIPE)
SIZE_HELP = "a Kubernetes quantity: 16Gi is 16 GiB, 16G is 16*10^9 bytes"
DESCRIPTION = """\
Stage, verify, list, export and benchmark safetensors models on a persistent-memory \
volume, and run the staging sidecar (csi-pmem-weights sidecar --help).

VOLUME is a published volume directory (with dax.sock), a devdax device, an fsdax \
block device, a plain file (tmpfs, hugetlbfs, an emulated volume's backing file), or \
any other directory, such as an fsdax file system volume's mount: its volume is then \
the image file csi-pmem-weights.img in it, which stage creates and grows to fit."""


def progress(verb: str, args: argparse.Namespace) -> Progress:
    return Progress(verb, wanted(args.progress))


def _plain_file(path: str, size: int | None, align: int | None) -> None:
    """Create or grow a plain-file volume when --size is given (tmpfs, hugetlbfs), to at
    least ``size`` rounded up to the align (``--size 16G`` is 16*10^9 bytes, no multiple
    of 2 MiB), as a directory volume's image is."""
    if size is None or volume_image(path) is not None:
        return  # a directory volume's image is sized by open_for_staging
    size = round_up(size, align or DEFAULT_ALIGN)
    if os.path.exists(path) and not os.path.isfile(path):
        raise errors.VolumeError(f"--size applies to plain files only; {path} is not one")
    with open(path, "ab") as f:
        if os.fstat(f.fileno()).st_size < size:
            f.truncate(size)


def cmd_stage(args: argparse.Namespace) -> int:
    _plain_file(args.volume, args.size, args.align)
    with progress("stage", args) as bar, \
            staging.open_for_staging(args.volume, align=args.align, size=args.size) as vol:
        result = staging.stage(vol, args.src, name=args.name, revision=args.revision,
                               replace=args.replace, threads=args.threads, progress=bar)
        image = f" (image {vol.image}, {describe_size(vol.size)})" if vol.image else ""
        durable = vol.persistence.detail
    m = result.model
    if result.already:
        print(f"{m.label()} is already staged on {args.volume} ({describe_size(m.size)}); "
              f"nothing copied{image}")
    else:
        rate = result.copied / max(result.seconds, 1e-9) / 1e9
        print(f"staged {m.label()}: {len(m.files)} files, {describe_size(m.size)} "
              f"({describe_size(result.copied)} copied, {describe_size(result.reused)} reused "
              f"after verification) in {result.seconds:.1f} s ({rate:.2f} GB/s){image}")
        print(f"persisted with {durable}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with progress("verify", args) as bar, open_volume(args.volume) as vol:
        report = staging.verify(vol, args.model, threads=args.threads, progress=bar)
    bad = 0
    for label, problems in report.items():
        print(f"{label}: {'OK' if not problems else f'{len(problems)} bad chunk(s)'}")
        for p in problems:
            print(f"  {p}")
        bad += len(problems)
    return EXIT_MISMATCH if bad else 0


def cmd_ls(args: argparse.Namespace) -> int:
    with open_volume(args.volume) as vol:
        index = read_index(vol)
        size, align, image = vol.size, vol.align, vol.image
    models = index.models if index else []
    if args.json:
        doc = {"volume": args.volume, "image": image, "size": size, "align": align,
               "generation": index.generation if index else 0,
               "models": [m.to_json() | {"digests": {f.name: f.digest for f in m.files}}
                          for m in models]}
        for m in doc["models"]:
            for f in m["files"]:
                f.pop("chunks", None)
        print(json.dumps(doc, indent=1))
        return 0
    used = max([INDEX_AREA] + [m.end for m in models])
    where = f"{args.volume} (image {image})" if image else args.volume
    print(f"{where}: {describe_size(size)}, align {describe_size(align)}, "
          f"{describe_size(size - used)} free")
    if not models:
        print("  (no model staged)")
    for m in models:
        print(f"  {m.label()}  [{m.state}]  {len(m.files)} files, {describe_size(m.size)}")
        for f in m.files:
            state = "" if f.done else "  (not copied yet)"
            print(f"    {f.length:>14}  @{f.offset:<14} {f.name}{state}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    with progress("export", args) as bar, open_volume(args.volume) as vol:
        written = staging.export(vol, args.dest, args.model, overwrite=args.overwrite,
                                 threads=args.threads, progress=bar)
    print(f"exported {len(written)} files to {args.dest} (checksums verified)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from csi_pmem.loader import bench
    from csi_pmem.loader.model import open_model

    with open_volume(args.volume) as vol:
        view = open_model(vol, args.model)
        results = bench.run_cpu(view, threads=args.threads or 12, buffers=args.buffers,
                                buffer_size=args.buffer_size, repeat=args.repeat)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=1))
    else:
        print(f"model {view.model.label()}: {describe_size(view.model.size)} on {args.volume} "
              f"(NUMA node {vol.numa_node if vol.numa_node is not None else 'unknown'})")
        for r in results:
            print(f"  {r.name:<36} {r.gbps:8.2f} GB/s  {r.seconds * 1e3:9.2f} ms  {r.note}")
    return 0


def cmd_sidecar(args: argparse.Namespace) -> int:
    return sidecar.run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="csi-pmem-weights", description=DESCRIPTION, formatter_class=HelpFormatter,
        epilog=exit_codes_epilog(EXIT_CODES, COMPLETION_HELP.format(prog="csi-pmem-weights")))
    add_version(p)
    p.add_argument("--log-level", default="WARNING", type=log_level,
                   metavar="{" + ",".join(lv.lower() for lv in LOG_LEVELS) + "}",
                   help="log messages from this level up on stderr (default: warning)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sp: argparse.ArgumentParser, model: bool = True, bar: bool = True) -> None:
        sp.add_argument("--threads", type=int, default=None, help="worker threads")
        if not bar:
            sp.set_defaults(progress=False)
        else:
            sp.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                            help="bytes, rate and ETA on stderr (default: when stderr is "
                                 "a terminal)")
            sp.add_argument("--quiet", "-q", dest="progress", action="store_false",
                            help="the same as --no-progress")
        if model:
            sp.add_argument("--model", help="model name (default: the only one)")

    s = sub.add_parser("stage", help="copy a model directory onto the volume")
    s.add_argument("src", metavar="SRC_DIR", help="directory of *.safetensors and configs")
    s.add_argument("volume", metavar="VOLUME")
    s.add_argument("--name", help="model name (default: SRC_DIR's name)")
    s.add_argument("--revision", default="", help="revision recorded with the model")
    s.add_argument("--replace", action="store_true",
                   help="discard everything on the volume first")
    s.add_argument("--size", type=parse_size,
                   help="create/grow a plain-file VOLUME (or a directory VOLUME's image "
                        f"file) to at least SIZE ({SIZE_HELP})")
    s.add_argument("--align", type=parse_size,
                   help=f"override the volume align, e.g. 2Mi ({SIZE_HELP})")
    common(s, model=False)
    s.set_defaults(func=cmd_stage)

    v = sub.add_parser("verify", help="check every staged chunk against its checksum")
    v.add_argument("volume", metavar="VOLUME")
    common(v)
    v.set_defaults(func=cmd_verify)

    ls = sub.add_parser("ls", help="list models, files, sizes and offsets")
    ls.add_argument("volume", metavar="VOLUME")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_ls)

    e = sub.add_parser("export", help="write a staged model's files back, byte-identical")
    e.add_argument("volume", metavar="VOLUME")
    e.add_argument("dest", metavar="DEST")
    e.add_argument("--overwrite", action="store_true")
    common(e)
    e.set_defaults(func=cmd_export)

    b = sub.add_parser("bench", help="CPU-path throughput (views, memcpy, verify)")
    b.add_argument("volume", metavar="VOLUME")
    b.add_argument("--buffers", type=int, default=24)
    b.add_argument("--buffer-size", type=parse_size, default=16 * MiB,
                   help=f"bounce buffer size (default 16Mi; {SIZE_HELP})")
    b.add_argument("--repeat", type=int, default=3)
    b.add_argument("--json", action="store_true")
    common(b, bar=False)
    b.set_defaults(func=cmd_bench)

    sc = sub.add_parser("sidecar", help="keep a model staged and verified; serve /readyz "
                        "(a native sidecar's entrypoint)")
    sidecar.add_arguments(sc)
    sc.set_defaults(func=cmd_sidecar)
    return p


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C anywhere, not only in the command: what was copied and verified stays.
    with quiet_interrupt("csi-pmem-weights", "; run the same command again to resume"):
        parser = build_parser()
        enable_completion(parser)
        args = parser.parse_args(attach_negative_values(
            parser, sys.argv[1:] if argv is None else argv))
        logging.basicConfig(level=args.log_level, stream=sys.stderr,
                            format="%(levelname)s %(name)s: %(message)s")
        with quiet_broken_pipe():
            return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except errors.LoaderError as exc:
        print(f"csi-pmem-weights: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
