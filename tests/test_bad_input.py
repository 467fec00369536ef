"""Hostile input for every RPC the driver serves: only documented codes come back.

Why: the CO, a misconfigured StorageClass or a buggy sidecar can send anything a
protobuf can carry. docs/design.md §6.5 promises a precise code with a readable message for
every failure, never UNKNOWN or INTERNAL and never a traceback, and the node plugin
serves every published volume's dax.sock, so one bad request must never take it down.

Each test starts one real driver (two small emulated NUMA pools) and lets hypothesis
throw many requests at it. Requests are drawn together with the defects they carry;
when a request has defects, the code must be one of those the contract gives for them
(so a request with a single defect gets exactly its code, in whatever order the driver
validates); a clean request must succeed or fail only for capacity. Volumes and
publications a random example happens to create are removed at once, so capacity
never runs out and every example sees the same node.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from dataclasses import dataclass, field

import grpc
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from csi_pmem.csi import csi_pb2, csi_pb2_grpc

from conftest import DriverProcess, MiB, Mode, block_cap, mount_cap, needs_root

pytestmark = needs_root()

C = grpc.StatusCode
DOCUMENTED = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.OUT_OF_RANGE, C.ALREADY_EXISTS,
              C.RESOURCE_EXHAUSTED, C.FAILED_PRECONDITION, C.ABORTED}
IA, NF, OOR, AE, RE, FP, ABORTED = (C.INVALID_ARGUMENT, C.NOT_FOUND, C.OUT_OF_RANGE,
                                    C.ALREADY_EXISTS, C.RESOURCE_EXHAUSTED,
                                    C.FAILED_PRECONDITION, C.ABORTED)

REGION = 256 * MiB  # per NUMA pool; small, so sizes above capacity are cheap to reach
REGIONS = "0=256Mi,1=256Mi"
NODE_KEY, NODE_ID = "csi-pmem.io/node", "test-node"
HEX = "0123456789abcdef"
INT64 = (-(2**63), 2**63 - 1)
INT32 = (-(2**31), 2**31 - 1)

# Sentinels that a test replaces with the fixture's real volume ids (strategies are
# built before any driver exists). Hypothesis prints them as they are.
PUBLISHED_ID = "<published volume>"
SPARE_ID = "<spare volume>"
SPARE_NAME = "fixture spare \u2603"  # the CSI name of the spare volume
PUBLISHED_NAME = "fixture published \u2603"


# CSI_PMEM_BAD_INPUT_SCALE=10 multiplies the examples of every test (a longer soak).
SCALE = int(os.environ.get("CSI_PMEM_BAD_INPUT_SCALE", "1"))


def settings_for(n: int):
    return settings(max_examples=n * SCALE, deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])


# ----------------------------------------------------------------------------- text
# Protobuf strings must be valid UTF-8, so surrogates cannot be sent at all.
any_char = st.characters(exclude_categories=("Cs",))
random_text = st.text(any_char, min_size=1, max_size=40)
SPECIAL = ["a\x00b", "\x00", "\U0001f9e0\U0001f4be\U0001f680", "\u202eevil\u202c.txt",
           "\u05e9\u05dc\u05d5\u05dd-\u05e2\u05d5\u05dc\u05dd", "\u0645\u0631\u062d\u0628\u0627",
           "e\u0301\u0301\u0301", "\ufeffbom", " ", "\t\n\r", "..", ".", "../../etc", "/", "//",
           "\\", "%s%n%x", "'; DROP TABLE volumes; --", "${HOME}", "$(reboot)", "a/b",
           "C:\\Windows", "\u200b", "\U0010ffff", "\x7f\x01\x1b[31m"]
special_text = st.sampled_from(SPECIAL)
overlong_text = st.one_of(
    st.text(any_char, min_size=129, max_size=300),
    st.sampled_from(["x" * 129, "x" * 10240, "\u00e9" * 65, "\U0001f9e0" * 33,
                     "\U0001f9e0" * 2560]))
exact_limit = st.sampled_from(["n" * 128, "\u00e9" * 64, "\U0001f9e0" * 32])
well_formed_id = st.text(HEX, min_size=32, max_size=32).map(lambda h: "pmem-" + h)
wrong_length_id = st.integers(0, 80).filter(lambda n: n != 32).flatmap(
    lambda n: st.text(HEX, min_size=n, max_size=n)).map(lambda h: "pmem-" + h)
path_like = st.one_of(st.sampled_from(["../../etc", "/", "/etc/passwd", "./x", "~root",
                                       "pmem-../../../etc", "pmem-" + "G" * 32,
                                       "PMEM-" + "a" * 32, "pmem-" + "A" * 32]),
                      wrong_length_id)
garbage = st.one_of(random_text, special_text, overlong_text, path_like)


def nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


# ------------------------------------------------------------------ volume ids
# (id or sentinel, kind); kinds: empty, unknown (well-formed, absent), garbage,
# published, spare.
volume_ids = st.one_of(
    st.just(("", "empty")),
    well_formed_id.map(lambda v: (v, "unknown")),
    garbage.map(lambda v: (v, "garbage")),
    st.just((PUBLISHED_ID, "published")),
    st.just((SPARE_ID, "spare")),
)

# ------------------------------------------------------------------ capabilities
ALL_MODES = [m for _, m in Mode.Mode.items()]
GOOD_MODES = {Mode.SINGLE_NODE_WRITER, Mode.SINGLE_NODE_READER_ONLY,
              Mode.SINGLE_NODE_SINGLE_WRITER, Mode.SINGLE_NODE_MULTI_WRITER}
# proto3 enums are open: a newer CO may send a mode this driver's proto does not know.
mode_values = st.one_of(st.sampled_from(ALL_MODES), st.integers(8, 1000),
                        st.integers(INT32[0], -1))


@st.composite
def odd_capabilities(draw):
    """(VolumeCapability, ok) with anything in it."""
    cap = csi_pb2.VolumeCapability()
    kind = draw(st.sampled_from(["mount", "mount", "mount", "block", "none"]))
    ok = kind == "mount"
    if kind == "mount":
        fs_type = draw(st.one_of(st.sampled_from(["", "", "devdax", "ext4", "xfs", "DEVDAX"]),
                                 random_text))
        ok &= fs_type in ("", "devdax")
        cap.mount.fs_type = fs_type
        cap.mount.mount_flags.extend(draw(st.lists(garbage, max_size=3)))
    elif kind == "block":
        cap.block.SetInParent()
    if draw(st.integers(0, 5)) or kind == "none":
        mode = draw(mode_values)
        cap.access_mode.mode = mode
        ok &= mode in GOOD_MODES
    else:
        ok = False  # no access mode at all
    return cap, ok


good_capabilities = st.sampled_from(sorted(GOOD_MODES)).map(lambda m: (mount_cap(m), True))
capabilities = st.one_of(good_capabilities, odd_capabilities())
cap_lists = st.lists(capabilities, max_size=3)

# ------------------------------------------------------------------ parameters
# Entries are (key, value); classify() gives each its effect: ok, bad, absent_numa (a
# NUMA node this node lacks: capacity 0, create RESOURCE_EXHAUSTED) or big_align (1Gi:
# no pool of this node is large enough, so every create is OUT_OF_RANGE).
CO_PREFIX = "csi.storage.k8s.io/"
VALID_KEYS = {"deviceMode", "numaNode", "align", "eraseOnDelete"}
BOOLS = {"true", "yes", "1", "on", "false", "no", "0", "off"}


def classify(key: str, value: str) -> str:
    """The contract's verdict on one parameter (docs/design.md §6.7, parameters)."""
    if key.startswith(CO_PREFIX):
        return "ok"
    text = value.strip()
    if key == "deviceMode":
        return "ok" if value == "devdax" else "bad"
    if key == "numaNode":
        if text.lower() == "auto":
            return "ok"
        if not (text.isascii() and text.isdecimal()) or len(text.lstrip("0")) > 18:
            return "bad"  # not a non-negative integer, or beyond any NUMA node id
        return "ok" if int(text) in (0, 1) else "absent_numa"
    if key == "align":
        return {"2Mi": "ok", "1Gi": "big_align"}.get(text, "bad")
    if key == "eraseOnDelete":
        return "ok" if text.lower() in BOOLS else "bad"
    return "bad"


