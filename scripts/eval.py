from dflash.workflow import start_job

start_job(snakemake)

from pathlib import Path  # noqa: E402

from dflash.eval import run_eval  # noqa: E402

i = snakemake.input
# From the config, not a rule param: the policy changes no result, and a changed param re-runs the job.
cfg = {**snakemake.params.eval, "fast_kernels": snakemake.config["target"]["fast_kernels"]}
# eval.engine vllm: the servers' logs beside the job's own
log = Path(snakemake.log[0])
run_eval(i.checkpoint, i.target, i.heldout, snakemake.output[0], cfg, server_logs=log.with_name(f"{log.stem}-vllm"))
