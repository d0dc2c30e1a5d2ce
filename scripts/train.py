from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.train.stage import train_job  # noqa: E402

i = snakemake.input
train_job(snakemake.config, i.tokenized, i.hidden, i.target, snakemake.output[0], snakemake.wildcards.run)
