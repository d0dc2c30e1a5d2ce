from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.tokenize.stage import tokenize_job  # noqa: E402

i, o = snakemake.input, snakemake.output
tokenize_job(snakemake.config, i.validated, i.target, o.tensors, o.index)
