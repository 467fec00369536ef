"""The host the driver runs on: mounts, loop devices, file systems, commands.

Why a package: these wrap the kernel and its tools (argv lists with timeouts) behind
small interfaces, so the core and the publishers never shell out themselves and the
unit tier can put fakes behind the same interfaces.
"""
