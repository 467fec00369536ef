"""Tests for dax.sock: fd passing, peer authentication and the device-cgroup bypass.

Why these tests: the devdax design stands on two kernel facts (device cgroups check open()
only; SO_PEERCRED + /proc/<pid>/cgroup identify the pod) and on the node plugin being
the only authorisation point. So the important tests use real processes in real cgroups,
a real block device with a real device-deny rule, and a real pid namespace, not mocks.
They need root (CI runs them as root) and clean up every cgroup, loop device, child
process and temp file even when an assertion fails.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import json
import mmap
import os
import secrets
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from csi_pmem import fdpass
from csi_pmem.daxclient import DaxSocketError, map_volume, open_volume
from csi_pmem.driver.daxsock import DaxSocketServer, pod_uid_in_cgroups

try:
    from tests import cgroups
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    import cgroups  # type: ignore[no-redef]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(
    not IS_ROOT, reason="needs root: creates cgroups, loop devices and pid namespaces")
CGROUP_VERSIONS = sorted(cgroups.hierarchies())
MiB = 1 << 20


# -- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture
def workdir() -> Iterator[str]:
    # Not tmp_path: pytest keeps those around; the brief is to leave nothing behind.
    with tempfile.TemporaryDirectory(prefix="csi-pmem-daxsock-") as d:
        yield d


@pytest.fixture
def server() -> Iterator[DaxSocketServer]:
    srv = DaxSocketServer()
    try:
        yield srv
    finally:
        srv.close()


def make_file(path: str, content: bytes) -> str:
    with open(path, "wb") as f:
        f.write(content)
    return path


def opener_for(path: str, flags: int) -> Callable[[], int]:
    return lambda: os.open(path, flags | os.O_CLOEXEC)


def metadata(volume_id: str = "vol-1", size: int = 4096, readonly: bool = False,
             **extra: object) -> dict[str, object]:
    return {"volume_id": volume_id, "device": "/dev/dax0.0", "numa_node": 0, "size": size,
            "usable_size": size, "align": 2 * MiB, "readonly": readonly, **extra}


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_child(code: str, *args: str, timeout: float = 60) -> dict[str, object]:
    """Run a Python snippet in a fresh process; it prints one JSON object as its result."""
    proc = subprocess.run([sys.executable, "-c", code, *args], check=False, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def background_child(argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    """A long-running child that prints "ready"; killed and reaped however the test ends."""
    proc = subprocess.Popen(argv, env=child_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.kill()
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"child did not start: {line!r}\n{err}")
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def wait_until(predicate: Callable[[], bool], timeout: float = 10) -> bool:
    """Counters move in the server thread just after the client has its answer."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def errno_of(fn: Callable[[], object]) -> int:
    try:
        fn()
    except OSError as exc:
        return exc.errno or -1
    return 0


# Joins the cgroups given as argv[1] (a JSON list of cgroup.procs files), then asks for
# the volume at argv[2]. Used to prove who is and who is not served.
CONNECT_FROM_CGROUP = r"""
import json, os, sys
from csi_pmem.daxclient import DaxSocketError, open_volume
for procs in json.loads(sys.argv[1]):
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
try:
    md, fd = open_volume(sys.argv[2], timeout=10)
    os.close(fd)
    print(json.dumps({"ok": True, "metadata": md}))
except DaxSocketError as e:
    print(json.dumps({"ok": False, "error": str(e), "server_message": e.server_message}))
"""


# -- basics --------------------------------------------------------------------------------


def test_serves_metadata_and_a_readable_fd(server: DaxSocketServer, workdir: str) -> None:
    data = make_file(os.path.join(workdir, "data"), b"hello devdax\n" * 100)
    sock = os.path.join(workdir, "dax.sock")
    md = metadata(size=1300, future_key={"opaque": [1, 2]})
    server.serve(sock, md, opener_for(data, os.O_RDWR), pod_uid=None)

    got, fd = open_volume(workdir)  # the directory form, as pods use it
    try:
        assert got == md  # unknown keys come through untouched
        assert os.pread(fd, 13, 0) == b"hello devdax\n"
        assert not os.get_inheritable(fd)
    finally:
        os.close(fd)
    got, mapping = map_volume(sock)  # the socket form
    with mapping:
        assert mapping[:13] == b"hello devdax\n"
        mapping[:5] = b"HELLO"  # MAP_SHARED: lands in the file
    with open(data, "rb") as f:
        assert f.read(5) == b"HELLO"
    assert wait_until(lambda: (server.served, server.refused, server.failed) == (2, 0, 0))


