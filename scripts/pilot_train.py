from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.plan.burst import pilot_train_job  # noqa: E402

i = snakemake.input
pilot_train_job(snakemake.config, i.tokenized, i.hidden, i.target, snakemake.output[0])
