from dflash.workflow import start_job

start_job(snakemake)

from dflash.eval import run_eval  # noqa: E402

i = snakemake.input
run_eval(i.checkpoint, i.target, i.heldout, snakemake.output[0], snakemake.params.eval)
