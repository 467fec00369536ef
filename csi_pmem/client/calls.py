"""The ``csi-pmem volume`` client: CSI calls over the driver socket.

Each action returns the answer as the CSI messages' JSON mapping
(:mod:`csi_pmem.client.output` prints it as a table, JSON, YAML or bare ids). A gRPC
error becomes :class:`DriverRefused` (the driver answered with a status) or
:class:`DriverUnreachable` (no answer), which the command line maps to distinct exit
codes (:mod:`csi_pmem.cmdline`).
"""

from __future__ import annotations

import argparse
import mmap
import os

import grpc
from google.protobuf import json_format

from csi_pmem.csi import csi_pb2, csi_pb2_grpc
from csi_pmem.driver.config import grpc_address
from csi_pmem.errors import CsiPmemError

Mode = csi_pb2.VolumeCapability.AccessMode


class ClientError(CsiPmemError):
    """The request could not be made on this side (a dax.sock that refuses, ...)."""


class DriverRefused(ClientError):
    """The driver answered with a gRPC error status; ``str(e)`` starts with its name."""


class DriverUnreachable(ClientError):
    """No answer: nothing listens at the endpoint, or none within the timeout."""


# gRPC's own words when it cannot connect (the driver never says them): told apart from
# an UNAVAILABLE the driver answers on purpose (a back end that cannot carve volumes).
_NO_CONNECTION = "failed to connect to all addresses"


def _cap(readonly: bool = False, args: argparse.Namespace | None = None,
         ) -> csi_pb2.VolumeCapability:
    """A mount capability (devdax, or an fsdax file system with --fs-type), or block."""
    mode = Mode(mode=Mode.SINGLE_NODE_READER_ONLY if readonly else Mode.SINGLE_NODE_WRITER)
    if args is not None and getattr(args, "block", False):
        return csi_pb2.VolumeCapability(block=csi_pb2.VolumeCapability.BlockVolume(),
                                        access_mode=mode)
    fs_type = getattr(args, "fs_type", "") if args is not None else ""
    return csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(fs_type=fs_type or ""), access_mode=mode)


def _dict(msg) -> dict:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def inspect(target: str) -> dict:
    """What a pod gets at ``target``; :class:`DriverUnreachable` when nothing answers on
    its dax.sock (the driver is down or not serving the volume yet: worth a retry, as
    every other action's "no answer"), :class:`ClientError` for everything else."""
    from csi_pmem.daxclient import METADATA_FILE, DaxSocketError, open_volume

    try:
        meta, fd = open_volume(target)
    except DaxSocketError as exc:
        cause = exc.__cause__
        # volume.json without its dax.sock: a publication whose driver is restarting.
        restarting = isinstance(cause, FileNotFoundError) \
            and os.path.isfile(os.path.join(target, METADATA_FILE))
        if restarting:
            raise DriverUnreachable(
                f"{target} holds a published volume's {METADATA_FILE} but no dax.sock: the "
                "csi-pmem node plugin is not running, or has not served this volume again "
                "since it restarted; retry in a few seconds") from None
        if isinstance(cause, ConnectionRefusedError | TimeoutError):
            raise DriverUnreachable(str(exc)) from None
        raise ClientError(str(exc)) from None
    try:
        try:
            size = int(meta["usable_size"])
            prot = mmap.PROT_READ | (0 if meta.get("readonly") else mmap.PROT_WRITE)
            with mmap.mmap(fd, size, mmap.MAP_SHARED, prot) as mm:
                first = mm[:16].hex()
        except (KeyError, TypeError, ValueError) as exc:
            raise ClientError(f"{target}: volume.json has no usable size ({exc})") from exc
        except OSError as exc:
            raise ClientError(f"cannot map the volume at {target}: {exc.strerror}") from exc
        return {"metadata": meta, "mapped_bytes": size, "first_16_bytes": first,
                "fd_flags": "O_RDONLY" if meta.get("readonly") else "O_RDWR"}
    finally:
        os.close(fd)


def run(args: argparse.Namespace) -> dict:
    if args.action == "inspect":
        return inspect(args.target)
    address, path = grpc_address(args.endpoint)
    if path and not os.path.exists(path):
        raise DriverUnreachable(f"no driver socket at {path}: is the driver running "
                                "(`make run`), and is --endpoint / CSI_PMEM_ENDPOINT right?")
    with grpc.insecure_channel(address) as channel:
        try:
            return _call(args, channel)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            message = f"{code.name}: {details}"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DriverUnreachable(f"{message} (no answer from {args.endpoint} within "
                                        f"--timeout {args.timeout:g} s)") from None
            if code == grpc.StatusCode.UNAVAILABLE and _NO_CONNECTION in details:
                raise DriverUnreachable(f"{message} (is the driver running at "
                                        f"{args.endpoint}?)") from None
            raise DriverRefused(message) from None


def volume_ids(args: argparse.Namespace) -> list[str]:
    """The driver's volume ids, for shell completion: quick, and empty on any failure
    (a completion must never print an error into the user's command line)."""
    try:
        quick = argparse.Namespace(endpoint=args.endpoint,
                                   timeout=min(getattr(args, "timeout", 2.0), 2.0))
        return [e["volume"]["volume_id"] for e in list_volumes(quick)["entries"]]
    except Exception:  # whatever went wrong, completion offers nothing
        return []


def list_volumes(args: argparse.Namespace) -> dict:
    address, _ = grpc_address(args.endpoint)
    with grpc.insecure_channel(address) as channel:
        return _list(csi_pb2_grpc.ControllerStub(channel), args.timeout)


