"""The on-volume weight store, shared by the pod-side loader and the node's copy service.

Why a package of its own: the copy service reads the same layout, index and checksums
as the loader, but must not depend on the pod-side library; both depend on this.
Standard library and numpy only: no torch, no CUDA, no grpc.
"""
