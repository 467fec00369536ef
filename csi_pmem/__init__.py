"""csi-pmem: a Kubernetes CSI driver for persistent memory (devdax namespaces per volume)."""

__version__ = "0.1.0"
DEFAULT_DRIVER_NAME = "csi-pmem.io"
