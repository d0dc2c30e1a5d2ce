import os
import sys

from dflash.workflow import start_job

start_job(snakemake)

from dflash.storage import destroy_verdict, safe_to_destroy  # noqa: E402

out = snakemake.config["output_dir"]
found = safe_to_destroy(".", out, snakemake.params.prefix)
lines, verdict = destroy_verdict(found, os.path.abspath(out))
# The answer is the job's whole point: on the console as well as in its log.
for stream in (sys.stderr, sys.__stdout__):
    print("\n".join(lines + [verdict]), file=stream, flush=True)
sys.exit(0 if found["safe"] else 1)