# Keys external-provisioner adds; accepted with any value, used for labels and logs.
co_keys = st.one_of(st.sampled_from(["csi.storage.k8s.io/pvc/name",
                                     "csi.storage.k8s.io/pvc/namespace",
                                     "csi.storage.k8s.io/pv/name"]),
                    random_text.map(lambda s: CO_PREFIX + s))
param_entries = st.one_of(
    st.tuples(st.just("deviceMode"),
              # "fsdax" is valid but changes which capabilities are: the fsdax cases are
              # in tests/test_fsdax.py, this model covers devdax classes.
              st.one_of(st.sampled_from(["devdax", "FSDAX", "DEVDAX", "block", ""]),
                        random_text.filter(lambda v: v.strip() != "fsdax"))),
    st.tuples(st.just("numaNode"),
              st.one_of(st.sampled_from(["0", "1", "auto", "AUTO", " 1 ", "7", "1023", "99999",
                                         "1" * 40, "0" * 30 + "1", "-1", "1.5", "0x1", "+1",
                                         "", "\u0663", "\uff11", "one"]),
                        random_text)),
    st.tuples(st.just("align"),
              st.one_of(st.sampled_from(["2Mi", "1Gi", "4Ki", "2M", "2097152", "2mi", "",
                                         "1Ti", "-2Mi"]), random_text)),
    st.tuples(st.just("eraseOnDelete"),
              st.one_of(st.sampled_from(["true", "false", "yes", "No", "ON", "0", "maybe",
                                         "", "2", "truee"]), random_text)),
    st.tuples(co_keys, st.one_of(random_text, special_text, st.just(""))),
    st.tuples(st.one_of(st.sampled_from(["numanode", "NumaNode", " numaNode", "numaNode ",
                                         "csi.storage.k8s.io", "csi.storage.k8s.io.x/y",
                                         "fsType", "size", ""]),
                        garbage.filter(lambda k: k not in VALID_KEYS
                                       and not k.startswith(CO_PREFIX))),
              st.one_of(random_text, st.just(""))),
)


good_param_entries = st.one_of(
    st.tuples(st.just("numaNode"), st.sampled_from(["0", "1", "auto"])),
    st.tuples(st.just("align"), st.just("2Mi")),
    st.tuples(st.just("eraseOnDelete"), st.sampled_from(["true", "false"])),
    st.tuples(st.just("deviceMode"), st.just("devdax")),
    st.tuples(co_keys, st.one_of(random_text, special_text, st.just(""))),
)


@st.composite
def parameters(draw, entries=param_entries):
    """(parameter map, set of effects)."""
    params = dict(draw(st.lists(entries, max_size=4)))
    return params, {classify(k, v) for k, v in params.items()} - {"ok"}


def hostile(draw, dims: list[str]) -> set[str]:
    """Which request fields get hostile values: none, one of them, or all.

    Mostly one: a request with a single defect must get exactly that defect's code,
    and clean requests must reach the code paths behind validation.
    """
    plan = draw(st.sampled_from(["clean", "one", "one", "all"]))
    if plan == "one":
        return {draw(st.sampled_from(dims))}
    return set(dims) if plan == "all" else set()


# ------------------------------------------------------------------ sizes, topology
SPECIAL_SIZES = [0, -1, INT64[0], 1, 4096, 2 * MiB, 16 * MiB, 64 * MiB, REGION - 1, REGION,
                 REGION + 1, 2 * REGION, 2**40, 2**62, INT64[1]]
sizes = st.one_of(st.sampled_from(SPECIAL_SIZES), st.integers(*INT64), st.integers(1, 80 * MiB))
limits = st.one_of(st.just(0), sizes)

segment_maps = st.dictionaries(st.one_of(st.just(NODE_KEY), random_text),
                               st.one_of(st.just(NODE_ID), random_text), max_size=2)
topologies = st.one_of(
    st.just(csi_pb2.Topology(segments={NODE_KEY: NODE_ID})),
    st.just(csi_pb2.Topology(segments={NODE_KEY: "elsewhere"})),
    segment_maps.map(lambda s: csi_pb2.Topology(segments=s)))


def on_this_node(topology: csi_pb2.Topology) -> bool:
    return topology.segments.get(NODE_KEY) == NODE_ID


# ------------------------------------------------------------------ publish targets
# (kind, free text); the test turns them into a path below the driver's kubelet dir.
TARGET_KINDS_IA = ["relative", "dotdot", "dotdot_inside", "nul", "root", "kubelet",
                   "trailing_slash", "double_slash", "outside", "symlink_escape",
                   "long_component", "long_path", "huge"]
TARGET_KINDS_FP = ["nonempty", "file", "symlink_target", "foreign_mount", "under_file"]
targets = st.one_of(
    st.tuples(st.sampled_from(["fresh", "empty_dir", "long_ok", "published", "empty",
                               *TARGET_KINDS_IA, *TARGET_KINDS_FP]),
              st.one_of(random_text, special_text)),
    st.tuples(st.just("fresh"), random_text),
)
_counter = itertools.count()


