from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.target.stage import target_job  # noqa: E402

target_job(snakemake.config, snakemake.output[0])
