"""End to end through the driver: a pod-like process whose device cgroup denies the
volume's device still receives the fd from dax.sock, maps it, writes and reads.

The emulated back end runs with ``--emulated-device loop`` so the volume is a real
device node (a loop block device over the backing file) and the kernel's device cgroup
applies to it exactly as it would to ``/dev/daxX.Y`` (the host kernel has no
device-dax; the QEMU tier repeats this with a real one).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import uuid

import pytest

import cgroups
from conftest import MiB, needs_root
from test_daxsock import CONNECT_FROM_CGROUP, DENIED_CHILD, pod_cgroup, run_child

pytestmark = needs_root()
POD_UID_KEY = "csi.storage.k8s.io/pod.uid"


@pytest.fixture(params=sorted(cgroups.hierarchies()), ids=lambda v: f"cgroup-v{v}")
def tree(request):
    t = cgroups.CgroupTree(cgroups.hierarchies()[request.param])
    try:
        yield t
    finally:
        t.cleanup()


def test_pod_in_device_denied_cgroup_maps_volume_through_driver(driver_factory, tree):
    d = driver_factory(device="loop").start()
    vol = d.create("weights", size=32 * MiB, params={"numaNode": "1"}).volume
    device = vol.volume_context["device"]
    assert device.startswith("/dev/loop")
    pod = str(uuid.uuid4())
    target = d.target(pod)
    d.publish(vol.volume_id, target, context={POD_UID_KEY: pod})

    container = pod_cgroup(tree, pod, "cgroupfs")
    rdev = os.stat(device).st_rdev
    container.deny_device("b", os.major(rdev), os.minor(rdev))
    pattern = secrets.token_bytes(4096)
    out = run_child(DENIED_CHILD, json.dumps({
        "device": device, "procs": container.procs_file, "socket": target,
        "pattern": pattern.hex()}))

    assert out["open_before"] == 0
    assert out["open_rdwr"] == errno.EPERM and out["open_rdonly"] == errno.EPERM
    assert out["reopen_proc_fd"] == errno.EPERM
    assert out["readback"] is True and out["map_volume_sees_pattern"] is True
    assert out["metadata"]["volume_id"] == vol.volume_id
    assert out["metadata"]["numa_node"] == 1

    # Another pod's process is refused, even though it can reach the socket.
    other = pod_cgroup(tree, str(uuid.uuid4()), "cgroupfs")
    refused = run_child(CONNECT_FROM_CGROUP, json.dumps([other.procs_file]), target)
    assert refused["ok"] is False and "pod" in refused["server_message"]

    # A later "pod" (after unpublish and publish again) reads what the first one wrote.
    d.unpublish(vol.volume_id, target)
    d.publish(vol.volume_id, target, readonly=True)
    fd = os.open(device, os.O_RDONLY)
    try:
        assert os.pread(fd, len(pattern), 0) == pattern
    finally:
        os.close(fd)
    d.unpublish(vol.volume_id, target)
    d.delete(vol.volume_id)
    assert d.pool_files() == []
