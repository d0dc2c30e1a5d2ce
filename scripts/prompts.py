from dflash.workflow import start_job

start_job(snakemake)

from dflash.prompt_checks import prompt_checks  # noqa: E402
from dflash.prompts import build_prompts  # noqa: E402

build_prompts(snakemake.params.sources, snakemake.output[0], snakemake.params.shard_size,
              prompt_checks(snakemake.input.target, snakemake.params.checks), snakemake.params.max_line_bytes,
              snakemake.params.max_dropped_share, snakemake.params.heldout)