def mountinfo_safe(text: str) -> str:
    """``text`` without the characters that csi_pmem.driver.host.mounts cannot read back yet.

    The kernel escapes only space, tab, newline and backslash in mountinfo, and
    mounts.mountinfo() splits lines with str.split(), which also splits at every other
    Unicode whitespace (\\x1c-\\x1f, \\x85, NBSP, U+2000...): the driver then does not
    recognise its own mount there. See test_target_with_unusual_whitespace.
    """
    return "".join("_" if c.isspace() and c not in " \t\n" else c for c in text)


def fresh_component(text: str) -> str:
    """A file name from ``text``: no '/', no NUL, not '.' or '..', at most 200 bytes."""
    name = mountinfo_safe(text).replace("/", "_").replace("\x00", "_")
    while nbytes(name) > 200:
        name = name[:-1]
    return name if name not in ("", ".", "..") else "dot" + name


# ------------------------------------------------------------------ the environment
@dataclass
class Result:
    code: grpc.StatusCode
    response: object
    details: str


@dataclass
class Env:
    """A started driver with one published and one spare volume, and odd directories."""

    d: DriverProcess
    published: str = ""
    spare: str = ""
    target: str = ""
    log_pos: int = 0
    paths: dict = field(default_factory=dict)

    def setup(self) -> Env:
        d = self.d
        self.published = d.create(PUBLISHED_NAME, size=16 * MiB,
                                  params={"numaNode": "0"}).volume.volume_id
        self.spare = d.create(SPARE_NAME, size=16 * MiB, params={"numaNode": "0"}).volume.volume_id
        self.target = d.target("fixture-pub")
        d.publish(self.published, self.target)
        kubelet = str(d.kubelet)
        p = self.paths
        p["nonempty"] = os.path.join(kubelet, "pods", "busy", "volumes", "mount")
        os.makedirs(p["nonempty"])
        with open(os.path.join(p["nonempty"], "data"), "w") as f:
            f.write("keep me")
        p["file"] = os.path.join(kubelet, "pods", "afile")
        open(p["file"], "w").close()
        p["outside"] = str(d.base / "outside")
        os.makedirs(p["outside"])
        p["escape"] = os.path.join(kubelet, "pods", "escape")
        os.symlink(p["outside"], p["escape"])
        p["linkdir"] = str(d.base / "linked-empty")
        os.makedirs(p["linkdir"])
        p["symlink_target"] = os.path.join(kubelet, "pods", "link", "volumes", "mount")
        os.makedirs(os.path.dirname(p["symlink_target"]))
        os.symlink(p["linkdir"], p["symlink_target"])
        p["foreign"] = os.path.join(kubelet, "pods", "foreign", "volumes", "mount")
        os.makedirs(p["foreign"])
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "foreign", p["foreign"]],
                       check=True)
        return self

    def real(self, value: str) -> str:
        return {PUBLISHED_ID: self.published, SPARE_ID: self.spare}.get(value, value)

    def target_for(self, kind: str, text: str) -> str:
        """Build (and where needed prepare) a target path of the given kind."""
        kubelet, p = str(self.d.kubelet), self.paths
        n = next(_counter)
        comp = fresh_component(text)
        return {
            "empty": lambda: "",
            "fresh": lambda: os.path.join(kubelet, "pods", f"f{n}", "volumes", comp),
            "empty_dir": lambda: self._empty_dir(os.path.join(kubelet, "pods", f"e{n}", "m")),
            "long_ok": lambda: os.path.join(kubelet, "pods", f"l{n}", *["d" * 200] * 12, comp),
            "published": lambda: self.target,
            "relative": lambda: os.path.join("pods", comp),
            "dotdot": lambda: os.path.join(kubelet, "pods", "..", "..", "..", "etc"),
            "dotdot_inside": lambda: os.path.join(kubelet, "pods", "x", "..", comp),
            "nul": lambda: os.path.join(kubelet, "pods", f"n{n}", "a\x00" + comp),
            "root": lambda: "/",
            "kubelet": lambda: kubelet,
            "trailing_slash": lambda: os.path.join(kubelet, "pods", f"t{n}", comp) + "/",
            "double_slash": lambda: kubelet + "//pods/" + comp,
            "outside": lambda: os.path.join(p["outside"], f"o{n}"),
            "symlink_escape": lambda: os.path.join(p["escape"], f"s{n}"),
            "long_component": lambda: os.path.join(kubelet, "pods", f"c{n}", "x" * 256),
            "long_path": lambda: os.path.join(kubelet, "pods", f"p{n}", *["d" * 250] * 17),
            "huge": lambda: os.path.join(kubelet, "pods", "h" * 10240),
            "nonempty": lambda: p["nonempty"],
            "file": lambda: p["file"],
            "symlink_target": lambda: p["symlink_target"],
            "foreign_mount": lambda: p["foreign"],
            "under_file": lambda: os.path.join(p["file"], comp),
        }[kind]()

    @staticmethod
    def _empty_dir(path: str) -> str:
        os.makedirs(path)
        return path

    # -- calls ---------------------------------------------------------------------
    def call(self, method, request, rpc: str = "") -> Result:
        """Call ``method``; check the driver survived and the status is documented."""
        try:
            response, code, details = method(request, timeout=60), C.OK, ""
        except grpc.RpcError as exc:
            response, code, details = None, exc.code(), exc.details() or ""
        log = self._new_log()
        assert self.d.proc.poll() is None, f"the driver died:\n{excerpt(log)}"
        assert code in DOCUMENTED, f"undocumented {code.name}: {details!r}\n{excerpt(log)}"
        if code != C.OK:
            assert details.strip(), f"{code.name} without a message"
            assert "Traceback" not in details and 'File "' not in details, details
        assert "Traceback (most recent call last)" not in log, excerpt(log)
        rpc = rpc or type(request).__name__.removesuffix("Request")
        event(f"{rpc} -> {code.name}")  # --hypothesis-show-statistics shows the spread
        return Result(code, response, details)

    def _new_log(self) -> str:
        with open(self.d.log, "rb") as f:
            f.seek(self.log_pos)
            data = f.read()
        self.log_pos += len(data)
        return data.decode("utf-8", "replace")

    def ensure_published(self) -> None:
        if not os.path.ismount(self.target):
            self.d.publish(self.published, self.target)

    def ensure_spare(self) -> None:
        vid = self.d.create(SPARE_NAME, size=16 * MiB, params={"numaNode": "0"}).volume.volume_id
        assert vid == self.spare

    def check_intact(self) -> None:
        """What the fixture set up is still there (no example may destroy it)."""
        assert os.path.ismount(self.target)
        assert os.path.exists(os.path.join(self.paths["nonempty"], "data"))
        assert os.path.ismount(self.paths["foreign"])
        assert os.listdir(self.paths["outside"]) == []


