# PYTHON_ARGCOMPLETE_OK (argcomplete's global completion looks for this marker)
"""Command line: ``csi-pmem serve`` runs the driver, ``csi-pmem volume ...`` talks to it.

The ``volume`` commands are a small CSI client over the driver's socket so a newcomer
can create, publish and inspect volumes without Kubernetes; they send exactly the RPCs
external-provisioner and kubelet would send. What they print is
:mod:`csi_pmem.client.output`'s (a table on a terminal, JSON for scripts); what they
exit with is :func:`exit_code`'s table over :class:`csi_pmem.cmdline.Exit`. The help
texts are written out here, not taken from docstrings, so ``--help`` shows no markup.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from csi_pmem.client import output as volume_output
from csi_pmem.cmdline import (
    COMPLETION_HELP,
    Exit,
    HelpFormatter,
    UsageError,
    add_version,
    attach_negative_values,
    enable_completion,
    exit_codes_epilog,
    from_env,
    positive_quantity,
    positive_seconds,
    quantity,
    quiet_broken_pipe,
    quiet_interrupt,
)
from csi_pmem.driver import config
from csi_pmem.errors import CsiPmemError, InvalidArgument

# What the `driver` extra installs, by top-level module (protobuf is google.protobuf):
# an install without it (`pip install csi-pmem[loader]`, an inference pod's) runs
# `serve` and `volume` to a one-line "install csi-pmem[driver]", not a traceback.
DRIVER_MODULES = ("grpc", "google", "prometheus_client", "pyudev", "yaml")
EXIT_CODES = (Exit.OK, Exit.ERROR, Exit.USAGE, Exit.REFUSED, Exit.UNREACHABLE,
              Exit.INTERRUPTED, Exit.BROKEN_PIPE)
DESCRIPTION = ("csi-pmem serve runs the CSI driver; csi-pmem volume ... talks to it over "
               "its socket, sending the RPCs external-provisioner and kubelet would send.")
VOLUME_EPILOG = """output: -o table is the default when stdout is a terminal, -o json otherwise, so
scripts that read the JSON keep working; -o name prints only volume ids, e.g.
  ID=$(csi-pmem volume create llama --size 1Gi -o name)

--endpoint and --timeout go before or after the action (csi-pmem volume list
--endpoint ...); given twice, the last one counts."""
DEFAULT_TIMEOUT = 120.0
# Said on Ctrl-C: the driver goes on with a request it already has, so a script knows
# what to check (create and delete are idempotent: running them again is safe).
INTERRUPTED_NOTE = ("; a request the driver already received may still complete (create "
                    "and delete may be run again)")


def key_value(text: str) -> tuple[str, str]:
    """An argparse type: a StorageClass parameter ``KEY=VALUE``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"parameter {text!r} must look like KEY=VALUE, "
                                         "e.g. numaNode=1")
    return key, value


