from pathlib import Path

from dflash.workflow import start_job

start_job(snakemake)

from dflash.pages import write_qa_page  # noqa: E402
from dflash.report import provenance  # noqa: E402

# computed here, not passed as a param: a new commit alone must not re-run the page
about = provenance(snakemake.config, Path(snakemake.scriptdir).parent)
write_qa_page(snakemake.input[0], snakemake.output[0], about, snakemake.config["run"])
