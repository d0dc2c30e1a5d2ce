import sys

from dflash.workflow import start_job

start_job(snakemake)

from dflash.io import read_json, write_json  # noqa: E402
from dflash.plan import forecast, plan_lines, prompt_counts  # noqa: E402

i = snakemake.input
try:
    plan = forecast(snakemake.config, prompt_counts(snakemake.config, i.manifest),
                    read_json(i.pilot) if i.pilot else None, target=i.target)
except ValueError as e:  # nothing to forecast from (an empty pilot): said in the plan, the report goes on
    plan = {"error": str(e)}
for stream in (sys.stderr, sys.__stderr__):
    print("\n".join(plan_lines(plan)), file=stream, flush=True)
write_json(snakemake.output[0], plan)
