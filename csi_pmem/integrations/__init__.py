"""Inference servers' plugins that load from a csi-pmem volume (docs/inference.md).

Why a package apart from :mod:`csi_pmem.loader`: each module here imports a server's
own API (vLLM's model loader classes), which the loader must never need; a server's
plugin mechanism imports only the module it names, and only in that server.
"""
