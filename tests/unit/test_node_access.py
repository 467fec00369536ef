"""Access modes, applied once before dispatch, hold for every kind of volume alike.

One table of kinds (a devdax directory, an fsdax block device, an fsdax file system),
each check run on all of them in-process through the fake mounter: the shared policy in
``Driver.publish`` must not depend on which publisher the volume ends up in.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest

from conftest import Mode, block_cap, mount_cap
from inprocess import InProcessNode, code_of, node_fixture  # noqa: F401 (the fixture)


@dataclass(frozen=True)
class Kind:
    name: str
    params: dict
    block: bool

    def cap(self, mode=Mode.SINGLE_NODE_WRITER):
        return block_cap(mode) if self.block else mount_cap(mode)


KINDS = [Kind("devdax", {}, False), Kind("fsdax-block", {"deviceMode": "fsdax"}, True),
         Kind("fsdax-fs", {"deviceMode": "fsdax"}, False)]


@pytest.fixture(params=KINDS, ids=lambda k: k.name)
def kind(request) -> Kind:
    return request.param


class Volume:
    """A volume of ``kind``, staged where that kind needs it, with pod targets."""

    def __init__(self, node: InProcessNode, kind: Kind, mode) -> None:
        self.node, self.kind, self.mode = node, kind, mode
        self.id = node.create(f"vol-{kind.name}", params=kind.params,
                              caps=[kind.cap(mode)]).volume.volume_id
        self.staging = node.staging(self.id)
        node.stage(self.id, self.staging, cap=kind.cap(mode))

    def target(self, pod: str) -> str:
        return self.node.block_target(pod) if self.kind.block else self.node.target(pod)

    def publish(self, pod: str, readonly: bool = False, mode=None) -> None:
        self.node.publish(self.id, self.target(pod), readonly=readonly,
                          cap=self.kind.cap(self.mode if mode is None else mode),
                          staging=self.staging)

    def unpublish(self, pod: str) -> None:
        self.node.unpublish(self.id, self.target(pod))

    def writers(self) -> list[str]:
        pubs = self.node.record(self.id).publications
        return sorted(t for t, p in pubs.items() if not p.readonly)


def test_single_node_single_writer_allows_one_writable_publication(node, kind):
    vol = Volume(node, kind, Mode.SINGLE_NODE_SINGLE_WRITER)
    vol.publish("w1")
    vol.publish("w1")  # the same publication again is no second writer
    with pytest.raises(grpc.RpcError) as info:
        vol.publish("w2")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert vol.target("w1") in info.value.details()  # names where the writer is
    vol.publish("r", readonly=True)  # readers are fine
    assert vol.writers() == [vol.target("w1")]
    vol.unpublish("w1")
    vol.publish("w2")  # the writer is gone now
    assert vol.writers() == [vol.target("w2")]


@pytest.mark.parametrize("mode", [Mode.SINGLE_NODE_WRITER, Mode.SINGLE_NODE_MULTI_WRITER])
def test_other_single_node_modes_allow_several_writers(node, kind, mode):
    vol = Volume(node, kind, mode)
    vol.publish("w1")
    vol.publish("w2")
    assert vol.writers() == sorted([vol.target("w1"), vol.target("w2")])


def test_a_reader_only_mode_publishes_read_only(node, kind):
    vol = Volume(node, kind, Mode.SINGLE_NODE_READER_ONLY)
    vol.publish("r")
    pub = node.record(vol.id).publications[vol.target("r")]
    assert pub.readonly
    mounted = node.fake.find(vol.target("r"))
    assert mounted is not None and mounted.readonly


@pytest.mark.parametrize("mode", [Mode.MULTI_NODE_MULTI_WRITER, Mode.MULTI_NODE_READER_ONLY,
                                  Mode.UNKNOWN])
def test_modes_beyond_one_node_are_refused_before_anything_is_mounted(node, kind, mode):
    vol = Volume(node, kind, Mode.SINGLE_NODE_WRITER)
    done = len(node.fake.calls)
    assert code_of(vol.publish, "p", mode=mode) == grpc.StatusCode.INVALID_ARGUMENT
    assert node.fake.calls[done:] == []
    assert node.record(vol.id).publications == {}
