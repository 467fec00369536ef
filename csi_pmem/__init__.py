"""csi-pmem: a Kubernetes CSI driver for persistent memory (devdax namespaces per volume).

Layers, top to bottom (each imports only from below; ``lint-imports`` enforces them with
the contracts in pyproject.toml): the entry points (``cli``); the processes (``server``,
``client``); the gRPC side (``servicers``, with the one status table); the core
(``driver``); the node publishers (``node``); the back ends (``backends``); node I/O
(``mounts``, ``loops``, ``state``, ``daxsock``, ... over ``runner``); and the common layer
(``sizes``, ``logs``, ``mountinfo``, ``failpoints``, ``daxclient``, ``errors``), standard
library only. ``loader`` and ``weights_cli`` run in inference pods: they use the common
layer and never the driver, grpc or protobuf.
"""

__version__ = "0.1.0"
DEFAULT_DRIVER_NAME = "csi-pmem.io"
