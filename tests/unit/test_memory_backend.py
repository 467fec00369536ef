"""The memory back end (``--backend memory``) without root: pool sizes from the node's
memory, the start-up refusal, the per-pool mounts it asks for, and what its pools say.

Mounts go to a fake behind the back end's :class:`PoolMounter` interface that keeps a
mount table the way mountinfo prints tmpfs and hugetlbfs options (tmpfs's size in KiB,
``huge=never`` left out), so the back end's "is it mounted as configured" check meets
the same text as on a host. Where the pages really land is the VM tier's
(``e2e/vm/test_guest.py::test_memory_pools_bind_pages_to_their_node``).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from csi_pmem import cli
from csi_pmem.client import output
from csi_pmem.cmdline import Exit
from csi_pmem.driver import config, server
from csi_pmem.driver.backends import memory_sizing
from csi_pmem.driver.backends.memory import MemoryBackend
from csi_pmem.driver.backends.memory_sizing import fit_pools, node_memory, parse_pools
from csi_pmem.driver.servicers.identity import IdentityServicer
from csi_pmem.errors import FailedPrecondition, InvalidArgument
from csi_pmem.mountinfo import MountInfo
from csi_pmem.sizes import GiB, MiB


class FakePoolMounter:
    """A mount table; ``mount`` records argv-like calls and shows options as mountinfo
    does. No loop devices (the tests make devdax namespaces only)."""

    def __init__(self) -> None:
        self.table: dict[str, MountInfo] = {}
        self.calls: list[tuple[str, str, str, tuple[str, ...]]] = []

    @staticmethod
    def _shown(fstype: str, options: list[str]) -> frozenset[str]:
        shown = {"rw"}
        for o in options:
            key, _, value = o.partition("=")
            if key == "size" and fstype == "tmpfs":
                shown.add(f"size={int(value) // 1024}k")
            elif key == "pagesize":  # hugetlbfs: MiB always, 1G as 1024M (the kernel's)
                shown.add(f"pagesize={ {'2M': 2, '1G': 1024}[value]}M")
            elif key == "size" and fstype == "hugetlbfs":  # bytes, whole pages
                page = 2**20 * {"2M": 2, "1G": 1024}[dict(
                    x.partition("=")[::2] for x in options)["pagesize"]]
                shown.add(f"size={int(value) // page * page}")
            elif o not in ("huge=never", "remount"):
                shown.add(o)
        return frozenset(shown)

    def find(self, target: str) -> MountInfo | None:
        return self.table.get(target)

    def mount(self, device: str, target: str, fstype: str, options: list[str]) -> None:
        self.calls.append((device, target, fstype, tuple(options)))
        if "remount" in options:
            assert target in self.table, "remount of what is not mounted"
        self.table[target] = MountInfo(target, fstype, device, self._shown(fstype, options))

    def unmount_all(self) -> None:  # a node restart
        self.table.clear()

    def loop_devices(self) -> dict[str, str]:
        return {}

    def attach_loop(self, path: str, *, readonly: bool = False,
                    sizelimit: int | None = None) -> str:
        raise AssertionError("no loop devices in these tests")

    def detach_loop(self, device: str) -> None:
        raise AssertionError("no loop devices in these tests")


def write_nodes(root: Path, mem_kib: dict[int, int]) -> str:
    for node, kib in mem_kib.items():
        d = root / f"node{node}"
        d.mkdir(parents=True)
        (d / "meminfo").write_text(f"Node {node} MemTotal:       {kib} kB\n"
                                   f"Node {node} MemFree:        {kib // 2} kB\n")
    (root / "possible").write_text("0-1\n")  # not a node directory: ignored
    return str(root)


# -- sizes --------------------------------------------------------------------------

def test_parse_pools_takes_sizes_and_shares():
    assert parse_pools("0=50%, 1=64Gi") == {0: Fraction(1, 2), 1: 64 * GiB}
    assert parse_pools("0=12.5%") == {0: Fraction(1, 8)}
    assert parse_pools("*=50%,1=64Gi") == {-1: Fraction(1, 2), 1: 64 * GiB}
    for bad in ("", "0", "x=1Gi", "0=1Gi,0=2Gi", "0=1Mi", "0=0%", "0=101%", "0=-5%",
                "0=50 %", "0=lots", "*=1Gi,*=2Gi", "**=1Gi", "-1=1Gi"):
        with pytest.raises(InvalidArgument):
            parse_pools(bad)


def test_node_memory_reads_memtotal_per_node(tmp_path):
    root = write_nodes(tmp_path, {0: 1_048_576, 1: 2_097_152})
    assert node_memory(root) == {0: GiB, 1: 2 * GiB}


def test_fit_pools_rounds_shares_of_each_node_down_to_16mi():
    memory = {0: 1000 * MiB, 1: 2 * GiB}
    assert fit_pools(parse_pools("0=50%,1=25%"), memory) == {0: 496 * MiB, 1: 512 * MiB}
    assert fit_pools(parse_pools("1=100%"), memory) == {1: 2 * GiB}
    assert fit_pools(parse_pools("0=100Mi"), memory) == {0: 96 * MiB}


def test_every_node_is_each_numa_node_the_host_has():
    """The default, *=50%: one configuration for one-socket and two-socket nodes."""
    assert fit_pools(parse_pools("*=50%"), {0: 2 * GiB}) == {0: GiB}
    assert fit_pools(parse_pools("*=50%"), {0: 2 * GiB, 1: 4 * GiB}) == {0: GiB, 1: 2 * GiB}
    assert fit_pools(parse_pools("*=25%,1=3Gi"), {0: 4 * GiB, 1: 4 * GiB}) == \
        {0: GiB, 1: 3 * GiB}  # a node named has its own size
    with pytest.raises(InvalidArgument, match="this host lists none under"):
        fit_pools(parse_pools("*=50%"), {})


@pytest.mark.parametrize(("spec", "line"), [
    ("0=50%,2=1Gi", "NUMA node 2 does not exist on this node (its NUMA nodes: 0, 1), and a "
                    "memory pool of 1Gi was asked there"),
    ("0=512Mi,1=3Gi", "NUMA node 1 has 2.0 GiB (2147483648 bytes) of memory (MemTotal), "
                      "and its memory pool asks 3Gi"),
])
def test_fit_pools_refuses_what_the_node_cannot_hold(spec, line):
    with pytest.raises(InvalidArgument) as exc:
        fit_pools(parse_pools(spec), {0: GiB, 1: 2 * GiB})
    assert str(exc.value) == line


@pytest.fixture
def no_start(monkeypatch):
    def started(*_a, **_k):
        raise AssertionError("the driver started although the node cannot hold its pools")
    monkeypatch.setattr(server, "serve", started)
    # serve's log handler would outlive this test's captured stderr, and the next test
    # that logs would print "--- Logging error ---" into its own.
    monkeypatch.setattr("csi_pmem.logs.setup", lambda *_a, **_k: None)
    for key in config.DEFAULTS:
        monkeypatch.delenv(config.env_name(key), raising=False)


def test_serve_refuses_pools_the_node_cannot_hold_in_one_line(tmp_path, no_start,
                                                              monkeypatch, capsys):
    monkeypatch.setattr(memory_sizing, "SYSFS_NODES",
                        write_nodes(tmp_path / "sys", {0: 1_048_576, 1: 1_048_576}))
    code = cli.main(["serve", "--backend", "memory", "--memory-pools", "0=50%,1=2Gi",
                     "--state-dir", str(tmp_path / "state")])
    err = capsys.readouterr().err
    assert code == Exit.USAGE == 2
    assert err == ("csi-pmem: --memory-pools: NUMA node 1 has 1.0 GiB (1073741824 bytes) "
                   "of memory (MemTotal), and its memory pool asks 2Gi\n")
    # The variable names itself; a missing node is refused the same way.
    monkeypatch.setenv("CSI_PMEM_MEMORY_POOLS", "0=10%,3=10%")
    assert cli.main(["serve", "--backend", "memory"]) == Exit.USAGE
    err = capsys.readouterr().err
    assert err.startswith("csi-pmem: environment variable CSI_PMEM_MEMORY_POOLS: NUMA node "
                          "3 does not exist") and err.count("\n") == 1, err


def test_serve_refuses_a_page_size_the_pools_file_system_lacks(tmp_path, no_start, capsys):
    """Before the node's huge pages are read: 4k hugetlbfs pages have no sysfs file to
    name, and 1G tmpfs pages are not a thing; both are usage errors naming the flag."""
    for fs, pages, offer in [("hugetlbfs", "4k", "2M or 1G"), ("tmpfs", "1G", "4k or 2M")]:
        code = cli.main(["serve", "--backend", "memory", "--memory-pools", "0=64Mi",
                         "--memory-fs", fs, "--memory-pages", pages,
                         "--state-dir", str(tmp_path / "state")])
        err = capsys.readouterr().err
        assert code == Exit.USAGE == 2
        assert err == (f"csi-pmem: --memory-pages: {fs} pools offer {offer} pages, "
                       f"not {pages}\n"), err


def test_other_back_ends_never_check_the_memory_pools(tmp_path, no_start, monkeypatch):
    """A pool on a node the host lacks (1=50% on a one-node laptop) must not stop the
    emulated driver: only --backend memory fits its pools."""
    monkeypatch.setattr(memory_sizing, "SYSFS_NODES", write_nodes(tmp_path, {0: 1_048_576}))
    with pytest.raises(AssertionError, match="the driver started"):
        cli.main(["serve", "--backend", "emulated", "--memory-pools", "0=50%,1=50%",
                  "--state-dir", str(tmp_path / "s")])


# -- mounts -------------------------------------------------------------------------

@pytest.fixture
def mounter():
    return FakePoolMounter()


def test_each_pool_is_a_tmpfs_bound_to_its_node_in_huge_pages(tmp_path, mounter):
    backend = MemoryBackend(tmp_path, {0: 256 * MiB, 1: 128 * MiB}, mounter)
    assert mounter.calls == [
        ("csi-pmem-pool:region0", str(tmp_path / "region0"), "tmpfs",
         ("size=268435456", "mpol=bind:0", "huge=always", "mode=0700", "nosuid", "nodev",
          "noexec")),
        ("csi-pmem-pool:region1", str(tmp_path / "region1"), "tmpfs",
         ("size=134217728", "mpol=bind:1", "huge=always", "mode=0700", "nosuid", "nodev",
          "noexec"))]
    pools = {p.name: p for p in backend.pools()}
    assert [(p.numa_node, p.size, p.page_size, p.placement, p.media)
            for p in pools.values()] == [(0, 256 * MiB, 2 * MiB, "bind", "volatile"),
                                         (1, 128 * MiB, 2 * MiB, "bind", "volatile")]
    ns = backend.create("pmem-a", "region1", 64 * MiB, 2 * MiB)
    assert ns.numa_node == 1 and Path(ns.device).parent == tmp_path / "region1"
    assert Path(ns.device).stat().st_blocks * 512 >= 64 * MiB  # allocated, not sparse


def test_a_restart_keeps_mounts_that_are_as_configured(tmp_path, mounter):
    MemoryBackend(tmp_path, {0: 256 * MiB}, mounter)
    again = MemoryBackend(tmp_path, {0: 256 * MiB}, mounter)
    assert len(mounter.calls) == 1 and again.pools()[0].usable


def test_the_start_up_log_names_the_memory_back_end_and_a_kept_pool(tmp_path, mounter,
                                                                    caplog):
    """Found in the cluster tier: a memory driver's first line was the emulated back
    end's, "emulated pools under ... are volatile (--emulated-media volatile)", a flag
    nobody gave; and a restarted driver said nothing of the pools it found mounted."""
    caplog.set_level("INFO", logger="csi_pmem.driver.backends")
    MemoryBackend(tmp_path, {0: 256 * MiB}, mounter)
    first = [r.getMessage() for r in caplog.records]
    assert f"memory pools under {tmp_path} are volatile (DRAM: a node restart empties " \
           "them)" in first, first
    assert not [m for m in first if "emulated" in m], first
    assert not [m for m in first if "kept" in m], first
    caplog.clear()
    again = MemoryBackend(tmp_path, {0: 256 * MiB}, mounter)
    kept = [r.getMessage() for r in caplog.records]
    assert f"memory pool region0: kept the tmpfs mounted at {tmp_path / 'region0'}, with " \
           "its volumes" in kept, kept
    caplog.clear()
    again.pools()  # the listings check the mounts too, and say nothing while kept
    assert not [r for r in caplog.records if "kept" in r.getMessage()]


def test_other_options_are_remounted_and_4k_pages_say_so(tmp_path, mounter):
    MemoryBackend(tmp_path, {0: 256 * MiB}, mounter)
    backend = MemoryBackend(tmp_path, {0: 512 * MiB}, mounter, pages="4k")
    assert mounter.calls[-1][3] == ("remount", "size=536870912", "mpol=bind:0",
                                    "huge=never", "mode=0700", "nosuid", "nodev", "noexec")
    assert backend.pools()[0].page_size == 4096
    MemoryBackend(tmp_path, {0: 512 * MiB}, mounter, pages="4k")
    assert len(mounter.calls) == 2  # huge=never is not shown, and still matches


def test_a_vanished_mount_is_mounted_again_empty(tmp_path, mounter):
    backend = MemoryBackend(tmp_path, {0: 256 * MiB}, mounter)
    mounter.unmount_all()
    assert backend.pools()[0].usable
    assert len(mounter.calls) == 2 and mounter.find(str(tmp_path / "region0")) is not None


def test_never_mounts_over_files_or_another_file_system(tmp_path, mounter):
    (tmp_path / "region0").mkdir()
    (tmp_path / "region0" / "precious").write_text("x")
    with pytest.raises(FailedPrecondition, match="holds files"):
        MemoryBackend(tmp_path, {0: 256 * MiB}, mounter)
    target = str(tmp_path / "region1")
    mounter.table[target] = MountInfo(target, "ext4", "/dev/sda1", frozenset({"rw"}))
    with pytest.raises(FailedPrecondition, match="is a ext4 mount"):
        MemoryBackend(tmp_path, {1: 256 * MiB}, mounter)


def test_hugetlbfs_pools_and_page_choices(tmp_path, mounter):
    backend = MemoryBackend(tmp_path, {0: 2 * GiB + 256 * MiB}, mounter, fs="hugetlbfs",
                            pages="1G")
    assert mounter.calls[0][2:] == ("hugetlbfs", ("pagesize=1G", f"size={2 * GiB}",
                                                  "mode=0700", "nosuid", "nodev", "noexec"))
    pool = backend.pools()[0]
    assert pool.page_size == GiB and pool.size == 2 * GiB  # whole pages, as the kernel cuts
    # A volume takes whole pages, and is counted so: 100 MiB asks one 1 GiB page.
    assert pool.align == GiB and pool.allocation(100 * MiB, 2 * MiB)[0] == GiB
    assert len(mounter.calls) == 1  # mountinfo's pagesize=1024M is today's 1G: no remount
    with pytest.raises(InvalidArgument, match="less than one 1G huge page"):
        MemoryBackend(tmp_path / "s", {0: 256 * MiB}, mounter, fs="hugetlbfs", pages="1G")
    with pytest.raises(InvalidArgument, match="use 4k or 2M"):
        MemoryBackend(tmp_path / "t", {0: 256 * MiB}, mounter, pages="1G")
    with pytest.raises(InvalidArgument, match="use 2M or 1G"):
        MemoryBackend(tmp_path / "h", {0: 256 * MiB}, mounter, fs="hugetlbfs", pages="4k")


# -- what the pools say -------------------------------------------------------------

def test_volume_info_shows_each_pools_node_pages_and_placement(tmp_path, mounter):
    backend = MemoryBackend(tmp_path, {0: 256 * MiB, 1: 128 * MiB}, mounter)
    info = IdentityServicer("csi-pmem.io", backend.probe, pools=backend.pools)
    manifest = dict(info._manifest())
    assert manifest["pool.region1"] == ("numa=1 size=128Mi free=128Mi pages=2Mi "
                                        "placement=bind media=volatile")
    text = output.render("info", {"plugin": {"name": "csi-pmem.io", "manifest": manifest},
                                  "probe": {"ready": True}, "node": {}}, "table")
    table = text.split("\n\n")[1].splitlines()
    assert table[0].split() == ["POOL", "NUMA", "SIZE", "FREE", "PAGES", "PLACEMENT", "MEDIA",
                                "USABLE"]
    assert table[2].split() == ["region1", "1", "128Mi", "128Mi", "2Mi", "bind", "volatile",
                                "yes"]
    # A pool the driver cannot use says so, not only in the manifest.
    manifest["pool.region1"] += " usable=no"
    text = output.render("info", {"plugin": {"name": "csi-pmem.io", "manifest": manifest},
                                  "probe": {"ready": True}, "node": {}}, "table")
    assert text.split("\n\n")[1].splitlines()[2].split()[-1] == "no"


def test_info_without_pools_and_a_failing_listing(tmp_path):
    def broken():
        raise OSError("ndctl is gone")
    assert IdentityServicer("x", lambda: (True, "ok"), pools=broken)._manifest() == {}
    text = output.render("info", {"plugin": {"name": "x"}, "probe": {}, "node": {}}, "table")
    assert "POOL" not in text


def test_hugetlbfs_pools_need_the_nodes_reserved_huge_pages(tmp_path, no_start, monkeypatch,
                                                            capsys):
    sys_root = tmp_path / "sys"
    monkeypatch.setattr(memory_sizing, "SYSFS_NODES",
                        write_nodes(sys_root, {0: 1_048_576, 1: 1_048_576}))
    for node, count in ((0, 128), (1, 64)):
        d = sys_root / f"node{node}" / "hugepages" / "hugepages-2048kB"
        d.mkdir(parents=True)
        (d / "nr_hugepages").write_text(f"{count}\n")
    argv = ["serve", "--backend", "memory", "--memory-fs", "hugetlbfs",
            "--memory-pools", "0=256Mi,1=256Mi", "--state-dir", str(tmp_path / "state")]
    assert cli.main(argv) == Exit.USAGE
    err = capsys.readouterr().err
    assert err == ("csi-pmem: --memory-pools: NUMA node 1 has 64 huge pages of 2Mi reserved "
                   "(128Mi), and its memory pool asks 256Mi; reserve 128 in "
                   f"{sys_root}/node1/hugepages/hugepages-2048kB/nr_hugepages\n")
    (sys_root / "node1" / "hugepages" / "hugepages-2048kB" / "nr_hugepages").write_text("128")
    with pytest.raises(AssertionError, match="the driver started"):
        cli.main(argv)