def _complete_volume_ids(prefix: str, parsed_args: argparse.Namespace,
                         **_: Any) -> list[str]:
    """argcomplete's completer for VOLUME_ID: the ids the driver lists."""
    from csi_pmem.client import calls as client

    try:
        parsed_args.endpoint = endpoint(parsed_args)
    except UsageError:
        return []  # a completion must never print an error into the command line
    return [v for v in client.volume_ids(parsed_args) if v.startswith(prefix)]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="csi-pmem", description=DESCRIPTION, formatter_class=HelpFormatter,
        epilog=exit_codes_epilog(EXIT_CODES, COMPLETION_HELP.format(prog="csi-pmem")))
    add_version(ap)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the CSI driver (Identity, Controller, Node)",
                           description="Run the CSI driver (Identity, Controller, Node). "
                           "Every flag is also an environment variable CSI_PMEM_<FLAG>.")
    config.add_serve_flags(serve)
    from csi_pmem.gpucopy import main as gpu_copy

    gpu_copy.add_flags(sub.add_parser(
        "gpu-copy", help="run the node's GPU copy service (weights from published volumes "
                         "to pods' GPU memory)"))

    vol = sub.add_parser(
        "volume", help="create, list, publish ... volumes over the CSI socket",
        description="A CSI client over the driver's socket: create, publish and inspect "
                    "volumes without Kubernetes.", formatter_class=HelpFormatter,
        epilog=exit_codes_epilog(EXIT_CODES, VOLUME_EPILOG),
        parents=[_connection_flags(defaults=True)])
    conn = _connection_flags(defaults=False)
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("-o", "--output", choices=volume_output.FORMATS, default=None,
                     help=volume_output.FORMAT_HELP)
    vsub = vol.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, help: str) -> argparse.ArgumentParser:
        return vsub.add_parser(name, help=help, description=help, parents=[out, conn],
                               formatter_class=HelpFormatter)

    def volume_id(parser: argparse.ArgumentParser, several: bool = False) -> None:
        arg = parser.add_argument("volume_id", metavar="VOLUME_ID",
                                  nargs="+" if several else None)
        arg.completer = _complete_volume_ids  # type: ignore[attr-defined]

    c = action("create", "CreateVolume: carve a volume of at least --size")
    c.add_argument("name")
    c.add_argument("--size", required=True, type=positive_quantity,
                   help="minimum usable size, more than 0, a Kubernetes quantity: 1Gi is "
                        "1 GiB, 1G is 10^9 bytes")
    c.add_argument("--limit", default=0, type=quantity,
                   help="maximum size, a quantity (0: none)")
    c.add_argument("--param", "-p", action="append", default=[], metavar="KEY=VALUE",
                   type=key_value,
                   help="StorageClass parameter (deviceMode, numaNode, align, eraseOnDelete)")
    _access_flags(c)
    action("list", "ListVolumes, with each volume's condition")
    # Not "zeroes, then frees": DeleteVolume answers the same whether the erase is over
    # or still running, so no --wait here could know when the space is back.
    d = action("delete", "DeleteVolume of each VOLUME_ID, in turn: the volume is gone "
               "when this returns; with "
               "eraseOnDelete (the default) its space is zeroed, and free only once that "
               "is done: the driver waits for it up to its --delete-wait-seconds (1 s), "
               "then zeroes on in the background. An id the driver does not know is "
               "reported as not found, nothing to do (DeleteVolume is idempotent)")
    volume_id(d, several=True)
    p = action("publish", "NodePublishVolume (devdax: mounts volume.json and dax.sock; "
               "fsdax: binds the device or the staged file system)")
    volume_id(p)
    p.add_argument("target")
    p.add_argument("--readonly", action="store_true")
    p.add_argument("--pod-uid", default="", help="only processes of this pod may get the fd")
    p.add_argument("--staging", default="", help="staging path of an fsdax file system")
    _access_flags(p)
    st = action("stage", "NodeStageVolume (fsdax: mkfs once, mount with -o dax; a devdax "
                "volume, or an fsdax one with --block, has nothing to stage)")
    volume_id(st)
    st.add_argument("staging")
    _access_flags(st)
    ust = action("unstage", "NodeUnstageVolume")
    volume_id(ust)
    ust.add_argument("staging")
    u = action("unpublish", "NodeUnpublishVolume")
    volume_id(u)
    u.add_argument("target")
    cap = action("capacity", "GetCapacity: free bytes and the largest volume that fits")
    cap.add_argument("--param", "-p", action="append", default=[], metavar="KEY=VALUE",
                     type=key_value, help="StorageClass parameter, e.g. numaNode=1")
    s = action("stats", "NodeGetVolumeStats: bytes (and inodes on fsdax) and the condition")
    volume_id(s)
    s.add_argument("target")
    i = action("inspect", "connect to a published volume's dax.sock, map it and report "
               "what a pod would get (no gRPC)")
    i.add_argument("target")
    action("info", "GetPluginInfo, Probe and NodeGetInfo")
    return ap


