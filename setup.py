"""Build of the one compiled part: the loader's native bounce loop
(csi_pmem/loader/gpu/_native/bounce.c).

Everything else is in pyproject.toml. The extension is optional: without a C compiler
the package installs without it, and the loader copies through its Python pipeline
(csi_pmem/loader/gpu/native.py says why the native loop exists). It uses no Python API and
is loaded with ctypes, so it needs no Python headers either.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "csi_pmem.loader.gpu._native.bounce", ["csi_pmem/loader/gpu/_native/bounce.c"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra"],
    libraries=["dl", "pthread"], optional=True)])
