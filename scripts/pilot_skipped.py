from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.plan.pilot import write_skipped_pilot  # noqa: E402

write_skipped_pilot(snakemake.output.completions, snakemake.output.summary)
