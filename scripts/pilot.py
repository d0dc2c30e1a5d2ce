import sys

from dflash.workflow import start_job

start_job(snakemake)

from dflash.io import write_json  # noqa: E402
from dflash.pilot import pilot_lines, summarize_pilot  # noqa: E402

i = snakemake.input
summary = summarize_pilot(i.selection, i.generated, i.completions, i.qa, i.index, snakemake.params.gates,
                          snakemake.params.gpus, i.burst or None)
# What the pilot found is worth seeing before the full run: on the console as well as in the log.
for stream in (sys.stderr, sys.__stderr__):
    print("\n".join(pilot_lines(summary)), file=stream, flush=True)
write_json(snakemake.output[0], summary)
