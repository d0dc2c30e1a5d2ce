from dflash.workflow import start_job

start_job(snakemake)

from dflash.report import write_qa_page  # noqa: E402

write_qa_page(snakemake.input[0], snakemake.output[0])
