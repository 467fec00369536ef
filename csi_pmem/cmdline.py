"""What both command lines, ``csi-pmem`` and ``csi-pmem-weights``, do the same way.

Why one module: a user moves between the two and expects the same exit codes, the same
``--version``, ``--log-level`` and completion, and no traceback when ``head`` closes the
pipe. The exit codes are the one table here (:data:`MEANING`); each command line's
``--help`` epilog is rendered from it, so help, README and code cannot drift apart.
Standard library only (the common layer): ``csi-pmem-weights`` runs in inference pods
without the driver's dependencies; argcomplete is used when it is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
import signal
import sys
import textwrap
from collections.abc import Iterable, Iterator

import csi_pmem
from csi_pmem.errors import InvalidArgument
from csi_pmem.sizes import parse_quantity


class Exit(enum.IntEnum):
    """Exit statuses of both command lines; :data:`MEANING` says what each tells a script."""

    OK = 0
    ERROR = 1
    USAGE = 2
    MISMATCH = 3
    REFUSED = 4
    UNREACHABLE = 5
    INTERRUPTED = 130
    BROKEN_PIPE = 128 + signal.SIGPIPE


MEANING = {
    Exit.OK: "success",
    Exit.ERROR: "an error on this side (a file or volume that cannot be used, a missing "
                "dependency); the message says which",
    Exit.USAGE: "a usage error: an unknown flag or a bad value (argparse)",
    Exit.MISMATCH: "verify found chunks that do not match their checksums",
    Exit.REFUSED: "the driver answered with a gRPC error status (INVALID_ARGUMENT, "
                  "NOT_FOUND, OUT_OF_RANGE, RESOURCE_EXHAUSTED, ...), named in the message",
    Exit.UNREACHABLE: "no answer from the driver: nothing listens at --endpoint, or no "
                      "reply within --timeout (worth a retry)",
    Exit.INTERRUPTED: "interrupted (Ctrl-C)",
    Exit.BROKEN_PIPE: "the reader closed the output early (`| head`); nothing is printed",
}

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions and epilogs as written: a one-line paragraph is wrapped to the
    terminal, a paragraph of several lines (the exit-code table, examples) is kept."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.split("\n\n"):
            if "\n" in para.strip():
                out.append("\n".join(indent + line for line in para.splitlines()))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width,
                                         initial_indent=indent, subsequent_indent=indent,
                                         break_on_hyphens=False))
        return "\n\n".join(out)


def exit_codes_epilog(codes: Iterable[Exit], extra: str = "") -> str:
    """The epilog that lists ``codes`` with their meaning, wrapped to 80 columns."""
    lines = ["exit codes:"]
    for code in codes:
        lines += textwrap.wrap(MEANING[code], width=80, initial_indent=f"  {int(code):<4}",
                               subsequent_indent=" " * 6)
    return (extra.rstrip() + "\n\n" if extra else "") + "\n".join(lines)


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version",
                        version=f"{parser.prog} {csi_pmem.__version__}")


def log_level(text: str) -> str:
    """An argparse type: a logging level name in any case, refused with the valid ones."""
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid level {text!r}: use one of {', '.join(lv.lower() for lv in LOG_LEVELS)}")
    return level


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def quantity(text: str) -> int:
    """An argparse type: a byte count as a Kubernetes quantity, as in manifests (16Gi is
    16 GiB, 16G is 16*10^9 bytes; :func:`csi_pmem.sizes.parse_quantity`)."""
    try:
        return parse_quantity(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def enable_completion(parser: argparse.ArgumentParser) -> None:
    """Answer the shell's completion request when argcomplete is installed and the shell
    asked (``_ARGCOMPLETE`` set; argcomplete then exits); otherwise do nothing.

    Why argcomplete: it is what Python command lines use (``register-python-argcomplete``),
    and it completes from the parser itself, so new flags complete without a script to
    regenerate; completers can ask the driver (volume ids)."""
    if "_ARGCOMPLETE" not in os.environ:
        return  # the common case costs no import
    try:
        import argcomplete
    except ImportError:
        return
    argcomplete.autocomplete(parser)


COMPLETION_HELP = """\
shell completion (argcomplete, which the driver and loader extras install):
  bash: eval "$(register-python-argcomplete {prog})"   (in ~/.bashrc)
  zsh:  autoload -U bashcompinit && bashcompinit
        eval "$(register-python-argcomplete {prog})"   (in ~/.zshrc)"""


@contextlib.contextmanager
def quiet_broken_pipe() -> Iterator[None]:
    """Leave quietly, with :attr:`Exit.BROKEN_PIPE`, when the reader of stdout goes away
    (``csi-pmem volume list | head``).

    Why not ``signal(SIGPIPE, SIG_DFL)``: the same processes serve gRPC and unix sockets,
    where a peer going away must be an error to handle, not a signal that kills. stdout
    is pointed at /dev/null so that the interpreter's final flush cannot fail again
    (the recipe in Python's signal documentation)."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError, ValueError):  # a stdout without a descriptor
            fd = sys.stdout.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        raise SystemExit(Exit.BROKEN_PIPE) from None