def _connection_flags(defaults: bool) -> argparse.ArgumentParser:
    """--endpoint and --timeout, for `volume` (``defaults``) and for every action, so they
    go before the action and after it, as kubectl's and helm's flags go anywhere.

    An action's flags default to SUPPRESS: one that was not given leaves the attribute
    alone, so a value given before the action is not overwritten by the action's
    default; given in both places, the later one counts. Two parsers, not one shared
    by both levels: argparse shares a parent's actions, and a default set on one level
    would be set on the other. The endpoint's default (None) is resolved by
    :func:`endpoint`, which reads CSI_PMEM_ENDPOINT only then."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--endpoint", default=None if defaults else argparse.SUPPRESS,
                   type=config.endpoint,
                   help=f"driver endpoint [env {config.env_name('endpoint')}, default "
                        f"{config.DEFAULTS['endpoint']}]")
    p.add_argument("--timeout", default=DEFAULT_TIMEOUT if defaults else argparse.SUPPRESS,
                   type=positive_seconds, metavar="SECONDS",
                   help=f"seconds per call, more than 0 [default {DEFAULT_TIMEOUT:g}]")
    return p


def endpoint(args: argparse.Namespace) -> str:
    """--endpoint when given, else CSI_PMEM_ENDPOINT (a bad one is a usage error that
    names the variable), else the default."""
    return from_env(getattr(args, "endpoint", None), config.env_name("endpoint"),
                    config.DEFAULTS["endpoint"], config.endpoint)


def _access_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block", action="store_true",
                        help="block access type (fsdax volumes only)")
    parser.add_argument("--fs-type", default="", help="fsdax file system: ext4 (default) or xfs")


def exit_code(exc: BaseException) -> Exit:
    """The one table from what went wrong to the exit status (:data:`cmdline.MEANING`
    says what each status tells a script; ``--help`` lists them)."""
    from csi_pmem.driver.instance import AlreadyRunning

    table: list[tuple[type[BaseException], Exit]] = [(volume_output.OutputError, Exit.USAGE),
                                                     (AlreadyRunning, Exit.USAGE),
                                                     (UsageError, Exit.USAGE)]
    try:
        from csi_pmem.client import calls as client
    except ModuleNotFoundError:  # no driver extra: no client, so none of its errors
        pass
    else:
        table += [(client.DriverUnreachable, Exit.UNREACHABLE),
                  (client.DriverRefused, Exit.REFUSED)]
    return next((code for cls, code in table if isinstance(exc, cls)), Exit.ERROR)


def main(argv: list[str] | None = None) -> int:
    with quiet_interrupt("csi-pmem", INTERRUPTED_NOTE):
        parser = build_parser()
        enable_completion(parser)
        args = parser.parse_args(attach_negative_values(
            parser, sys.argv[1:] if argv is None else argv))
        with quiet_broken_pipe():
            return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command == "serve":
            from csi_pmem import logs
            from csi_pmem.driver import server
            from csi_pmem.driver.backends.emulated import parse_regions
            from csi_pmem.driver.backends.memory import PAGES, PAGES_OF
            from csi_pmem.driver.backends.memory_sizing import (
                check_huge_pages,
                fit_pools,
                node_memory,
                parse_pools,
            )

            cfg = config.from_args(args, {"emulated_regions": parse_regions,
                                          "memory_pools": parse_pools})
            if "memory" in cfg.backends:  # refused before anything is mounted

                def offered(pages: str) -> None:
                    if pages not in PAGES_OF[cfg.memory_fs]:
                        raise InvalidArgument(
                            f"{cfg.memory_fs} pools offer {' or '.join(PAGES_OF[cfg.memory_fs])}"
                            f" pages, not {pages}")

                config.check_value(args, "memory_pages", cfg.memory_pages, offered)
                sized = config.check_value(
                    args, "memory_pools", cfg.memory_pools,
                    lambda spec: fit_pools(parse_pools(spec), node_memory()))
                if cfg.memory_fs == "hugetlbfs":  # the node's reserved huge pages
                    config.check_value(args, "memory_pools", sized, lambda s: check_huge_pages(
                        s, PAGES[cfg.memory_pages]))
            logs.setup(cfg.log_format, cfg.log_level)
            return server.serve(cfg)
        if args.command == "gpu-copy":
            from csi_pmem.gpucopy import main as gpu_copy

            return gpu_copy.run(args)
        from csi_pmem.client import calls as client
        from csi_pmem.daxclient import DaxSocketError

        args.endpoint = endpoint(args)
        fmt = args.output or volume_output.default_format()
        volume_output.check(args.action, fmt)
        try:
            result = client.run(args)
        except DaxSocketError as exc:
            raise client.ClientError(str(exc)) from None
        text = volume_output.render(args.action, result, fmt)
    except CsiPmemError as exc:
        print(f"csi-pmem: {exc}", file=sys.stderr)
        return exit_code(exc)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in DRIVER_MODULES:
            raise
        print(f"csi-pmem: {args.command} needs the driver's dependencies, and {exc.name} is "
              "not installed: pip install 'csi-pmem[driver]'", file=sys.stderr)
        return exit_code(exc)
    if text:
        print(text)
    return Exit.OK
