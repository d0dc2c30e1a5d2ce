from dflash.workflow import start_job

start_job(snakemake)

from dflash.target import build_target  # noqa: E402

build_target(list(snakemake.input.sources), snakemake.output[0], snakemake.params.build)
