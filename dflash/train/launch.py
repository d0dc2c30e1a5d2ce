"""Starting a training run's processes: torchrun on this node, or one torchrun per node of the
job's SLURM allocation (srun), meeting at a c10d rendezvous. Torch-free: the processes it starts
import the trainer (``python -m dflash.train.stage``)."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from contextlib import suppress
from pathlib import Path

from dflash.core.errors import RANK_ERRORS, first_rank_error
from dflash.core.workflow import CONSOLE_FD, job_console

RENDEZVOUS_PORT = 29500  # torchrun's default, at the first node of a run over several


def torchrun_args(processes: int, nodes: int = 1, rendezvous: str | None = None, run_id: str = "dflash") -> list[str]:
    """torchrun's launch flags: ``processes`` on this machine alone, or on each of ``nodes`` machines
    that meet at ``rendezvous`` (``host:port`` of the first; c10d, so nothing but torch is needed)
    under ``run_id``; the rendezvous hands out the node ranks."""
    if nodes == 1:
        return ["--standalone", f"--nproc_per_node={processes}"]
    return [f"--nnodes={nodes}", f"--nproc_per_node={processes}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={rendezvous}", f"--rdzv_id={run_id}"]


def slurm_nodes_launch(nodes: int) -> tuple[list[str], str, str, dict]:
    """(the srun prefix that starts one task per node, the rendezvous address, the run id, srun's
    environment) for a train job holding ``nodes`` nodes of a SLURM allocation. The allocation is
    asked of squeue: a job step (Snakemake's SLURM plugin runs each job in one) keeps only the job's
    id. The rendezvous is this machine: the job's script runs on the allocation's first node, which
    srun's tasks include; its host name is the machine's own (a node's SLURM name may be an alias no
    resolver knows)."""
    job, held = os.environ.get("SLURM_JOB_ID"), []
    with suppress(FileNotFoundError):
        held = subprocess.run(["squeue", "-h", "-j", job, "-o", "%D %C %N"], capture_output=True, text=True,
                              timeout=60).stdout.split() if job else []
    if len(held) != 3 or int(held[0]) < nodes:
        raise RuntimeError(f"train.nodes is {nodes}: the train job must run in a SLURM allocation of {nodes} nodes "
                           f"(this one has {held[0] if held else 'none'}): request them for the train job (the SLURM "
                           f"profiles do, from train.nodes), or set train.nodes: 1")
    # the step's own settings (its one task, its CPUs and GPUs) would bind srun's new step
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_", "SBATCH_"))
           or k in ("SLURM_JOB_ID", "SLURM_CONF")}
    rendezvous = f"{socket.gethostname()}:{RENDEZVOUS_PORT}"
    logging.getLogger(__name__).info("%d nodes (%s), rendezvous %s", nodes, held[2], rendezvous)
    # each node's torchrun and its ranks get the node's CPUs (a step's task gets 1 unless told), and
    # share them, and the node's GPUs, with the step this job runs in
    cpus = int(held[1]) // int(held[0])
    return (["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}",
             "--overlap"], rendezvous, job, env)


def train_processes(processes: int, tokenized: list[Path], hidden: list[Path], target_dir: Path, out_dir: Path,
                    cfg: dict, curves_spec: dict | None = None, nodes: int = 1) -> None:
    """``train`` in data-parallel processes, one per GPU (torchrun), on this node or on each of
    ``nodes`` (srun in the job's SLURM allocation): their output goes to this process's stderr (a
    job's log), rank 0's progress lines to its job's console, and a failure is one error naming the
    rank that failed first and its reason."""
    prefix, rendezvous, run_id, env = slurm_nodes_launch(nodes) if nodes > 1 else ([], None, "dflash", os.environ)
    console = job_console()
    out_dir, shared = Path(out_dir), None
    if nodes > 1:
        shared = out_dir.parent  # the other nodes' ranks leave their errors there too: not this node's /tmp
        shared.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.ranks-", dir=shared) as errors:
        # the ranks' stderr is the log from the start: their stdout is the console
        env = {**env, RANK_ERRORS: errors, **({CONSOLE_FD: "1"} if console else {})}
        ranks = subprocess.run([*prefix, sys.executable, "-m", "torch.distributed.run",
                                *torchrun_args(processes, nodes, rendezvous, run_id), "-m", "dflash.train.stage",
                                "--cfg", json.dumps(cfg),
                                "--tokenized", *map(str, tokenized), "--hidden", *map(str, hidden or []),
                                "--target", str(target_dir), "--out", str(out_dir),
                                "--curves", json.dumps(curves_spec)],
                               stdout=console or sys.stderr, stderr=sys.stderr, env=env)
        if ranks.returncode:
            first = first_rank_error(errors) or (f"torchrun exited with {ranks.returncode} and no rank raised an "
                                                 f"error (killed or crashed: out of memory?)")
            raise RuntimeError(f"training in {processes * nodes} processes failed: {first}\n(every rank's output is in "
                               f"the log; a re-run resumes from the last resume point)")