def _list(ctl: csi_pb2_grpc.ControllerStub, timeout: float) -> dict:
    entries, token = [], ""
    while True:
        resp = ctl.ListVolumes(csi_pb2.ListVolumesRequest(starting_token=token),
                               timeout=timeout)
        entries += [_dict(e) for e in resp.entries]
        token = resp.next_token
        if not token:
            return {"entries": entries}


def _found(ctl: csi_pb2_grpc.ControllerStub, vid: str,
           timeout: float) -> csi_pb2.ControllerGetVolumeResponse | None:
    """ControllerGetVolume of ``vid``; None when the driver answers NOT_FOUND."""
    try:
        return ctl.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vid),
                                       timeout=timeout)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise


def _context(ctl: csi_pb2_grpc.ControllerStub, vid: str, timeout: float) -> dict[str, str]:
    """The volume's volume_context (empty if it cannot be told)."""
    try:
        got = _found(ctl, vid, timeout)
    except grpc.RpcError:
        return {}
    return dict(got.volume.volume_context) if got is not None else {}



def _delete(ctl: csi_pb2_grpc.ControllerStub, ids: list[str], timeout: float) -> dict:
    """DeleteVolume of each id in turn (as kubectl delete takes several names). The
    RPC stays idempotent, so it is sent for an unknown id too (it also finishes a delete
    a crash cut short), but the answer tells a deleted volume from one that was not
    there. The first refusal stops, naming what was deleted before it."""
    deleted: list[str] = []
    not_found: list[str] = []
    for vid in ids:
        try:
            there = _found(ctl, vid, timeout) is not None
            ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vid), timeout=timeout)
        except grpc.RpcError as exc:
            if deleted or not_found:
                done = ", ".join(deleted + not_found)
                raise _StoppedAt(exc, f"deleting {vid}; done before it: {done}") from None
            raise
        (deleted if there else not_found).append(vid)
    return {"deleted": deleted, "not_found": not_found}


class _StoppedAt(grpc.RpcError):
    """A refusal in the middle of several requests: the code is the driver's, the
    details say which request it was and what was done before it."""

    def __init__(self, cause: grpc.RpcError, where: str) -> None:
        super().__init__()
        self._code, self._details = cause.code(), f"{cause.details() or ''} ({where})"

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _call(args: argparse.Namespace, channel: grpc.Channel) -> dict:
    ctl = csi_pb2_grpc.ControllerStub(channel)
    node = csi_pb2_grpc.NodeStub(channel)
    t = args.timeout
    if args.action == "create":
        rng = csi_pb2.CapacityRange(required_bytes=args.size, limit_bytes=args.limit)
        resp = ctl.CreateVolume(csi_pb2.CreateVolumeRequest(
            name=args.name, capacity_range=rng, volume_capabilities=[_cap(args=args)],
            parameters=dict(args.param)), timeout=t)
        return _dict(resp.volume)
    if args.action == "list":
        return _list(ctl, t)
    if args.action == "delete":
        return _delete(ctl, args.volume_id, t)
    if args.action == "publish":
        ctx = {"csi.storage.k8s.io/pod.uid": args.pod_uid} if args.pod_uid else {}
        node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=args.volume_id, target_path=os.path.abspath(args.target),
            volume_capability=_cap(args.readonly, args), readonly=args.readonly,
            volume_context=ctx,
            staging_target_path=os.path.abspath(args.staging) if args.staging else ""),
            timeout=t)
        return {"published": args.volume_id, "target": os.path.abspath(args.target)}
    if args.action == "stage":
        node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
            volume_id=args.volume_id, staging_target_path=os.path.abspath(args.staging),
            volume_capability=_cap(False, args)), timeout=t)
        ctx = _context(ctl, args.volume_id, t)
        mode = ctx.get("deviceMode", "")
        doc = {"staged": args.volume_id, "staging": os.path.abspath(args.staging),
               "device_mode": mode}
        # NodeStageVolume succeeds for every volume (kubelet calls it for each), but only
        # an fsdax file system is staged; say so rather than "staged at" a path that
        # holds nothing.
        if mode == "devdax" or args.block:
            doc["nothing_to_stage"] = True
        elif mode == "fsdax":
            doc["fs_type"] = args.fs_type or ctx.get("fsType") or "ext4"
        return doc
    if args.action == "unstage":
        node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
            volume_id=args.volume_id, staging_target_path=os.path.abspath(args.staging)),
            timeout=t)
        return {"unstaged": args.volume_id}
    if args.action == "unpublish":
        node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=args.volume_id, target_path=os.path.abspath(args.target)), timeout=t)
        return {"unpublished": args.volume_id}
    if args.action == "capacity":
        resp = ctl.GetCapacity(csi_pb2.GetCapacityRequest(parameters=dict(args.param),
                                                          volume_capabilities=[_cap()]),
                               timeout=t)
        return _dict(resp)
    if args.action == "stats":
        return _dict(node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
            volume_id=args.volume_id, volume_path=os.path.abspath(args.target)), timeout=t))
    if args.action == "info":
        ident = csi_pb2_grpc.IdentityStub(channel)
        return {"plugin": _dict(ident.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=t)),
                "probe": _dict(ident.Probe(csi_pb2.ProbeRequest(), timeout=t)),
                "node": _dict(node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=t))}
    raise ClientError(f"unknown action {args.action}")  # pragma: no cover - argparse guards