def excerpt(log: str, lines: int = 30, width: int = 240) -> str:
    """The end of a driver log, each line cut short (requests may hold 10 KiB fields)."""
    return "\n".join(line if len(line) <= width else line[:width] + "..."
                     for line in log.splitlines()[-lines:])


def expect(result: Result, defects: set, clean: set) -> None:
    """With defects, the code is one of theirs; without, one of the clean outcomes."""
    allowed = defects or clean
    assert result.code in allowed, (
        f"got {result.code.name} ({result.details!r}), expected one of "
        f"{sorted(c.name for c in allowed)}")


@pytest.fixture
def env(driver_factory) -> Env:
    return Env(driver_factory(regions=REGIONS).start()).setup()


def id_defects(kind: str) -> set:
    return {"empty": {IA}, "unknown": {NF}, "garbage": {NF}}.get(kind, set())


# ============================================================================ Identity
def unknown_fields(pairs) -> bytes:
    """Encode (field number, bytes) pairs as length-delimited protobuf fields."""
    out = bytearray()
    for number, payload in pairs:
        out += _varint(number << 3 | 2) + _varint(len(payload)) + payload
    return bytes(out)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


NO_ARG_RPCS = [
    ("/csi.v1.Identity/GetPluginInfo", csi_pb2.GetPluginInfoResponse),
    ("/csi.v1.Identity/GetPluginCapabilities", csi_pb2.GetPluginCapabilitiesResponse),
    ("/csi.v1.Identity/Probe", csi_pb2.ProbeResponse),
    ("/csi.v1.Controller/ControllerGetCapabilities", csi_pb2.ControllerGetCapabilitiesResponse),
    ("/csi.v1.Node/NodeGetInfo", csi_pb2.NodeGetInfoResponse),
    ("/csi.v1.Node/NodeGetCapabilities", csi_pb2.NodeGetCapabilitiesResponse),
]


@settings_for(60)
@given(rpc=st.sampled_from(NO_ARG_RPCS),
       fields=st.lists(st.tuples(st.integers(16, 2**29 - 1), st.binary(max_size=64)),
                       max_size=4))
def test_argumentless_rpcs_ignore_unknown_fields(env, rpc, fields):
    """A newer CO may send fields this proto lacks: they are ignored, the call succeeds."""
    path, response_type = rpc
    method = env.d.channel.unary_unary(path, request_serializer=lambda b: b,
                                       response_deserializer=response_type.FromString)
    result = env.call(method, unknown_fields(fields), rpc=path.rsplit("/", 1)[1])
    assert result.code == C.OK, result.details
    resp = result.response
    if path.endswith("GetPluginInfo"):
        assert resp.name == "csi-pmem.io" and resp.vendor_version
    elif path.endswith("Probe"):
        assert resp.ready.value is True
    elif path.endswith("NodeGetInfo"):
        assert resp.node_id == NODE_ID and resp.max_volumes_per_node > 0
    else:
        assert len(resp.capabilities) > 0


# ======================================================================== Controller
@st.composite
def create_requests(draw):
    """(CreateVolumeRequest, defects, clean outcomes)."""
    bad = hostile(draw, ["name", "caps", "params", "size", "source", "topology", "secrets"])
    good_name = st.one_of(random_text, special_text, exact_limit, path_like,
                          well_formed_id).filter(lambda n: 0 < nbytes(n) <= 128)
    name = draw(st.one_of(st.just(""), good_name, overlong_text, st.just(SPARE_NAME))
                if "name" in bad else good_name)
    caps = draw(cap_lists if "caps" in bad
                else st.lists(good_capabilities, min_size=1, max_size=3))
    params, effects = draw(parameters() if "params" in bad
                           else parameters(good_param_entries))
    if "size" in bad:
        required, limit = draw(sizes), draw(limits)
    else:
        required = draw(st.one_of(st.integers(1, 64 * MiB),
                                  st.sampled_from([1, 4096, 2 * MiB, 16 * MiB, 64 * MiB])))
        limit = draw(st.one_of(st.just(0), st.integers(required, 2 * REGION)))
    secrets = draw(st.dictionaries(garbage, garbage, max_size=3)) if "secrets" in bad else {}
    req = csi_pb2.CreateVolumeRequest(
        name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=required,
                                                        limit_bytes=limit),
        volume_capabilities=[c for c, _ in caps], parameters=params, secrets=secrets)
    if "size" in bad and draw(st.integers(0, 9)) == 0:
        req.ClearField("capacity_range")
        required = limit = 0
    source = draw(st.sampled_from(["none", "snapshot", "volume"])) if "source" in bad \
        else "none"
    if source == "snapshot":
        req.volume_content_source.snapshot.snapshot_id = draw(garbage)
    elif source == "volume":
        req.volume_content_source.volume.volume_id = draw(st.sampled_from([SPARE_NAME, "x"]))
    here = csi_pb2.Topology(segments={NODE_KEY: NODE_ID})
    requisite = draw(st.lists(topologies, max_size=2)) if "topology" in bad \
        else draw(st.sampled_from([[], [here]]))
    preferred = draw(st.lists(topologies, max_size=2)) if "topology" in bad else []
    if requisite or preferred:
        req.accessibility_requirements.requisite.extend(requisite)
        req.accessibility_requirements.preferred.extend(preferred)

    invalid = (not name or nbytes(name) > 128
               or not caps or not all(ok for _, ok in caps)
               or "bad" in effects
               or required < 0 or limit < 0 or (required == 0 and limit == 0)
               or bool(limit and required > limit)
               or source != "none")
    elsewhere = bool(requisite) and not any(map(on_this_node, requisite))
    defects = ({IA} if invalid else set()) | ({RE} if elsewhere else set())
    if name == SPARE_NAME:
        # The spare exists: a compatible request returns it, anything else (another
        # size, pool, align...) is ALREADY_EXISTS.
        return req, defects, {C.OK, AE}
    if "absent_numa" in effects:
        defects.add(RE)  # a NUMA node this node lacks: the scheduler tries another node
    # Without defects: success, or a size this node can never (OUT_OF_RANGE) or not now
    # (RESOURCE_EXHAUSTED) hold. Where the outcome is certain, say so.
    request_size = required or limit
    if "big_align" in effects or request_size > REGION:
        clean = {OOR}
    elif request_size <= 64 * MiB and not limit:
        clean = {C.OK}
    else:
        clean = {C.OK, OOR, RE}
    return req, defects, clean


