"""Command line: ``csi-pmem serve`` runs the driver, ``csi-pmem volume ...`` talks to it.

The ``volume`` commands are a small CSI client over the driver's socket so a newcomer
can create, publish and inspect volumes without Kubernetes; they send exactly the RPCs
external-provisioner and kubelet would send.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from csi_pmem import config
from csi_pmem.errors import CsiPmemError

USER_ERROR = 2
NOT_INSTALLED = 1
# What the `driver` extra installs, by top-level module (protobuf is google.protobuf):
# an install without it (`pip install csi-pmem[loader]`, an inference pod's) runs
# `serve` and `volume` to a one-line "install csi-pmem[driver]", not a traceback.
DRIVER_MODULES = ("grpc", "google", "prometheus_client", "pyudev")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="csi-pmem", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the CSI driver (Identity, Controller, Node)")
    config.add_serve_flags(serve)
    from csi_pmem.gpucopy import main as gpu_copy

    gpu_copy.add_flags(sub.add_parser(
        "gpu-copy", help="run the node's GPU copy service (weights from published volumes "
                         "to pods' GPU memory)"))

    vol = sub.add_parser("volume", help="create, list, publish ... volumes over the CSI socket")
    vol.add_argument("--endpoint", default=os.environ.get(config.env_name("endpoint"),
                                                          config.DEFAULTS["endpoint"]),
                     help="driver endpoint [env CSI_PMEM_ENDPOINT]")
    vol.add_argument("--timeout", type=float, default=120, help="seconds per call")
    vsub = vol.add_subparsers(dest="action", required=True)
    c = vsub.add_parser("create", help="CreateVolume")
    c.add_argument("name")
    c.add_argument("--size", required=True,
                   help="minimum usable size, a Kubernetes quantity: 1Gi is 1 GiB, 1G is "
                        "10^9 bytes")
    c.add_argument("--limit", default="0", help="maximum size, a quantity (0: none)")
    c.add_argument("--param", "-p", action="append", default=[], metavar="KEY=VALUE",
                   help="StorageClass parameter (deviceMode, numaNode, align, eraseOnDelete)")
    _access_flags(c)
    vsub.add_parser("list", help="ListVolumes")
    d = vsub.add_parser("delete", help="DeleteVolume")
    d.add_argument("volume_id")
    p = vsub.add_parser("publish", help="NodePublishVolume (devdax: mounts volume.json and "
                        "dax.sock; fsdax: binds the device or the staged file system)")
    p.add_argument("volume_id")
    p.add_argument("target")
    p.add_argument("--readonly", action="store_true")
    p.add_argument("--pod-uid", default="", help="only processes of this pod may get the fd")
    p.add_argument("--staging", default="", help="staging path of an fsdax file system")
    _access_flags(p)
    st = vsub.add_parser("stage", help="NodeStageVolume (fsdax: mkfs once, mount with -o dax)")
    st.add_argument("volume_id")
    st.add_argument("staging")
    _access_flags(st)
    ust = vsub.add_parser("unstage", help="NodeUnstageVolume")
    ust.add_argument("volume_id")
    ust.add_argument("staging")
    u = vsub.add_parser("unpublish", help="NodeUnpublishVolume")
    u.add_argument("volume_id")
    u.add_argument("target")
    cap = vsub.add_parser("capacity", help="GetCapacity")
    cap.add_argument("--param", "-p", action="append", default=[], metavar="KEY=VALUE")
    s = vsub.add_parser("stats", help="NodeGetVolumeStats")
    s.add_argument("volume_id")
    s.add_argument("target")
    i = vsub.add_parser("inspect", help="connect to a published volume's dax.sock, map it and "
                        "report what a pod would get (no gRPC)")
    i.add_argument("target")
    vsub.add_parser("info", help="GetPluginInfo, Probe and NodeGetInfo")
    return ap


def _access_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block", action="store_true",
                        help="block access type (fsdax volumes only)")
    parser.add_argument("--fs-type", default="", help="fsdax file system: ext4 (default) or xfs")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            from csi_pmem import logs, server

            cfg = config.from_args(args)
            logs.setup(cfg.log_format, cfg.log_level)
            return server.serve(cfg)
        if args.command == "gpu-copy":
            from csi_pmem.gpucopy import main as gpu_copy

            return gpu_copy.run(args)
        from csi_pmem import client
        from csi_pmem.daxclient import DaxSocketError

        try:
            result = client.run(args)
        except DaxSocketError as exc:
            raise client.ClientError(str(exc)) from None
    except CsiPmemError as exc:
        print(f"csi-pmem: {exc}", file=sys.stderr)
        return USER_ERROR
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in DRIVER_MODULES:
            raise
        print(f"csi-pmem: {args.command} needs the driver's dependencies, and {exc.name} is "
              "not installed: pip install 'csi-pmem[driver]'", file=sys.stderr)
        return NOT_INSTALLED
    if result is not None:
        try:
            print(json.dumps(result, indent=2, sort_keys=True))
        except BrokenPipeError:  # `csi-pmem volume list | head`
            sys.stderr.close()
    return 0
