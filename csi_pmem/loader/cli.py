# PYTHON_ARGCOMPLETE_OK (argcomplete's global completion looks for this marker)
"""``csi-pmem-weights``: stage, verify, list, export and benchmark models on a volume, and
run the staging sidecar (``sidecar``: see :mod:`csi_pmem.loader.sidecar`).

Why a CLI beside the library: staging is an operator's (or a sidecar's) job, and it
must say clearly why it refuses (too small, read-only, corrupt) and how far it got.
VOLUME is a published volume directory (with ``dax.sock``), a devdax device, an fsdax
block device, a plain file (tmpfs, hugetlbfs, an emulated volume's backing file), or any
other directory, such as an fsdax file system volume's mount: its volume is then the
image file ``csi-pmem-weights.img`` in it, which ``stage`` creates and grows to fit.

What it prints: results on stdout, in the format ``-o table|json|yaml|name`` picks, by
the rule ``csi-pmem volume`` follows (a table on a terminal, JSON otherwise, so scripts
need no flag; ``--json`` stays as ``-o json``); progress (bytes, rate, ETA) on stderr
when that is a terminal or with ``--progress`` (:mod:`csi_pmem.loader.progress`); exit
codes and the conventions both command lines share are :mod:`csi_pmem.cmdline`'s. The help texts are
written out here, not taken from docstrings, so ``--help`` shows no markup.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from csi_pmem.cmdline import (
    COMPLETION_HELP,
    LOG_LEVELS,
    Exit,
    HelpFormatter,
    UsageError,
    add_output,
    add_version,
    attach_negative_values,
    default_output,
    enable_completion,
    exit_codes_epilog,
    log_level,
    quiet_broken_pipe,
    quiet_interrupt,
    stop_on_sigterm,
)
from csi_pmem.cmdline import quantity as parse_size
from csi_pmem.loader import auxfiles, sidecar, sources, staging
from csi_pmem.loader.fingerprint import FINGERPRINTS
from csi_pmem.loader.progress import Progress, wanted
from csi_pmem.sizes import MiB, describe_size, round_up
from csi_pmem.weights import errors
from csi_pmem.weights.image import volume_image
from csi_pmem.weights.layout import INDEX_AREA, read_index
from csi_pmem.weights.volume import DEFAULT_ALIGN, open_volume

EXIT_ERROR, EXIT_MISMATCH = Exit.ERROR, Exit.MISMATCH
EXIT_CODES = (Exit.OK, Exit.ERROR, Exit.USAGE, Exit.MISMATCH, Exit.UNREACHABLE,
              Exit.INTERRUPTED, Exit.TERMINATED, Exit.BROKEN_PIPE)
OUTPUT_HELP = ("output format, as csi-pmem volume's: table (the default when stdout is a "
               "terminal), json (the default otherwise, so scripts keep working; --json "
               "is the same), yaml (needs PyYAML), or name ({names}, one a line)")
SIZE_HELP = "a Kubernetes quantity: 16Gi is 16 GiB, 16G is 16*10^9 bytes"
DESCRIPTION = """\
Stage, verify, list, export and benchmark safetensors models on a persistent-memory \
volume, and run the staging sidecar (csi-pmem-weights sidecar --help).

