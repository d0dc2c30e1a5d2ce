from dflash.workflow import start_job

start_job(snakemake)

from dflash.hidden import capture_shard  # noqa: E402

capture_shard(snakemake.input.tokenized, snakemake.output[0], snakemake.input.target,
              snakemake.params.layers, snakemake.params.dtype,
              fast_kernels=snakemake.config["target"]["fast_kernels"])  # not a param: it changes no result
