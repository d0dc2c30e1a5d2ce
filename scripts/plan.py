from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.plan.stage import plan_job  # noqa: E402

i = snakemake.input
plan_job(snakemake.config, i.manifest, i.pilot or None, i.target, snakemake.output[0])
