from dflash.workflow import start_job

start_job(snakemake)

from dflash.eval import run_eval  # noqa: E402

i = snakemake.input
# From the config, not a rule param: the policy changes no result, and a changed param re-runs the job.
cfg = {**snakemake.params.eval, "fast_kernels": snakemake.config["target"]["fast_kernels"]}
run_eval(i.checkpoint, i.target, i.heldout, snakemake.output[0], cfg)
