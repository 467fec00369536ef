"""What both command lines, ``csi-pmem`` and ``csi-pmem-weights``, do the same way.

Why one module: a user moves between the two and expects the same exit codes, the same
``--version``, ``--log-level`` and completion, and no traceback when ``head`` closes the
pipe. The exit codes are the one table here (:data:`MEANING`); each command line's
``--help`` epilog is rendered from it, so help, README and code cannot drift apart.
Standard library only (the common layer): ``csi-pmem-weights`` runs in inference pods
without the driver's dependencies; argcomplete is used when it is installed.

Values have one grammar wherever they are typed: the argparse types here check a flag
on the command line, and :func:`from_env` checks the same text when it comes from an
environment variable instead, naming the variable: either is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import math
import os
import re
import signal
import sys
import textwrap
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TextIO, TypeVar

import csi_pmem
from csi_pmem.errors import InvalidArgument
from csi_pmem.sizes import parse_quantity

T = TypeVar("T")


class Exit(enum.IntEnum):
    """Exit statuses of both command lines; :data:`MEANING` says what each tells a script."""

    OK = 0
    ERROR = 1
    USAGE = 2
    MISMATCH = 3
    REFUSED = 4
    UNREACHABLE = 5
    INTERRUPTED = 130
    TERMINATED = 128 + signal.SIGTERM
    BROKEN_PIPE = 128 + signal.SIGPIPE


MEANING = {
    Exit.OK: "success",
    Exit.ERROR: "an error on this side (a file or volume that cannot be used, a missing "
                "dependency); the message says which",
    Exit.USAGE: "a usage error: an unknown flag, or a bad value of a flag or of a "
                "CSI_PMEM_* environment variable (the message names which); for serve "
                "and gpu-copy, another process holding the state dir, the socket or the "
                "metrics port",
    Exit.MISMATCH: "verify found chunks that do not match their checksums",
    Exit.REFUSED: "the driver answered with a gRPC error status (INVALID_ARGUMENT, "
                  "NOT_FOUND, OUT_OF_RANGE, RESOURCE_EXHAUSTED, ...), named in the message",
    Exit.UNREACHABLE: "no answer from the driver (nothing listens at --endpoint, or no "
                      "reply within --timeout), or from an s3:// source's server after "
                      "its retries (worth a retry)",
    Exit.INTERRUPTED: "interrupted (Ctrl-C)",
    Exit.TERMINATED: "stopped by SIGTERM (a pod deleted, a timeout); what was done is kept",
    Exit.BROKEN_PIPE: "the reader closed the output early (`| head`); nothing is printed",
}

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class UsageError(InvalidArgument):
    """A bad value that argparse could not see: an environment variable's (``str(e)``
    names it), or one a command checks after parsing. Exits :attr:`Exit.USAGE`."""


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


# -o: the formats both command lines print their answers in.
OUTPUT_FORMATS = ("table", "json", "yaml", "name")


def default_output(stream: TextIO | None = None) -> str:
    """The format when no ``-o`` is given: a table for a person at a terminal, JSON
    otherwise, so scripts that read the output need no flag (both command lines)."""
    return "table" if (stream or sys.stdout).isatty() else "json"


def add_output(parser: argparse.ArgumentParser, help: str, *,
               formats: Sequence[str] = OUTPUT_FORMATS, json_alias: bool = False) -> None:
    """``-o/--output`` into ``args.output`` (None: :func:`default_output`), and
    ``--json``, the same as ``-o json``, where a command had that flag before ``-o``."""
    parser.add_argument("-o", "--output", choices=formats, default=None, help=help)
    if json_alias:
        parser.add_argument("--json", dest="output", action="store_const", const="json",
                            help="the same as -o json")


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


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number of at least 0 (0 often means "sized for me")."""
    if not text.strip().isdecimal():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 0 or more")
    return int(text)