def base_create(**kw) -> csi_pb2.CreateVolumeRequest:
    req = csi_pb2.CreateVolumeRequest(
        name="example", capacity_range=csi_pb2.CapacityRange(required_bytes=16 * MiB),
        volume_capabilities=[mount_cap()])
    for k, v in kw.items():
        if k == "required":
            req.capacity_range.required_bytes = v
        elif k == "limit":
            req.capacity_range.limit_bytes = v
        elif k == "parameters":
            req.parameters.update(v)
        elif k == "caps":
            del req.volume_capabilities[:]
            req.volume_capabilities.extend(v)
        else:
            setattr(req, k, v)
    return req


def block_only():
    return [csi_pb2.VolumeCapability(block=csi_pb2.VolumeCapability.BlockVolume(),
                                     access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER))]


@settings_for(150)
@given(case=create_requests())
@example(case=(base_create(name=""), {IA}, set()))
@example(case=(base_create(name="x" * 129), {IA}, set()))
@example(case=(base_create(name="\U0001f9e0" * 2560), {IA}, set()))
@example(case=(base_create(required=100 * MiB, limit=50 * MiB), {IA}, set()))
@example(case=(base_create(required=-1), {IA}, set()))
@example(case=(base_create(required=0, limit=0), {IA}, set()))
@example(case=(base_create(required=2**62), set(), {OOR}))
@example(case=(base_create(required=REGION + 1), set(), {OOR}))
@example(case=(base_create(required=1, limit=1), set(), {OOR}))
@example(case=(base_create(parameters={"numaNod": "0"}), {IA}, set()))
@example(case=(base_create(parameters={"numaNode": "-1"}), {IA}, set()))
@example(case=(base_create(parameters={"numaNode": "7"}), {RE}, set()))
@example(case=(base_create(parameters={"numaNode": "12345"}), {RE}, set()))
@example(case=(base_create(parameters={"align": "4Ki"}), {IA}, set()))
@example(case=(base_create(parameters={"eraseOnDelete": "maybe"}), {IA}, set()))
@example(case=(base_create(parameters={"deviceMode": "fsdax", "align": "2Mi"}), {IA}, set()))
@example(case=(base_create(parameters={"csi.storage.k8s.io/pvc/name": "claim",
                                       "csi.storage.k8s.io/pvc/namespace": "\u202ens"}),
               set(), {C.OK}))
@example(case=(base_create(caps=[]), {IA}, set()))
@example(case=(base_create(caps=block_only()), {IA}, set()))
@example(case=(base_create(caps=[mount_cap(Mode.MULTI_NODE_MULTI_WRITER)]), {IA}, set()))
@example(case=(base_create(caps=[csi_pb2.VolumeCapability(access_mode=Mode(mode=1))]),
               {IA}, set()))
@example(case=(base_create(caps=[mount_cap(99)]), {IA}, set()))
@example(case=(base_create(name="a\x00b"), set(), {C.OK}))
@example(case=(base_create(name="../../etc"), set(), {C.OK}))
def test_create_volume(env, case):
    req, defects, clean = case
    result = env.call(env.d.controller.CreateVolume, req)
    try:
        expect(result, defects, clean)
        if result.code == C.OK:
            vol = result.response.volume
            rng = req.capacity_range
            assert vol.volume_id.startswith("pmem-") and len(vol.volume_id) == 37
            assert vol.capacity_bytes >= rng.required_bytes
            assert not rng.limit_bytes or vol.capacity_bytes <= rng.limit_bytes
            if req.name == SPARE_NAME:
                assert vol.volume_id == env.spare
    finally:
        if result.code == C.OK and result.response.volume.volume_id != env.spare:
            deleted = env.call(env.d.controller.DeleteVolume, csi_pb2.DeleteVolumeRequest(
                volume_id=result.response.volume.volume_id))
            assert deleted.code == C.OK, deleted.details


@settings_for(100)
@given(vid=volume_ids, secrets=st.dictionaries(random_text, garbage, max_size=2))
@example(vid=("", "empty"), secrets={})
@example(vid=("pmem-" + "0" * 32, "unknown"), secrets={})
@example(vid=("../../etc", "garbage"), secrets={})
@example(vid=("/", "garbage"), secrets={})
@example(vid=("pmem-" + "0" * 31, "garbage"), secrets={})
@example(vid=(PUBLISHED_ID, "published"), secrets={})
@example(vid=(SPARE_ID, "spare"), secrets={})
def test_delete_volume(env, vid, secrets):
    text, kind = vid
    result = env.call(env.d.controller.DeleteVolume, csi_pb2.DeleteVolumeRequest(
        volume_id=env.real(text), secrets=secrets))
    # Unknown ids, well-formed or not, are already deleted: OK (docs/design.md §6.7).
    want = {"empty": IA, "published": FP}.get(kind, C.OK)
    assert result.code == want, result.details
    if kind == "spare":
        env.ensure_spare()  # same name, same id
    env.check_intact()


@settings_for(100)
@given(vid=volume_ids, caps=cap_lists, params=parameters(),
       context=st.dictionaries(garbage, garbage, max_size=3))
@example(vid=("", "empty"), caps=[(mount_cap(), True)], params=({}, set()), context={})
@example(vid=("pmem-" + "f" * 32, "unknown"), caps=[(mount_cap(), True)], params=({}, set()),
         context={})
@example(vid=(SPARE_ID, "spare"), caps=[], params=({}, set()), context={})
@example(vid=(SPARE_ID, "spare"), caps=[(mount_cap(), True)], params=({}, set()), context={})
@example(vid=(SPARE_ID, "spare"), caps=[(block_only()[0], False)], params=({}, set()),
         context={})
@example(vid=(SPARE_ID, "spare"), caps=[(mount_cap(1234), False)], params=({}, set()),
         context={})
def test_validate_volume_capabilities(env, vid, caps, params, context):
    text, kind = vid
    params, effects = params
    result = env.call(env.d.controller.ValidateVolumeCapabilities,
                      csi_pb2.ValidateVolumeCapabilitiesRequest(
                          volume_id=env.real(text), volume_capabilities=[c for c, _ in caps],
                          parameters=params, volume_context=context))
    defects = id_defects(kind) | ({IA} if not caps else set())
    expect(result, defects, {C.OK})
    if result.code == C.OK:
        resp = result.response
        if not all(ok for _, ok in caps) or "bad" in effects:
            assert not resp.HasField("confirmed") and resp.message
        elif not params:
            assert resp.HasField("confirmed"), resp.message
        if resp.HasField("confirmed"):
            assert list(resp.confirmed.volume_capabilities) == [c for c, _ in caps]


tokens = st.one_of(st.just(("", "none")), garbage.map(lambda t: (t, "garbage")),
                   well_formed_id.map(lambda t: (t, "unknown")),
                   st.just((PUBLISHED_ID, "published")), st.just((SPARE_ID, "spare")))


