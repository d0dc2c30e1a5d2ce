"""Glue shared by the Snakefile, the rule scripts and the CLI: paths, logging, threads."""
from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from dflash.core.errors import install_job_hook
from dflash.core.io import naming_full_disk, read_json
from dflash.core.units import clock, plural, rate_text
from dflash.core.vocabulary import terminal_safe


def target_dir(config: dict) -> str:
    """The target model folder: the configured one, or the demo target the pipeline builds."""
    return config["target"]["path"] or f"{config['output_dir']}/target"


def demo_target_sources(config: dict) -> list[str]:
    """Sources the demo target's tokenizer learns from: the local prompt conversations (adopted
    generations come from a real target, which ``target.path`` names)."""
    return [s["path"] for s in config["prompts"]["sources"]
            if s.get("format", "openai") != "chat_completions" and not s["path"].startswith("s3://")]


def shard_ids(prompts_dir: str | Path) -> list[str]:
    """Shard numbers ("00000", ...) listed in the prompts manifest."""
    manifest = read_json(Path(prompts_dir) / "manifest.json")
    return [s["name"].removeprefix("shard-").split(".")[0] for s in manifest["shards"]]


class _TerminalSafeFormatter(logging.Formatter):
    """Log lines quote record text (a drop's detail, a template's error): shown, never acted on
    by the terminal that reads the log."""

    def format(self, record: logging.LogRecord) -> str:
        return terminal_safe(super().format(record))


