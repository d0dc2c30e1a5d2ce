from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.prompts.stage import prompts_job  # noqa: E402

prompts_job(snakemake.config, snakemake.input.target, snakemake.output[0])