@settings_for(100)
@given(max_entries=st.one_of(st.sampled_from([0, 1, 2, -1, INT32[0], INT32[1]]),
                             st.integers(*INT32)),
       token=tokens)
@example(max_entries=-1, token=("", "none"))
@example(max_entries=0, token=("bogus", "garbage"))
@example(max_entries=0, token=("pmem-" + "0" * 31, "garbage"))
@example(max_entries=0, token=("x" * 10240, "garbage"))
@example(max_entries=1, token=(SPARE_ID, "spare"))
def test_list_volumes(env, max_entries, token):
    text, kind = token
    result = env.call(env.d.controller.ListVolumes, csi_pb2.ListVolumesRequest(
        max_entries=max_entries, starting_token=env.real(text)))
    defects = ({IA} if max_entries < 0 else set()) | ({ABORTED} if kind == "garbage" else set())
    # A well-formed token of no volume may resume at the next one or be refused.
    expect(result, defects, {C.OK, ABORTED} if kind == "unknown" else {C.OK})
    if result.code == C.OK:
        resp = result.response
        assert max_entries == 0 or len(resp.entries) <= max_entries
        ids = [e.volume.volume_id for e in resp.entries]
        assert ids == sorted(ids) and set(ids) <= {env.published, env.spare}
        assert resp.next_token in ("", env.published, env.spare)
        if kind == "none" and max_entries != 1:
            assert set(ids) == {env.published, env.spare}


@settings_for(100)
@given(params=parameters(), caps=st.lists(capabilities, max_size=2),
       topology=st.one_of(st.none(), topologies))
@example(params=({"numaNode": "7"}, {"absent_numa"}), caps=[], topology=None)
@example(params=({"csi.storage.k8s.io/pvc/name": "c"}, set()), caps=[], topology=None)
@example(params=({"bogus": "1"}, {"bad"}), caps=[], topology=None)
@example(params=({}, set()), caps=[(mount_cap(77), False)], topology=None)
def test_get_capacity(env, params, caps, topology):
    params, effects = params
    req = csi_pb2.GetCapacityRequest(parameters=params, volume_capabilities=[c for c, _ in caps])
    if topology is not None:
        req.accessible_topology.CopyFrom(topology)
    result = env.call(env.d.controller.GetCapacity, req)
    # A capability or topology this node cannot serve, or a NUMA node it lacks, is no
    # error of the class: the answer is 0 (capacity is asked per class x node).
    zero = (not all(ok for _, ok in caps) or "absent_numa" in effects
            or (topology is not None and not on_this_node(topology)))
    defects = {IA} if "bad" in effects else set()
    if defects and zero:
        defects.add(C.OK)
    expect(result, defects, {C.OK})
    if result.code == C.OK:
        resp = result.response
        assert resp.available_capacity >= 0
        if zero:
            assert resp.available_capacity == 0
        else:
            assert resp.maximum_volume_size.value <= resp.available_capacity
            if "big_align" not in effects:
                assert resp.available_capacity > 0


@settings_for(80)
@given(vid=volume_ids)
@example(vid=("", "empty"))
@example(vid=("pmem-" + "0" * 32, "unknown"))
@example(vid=(PUBLISHED_ID, "published"))
def test_controller_get_volume(env, vid):
    text, kind = vid
    result = env.call(env.d.controller.ControllerGetVolume,
                      csi_pb2.ControllerGetVolumeRequest(volume_id=env.real(text)))
    expect(result, id_defects(kind), {C.OK})
    if result.code == C.OK:
        resp = result.response
        assert resp.volume.volume_id == env.real(text)
        assert list(resp.status.published_node_ids) == ([NODE_ID] if kind == "published"
                                                        else [])
        assert not resp.status.volume_condition.abnormal


# ============================================================================== Node
@st.composite
def publish_requests(draw):
    """((id, id kind), (target kind, text), (capability, ok) or None, readonly, context,
    mount group, other request fields)."""
    bad = hostile(draw, ["id", "target", "cap", "group", "context"])
    vid = draw(volume_ids if "id" in bad
               else st.sampled_from([(PUBLISHED_ID, "published"), (SPARE_ID, "spare")]))
    target = draw(targets if "target" in bad
                  else st.tuples(st.sampled_from(["fresh", "fresh", "empty_dir", "long_ok",
                                                  "published"]),
                                 st.one_of(random_text, special_text)))
    cap = draw(st.one_of(st.none(), capabilities) if "cap" in bad else good_capabilities)
    if "group" in bad:
        group = draw(st.one_of(
            st.just(""), st.integers(0, 2**32 - 2).map(str),
            st.sampled_from(["-1", "4294967295", "4294967296", "1" * 30, "9" * 10240, "1.0",
                             "\u0661\u0662", "\uff11", " 1", "0x10", "root"]),
            random_text))
    else:
        group = draw(st.sampled_from(["", "", "0", "1000", "4294967294"]))
    if "context" in bad:
        uid = draw(st.one_of(st.none(), st.just(""), st.uuids().map(str), garbage))
        context = draw(st.dictionaries(garbage, garbage, max_size=2))
    else:
        uid = draw(st.one_of(st.none(), st.just(""), st.uuids().map(str)))
        context = {}
    if uid is not None:
        context["csi.storage.k8s.io/pod.uid"] = uid
    # Fields this driver has no use for (no NodeStage, no ControllerPublish, no secrets).
    extras = draw(st.fixed_dictionaries({
        "publish_context": st.dictionaries(garbage, garbage, max_size=2),
        "staging_target_path": st.one_of(garbage, st.just("/")),
        "secrets": st.dictionaries(garbage, garbage, max_size=2)})) if "context" in bad else {}
    return vid, target, cap, draw(st.booleans()), context, group, extras


def publish_request(env: Env, vid: str, target: str, cap, readonly: bool, context: dict,
                    group: str, extras: dict) -> csi_pb2.NodePublishVolumeRequest:
    req = csi_pb2.NodePublishVolumeRequest(volume_id=env.real(vid), target_path=target,
                                           readonly=readonly, volume_context=context, **extras)
    if cap is not None:
        req.volume_capability.CopyFrom(cap[0])
        if group and req.volume_capability.HasField("mount"):
            req.volume_capability.mount.volume_mount_group = group
    return req


PLAIN = (mount_cap(), True)