VOLUME is a published volume directory (with dax.sock), a devdax device, an fsdax \
block device, a plain file (tmpfs, hugetlbfs, an emulated volume's backing file), or \
any other directory, such as an fsdax file system volume's mount: its volume is then \
the image file csi-pmem-weights.img in it, which stage creates and grows to fit."""


def align_size(text: str) -> int:
    """An argparse type: ``--align``, a quantity that is a power of two of at least
    4 KiB (what a mapping of the volume can be aligned to), else a usage error."""
    value = parse_size(text)
    if value < 4096 or value & (value - 1):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a power of two of at least 4Ki (e.g. 2Mi or 1Gi)")
    return value


def source_location(text: str) -> str:
    """A staging source's form checked at parse time: a bad ``s3://`` URL is a usage
    error (exit 2), not a failed stage."""
    try:
        return sources.check_location(text)
    except sources.SourceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


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
        # A flag that does not apply to this VOLUME: a usage error, as a bad value is.
        raise UsageError(f"--size applies to a plain-file VOLUME or a directory VOLUME's "
                         f"image only; {path} is neither (a devdax or fsdax device, or a "
                         "published devdax volume, has the size it was made with): drop "
                         "--size")
    with open(path, "ab") as f:
        if os.fstat(f.fileno()).st_size < size:
            f.truncate(size)


def output_format(args: argparse.Namespace) -> str:
    """``-o``, or the default both command lines share; checked before any work (a
    stage must not find out after copying that it cannot print its answer)."""
    fmt: str = args.output or default_output()
    if fmt == "yaml":
        try:
            import yaml  # noqa: F401 - only -o yaml needs PyYAML, not in the loader extra
        except ModuleNotFoundError:
            raise errors.LoaderError("-o yaml needs PyYAML, which is not installed: pip "
                                     "install pyyaml (or use -o json)") from None
    return fmt


def emit(fmt: str, doc: Any, table: str, names: list[str]) -> None:
    """Print one command's answer: ``doc`` as JSON or YAML, ``table`` for people, or
    ``names`` one a line (models, or exported files, for ``$(...)``)."""
    if fmt == "json":
        text = json.dumps(doc, indent=2, sort_keys=True)
    elif fmt == "yaml":
        import yaml

        text = yaml.safe_dump(doc, sort_keys=True, default_flow_style=False).rstrip("\n")
    elif fmt == "name":
        text = "\n".join(names)
    else:
        text = table
    if text:
        print(text)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _stage_table(result: staging.StageResult, volume: str, image: str,
                 durable: str) -> str:
    m = result.model
    lines = []
    if result.adopted:
        lines.append(f"recorded revision {m.revision} on {m.name}: the copy on the volume "
                     "is the source's content")
    if result.action == "already-staged":
        lines.append(f"{m.label()} is already staged on {volume} ({describe_size(m.size)}); "
                     f"every chunk checked, nothing copied{image}")
        return "\n".join(lines)
    if result.repair is not None:
        fixed = result.repair
        lines.append(f"repaired {m.label()}: {_count(fixed.chunks, 'chunk')} of "
                     f"{_count(len(fixed.files), 'file')}, {describe_size(result.copied)} "
                     f"copied ({describe_size(result.reused)} checked intact) in "
                     f"{result.seconds:.1f} s{image}")
        if fixed.whole:
            lines.append("  copied whole, the source no longer holding the bytes staged: "
                         + ", ".join(fixed.whole))
    else:
        rate = result.copied / max(result.seconds, 1e-9) / 1e9
        lines.append(f"staged {m.label()}: {len(m.files)} files, {describe_size(m.size)} "
                     f"({describe_size(result.copied)} copied, {describe_size(result.reused)} "
                     f"reused after verification) in {result.seconds:.1f} s "
                     f"({rate:.2f} GB/s){image}")
    lines.append(f"persisted with {durable}")
    return "\n".join(lines)


def cmd_stage(args: argparse.Namespace) -> int:
    fmt = output_format(args)
    if args.size is None and not os.path.lexists(args.volume):
        raise errors.VolumeError(
            f"{args.volume} does not exist: pass --size (e.g. --size 16Gi) to create it as "
            "a plain-file volume, or give a published volume directory, a device or an "
            "existing file")
    _plain_file(args.volume, args.size, args.align)
    with progress("stage", args) as bar, \
            staging.open_for_staging(args.volume, align=args.align, size=args.size) as vol:
        result = staging.stage(vol, args.src, name=args.name, revision=args.revision,
                               fingerprint=args.fingerprint, replace=args.replace,
                               threads=args.threads, progress=bar)
        image = f" (image {vol.image}, {describe_size(vol.size)})" if vol.image else ""
        durable = vol.persistence.detail
        where = {"volume": args.volume, "image": vol.image, "volume_size": vol.size}
    m, fixed = result.model, result.repair
    doc = {**where, "action": result.action, "model": m.name, "revision": m.revision,
           "adopted": result.adopted, "files": len(m.files), "bytes": m.size,
           "copied": result.copied, "reused": result.reused, "checked": result.checked,
           "seconds": round(result.seconds, 3),
           "persistence": None if result.action == "already-staged" else durable,
           "repaired": None if fixed is None else {
               "chunks": fixed.chunks, "files": fixed.files, "whole_files": fixed.whole,
               "bytes": fixed.copied}}
    emit(fmt, doc, _stage_table(result, args.volume, image, durable), [m.name])
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    fmt = output_format(args)
    with progress("verify", args) as bar, open_volume(args.volume) as vol:
        report = staging.verify_models(vol, args.model, threads=args.threads, progress=bar)
    lines = []
    for model, problems in report:
        lines.append(f"{model.label()}: "
                     f"{'OK' if not problems else f'{len(problems)} bad chunk(s)'}")
        lines += [f"  {p}" for p in problems]
    doc = {"volume": args.volume, "ok": not any(p for _, p in report), "models": [
        {"model": model.name, "revision": model.revision, "ok": not problems,
         "bytes": model.size,
         "bad_chunks": [{"file": p.chunk.file, "chunk": p.chunk.index,
                         "offset": p.chunk.offset, "length": p.chunk.length,
                         "algo": p.chunk.algo, "expected": p.chunk.expected, "got": p.got}
                        for p in problems]}
        for model, problems in report]}
    emit(fmt, doc, "\n".join(lines), [model.name for model, _ in report])
    return 0 if doc["ok"] else EXIT_MISMATCH


def cmd_ls(args: argparse.Namespace) -> int:
    fmt = output_format(args)
    with open_volume(args.volume) as vol:
        index = read_index(vol)
        size, align, image = vol.size, vol.align, vol.image
    models = index.models if index else []
    doc = {"volume": args.volume, "image": image, "size": size, "align": align,
           "generation": index.generation if index else 0,
           "models": [m.to_json() | {"digests": {f.name: f.digest for f in m.files}}
                      for m in models]}
    for entry in doc["models"]:
        for f in entry["files"]:
            f.pop("chunks", None)
            f.pop("partial", None)
    used = max([INDEX_AREA] + [m.end for m in models])
    where = f"{args.volume} (image {image})" if image else args.volume
    lines = [f"{where}: {describe_size(size)}, align {describe_size(align)}, "
             f"{describe_size(size - used)} free"]
    if not models:
        lines.append("  (no model staged)")
    for m in models:
        lines.append(f"  {m.label()}  [{m.state}]  {len(m.files)} files, "
                     f"{describe_size(m.size)}")
        for f in m.files:
            state = "" if f.done else "  (not copied yet)" if not f.partial else \
                f"  ({len(f.partial)} of {-(-f.length // m.chunk_size)} chunks copied)"
            lines.append(f"    {f.length:>14}  @{f.offset:<14} {f.name}{state}")
    emit(fmt, doc, "\n".join(lines), [m.name for m in models])
    return 0


def cmd_export_config(args: argparse.Namespace) -> int:
    try:
        return auxfiles.run(args)
    except errors.ChecksumError as exc:
        print(f"csi-pmem-weights: {exc}", file=sys.stderr)
        return EXIT_MISMATCH


def cmd_export(args: argparse.Namespace) -> int:
    fmt = output_format(args)
    with progress("export", args) as bar, open_volume(args.volume) as vol:
        written = staging.export(vol, args.dest, args.model, overwrite=args.overwrite,
                                 threads=args.threads, progress=bar)
    doc = {"volume": args.volume, "dest": args.dest, "files": written, "verified": True}
    emit(fmt, doc, f"exported {len(written)} files to {args.dest} (checksums verified)",
         written)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from csi_pmem.loader import bench
    from csi_pmem.loader.model import open_model

    fmt = output_format(args)
    with open_volume(args.volume) as vol:
        view = open_model(vol, args.model)
        results = bench.run_cpu(view, threads=args.threads or 12, buffers=args.buffers,
                                buffer_size=args.buffer_size, repeat=args.repeat)
    lines = [f"model {view.model.label()}: {describe_size(view.model.size)} on {args.volume} "
             f"(NUMA node {vol.numa_node if vol.numa_node is not None else 'unknown'})"]
    lines += [f"  {r.name:<36} {r.gbps:8.2f} GB/s  {r.seconds * 1e3:9.2f} ms  {r.note}"
              for r in results]
    emit(fmt, [r.as_dict() for r in results], "\n".join(lines), [])
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

    s = sub.add_parser("stage", help="copy a model (a directory or s3://) onto the volume")
    s.add_argument("src", metavar="SOURCE", type=source_location,
                   help="directory of *.safetensors and configs, or s3://BUCKET/PREFIX/ "
                        "(credentials and endpoint from the standard AWS_* variables or "
                        "files: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                        "AWS_ENDPOINT_URL_S3, AWS_MAX_ATTEMPTS)")
    s.add_argument("volume", metavar="VOLUME")
    s.add_argument("--name", help="model name (default: the directory's name, or the "
                                  "prefix's last part)")
    s.add_argument("--revision", default=None,
                   help="revision recorded with the model (default: the source's "
                        "fingerprint, the revision the staging sidecar records without "
                        "--revision, so neither copies again what the other staged)")
    s.add_argument("--fingerprint", choices=FINGERPRINTS, default="sample",
                   help="without --revision: sample (headers plus a few MiB of data; "
                        "for s3://, the objects' ETags and sizes; default) or full (hash "
                        "every byte of the source); as the sidecar's --fingerprint")
    s.add_argument("--replace", action="store_true",
                   help="discard everything on the volume first")
    s.add_argument("--size", type=parse_size,
                   help="create/grow a plain-file VOLUME (or a directory VOLUME's image "
                        f"file) to at least SIZE ({SIZE_HELP})")
    s.add_argument("--align", type=align_size,
                   help=f"override the volume align, a power of two of at least 4Ki, "
                        f"e.g. 2Mi ({SIZE_HELP})")
    common(s, model=False)
    add_output(s, OUTPUT_HELP.format(names="the model name"), json_alias=True)
    s.set_defaults(func=cmd_stage)

    v = sub.add_parser("verify", help="check every staged chunk against its checksum")
    v.add_argument("volume", metavar="VOLUME")
    common(v)
    add_output(v, OUTPUT_HELP.format(names="the names of the models checked"),
               json_alias=True)
    v.set_defaults(func=cmd_verify)

    ls = sub.add_parser("ls", help="list models, files, sizes and offsets")
    ls.add_argument("volume", metavar="VOLUME")
    add_output(ls, OUTPUT_HELP.format(names="model names"), json_alias=True)
    ls.set_defaults(func=cmd_ls)

    e = sub.add_parser("export", help="write a staged model's files back, byte-identical")
    e.add_argument("volume", metavar="VOLUME")
    e.add_argument("dest", metavar="DEST")
    e.add_argument("--overwrite", action="store_true")
    common(e)
    add_output(e, OUTPUT_HELP.format(names="the paths written"), json_alias=True)
    e.set_defaults(func=cmd_export)

    x = sub.add_parser("export-config", help="write a staged model's config and tokenizer "
                       "files (not its weights), verified: what vLLM's --hf-config-path "
                       "and --tokenizer read (docs/inference.md)")
    auxfiles.add_arguments(x)
    common(x, model=False, bar=False)
    x.set_defaults(func=cmd_export_config)

    b = sub.add_parser("bench", help="CPU-path throughput (views, memcpy, verify)")
    b.add_argument("volume", metavar="VOLUME")
    b.add_argument("--buffers", type=int, default=24)
    b.add_argument("--buffer-size", type=parse_size, default=16 * MiB,
                   help=f"bounce buffer size (default 16Mi; {SIZE_HELP})")
    b.add_argument("--repeat", type=int, default=3)
    add_output(b, "output format: table (the default when stdout is a terminal), json "
               "(the default otherwise) or yaml", formats=("table", "json", "yaml"),
               json_alias=True)
    common(b, bar=False)
    b.set_defaults(func=cmd_bench)

    sc = sub.add_parser("sidecar", help="keep a model staged and verified; serve /readyz "
                        "(a native sidecar's entrypoint)")
    sidecar.add_arguments(sc)
    sc.set_defaults(func=cmd_sidecar)
    return p


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C or SIGTERM anywhere, not only in the command: what was copied and verified
    # stays. (The sidecar installs its own SIGTERM handler: it exits 0 at once.)
    with stop_on_sigterm(), \
            quiet_interrupt("csi-pmem-weights", "; run the same command again to resume"):
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
    except UsageError as exc:
        print(f"csi-pmem-weights: error: {exc}", file=sys.stderr)
        return Exit.USAGE
    except sources.SourceUnreachableError as exc:
        print(f"csi-pmem-weights: error: {exc}", file=sys.stderr)
        return Exit.UNREACHABLE
    except errors.LoaderError as exc:
        print(f"csi-pmem-weights: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
