from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.validate.gates import write_qa_summary  # noqa: E402

write_qa_summary(snakemake.input.qa, snakemake.input.tokenized, snakemake.output[0])