def test_readonly_fd_cannot_be_written_or_mapped_writable(
        server: DaxSocketServer, workdir: str) -> None:
    data = make_file(os.path.join(workdir, "data"), b"\0" * 8192)
    sock = os.path.join(workdir, "dax.sock")
    server.serve(sock, metadata(size=8192, readonly=True), opener_for(data, os.O_RDONLY),
                 pod_uid=None)

    _, fd = open_volume(sock)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 8192, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        assert errno_of(lambda: os.write(fd, b"x")) == errno.EBADF
        with mmap.mmap(fd, 8192, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as ro:
            assert ro[:4] == b"\0\0\0\0"
    finally:
        os.close(fd)

    _, mapping = map_volume(sock)  # writable=None follows the volume's read-only flag
    with mapping, pytest.raises(TypeError):
        mapping[0] = 1
    with pytest.raises(DaxSocketError, match="read-only"):
        map_volume(sock, writable=True)


def test_socket_mode_and_mount_group(server: DaxSocketServer, workdir: str) -> None:
    data = make_file(os.path.join(workdir, "data"), b"x")
    open_ = opener_for(data, os.O_RDONLY)
    plain, grouped = os.path.join(workdir, "a.sock"), os.path.join(workdir, "b.sock")
    server.serve(plain, metadata(), open_, pod_uid=None)
    st = os.stat(plain)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o666

    gid = os.getgid() if not IS_ROOT else 4242  # only root may chown to a foreign group
    server.serve(grouped, metadata(), open_, pod_uid=None, gid=gid)
    st = os.stat(grouped)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid


def test_serve_is_idempotent_and_replaces_metadata(
        server: DaxSocketServer, workdir: str) -> None:
    one = make_file(os.path.join(workdir, "one"), b"1")
    two = make_file(os.path.join(workdir, "two"), b"2")
    sock = os.path.join(workdir, "dax.sock")
    server.serve(sock, metadata("v1"), opener_for(one, os.O_RDONLY), pod_uid=None)
    inode = os.stat(sock).st_ino
    server.serve(sock, metadata("v2"), opener_for(two, os.O_RDONLY), pod_uid=None)
    assert os.stat(sock).st_ino == inode  # same listener, nothing re-bound
    assert server.paths() == [sock]
    md, fd = open_volume(sock)
    try:
        assert md["volume_id"] == "v2" and os.pread(fd, 1, 0) == b"2"
    finally:
        os.close(fd)


def test_serve_refuses_to_replace_a_non_socket(server: DaxSocketServer, workdir: str) -> None:
    path = make_file(os.path.join(workdir, "dax.sock"), b"precious")
    with pytest.raises(FileExistsError, match="not a socket"):
        server.serve(path, metadata(), lambda: os.open(path, os.O_RDONLY), pod_uid=None)
    with open(path, "rb") as f:
        assert f.read() == b"precious"
    assert server.paths() == []


def test_stop_removes_socket_and_unknown_paths_are_fine(
        server: DaxSocketServer, workdir: str) -> None:
    data = make_file(os.path.join(workdir, "data"), b"x")
    sock = os.path.join(workdir, "dax.sock")
    server.serve(sock, metadata(), opener_for(data, os.O_RDONLY), pod_uid=None)
    server.stop(sock)
    assert not os.path.exists(sock) and server.paths() == []
    server.stop(sock)
    server.stop(os.path.join(workdir, "never-served.sock"))
    with pytest.raises(DaxSocketError, match="does not exist"):
        open_volume(sock)


def test_a_live_socket_is_never_taken_over_and_stop_removes_only_its_own(
        workdir: str) -> None:
    # A second server (a second driver on the node) must not take over a path the first
    # one serves: the pods connected there would lose it. Once the first has stopped,
    # the path is free and the second serves it; the first's stop never removes the
    # second's socket.
    data = make_file(os.path.join(workdir, "data"), b"x")
    sock = os.path.join(workdir, "dax.sock")
    with DaxSocketServer() as old, DaxSocketServer() as new:
        old.serve(sock, metadata("old"), opener_for(data, os.O_RDONLY), pod_uid=None)
        with pytest.raises(fdpass.SocketInUse):
            new.serve(sock, metadata("new"), opener_for(data, os.O_RDONLY), pod_uid=None)
        md, fd = open_volume(sock)
        os.close(fd)
        assert md["volume_id"] == "old"
        old.stop(sock)
        new.serve(sock, metadata("new"), opener_for(data, os.O_RDONLY), pod_uid=None)
        old.stop(sock)  # not its socket any more: left alone
        old.close()
        md, fd = open_volume(sock)
        os.close(fd)
        assert md["volume_id"] == "new"
        # A path this server never served: a live socket stays, a stale one goes.
        third = DaxSocketServer()
        third.stop(sock)
        assert stat.S_ISSOCK(os.lstat(sock).st_mode)
        third.close()
        stale = os.path.join(workdir, "stale.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(stale)
        s.close()
        new.stop(stale)
        assert not os.path.exists(stale)


def test_long_socket_path_beyond_sun_path(server: DaxSocketServer, workdir: str) -> None:
    # Kubelet targets are ~140 bytes; sun_path holds 107.
    deep = os.path.join(workdir, "pods", str(uuid.uuid4()), "volumes", "kubernetes.io~csi",
                        f"pvc-{uuid.uuid4()}", "mount")
    os.makedirs(deep)
    sock = os.path.join(deep, "dax.sock")
    assert len(sock) > 108
    data = make_file(os.path.join(workdir, "data"), b"long")
    server.serve(sock, metadata(), opener_for(data, os.O_RDONLY), pod_uid=None)
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    _, fd = open_volume(deep)
    try:
        assert os.pread(fd, 4, 0) == b"long"
    finally:
        os.close(fd)


def test_opener_failure_is_reported_and_the_loop_survives(
        server: DaxSocketServer, workdir: str) -> None:
    events: list[tuple[str, str]] = []
    server.on_event = lambda kind, path: events.append((kind, path))
    bad = os.path.join(workdir, "bad.sock")
    good = os.path.join(workdir, "good.sock")
    data = make_file(os.path.join(workdir, "data"), b"ok")

    def broken() -> int:
        raise OSError(errno.ENXIO, "No such device or address", "/dev/dax9.9")

    server.serve(bad, metadata(), broken, pod_uid=None)
    server.serve(good, metadata(), opener_for(data, os.O_RDONLY), pod_uid=None)
    with pytest.raises(DaxSocketError, match="could not open the volume's device") as info:
        open_volume(bad)
    assert "dax9.9" in (info.value.server_message or "")
    _, fd = open_volume(good)
    os.close(fd)
    assert wait_until(lambda: (server.served, server.failed) == (1, 1))
    assert events == [("error", bad), ("served", good)]


def test_stale_socket_without_listener_gives_a_clear_error(workdir: str) -> None:
    sock = os.path.join(workdir, "dax.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock)  # what a crashed node plugin leaves behind: a socket file, no listener
    s.close()
    with pytest.raises(DaxSocketError, match="nothing is listening") as info:
        open_volume(workdir, timeout=2)
    assert sock in str(info.value) and info.value.server_message is None


def test_not_a_volume_gives_a_clear_error(workdir: str) -> None:
    with pytest.raises(DaxSocketError, match="does not exist"):
        open_volume(workdir)  # a directory without dax.sock
    path = make_file(os.path.join(workdir, "plain"), b"")
    with pytest.raises(DaxSocketError):
        open_volume(path)


def test_restart_after_sigkill_serves_the_stale_path_again(workdir: str) -> None:
    data = make_file(os.path.join(workdir, "data"), b"after restart")
    sock = os.path.join(workdir, "dax.sock")
    old_server = r"""
import os, sys, time
from csi_pmem.driver.daxsock import DaxSocketServer
srv = DaxSocketServer()
srv.serve(sys.argv[1], {"volume_id": "old"}, lambda: os.open(sys.argv[2], os.O_RDONLY),
          pod_uid=None)
print("ready", flush=True)
time.sleep(600)
"""
    with background_child([sys.executable, "-c", old_server, sock, data]) as proc:
        md, fd = open_volume(sock)
        os.close(fd)
        assert md["volume_id"] == "old"
        proc.kill()  # SIGKILL: no stop(), no unlink
        proc.wait(timeout=30)
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    with pytest.raises(DaxSocketError, match="nothing is listening"):
        open_volume(sock, timeout=2)

    with DaxSocketServer() as srv:
        srv.serve(sock, metadata("new", size=13), opener_for(data, os.O_RDONLY), pod_uid=None)
        md, fd = open_volume(sock)
        try:
            assert md["volume_id"] == "new" and os.pread(fd, 13, 0) == b"after restart"
        finally:
            os.close(fd)
    assert not os.path.exists(sock)  # close() cleans up after itself


def test_a_client_that_never_reads_does_not_block_others(
        server: DaxSocketServer, workdir: str) -> None:
    data = make_file(os.path.join(workdir, "data"), b"x")
    sock = os.path.join(workdir, "dax.sock")
    server.serve(sock, metadata(), opener_for(data, os.O_RDONLY), pod_uid=None)
    idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(20)]
    try:
        for s in idle:
            s.connect(sock)  # and never read
        start = time.monotonic()
        _, fd = open_volume(sock, timeout=5)
        os.close(fd)
        assert time.monotonic() - start < 1.5
    finally:
        for s in idle:
            s.close()


def test_many_concurrent_clients_on_several_sockets(
        server: DaxSocketServer, workdir: str) -> None:
    n_sockets, n_clients = 5, 50
    socks = []
    for i in range(n_sockets):
        data = make_file(os.path.join(workdir, f"data{i}"), f"volume-{i}".encode())
        sock = os.path.join(workdir, f"v{i}", "dax.sock")
        os.mkdir(os.path.dirname(sock))
        server.serve(sock, metadata(f"vol-{i}"), opener_for(data, os.O_RDONLY), pod_uid=None)
        socks.append(sock)
    barrier = threading.Barrier(n_clients)

    def client(k: int) -> tuple[str, bytes]:
        barrier.wait(timeout=30)
        md, fd = open_volume(socks[k % n_sockets], timeout=20)
        try:
            return str(md["volume_id"]), os.pread(fd, 16, 0)
        finally:
            os.close(fd)

    # Publishes and unpublishes of other volumes happen while pods connect.
    stop_churn = threading.Event()

    def churn() -> None:
        extra = os.path.join(workdir, "churn.sock")
        while not stop_churn.is_set():
            server.serve(extra, metadata("churn"), lambda: os.open("/dev/null", os.O_RDONLY),
                         pod_uid=None)
            server.stop(extra)

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(n_clients) as pool:
            results = list(pool.map(client, range(n_clients)))
    finally:
        stop_churn.set()
        churner.join(timeout=30)
    for k, (volume_id, content) in enumerate(results):
        assert volume_id == f"vol-{k % n_sockets}"
        assert content == f"volume-{k % n_sockets}".encode()
    assert wait_until(lambda: (server.served, server.failed) == (n_clients, 0))
    assert server.paths() == sorted(socks)


def test_server_uses_one_thread_for_all_sockets(workdir: str) -> None:
    before = threading.active_count()
    with DaxSocketServer() as srv:
        for i in range(200):
            srv.serve(os.path.join(workdir, f"{i}.sock"), metadata(str(i)),
                      lambda: os.open("/dev/null", os.O_RDONLY), pod_uid=None)
        assert threading.active_count() == before + 1
    assert threading.active_count() == before
    assert not [n for n in os.listdir(workdir) if n.endswith(".sock")]


# -- peer authentication ---------------------------------------------------------------------


def test_pod_uid_matching() -> None:
    uid = "0f9d2c1e-7a55-4b1e-9c1a-3e2f8d6b4a10"
    us = uid.replace("-", "_")
    yes = [
        f"5:devices:/kubepods/besteffort/pod{uid}/0123abcd",
        f"4:devices:/kubepods/pod{uid}/c",
        (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{us}.slice/"
         "cri-containerd-0123.scope"),
        f"0::/kubepods.slice/kubepods-pod{us}.slice/crio-0123.scope",
        # Seen from a node plugin in its own cgroup namespace (containerd on v2 default).
        f"0::/../../kubepods-besteffort-pod{us}.slice/cri-containerd-0123.scope",
        f"1:name=systemd:/x\n0::/kubepods/pod{uid}/c",
    ]
    no = [
        "0::/",
        "0::/system.slice/kubelet.service",
        f"0::/kubepods/pod{uid}x/c",  # a longer UID that merely starts with ours
        f"0::/kubepods/xpod{uid}/c",
        f"0::/kubepods/burstable/pod{uuid.uuid4()}/c",
        f"garbage pod{uid}",
    ]
    for text in yes:
        assert pod_uid_in_cgroups(text, uid), text
    for text in no:
        assert not pod_uid_in_cgroups(text, uid), text


def test_proc_root_is_configurable(workdir: str) -> None:
    uid = str(uuid.uuid4())
    proc = os.path.join(workdir, "proc")
    os.makedirs(os.path.join(proc, str(os.getpid())))
    data = make_file(os.path.join(workdir, "data"), b"x")
    sock = os.path.join(workdir, "dax.sock")
    with DaxSocketServer(proc_root=proc) as srv:
        srv.serve(sock, metadata(), opener_for(data, os.O_RDONLY), pod_uid=uid)
        with pytest.raises(DaxSocketError, match="cannot read the cgroups"):
            open_volume(sock)
        make_file(os.path.join(proc, str(os.getpid()), "cgroup"),
                  f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/c.scope\n"
                  .encode())
        _, fd = open_volume(sock)
        os.close(fd)
        assert wait_until(lambda: (srv.served, srv.refused) == (1, 1))


def test_a_refused_peer_gone_before_the_reply_is_counted_once(
        workdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = os.path.join(workdir, "proc")
    os.makedirs(os.path.join(proc, str(os.getpid())))
    data = make_file(os.path.join(workdir, "data"), b"x")
    sock = os.path.join(workdir, "dax.sock")
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with DaxSocketServer(proc_root=proc) as srv:
        authorize = srv._authorize

        def peer_leaves_first(*args):  # the peer exits while it is being checked
            client.close()
            return authorize(*args)

        monkeypatch.setattr(srv, "_authorize", peer_leaves_first)
        srv.serve(sock, metadata(), opener_for(data, os.O_RDONLY), pod_uid=str(uuid.uuid4()))
        client.connect(sock)
        assert wait_until(lambda: srv.refused == 1)
        time.sleep(0.1)
        assert (srv.served, srv.refused, srv.failed) == (0, 1, 0)


def test_running_out_of_fds_backs_off_and_logs_once(
        server: DaxSocketServer, workdir: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """accept() failing with EMFILE leaves the connection pending, so select() would
    wake at once, forever: the loop must pause between tries and log once, not spin."""
    data = make_file(os.path.join(workdir, "data"), b"x")
    sock = os.path.join(workdir, "dax.sock")
    server.serve(sock, metadata(), opener_for(data, os.O_RDONLY), pod_uid=None)
    tries = []
    real_accept = socket.socket.accept

    def accept(self):
        if self.family == socket.AF_UNIX and self.getsockname() == sock and len(tries) < 1000:
            tries.append(time.monotonic())
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(self)

    monkeypatch.setattr(socket.socket, "accept", accept)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(sock)
    time.sleep(0.5)
    monkeypatch.setattr(socket.socket, "accept", real_accept)
    client.close()
    assert 2 <= len(tries) <= 0.5 / 0.05 + 2, len(tries)
    assert sum("accept failed" in r.getMessage() for r in caplog.records) == 1


@pytest.fixture(params=CGROUP_VERSIONS, ids=lambda v: f"cgroup-v{v}")
def cgroup_tree(request: pytest.FixtureRequest) -> Iterator[cgroups.CgroupTree]:
    if not IS_ROOT:
        pytest.skip("needs root to create cgroups")
    tree = cgroups.CgroupTree(cgroups.hierarchies()[request.param])
    try:
        yield tree
    finally:
        tree.cleanup()


def pod_cgroup(tree: cgroups.CgroupTree, pod_uid: str, layout: str) -> cgroups.Cgroup:
    """A container cgroup of pod ``pod_uid`` laid out like the kubelet's cgroup driver."""
    container = secrets.token_hex(8)
    if layout == "cgroupfs":
        return tree.create("kubepods", "burstable", f"pod{pod_uid}", container)
    us = pod_uid.replace("-", "_")
    return tree.create("kubepods.slice", "kubepods-burstable.slice",
                       f"kubepods-burstable-pod{us}.slice", f"cri-containerd-{container}.scope")


@needs_root
@pytest.mark.root
@pytest.mark.parametrize("layout", ["cgroupfs", "systemd"])
def test_only_processes_of_the_pod_are_served(
        server: DaxSocketServer, workdir: str, cgroup_tree: cgroups.CgroupTree,
        layout: str, caplog: pytest.LogCaptureFixture) -> None:
    pod, other_pod = str(uuid.uuid4()), str(uuid.uuid4())
    mine = pod_cgroup(cgroup_tree, pod, layout)
    theirs = pod_cgroup(cgroup_tree, other_pod, layout)
    data = make_file(os.path.join(workdir, "data"), b"x")
    sock = os.path.join(workdir, "dax.sock")
    server.serve(sock, metadata("pod-vol"), opener_for(data, os.O_RDONLY), pod_uid=pod)

    served = run_child(CONNECT_FROM_CGROUP, json.dumps([mine.procs_file]), sock)
    assert served["ok"], served
    assert served["metadata"]["volume_id"] == "pod-vol"  # type: ignore[index]

    refused = run_child(CONNECT_FROM_CGROUP, json.dumps([theirs.procs_file]), sock)
    assert not refused["ok"]
    assert f"published to pod {pod}" in str(refused["server_message"])

    with pytest.raises(DaxSocketError, match="is not in that pod's cgroup"):
        open_volume(sock)  # the test process itself belongs to no pod

    assert wait_until(lambda: (server.served, server.refused) == (1, 2))
    # The warning names the peer and its cgroups, so an operator can see who knocked.
    warnings = [r.getMessage() for r in caplog.records if "refused peer" in r.getMessage()]
    assert len(warnings) == 2 and f"pod{other_pod}" in warnings[0].replace("_", "-")
    assert mine.procs() == [] and theirs.procs() == []


@needs_root
@pytest.mark.root
def test_peer_outside_our_pid_namespace_is_refused(workdir: str) -> None:
    # The server runs as pid 1 of a new pid namespace; the test process is invisible
    # there, so SO_PEERCRED reports pid 0: what a node plugin without hostPID sees.
    data = make_file(os.path.join(workdir, "data"), b"x")
    sock = os.path.join(workdir, "dax.sock")
    server_code = r"""
import os, sys
from csi_pmem.driver.daxsock import DaxSocketServer
srv = DaxSocketServer()
srv.serve(sys.argv[1], {"volume_id": "ns"}, lambda: os.open(sys.argv[2], os.O_RDONLY),
          pod_uid=sys.argv[3])
print("ready", flush=True)
sys.stdin.read()
srv.close()
print(f"refused={srv.refused} served={srv.served}", flush=True)
"""
    argv = ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", server_code,
            sock, data, str(uuid.uuid4())]
    with background_child(argv) as proc:
        with pytest.raises(DaxSocketError, match="hostPID") as info:
            open_volume(sock)
        assert "cannot identify the connecting process" in (info.value.server_message or "")
        out, _ = proc.communicate(timeout=30)  # closes stdin: the server shuts down
        assert "refused=1 served=0" in out


# -- the key test: a device the pod's cgroup denies is still usable through the fd ---------


@pytest.fixture
def loop_device(workdir: str) -> Iterator[tuple[str, str]]:
    if not IS_ROOT:
        pytest.skip("needs root to create a loop device")
    backing = os.path.join(workdir, "backing.img")
    with open(backing, "wb") as f:
        f.truncate(4 * MiB)
    device = subprocess.run(["losetup", "--find", "--show", backing], check=True,
                            capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        yield device, backing
    finally:
        subprocess.run(["losetup", "-d", device], check=False, capture_output=True,
                       timeout=30)


DENIED_CHILD = r"""
import json, mmap, os, sys
from csi_pmem.daxclient import map_volume, open_volume
args = json.loads(sys.argv[1])
device, pattern = args["device"], bytes.fromhex(args["pattern"])
out = {}

def errno_of(fn):
    try:
        os.close(fn())
    except OSError as e:
        return e.errno
    return 0

# Control: before joining the cgroup this process may open the device, so a later
# EPERM is the cgroup's doing and nothing else's.
out["open_before"] = errno_of(lambda: os.open(device, os.O_RDONLY))
with open(args["procs"], "w") as f:
    f.write(str(os.getpid()))
out["cgroup"] = open("/proc/self/cgroup").read()
out["open_rdwr"] = errno_of(lambda: os.open(device, os.O_RDWR))
out["open_rdonly"] = errno_of(lambda: os.open(device, os.O_RDONLY))

md, fd = open_volume(args["socket"])
out["metadata"] = md
out["reopen_proc_fd"] = errno_of(lambda: os.open(f"/proc/self/fd/{fd}", os.O_RDWR))
out["reopen_proc_fd_ro"] = errno_of(lambda: os.open(f"/proc/self/fd/{fd}", os.O_RDONLY))
size = md["usable_size"]
m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
m[:len(pattern)] = pattern
m[size - len(pattern):] = pattern[::-1]
m.flush()  # msync: through the loop device into the backing file
out["readback"] = m[:len(pattern)] == pattern and m[size - len(pattern):] == pattern[::-1]
m.close()
os.close(fd)

# map_volume over a second connection sees the same bytes.
md2, m2 = map_volume(args["socket"])
out["map_volume_sees_pattern"] = m2[:len(pattern)] == pattern
m2.close()
print(json.dumps(out))
"""


@needs_root
@pytest.mark.root
def test_fd_from_dax_sock_maps_a_device_the_cgroup_denies(
        loop_device: tuple[str, str], cgroup_tree: cgroups.CgroupTree,
        workdir: str) -> None:
    device, backing = loop_device
    rdev = os.stat(device).st_rdev
    major, minor = os.major(rdev), os.minor(rdev)
    pod = str(uuid.uuid4())
    container = pod_cgroup(cgroup_tree, pod, "cgroupfs")
    container.deny_device("b", major, minor)  # what runc does for a pod without the device

    size = 4 * MiB
    sock = os.path.join(workdir, "dax.sock")
    pattern = secrets.token_bytes(4096)
    with DaxSocketServer() as srv:
        srv.serve(sock, metadata("loop-vol", size=size, device=device),
                  opener_for(device, os.O_RDWR), pod_uid=pod)
        out = run_child(DENIED_CHILD, json.dumps({
            "device": device, "procs": container.procs_file, "socket": sock,
            "pattern": pattern.hex()}))
        assert wait_until(lambda: (srv.served, srv.refused) == (2, 0))

    assert out["open_before"] == 0
    assert f"pod{pod}" in str(out["cgroup"])
    # (a) the pod's cgroup denies the device by path
    assert out["open_rdwr"] == errno.EPERM and out["open_rdonly"] == errno.EPERM
    # (b) the received fd cannot be laundered back into a new open of the device
    assert out["reopen_proc_fd"] == errno.EPERM and out["reopen_proc_fd_ro"] == errno.EPERM
    # (c) but the fd itself maps MAP_SHARED, read and write
    assert out["readback"] is True and out["map_volume_sees_pattern"] is True
    assert out["metadata"]["device"] == device  # type: ignore[index]

    # The bytes really reached the device: through our own fd and in the backing file.
    fd = os.open(device, os.O_RDONLY)
    try:
        assert os.pread(fd, len(pattern), 0) == pattern
        assert os.pread(fd, len(pattern), size - len(pattern)) == pattern[::-1]
        os.fsync(fd)
    finally:
        os.close(fd)
    with open(backing, "rb") as f:
        assert f.read(len(pattern)) == pattern
        f.seek(size - len(pattern))
        assert f.read() == pattern[::-1]
