from dflash.workflow import start_job

start_job(snakemake)

from dflash.gates import run_gates  # noqa: E402

run_gates(snakemake.input.qa, snakemake.input.tokenized, snakemake.output[0], snakemake.params.gates)
