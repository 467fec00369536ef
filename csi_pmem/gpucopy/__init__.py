"""The node-side GPU copy service: weights from a published volume to a pod's GPU memory.

Why a service on the node: a restarted pod is a fresh process, and a fresh process
cannot make a model-sized mapping pinned (registering it with CUDA costs 0.025 s/GB on
2 MiB pages, about as long as the copy itself). A long-lived process on the node can:
it keeps the mapping of every published volume that holds a staged model registered,
once, at publish and stage time. A starting pod allocates its device memory with the
CUDA virtual memory API, exportable as a POSIX fd, and sends that fd and the list of
copies over the volume's ``gpu.sock``; the service imports the allocation, has the copy
engine read straight from its registered mapping, and reports progress, so the pod's
per-tensor futures resolve as the bytes land. The pod ends up with ordinary tensors
that are views of its own allocation.

Pieces: :mod:`.protocol` (messages, limits, request checks; standard library only, the
loader in the pod imports it), :mod:`.copier` (the copy engine interface with a fake,
file-backed implementation for tests), :mod:`.cuda` (the implementation with
cuda-python), :mod:`.service` (the process: control socket for the node plugin, one
thread per client), :mod:`.link` (the node plugin's half: prepare, release, forward an
authenticated client). docs/gpu-copy-service.md says how it is deployed.
"""
