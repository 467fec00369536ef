"""docs/layout.md against the package tree: every module placed, every name still real.

The convention (docs/layout.md says it too): a folder or module of the package is named
by its path from the repository root, folders with a trailing slash
(``csi_pmem/driver/node/``, ``csi_pmem/driver/daxsock.py``); a package's ``__init__.py``
is its folder. Every ``csi_pmem/...`` path and every dotted ``csi_pmem.x.y`` module name
anywhere in the document must exist; placing a module needs its path.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
DOC = ROOT / "docs" / "layout.md"
PACKAGE = "csi_pmem"

# The sources a module of the package is made of; build outputs (.so) and markers are not.
SOURCES = (".py", ".c", ".cu")
SKIP = {"__pycache__"}

# A path or a dotted module name of the package, not part of a longer word or path.
_PATH = re.compile(rf"(?<![\w./-]){PACKAGE}/[\w./-]*")
_DOTTED = re.compile(rf"(?<![\w./-]){PACKAGE}(?:\.\w+)+")


def package_names(root: Path) -> set[str]:
    """What the doc must name: each folder (``csi_pmem/x/``) and source module."""
    names = {f"{PACKAGE}/"}
    for path in (root / PACKAGE).rglob("*"):
        rel = path.relative_to(root)
        if SKIP.intersection(rel.parts):
            continue
        if path.is_dir():
            names.add(f"{rel.as_posix()}/")
        elif path.suffix in SOURCES and path.name != "__init__.py":
            names.add(rel.as_posix())
    return names


def doc_names(text: str) -> tuple[set[str], set[str]]:
    """The package paths and the dotted module names a document mentions."""
    paths = {m.rstrip(".") for m in _PATH.findall(text)}
    dotted = {m.rstrip(".") for m in _DOTTED.findall(text)}
    return paths, dotted


def _exists(root: Path, path: str) -> bool:
    target = root / path
    if SKIP.intersection(Path(path).parts):
        return False
    return target.is_dir() if path.endswith("/") else target.is_file()


def _module_exists(root: Path, dotted: str) -> bool:
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def missing(text: str, root: Path) -> list[str]:
    """Folders and modules of the package the document does not name by path."""
    paths, _ = doc_names(text)
    return sorted(package_names(root) - paths)


def stale(text: str, root: Path) -> list[str]:
    """Names in the document that are not in the tree (renamed, moved or removed)."""
    paths, dotted = doc_names(text)
    gone = {p for p in paths if not _exists(root, p)}
    gone |= {d for d in dotted if not _module_exists(root, d)}
    return sorted(gone)


def test_every_folder_and_module_is_placed_in_the_layout_doc():
    absent = missing(DOC.read_text(encoding="utf-8"), ROOT)
    assert not absent, (
        f"{DOC} does not name these (a path from the repository root, in "
        "backticks, folders ending in '/'; give each a line saying what it owns and why):\n  "
        + "\n  ".join(absent)
    )


def test_every_package_name_in_the_layout_doc_exists():
    gone = stale(DOC.read_text(encoding="utf-8"), ROOT)
    assert not gone, (
        f"{DOC} names what is not in the tree (renamed, moved or removed? "
        "a folder needs its trailing '/', a file must not have one):\n  " + "\n  ".join(gone)
    )


def test_the_check_reports_exactly_the_missing_and_the_stale_names(tmp_path):
    """The two checks above on a tree and a document made here, so they can fail."""
    for rel in (
        "csi_pmem/__init__.py",
        "csi_pmem/cli.py",
        "csi_pmem/driver/__init__.py",
        "csi_pmem/driver/daxsock.py",
        "csi_pmem/loader/gpu/_native/bounce.c",
        "csi_pmem/driver/__pycache__/daxsock.cpython-311.pyc",
        "csi_pmem/loader/gpu/_native/bounce.cpython-311-x86_64-linux-gnu.so",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    good = (
        "`csi_pmem/`, `csi_pmem/cli.py`. The driver: `csi_pmem/driver/`, with "
        "`csi_pmem/driver/daxsock.py` (see csi_pmem.driver.daxsock). "
        "`csi_pmem/loader/` `csi_pmem/loader/gpu/` `csi_pmem/loader/gpu/_native/` "
        "`csi_pmem/loader/gpu/_native/bounce.c`"
    )
    assert missing(good, tmp_path) == []
    assert stale(good, tmp_path) == []

    moved = good.replace("csi_pmem/driver/daxsock.py", "csi_pmem/driver/node/daxsock.py")
    moved = moved.replace("csi_pmem.driver.daxsock", "csi_pmem.driver.node.daxsock")
    moved = moved.replace("`csi_pmem/loader/` ", "`csi_pmem/loader` ")
    assert missing(moved, tmp_path) == ["csi_pmem/driver/daxsock.py", "csi_pmem/loader/"]
    assert stale(moved, tmp_path) == [
        "csi_pmem.driver.node.daxsock",
        "csi_pmem/driver/node/daxsock.py",
        "csi_pmem/loader",
    ]
