from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.hidden.stage import hidden_job  # noqa: E402

hidden_job(snakemake.config, snakemake.input.tokenized, snakemake.input.target, snakemake.output[0])
