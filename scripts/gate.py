import sys

from dflash.workflow import start_job

start_job(snakemake)

from dflash.gates import GateError, run_gates  # noqa: E402

try:
    run_gates(snakemake.input[0], snakemake.output[0], snakemake.params.gates)
except GateError as e:
    # In the job's log and on the terminal, where the run stops.
    for stream in (sys.stderr, sys.__stderr__):
        print(f"\n{e}\n", file=stream)
    sys.exit(1)