def _seconds(text: str, least: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (least == "positive" and value == 0):
        what = "positive" if least == "positive" else "non-negative"
        raise argparse.ArgumentTypeError(f"{text!r} is not a {what} number of seconds")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0 (a timeout of 0 would fail
    every call as a deadline exceeded, which reads as "worth a retry")."""
    return _seconds(text, "positive")


def non_negative_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds of 0 or more (0: do not wait)."""
    return _seconds(text, "non-negative")


def one_of(choices: Sequence[str]) -> Callable[[str], str]:
    """A check for :func:`from_env` of a flag given ``choices=`` (argparse checks a value
    typed on the command line against them, but never a default)."""
    def check(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"invalid choice {text!r} (use one of "
                                             f"{', '.join(choices)})")
        return text
    return check


def from_env(given: T | None, name: str, default: str, check: Callable[[str], T]) -> T:
    """A flag's value: ``given`` when it was on the command line (argparse has checked
    it), else environment variable ``name``'s, else ``default``, read by ``check``.

    Why not ``default=os.environ.get(name)`` on the flag: argparse then reports a bad
    variable as a bad flag, or not at all (it never checks a default against
    ``choices``), and it reads it while building the parser, so one bad variable broke
    every command, even those that never use it. Raises :class:`UsageError` naming the
    variable."""
    if given is not None:
        return given
    text = os.environ.get(name)
    if text is None:
        return check(default)
    try:
        return check(text)
    except (argparse.ArgumentTypeError, InvalidArgument, ValueError) as exc:
        raise UsageError(f"environment variable {name}: {exc}") from None


# What argparse takes for a flag although it is a value: "-1Gi", "-.5", "-1e3" (only
# "-1" and "-1.5" count as negative numbers to it).
_NEGATIVE = re.compile(r"-\.?\d")


def attach_negative_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with a value that starts with a minus joined to its flag
    (``--size -1Gi`` becomes ``--size=-1Gi``, the form the argparse documentation gives
    for such values), so that the value's own type refuses it with a reason ("a size
    cannot be negative") instead of argparse's "expected one argument".

    Only flags of ``parser`` and its sub-commands that take exactly one value are
    joined, and only to a word that cannot be a flag (a minus and then a digit); nothing
    after ``--`` is touched."""
    takes_one = {opt for p in _parsers(parser) for a in p._actions
                 if a.option_strings and a.nargs is None for opt in a.option_strings}
    out, i = list(argv), 0
    while i < len(out) - 1 and out[i] != "--":
        if out[i] in takes_one:
            if _NEGATIVE.match(out[i + 1]):
                out[i:i + 2] = [f"{out[i]}={out[i + 1]}"]
            elif out[i + 1] != "--":
                i += 1  # the flag's value, whatever it looks like, is no flag
        i += 1
    return out


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def quantity(text: str) -> int:
    """An argparse type: a byte count as a Kubernetes quantity, as in manifests (16Gi is
    16 GiB, 16G is 16*10^9 bytes; :func:`csi_pmem.sizes.parse_quantity`)."""
    try:
        return parse_quantity(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_quantity(text: str) -> int:
    """An argparse type: a byte count as :func:`quantity` reads it, of at least 1 byte
    (``--size 0`` of a volume is no size: refused here, a usage error, not sent to the
    driver to come back as INVALID_ARGUMENT)."""
    value = quantity(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is no size: give at least 1 byte, "
                                         "e.g. 64Mi")
    return value


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


class Terminated(BaseException):
    """SIGTERM, raised in the main thread where :func:`stop_on_sigterm` asked for it."""


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM unwinds the main thread like Ctrl-C does
    (:class:`Terminated`), so that a stage stopped by a deleted pod or a ``timeout``
    records the chunks it copied before it exits (:attr:`Exit.TERMINATED`), instead of
    dying between two records. The previous handler is back afterwards (a command run
    in process, by a test, leaves none behind); off the main thread, nothing changes."""

    def handler(signum: int, frame: object) -> None:
        raise Terminated

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def quiet_interrupt(prog: str, note: str = "") -> Iterator[None]:
    """Ctrl-C ends the command with one line on stderr and :attr:`Exit.INTERRUPTED`.

    Why: Python's default is a traceback of wherever the main thread waited (30 lines of
    gRPC internals for ``csi-pmem volume list``), then death by SIGINT; the exit code
    table promises 130 and a line that says what the interruption leaves behind
    (``note``). Commands that serve (``serve``, ``gpu-copy``, ``sidecar``) install
    their own SIGINT handler and stop gracefully instead; this covers their start-up."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"{prog}: interrupted{note}", file=sys.stderr)
        raise SystemExit(Exit.INTERRUPTED) from None
    except Terminated:
        print(f"{prog}: terminated{note}", file=sys.stderr)
        raise SystemExit(Exit.TERMINATED) from None


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
