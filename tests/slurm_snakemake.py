"""`python -m snakemake` for the SLURM tests, polling SLURM every POLL_S seconds at most.

The SLURM executor plugin waits 10 s longer after each status check that finds no job finished
(1, 11, 21, ... up to 180 s): on a real cluster that spares the controller, here it made each
job of a few seconds look like half a minute, and the SLURM tests the slowest part of CI. Only
when snakemake notices an ended job changes; the jobs, sbatch lines and SLURM itself are real."""
import sys

import snakemake_executor_plugin_slurm as slurm
from snakemake.cli import main
from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor

POLL_S = 1
interval = RemoteExecutor.next_seconds_between_status_checks
slurm.Executor.next_seconds_between_status_checks = property(
    interval.fget, lambda self, seconds: interval.fset(self, None if seconds is None else min(seconds, POLL_S)))

if __name__ == "__main__":
    sys.exit(main())
