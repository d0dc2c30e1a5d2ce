from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.eval.stage import eval_job  # noqa: E402

i = snakemake.input
eval_job(snakemake.config, i.trained, i.untrained, i.thinking_off, snakemake.output[0], snakemake.wildcards.run)