def setup_logging(log_file: str | Path | None = None, level: int = logging.INFO) -> None:
    """Log to ``log_file`` (Snakemake's per-job log) or stderr, one format everywhere."""
    handler = logging.FileHandler(log_file, mode="a") if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(_TerminalSafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "urllib3", "filelock", "botocore", "boto3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # transformers prints through its own handler; propagating would print every warning twice.
    logging.getLogger("transformers").propagate = False


class LogStream:
    """A job's stderr, its log file: a full disk there is a ``DiskFull`` naming the log, not a bare
    ``[Errno 28]`` from whatever printed (a progress bar, a library's warning)."""

    def __init__(self, log_file: str | Path):
        self.path = Path(log_file)
        with naming_full_disk(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a", buffering=1)

    def write(self, text: str) -> int:
        with naming_full_disk(self.path):
            return self.file.write(text)

    def flush(self) -> None:
        with naming_full_disk(self.path):
            self.file.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding ...: the file's own
        return getattr(self.file, name)


def log_to(log_file: str | Path) -> None:
    """Everything a job prints (logging, progress bars, a traceback) into its log file."""
    sys.stderr = LogStream(log_file)
    setup_logging(log_file)


def job_context() -> str:
    """Where a job runs, for the first line of its log: the host, the SLURM job and the GPUs it sees."""
    slurm = os.environ.get("SLURM_JOB_ID")
    return (f"host {socket.gethostname()}" + (f", SLURM job {slurm}" if slurm else "")
            + f", CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")


JOB = "DFLASH_JOB"  # the rule's job ("generate (shard=00003)"), set by start_job, inherited by its processes
CONSOLE_FD = "DFLASH_CONSOLE_FD"  # the console of a process whose stderr is the log from the start (a rank)
PROGRESS_SECONDS = "DFLASH_PROGRESS_SECONDS"


def job_label(rule: str, wildcards: dict) -> str:
    """A job as the console names it: ``generate (shard=00003)``."""
    return rule + (f" ({', '.join(f'{k}={v}' for k, v in wildcards.items())})" if wildcards else "")


@functools.cache
def _console_fd(fd: int):
    return open(fd, "w", buffering=1, closefd=False)


def job_console():
    """Where a rule's job talks to the user, when its stderr goes to its log: the stderr Snakemake
    started it with. None outside a rule's job (the CLI's stderr is the console already)."""
    if os.environ.get(CONSOLE_FD):
        return _console_fd(int(os.environ[CONSOLE_FD]))
    return sys.__stderr__ if sys.stderr is not sys.__stderr__ else None


def notice(logger: logging.Logger, message: str) -> None:
    """A warning worth seeing although the job succeeds: in its log, and on the console when the
    log is a rule's (Snakemake shows a log only when the job fails)."""
    logger.warning(message)
    if console := job_console():
        print(f"warning: {terminal_safe(message)}", file=console, flush=True)


def to_console(text: str) -> None:
    """What a job found that is worth seeing before the run goes on (the pilot's figures, the plan, a
    gate's verdicts): in its log (the CLI's stderr) and, in a rule's job, on the console too."""
    print(text, file=sys.stderr, flush=True)
    if console := job_console():
        print(text, file=console, flush=True)


def tell(logger: logging.Logger, message: str) -> None:
    """What a job did, in one line: in its log, and on the console as its progress lines are."""
    logger.info(message)
    if (console := job_console()) and os.environ.get(JOB):
        print(f"[{os.environ[JOB]}] {terminal_safe(message)}", file=console, flush=True)


def exit_on_sigterm(note: str):
    """From now on SIGTERM (Snakemake cancelling a job, SLURM's time limit, torchrun stopping its
    ranks) is SystemExit(143), logged with ``note``, so ``finally`` blocks and context managers
    run: a stage's temp outputs are removed, its locks released. Python's default ends the process
    at once and leaves the temp files beside the outputs. SystemExit, not an Exception: a reader's
    handler of a file's faults must not take it for one. Returns the handler it replaced (None
    off the main thread, which gets no signals)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
        logging.getLogger("dflash.job").warning("SIGTERM: %s", note)
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


class StopRequest:
    """The first stop signal received inside :func:`stop_requested` (None until one arrives)."""
    signum: int | None = None


# SLURM sends SIGTERM at a preemption (then waits GraceTime) and at the time limit (then KillWait),
# and any signal chosen with sbatch --signal=SIG@seconds before it; Snakemake and torchrun pass
# SIGTERM on when they stop a job
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextmanager
def stop_requested(signals=STOP_SIGNALS) -> Iterator[StopRequest]:
    """While the block runs, ``signals`` only set the yielded request's ``signum``, for a loop that
    stops at its next safe point (a training's step boundary: a resume point of that step, then
    the exit). Off the main thread, which gets no signals, nothing is installed."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def note(signum, frame):
        if request.signum is None:
            request.signum = signum
            logging.getLogger("dflash.job").warning("%s: stopping at the next safe point", signal.Signals(signum).name)

    before = {s: signal.signal(s, note) for s in signals}
    try:
        yield request
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


@contextmanager
def sigterm_exits(note: str) -> Iterator[None]:
    """:func:`exit_on_sigterm` while the block runs (a ``dflash`` command's stage, torchrun's ranks)."""
    before = exit_on_sigterm(note)
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def start_job(snakemake) -> None:
    """First call of every rule script: logging into the rule's log, failures as one line on the
    console (the traceback in the log), progress lines on the console, torch threads, SIGTERM as
    an exit that removes the job's temp files."""
    log_to(snakemake.log[0])
    exit_on_sigterm("the job stopped; its unfinished outputs are removed")
    logging.getLogger("dflash.job").info("rule %s: %s", snakemake.rule, job_context())
    os.environ[JOB] = job_label(snakemake.rule, dict(snakemake.wildcards.items()))
    install_job_hook(os.environ[JOB], snakemake.log[0])
    progress_seconds()  # a bad value fails the job now, not when its first long stage starts
    set_threads(snakemake.threads)


def set_threads(n: int) -> None:
    """The job's threads for torch and for the Rust tokenizer's batch encode, which would take
    every core (Snakemake runs one job per core it was given). torch reads OMP_NUM_THREADS when it
    starts, so the jobs that never import it (most of them) do not spend the seconds it takes to.
    An explicit ``RAYON_NUM_THREADS`` in the environment wins."""
    n = max(1, int(n))
    os.environ["OMP_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    os.environ.setdefault("RAYON_NUM_THREADS", str(n))


def progress(iterable=None, **kwargs):
    """tqdm that stays readable in a log file: in a file it redraws every 15 s, not every step.
    In a rule's job it also prints a plain line on the console (Snakemake shows the log only when
    the job fails) every ``DFLASH_PROGRESS_SECONDS`` (30; 0: none): done, rate, ETA and the bar's
    postfix; one when it starts and one with the total time when it ends."""
    interactive = sys.stderr.isatty()
    kwargs.setdefault("mininterval", 1 if interactive else 15)
    kwargs.setdefault("disable", None if interactive else False)
    console, every = job_console(), progress_seconds()
    if console is None or not every or not os.environ.get(JOB):
        return tqdm(iterable, **kwargs)
    # a loop over the bar only calls update() when the bar redraws
    kwargs["mininterval"] = min(kwargs["mininterval"], every)
    return ConsoleBar(iterable, console=console, every=every, job=os.environ[JOB], **kwargs)


def progress_seconds() -> float:
    value = os.environ.get(PROGRESS_SECONDS, "30")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1
    if seconds < 0:
        raise ValueError(f"{PROGRESS_SECONDS}={value!r}: give the seconds between progress lines on the "
                         f"console (0: none)")
    return seconds


class ConsoleBar(tqdm):
    """The bar in the job's log, and its story in plain lines on the console."""

    def __init__(self, iterable=None, *, console, every: float, job: str, **kwargs):
        self._console = None  # a disabled bar (training's other ranks) says nothing
        super().__init__(iterable, **kwargs)
        if not self.disable:
            self._console, self._every, self._job = console, every, job
            self._said = self._time()
            self._say(f"{self._done()}, {'resumed' if self.n else 'started'}")

    def update(self, n=1):
        shown = super().update(n)
        if self._console is not None and self._time() - self._said >= self._every:
            self._said = self._time()
            d = self.format_dict
            rate = d["rate"] or self._average_rate()
            eta = f", ETA {clock((self.total - self.n) / rate)}" if rate and self.total else ""
            self._say(f"{self._done()}, {rate_text(rate, self.unit)}{eta}" if rate else self._done())
        return shown

    def close(self):
        if self._console is not None and not self.disable:
            ended = "done in" if not self.total or self.n >= self.total else "stopped after"
            rate = self._average_rate()
            self._say(f"{self._done()} {ended} {clock(self.format_dict['elapsed'])}"
                      + (f", {rate_text(rate, self.unit)}" if rate else ""))
            self._console = None
        super().close()

    def _done(self) -> str:
        units = plural(self.unit)
        if self.total:
            return f"{self.n:,}/{self.total:,} {units} ({int(100 * self.n / self.total)}%)"
        return f"{self.n:,} {units}"

    def _average_rate(self) -> float | None:
        elapsed = self.format_dict["elapsed"]
        return (self.n - self.initial) / elapsed if elapsed and self.n > self.initial else None

    def _say(self, text: str) -> None:
        postfix = ", ".join(p.replace("=", " ", 1) for p in (self.postfix or "").split(", ") if p)
        print(f"[{self._job}] {self.desc} {text}" + (f", {postfix}" if postfix else ""), file=self._console,
              flush=True)