@settings_for(150)
@given(case=publish_requests())
@example(case=(("", "empty"), ("fresh", "x"), PLAIN, False, {}, ""))
@example(case=((SPARE_ID, "spare"), ("empty", ""), PLAIN, False, {}, ""))
@example(case=((SPARE_ID, "spare"), ("fresh", "x"), None, False, {}, ""))
@example(case=(("pmem-" + "0" * 32, "unknown"), ("fresh", "x"), PLAIN, False, {}, ""))
@example(case=(("../../etc", "garbage"), ("fresh", "x"), PLAIN, False, {}, ""))
@example(case=((SPARE_ID, "spare"), ("fresh", "\U0001f9e0 \u202e\n\\040"), PLAIN, False, {}, ""))
@example(case=((SPARE_ID, "spare"), ("long_ok", "x"), PLAIN, False, {}, ""))
@example(case=((SPARE_ID, "spare"), ("fresh", "x"), (mount_cap(99), False), False, {}, ""))
@example(case=((SPARE_ID, "spare"), ("fresh", "x"), PLAIN, False, {}, "4294967296"))
@example(case=((SPARE_ID, "spare"), ("fresh", "x"), PLAIN, False, {}, "1" * 30))
@example(case=((SPARE_ID, "spare"), ("fresh", "x"), PLAIN, True,
               {"csi.storage.k8s.io/pod.uid": "../../x"}, ""))
@example(case=((SPARE_ID, "spare"), ("long_component", "x"), PLAIN, False, {}, ""))
@example(case=((SPARE_ID, "spare"), ("long_path", "x"), PLAIN, False, {}, ""))
@example(case=((SPARE_ID, "spare"), ("huge", "x"), PLAIN, False, {}, ""))
@example(case=((SPARE_ID, "spare"), ("under_file", "x"), PLAIN, False, {}, ""))
@example(case=((SPARE_ID, "spare"), ("nonempty", "x"), PLAIN, False, {}, ""))
@example(case=((SPARE_ID, "spare"), ("published", "x"), PLAIN, False, {}, ""))
@example(case=((PUBLISHED_ID, "published"), ("published", "x"), PLAIN, False, {}, ""))
@example(case=((PUBLISHED_ID, "published"), ("published", "x"), PLAIN, True, {}, ""))
def test_node_publish_volume(env, case):
    (vid, id_kind), (target_kind, text), cap, readonly, context, group, *extras = case
    target = env.target_for(target_kind, text)
    req = publish_request(env, vid, target, cap, readonly, context, group,
                          extras[0] if extras else {})
    result = env.call(env.d.node.NodePublishVolume, req)
    try:
        defects = id_defects(id_kind)
        if target_kind == "empty" or cap is None or not cap[1]:
            defects.add(IA)
        group = req.volume_capability.mount.volume_mount_group
        if group and not (group.isascii() and group.isdecimal() and len(group) <= 10
                          and int(group) < 2**32 - 1):
            defects.add(IA)
        uid = context.get("csi.storage.k8s.io/pod.uid")
        if uid and "/" in uid:
            defects.add(IA)
        if target_kind in TARGET_KINDS_IA:
            defects.add(IA)
        if id_kind in ("published", "spare") and target_kind in TARGET_KINDS_FP:
            defects.add(FP)
        mode = req.volume_capability.access_mode.mode
        effective_ro = readonly or mode == Mode.SINGLE_NODE_READER_ONLY
        if target_kind == "published":
            if id_kind == "spare" or (id_kind == "published" and (effective_ro or group)):
                defects.add(AE)
        clean = {C.OK}
        if id_kind == "published" and target_kind != "published" \
                and mode == Mode.SINGLE_NODE_SINGLE_WRITER and not effective_ro:
            clean = {FP}  # the volume is already published writable elsewhere
        expect(result, defects, clean)
        if result.code == C.OK and target_kind != "published":
            assert os.path.ismount(target)
            assert sorted(os.listdir(target)) == ["dax.sock", "volume.json"]
    finally:
        if result.code == C.OK and target_kind != "published":
            done = env.call(env.d.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
                volume_id=req.volume_id, target_path=target))
            assert done.code == C.OK, done.details
            assert not os.path.exists(target)
    env.check_intact()


known_ids = st.sampled_from([(PUBLISHED_ID, "published"), (SPARE_ID, "spare")])


@st.composite
def id_and_target(draw, target_kinds):
    """(id, target): mostly one of them hostile, see hostile()."""
    bad = hostile(draw, ["id", "target"])
    vid = draw(volume_ids if "id" in bad else known_ids)
    target = draw(target_kinds if "target" in bad else st.sampled_from(
        [("published", ""), ("fresh", "x"), ("empty_dir", "")]))
    return vid, target


@settings_for(80)
@given(case=id_and_target(targets), cap=st.one_of(st.none(), capabilities))
@example(case=((SPARE_ID, "spare"), ("fresh", "x")), cap=(block_cap(), False))
@example(case=(("", "empty"), ("fresh", "x")), cap=None)
def test_node_stage_and_unstage_volume(env, case, cap):
    """devdax volumes stage as a validated no-op; NodeUnstage only needs its fields.
    (fsdax staging, with real file systems, is in tests/test_fsdax.py.)"""
    (vid, id_kind), (target_kind, text) = case
    target = env.target_for(target_kind, text)
    vid = env.real(vid)
    req = csi_pb2.NodeStageVolumeRequest(volume_id=vid, staging_target_path=target)
    if cap is not None:
        req.volume_capability.CopyFrom(cap[0])
    result = env.call(env.d.node.NodeStageVolume, req)
    defects = id_defects(id_kind)
    if target_kind == "empty" or cap is None or not cap[1] or target_kind in TARGET_KINDS_IA:
        defects.add(IA)
    expect(result, defects, {C.OK})
    done = env.call(env.d.node.NodeUnstageVolume, csi_pb2.NodeUnstageVolumeRequest(
        volume_id=vid, staging_target_path=target))
    # A path stage refuses, unstage refuses too (rather than "done" for nothing done).
    defects = id_defects(id_kind) | (
        {IA} if target_kind == "empty" or target_kind in TARGET_KINDS_IA else set())
    expect(done, defects, {C.OK})
    env.check_intact()


@settings_for(100)
@given(case=id_and_target(targets))
@example(case=(("", "empty"), ("fresh", "x")))
@example(case=((SPARE_ID, "spare"), ("empty", "")))
@example(case=(("pmem-" + "0" * 32, "unknown"), ("fresh", "x")))
@example(case=((PUBLISHED_ID, "published"), ("published", "")))
@example(case=((SPARE_ID, "spare"), ("published", "")))
@example(case=((PUBLISHED_ID, "published"), ("nonempty", "")))
@example(case=((PUBLISHED_ID, "published"), ("foreign_mount", "")))
@example(case=((PUBLISHED_ID, "published"), ("kubelet", "")))
def test_node_unpublish_volume(env, case):
    (text, id_kind), (target_kind, ttext) = case
    path = env.target_for(target_kind, ttext)
    result = env.call(env.d.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
        volume_id=env.real(text), target_path=path))
    # A path publish refuses (outside the kubelet directory, not normalised) is refused
    # here too; unknown targets of a known volume are already unpublished: OK.
    defects = id_defects(id_kind) | (
        {IA} if target_kind == "empty" or target_kind in TARGET_KINDS_IA else set())
    expect(result, defects, {C.OK})
    if id_kind == "published" and target_kind == "published" and result.code == C.OK:
        assert not os.path.exists(env.target)
        env.ensure_published()
    env.check_intact()


