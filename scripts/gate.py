import sys

from dflash.workflow import start_job

start_job(snakemake)

from dflash.gates import GateError, run_gates  # noqa: E402
from dflash.hidden_cache import cache_plan  # noqa: E402
from dflash.io import read_json  # noqa: E402

cache = None
if snakemake.params.cache["mode"] == "offline":
    tokens = read_json(snakemake.input.summary)["tokenized"].get("tokens", 0)
    cache = {**cache_plan(snakemake.config, snakemake.input.target, tokens),
             "max_bytes": snakemake.params.cache["max_bytes"]}
try:
    run_gates(snakemake.input.summary, snakemake.output[0], snakemake.params.gates, cache)
except GateError as e:
    # In the job's log and on the terminal, where the run stops.
    for stream in (sys.stderr, sys.__stderr__):
        print(f"\n{e}\n", file=stream)
    sys.exit(1)
