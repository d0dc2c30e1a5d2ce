from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.plan.pilot import write_pilot_prompts  # noqa: E402

write_pilot_prompts(snakemake.input[0], snakemake.output.prompts, snakemake.output.selection, snakemake.config["pilot"])