stats_paths = st.one_of(st.tuples(st.just("published"), st.just("")),
                        st.tuples(st.just("empty"), st.just("")),
                        garbage.map(lambda g: ("raw", g)), targets)


@settings_for(100)
@given(case=id_and_target(stats_paths))
@example(case=(("", "empty"), ("published", "")))
@example(case=((PUBLISHED_ID, "published"), ("empty", "")))
@example(case=(("pmem-" + "0" * 32, "unknown"), ("published", "")))
@example(case=((PUBLISHED_ID, "published"), ("published", "")))
@example(case=((SPARE_ID, "spare"), ("published", "")))
@example(case=((PUBLISHED_ID, "published"), ("raw", "a\x00b")))
def test_node_get_volume_stats(env, case):
    (text, id_kind), (path_kind, ptext) = case
    volume_path = ptext if path_kind == "raw" else env.target_for(path_kind, ptext)
    result = env.call(env.d.node.NodeGetVolumeStats, csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=env.real(text), volume_path=volume_path))
    defects = id_defects(id_kind) | ({IA} if not volume_path else set())
    # Only the published volume at its own target has stats; anything else is NOT_FOUND.
    published_here = id_kind == "published" and volume_path == env.target
    expect(result, defects, {C.OK} if published_here else {NF})
    if result.code == C.OK:
        usage = result.response.usage
        assert len(usage) == 1 and usage[0].total > 0 and usage[0].used == 0
        assert not result.response.volume_condition.abnormal


# ===================================================================== not implemented
UNIMPLEMENTED = [
    ("Controller", "ControllerPublishVolume", csi_pb2.ControllerPublishVolumeRequest),
    ("Controller", "ControllerUnpublishVolume", csi_pb2.ControllerUnpublishVolumeRequest),
    ("Controller", "CreateSnapshot", csi_pb2.CreateSnapshotRequest),
    ("Controller", "DeleteSnapshot", csi_pb2.DeleteSnapshotRequest),
    ("Controller", "ListSnapshots", csi_pb2.ListSnapshotsRequest),
    ("Controller", "GetSnapshot", csi_pb2.GetSnapshotRequest),
    ("Controller", "ControllerExpandVolume", csi_pb2.ControllerExpandVolumeRequest),
    ("Controller", "ControllerModifyVolume", csi_pb2.ControllerModifyVolumeRequest),
    ("Node", "NodeExpandVolume", csi_pb2.NodeExpandVolumeRequest),
    ("GroupController", "GroupControllerGetCapabilities",
     csi_pb2.GroupControllerGetCapabilitiesRequest),
    ("GroupController", "CreateVolumeGroupSnapshot", csi_pb2.CreateVolumeGroupSnapshotRequest),
    ("GroupController", "DeleteVolumeGroupSnapshot", csi_pb2.DeleteVolumeGroupSnapshotRequest),
    ("GroupController", "GetVolumeGroupSnapshot", csi_pb2.GetVolumeGroupSnapshotRequest),
]


def test_unimplemented_rpcs(driver_factory):
    """Everything the driver does not offer answers UNIMPLEMENTED, with any arguments."""
    d = driver_factory(regions=REGIONS).start()
    vol = d.create("unimpl", size=16 * MiB).volume.volume_id
    stubs = {"Controller": d.controller, "Node": d.node,
             "GroupController": csi_pb2_grpc.GroupControllerStub(d.channel)}
    for service, name, request_type in UNIMPLEMENTED:
        method = getattr(stubs[service], name)
        requests = [request_type()]
        fields = {f.name for f in request_type.DESCRIPTOR.fields}
        for key in ("volume_id", "source_volume_id", "snapshot_id", "name"):
            if key in fields:
                requests.append(request_type(**{key: vol}))
                requests.append(request_type(**{key: "../../\x00\U0001f9e0" * 100}))
        for request in requests:
            with pytest.raises(grpc.RpcError) as info:
                method(request, timeout=30)
            assert info.value.code() == C.UNIMPLEMENTED, (name, info.value.details())
            assert d.proc.poll() is None
    for name in ("GetMetadataAllocated", "GetMetadataDelta"):
        stream = getattr(csi_pb2_grpc.SnapshotMetadataStub(d.channel), name)(
            getattr(csi_pb2, name + "Request")(), timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == C.UNIMPLEMENTED
    # The capabilities agree: nothing unimplemented is advertised.
    ccaps = {c.rpc.type for c in d.controller.ControllerGetCapabilities(
        csi_pb2.ControllerGetCapabilitiesRequest()).capabilities}
    RPC = csi_pb2.ControllerServiceCapability.RPC
    assert not ccaps & {RPC.PUBLISH_UNPUBLISH_VOLUME, RPC.CREATE_DELETE_SNAPSHOT,
                        RPC.LIST_SNAPSHOTS, RPC.EXPAND_VOLUME, RPC.MODIFY_VOLUME,
                        RPC.CLONE_VOLUME, RPC.PUBLISH_READONLY}
    ncaps = {c.rpc.type for c in d.node.NodeGetCapabilities(
        csi_pb2.NodeGetCapabilitiesRequest()).capabilities}
    NRPC = csi_pb2.NodeServiceCapability.RPC
    assert not ncaps & {NRPC.EXPAND_VOLUME}
    assert NRPC.STAGE_UNSTAGE_VOLUME in ncaps  # implemented: fsdax file systems
    d.delete(vol)


@pytest.mark.parametrize("char", ["\x1f", "\xa0", "\u2028", "\x0b"])
def test_target_with_unusual_whitespace(driver_factory, char):
    d = driver_factory(regions=REGIONS).start()
    vol = d.create("ws", size=16 * MiB).volume.volume_id
    target = d.target(f"a{char}b")
    try:
        d.publish(vol, target)
        d.unpublish(vol, target)  # INTERNAL today: EROFS removing dax.sock
        assert not os.path.exists(target)
    finally:
        # conftest's clean-up reads mountinfo the same way and would miss this mount.
        subprocess.run(["umount", "-l", target], capture_output=True)
