from dflash.workflow import start_job

start_job(snakemake)

from pathlib import Path  # noqa: E402

from dflash.eval import decode_heldout  # noqa: E402
from dflash.io import write_json  # noqa: E402
from dflash.train import planned_drafter_config  # noqa: E402

i = snakemake.input
# From the config, not a rule param: the policy changes no result, and a changed param re-runs the job.
cfg = {**snakemake.params.eval, "fast_kernels": snakemake.config["target"]["fast_kernels"]}
# the trained drafter's checkpoint; the untrained one's config, as training will make it
drafter = i.checkpoint or planned_drafter_config(snakemake.params.drafter, i.target)
# eval.engine vllm: the server's log beside the job's own
log = Path(snakemake.log[0])
decoded = decode_heldout(drafter, i.target, i.heldout, cfg, snakemake.wildcards.drafter,
                         server_logs=log.with_name(f"{log.stem}-vllm"), part=int(snakemake.wildcards.part))
write_json(snakemake.output[0], decoded)
