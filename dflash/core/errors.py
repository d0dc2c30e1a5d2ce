"""How a failure reaches the user: one line naming the file, line or id and what to do, from the
CLI and from every rule script; the traceback only on request (``--debug`` or ``DFLASH_DEBUG=1``).

Expected conditions (bad input, a truncated shard, a full disk, a server that is down, a template
that refuses a conversation) raise ``ValueError``, ``OSError`` or ``RuntimeError`` with a message
written for the user. Anything else is a bug: its line says so and how to see the traceback.
"""
from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager, suppress
from pathlib import Path

from dflash.core.vocabulary import terminal_safe

EXPECTED = (ValueError, OSError, RuntimeError)  # OSError: missing files, full disks, unreachable servers


def debug_requested() -> bool:
    return os.environ.get("DFLASH_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def describe(error: BaseException) -> str:
    """The message a user sees for ``error``, terminal-safe: it may quote record text."""
    return terminal_safe(_described(error))


def _described(error: BaseException) -> str:
    if isinstance(error, OSError) and error.filename is not None and error.strerror and not str(error).startswith(
            str(error.filename)):
        return f"{error.filename}: {error.strerror}"
    if isinstance(error, EXPECTED) and str(error):
        return str(error)
    return (f"{type(error).__name__}: {error} (an internal error: run with --debug or DFLASH_DEBUG=1 for the "
            f"traceback, and report it)")


def failure_line(job: str, message: str, log_file: str | os.PathLike) -> str:
    """A failed job's line on the console: its first line, and where the rest is."""
    lines = message.split("\n")
    more = f" ({len(lines) - 1} more lines in the log)" if len(lines) > 1 else ""
    return f"rule {job}: {lines[0]}{more} [log: {log_file}]"


def install_job_hook(job: str, log_file: str) -> None:
    """For a rule script whose stderr goes to its log: an uncaught error writes its traceback to
    the log and its one line to the console (the stderr Snakemake started the job with), where
    the run stops; the whole traceback goes there too when debugging is requested."""

    def hook(kind, error, tb):
        if issubclass(kind, KeyboardInterrupt):
            return sys.__excepthook__(kind, error, tb)
        with suppress(OSError):  # a full disk under the log: the console line must still come
            traceback.print_exception(kind, error, tb, file=sys.stderr)
        console = sys.__stderr__
        if debug_requested():
            traceback.print_exception(kind, error, tb, file=console)
        print(failure_line(job, describe(error), log_file), file=console, flush=True)
        with suppress(OSError):
            print(f"rule {job} failed: {describe(error)}", file=sys.stderr, flush=True)

    sys.excepthook = hook


RANK_ERRORS = "DFLASH_RANK_ERRORS"  # the folder where torchrun's ranks leave their error's line for the launcher


@contextmanager
def rank_error_recorded():
    """Around one torchrun process: an error leaves its line in the launcher's folder (the
    traceback goes to the job's log with the other ranks' output; torchrun itself only says
    "exit 1")."""
    try:
        yield
    except Exception as error:
        if folder := os.environ.get(RANK_ERRORS):
            (Path(folder) / f"rank-{os.environ.get('RANK', '0')}").write_text(describe(error))
        raise


def first_rank_error(folder: str | os.PathLike) -> str | None:
    """The error of the rank that failed first (the others' follow from it: a peer gone, a
    timeout), as ``rank N: message``; None when no rank raised one (killed, crashed)."""
    files = sorted(Path(folder).glob("rank-*"), key=lambda f: f.stat().st_mtime_ns)
    return f"rank {files[0].name.removeprefix('rank-')}: {files[0].read_text()}" if files else None
