"""How ``csi-pmem volume`` prints what the driver answered: ``-o table|json|yaml|name``.

Why its own module: the client speaks CSI and returns the answer as the CSI messages'
JSON mapping (int64 sizes as strings, as every CSI tool prints them); this module only
presents that document, so scripts that read ``-o json`` keep working while a person at
a terminal gets a table with sizes in binary units, and ``-o name`` prints bare volume
ids for ``ID=$(...)``. Pure functions of (action, document), tested without a driver.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from csi_pmem.cmdline import OUTPUT_FORMATS, default_output
from csi_pmem.errors import CsiPmemError
from csi_pmem.sizes import human_size

FORMATS = OUTPUT_FORMATS  # the same -o as csi-pmem-weights' (csi_pmem.cmdline)
FORMAT_HELP = ("output format: table (the default when stdout is a terminal), json (the "
               "default otherwise, so scripts keep working), yaml, or name (volume ids "
               "only, one a line, for ID=$(...))")


class OutputError(CsiPmemError):
    """The output format does not apply to this action (``-o name`` of ``capacity``)."""


def default_format(stream: TextIO | None = None) -> str:
    return default_output(stream)


def check(action: str, fmt: str) -> None:
    """Refuse a format that cannot print ``action``'s answer before the request is sent
    (``create -o name`` must not find out after creating the volume)."""
    if fmt == "name" and action not in _NAMES:
        raise OutputError(f"-o name prints volume ids, and {action} answers with none; "
                          "use -o table, json or yaml")
    if fmt == "yaml":
        import yaml  # noqa: F401 - the driver extra brings PyYAML; only this format needs it


def render(action: str, doc: dict[str, Any], fmt: str) -> str:
    """The text to print for ``action``'s answer ``doc`` in format ``fmt``."""
    if fmt == "json":
        return json.dumps(doc, indent=2, sort_keys=True)
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(doc, sort_keys=True, default_flow_style=False).rstrip("\n")
    if fmt == "name":
        check(action, fmt)
        return "\n".join(_NAMES[action](doc))
    return _TABLES[action](doc)


def columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """kubectl's look: upper-case headers, columns three spaces apart, no rules."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("   ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))
                     .rstrip() for r in [header, *rows])


def fields(pairs: Sequence[tuple[str, Any]]) -> str:
    """``key:  value`` lines with the values aligned (one object, as kubectl describe)."""
    width = max(len(k) for k, _ in pairs) + 1
    return "\n".join(f"{k + ':':<{width}}  {v}" for k, v in pairs)


def size(value: Any) -> str:
    """A CSI int64 byte count (a string in the JSON mapping; absent when 0) for people."""
    return human_size(int(value or 0))


def condition(cond: dict[str, Any] | None) -> str:
    if not cond:
        return "-"
    return f"abnormal: {cond.get('message', '')}" if cond.get("abnormal") else "ok"


VOLUME_HEADER = ("VOLUME ID", "SIZE", "MODE", "NUMA", "ALIGN", "POOL")


def _volume_row(vol: dict[str, Any]) -> list[str]:
    ctx = vol.get("volume_context", {})
    return [vol["volume_id"], size(vol.get("capacity_bytes")), ctx.get("deviceMode", "-"),
            ctx.get("numaNode", "-"), ctx.get("align", "-"), ctx.get("pool", "-")]


def _create(doc: dict[str, Any]) -> str:
    return columns(VOLUME_HEADER, [_volume_row(doc)])


def _list(doc: dict[str, Any]) -> str:
    entries = doc.get("entries", [])
    if not entries:
        return "No volumes."
    rows = []
    for e in entries:
        status = e.get("status", {})
        nodes = ",".join(status.get("published_node_ids", [])) or "-"
        rows.append([*_volume_row(e["volume"]), nodes,
                     condition(status.get("volume_condition"))])
    return columns((*VOLUME_HEADER, "PUBLISHED ON", "CONDITION"), rows)


def _done(verb: str, where: str | None = None) -> Callable[[dict[str, Any]], str]:
    def text(doc: dict[str, Any]) -> str:
        place = f" at {doc[where]}" if where else ""
        return f"volume {doc[verb]} {verb}{place}"
    return text


def _delete(doc: dict[str, Any]) -> str:
    return "\n".join([f"volume {v} deleted" for v in doc.get("deleted", [])]
                     + [f"volume {v} not found, nothing to do"
                        for v in doc.get("not_found", [])])


def _stage(doc: dict[str, Any]) -> str:
    vid, mode = doc["staged"], doc.get("device_mode")
    if doc.get("nothing_to_stage"):
        what = "a devdax volume" if mode == "devdax" else "a block volume"
        return (f"volume {vid} is {what}: nothing to stage (NodeStageVolume only checked "
                f"it, and {doc['staging']} holds nothing); publish it without --staging")
    fs = f" as {doc['fs_type']}" if doc.get("fs_type") else ""
    return f"volume {vid} staged at {doc['staging']}{fs}"


def _capacity(doc: dict[str, Any]) -> str:
    header, row = ["AVAILABLE", "LARGEST VOLUME"], [size(doc.get("available_capacity")),
                                                   size(doc.get("maximum_volume_size"))]
    if doc.get("minimum_volume_size"):
        header.append("SMALLEST VOLUME")
        row.append(size(doc["minimum_volume_size"]))
    return columns(header, [row])


def _stats(doc: dict[str, Any]) -> str:
    rows = []
    for u in doc.get("usage", []):
        fmt = size if u.get("unit") == "BYTES" else (lambda v: str(int(v or 0)))
        rows.append([u.get("unit", "UNKNOWN"), fmt(u.get("total")), fmt(u.get("used")),
                     fmt(u.get("available"))])
    table = columns(("UNIT", "TOTAL", "USED", "AVAILABLE"), rows)
    return f"{table}\n\ncondition: {condition(doc.get('volume_condition'))}"


def _inspect(doc: dict[str, Any]) -> str:
    meta = doc.get("metadata", {})
    numa = meta.get("numa_node")
    return fields([
        ("volume", meta.get("volume_id", "-")),
        ("mapped", human_size(doc.get("mapped_bytes", 0))),
        ("fd", doc.get("fd_flags", "-")),
        ("device", meta.get("device", "-")),
        ("NUMA node", "unknown" if numa is None or numa < 0 else numa),
        ("align", human_size(meta["align"]) if meta.get("align") else "-"),
        ("first 16 bytes", doc.get("first_16_bytes", "")),
    ])


def _info(doc: dict[str, Any]) -> str:
    plugin, node = doc.get("plugin", {}), doc.get("node", {})
    segments = node.get("accessible_topology", {}).get("segments", {})
    return fields([
        ("driver", f"{plugin.get('name', '-')} {plugin.get('vendor_version', '')}".strip()),
        ("ready", "yes" if doc.get("probe", {}).get("ready") else "no"),
        ("node", node.get("node_id", "-")),
        ("max volumes", node.get("max_volumes_per_node", "-")),
        ("topology", ", ".join(f"{k}={v}" for k, v in sorted(segments.items())) or "-"),
    ]) + _pools(plugin.get("manifest", {}))


POOL_HEADER = ("POOL", "NUMA", "SIZE", "FREE", "PAGES", "PLACEMENT", "MEDIA", "USABLE")


def _pools(manifest: dict[str, str]) -> str:
    """The pools GetPluginInfo's manifest names (``pool.<name>``: ``numa=0 size=...``,
    csi_pmem.driver.servicers.identity), as a table below the fields; nothing for a
    driver that names none."""
    rows = []
    for key, value in sorted(manifest.items()):
        if not key.startswith("pool."):
            continue
        words = dict(w.partition("=")[::2] for w in value.split())
        rows.append([key[len("pool."):], words.get("numa", "-"), words.get("size", "-"),
                     words.get("free", "-"), words.get("pages", "-"),
                     words.get("placement", "-"), words.get("media", "-"),
                     words.get("usable", "yes")])
    return "\n\n" + columns(POOL_HEADER, rows) if rows else ""


_TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "create": _create, "list": _list, "delete": _delete,
    "publish": _done("published", "target"), "unpublish": _done("unpublished"),
    "stage": _stage, "unstage": _done("unstaged"),
    "capacity": _capacity, "stats": _stats, "inspect": _inspect, "info": _info,
}

_NAMES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "create": lambda d: [d["volume_id"]],
    "list": lambda d: [e["volume"]["volume_id"] for e in d.get("entries", [])],
    "delete": lambda d: [*d.get("deleted", []), *d.get("not_found", [])],
    "publish": lambda d: [d["published"]],
    "unpublish": lambda d: [d["unpublished"]], "stage": lambda d: [d["staged"]],
    "unstage": lambda d: [d["unstaged"]],
    "inspect": lambda d: [d["metadata"]["volume_id"]],
}
