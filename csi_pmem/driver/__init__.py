"""The node plugin process: the `driver` extra (grpc, protobuf, prometheus-client, pyudev).

Why a package: everything here runs only in the driver's DaemonSet pod; the loader
and the copy service must not import it (the import contracts in pyproject.toml).
:mod:`.core` owns the volume life cycle, :mod:`.server` assembles the process,
:mod:`.servicers` speak CSI, :mod:`.node` publishes, :mod:`.backends` carve,
:mod:`.erasing` zeroes and :mod:`.host` wraps the host's mounts and commands.
"""
