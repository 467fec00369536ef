"""OSErrors become statuses that say what is short and where (csi_pmem.errors.from_os_error).

Why: an OSError that reaches the status table untranslated used to be "INTERNAL:
internal error (OSError); see the driver log". Each call site now passes its context
(which path, which volume, what it needs) and the errno picks the code.
"""

from __future__ import annotations

import errno
import subprocess
import sys

import grpc
import pytest

from csi_pmem.driver.servicers.status import status_for
from csi_pmem.errors import from_os_error

C = grpc.StatusCode


@pytest.mark.parametrize("code,status,says", [
    (errno.ENOSPC, C.RESOURCE_EXHAUSTED, "the file system holding /k/pods is full"),
    (errno.EDQUOT, C.RESOURCE_EXHAUSTED, "disk quota on the file system holding /k/pods"),
    (errno.EROFS, C.FAILED_PRECONDITION, "the file system holding /k/pods is read-only"),
    (errno.EACCES, C.FAILED_PRECONDITION, "must run as root with CAP_SYS_ADMIN"),
    (errno.EPERM, C.FAILED_PRECONDITION, "must run as root with CAP_SYS_ADMIN"),
    (errno.EMFILE, C.RESOURCE_EXHAUSTED, "the driver is out of file descriptors"),
    (errno.ENFILE, C.RESOURCE_EXHAUSTED, "the node is out of file descriptors"),
    (errno.ENOMEM, C.RESOURCE_EXHAUSTED, "out of memory"),
    (errno.EIO, C.INTERNAL, "dmesg"),
])
def test_each_errno_gets_a_code_and_advice(code, status, says):
    exc = OSError(code, "kernel words", "/k/pods/x/mount")
    got, message = status_for(from_os_error(exc, "cannot create target /k/pods/x/mount "
                                            "for volume v", fs="/k/pods", needs="NEEDS"))
    assert got == status
    assert message.startswith("cannot create target /k/pods/x/mount for volume v: ")
    assert says in message
    assert f"kernel words [{errno.errorcode[code]}]" in message
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        assert message.endswith(": NEEDS")


def test_path_comes_from_the_error_when_not_given():
    exc = OSError(errno.ENOSPC, "No space left on device", "/var/lib/x/.tmp")
    assert "holding /var/lib/x/.tmp is full" in str(from_os_error(exc, "writing"))


def test_a_command_the_driver_cannot_fork_for_says_what_is_short():
    """Out of descriptors before mount/ndctl can even start: RESOURCE_EXHAUSTED naming
    the limit, not an INTERNAL failure of the command. In a child process, whose fd
    limit is lowered and then used up."""
    child = r"""
import os, resource
from csi_pmem.errors import CsiPmemError
from csi_pmem.driver.host.runner import Runner
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
try:
    Runner().run(["true"])
except CsiPmemError as exc:
    print(type(exc).__name__, exc)
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.startswith("ResourceExhausted cannot start true: the driver is out of file "
                          "descriptors"), out
    assert "[EMFILE]" in out and "LimitNOFILE" in out
