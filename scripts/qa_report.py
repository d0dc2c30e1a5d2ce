from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.report.stage import qa_page_job  # noqa: E402

qa_page_job(snakemake.config, snakemake.input[0], snakemake.output[0])
