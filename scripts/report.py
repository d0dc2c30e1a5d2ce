from pathlib import Path

from dflash.workflow import start_job

start_job(snakemake)

from dflash.report import provenance, write_report  # noqa: E402
from dflash.storage import safe_to_destroy  # noqa: E402

i, o = snakemake.input, snakemake.output
# This job's own files are written and uploaded after it looks.
durability = safe_to_destroy(".", snakemake.config["output_dir"], snakemake.params.storage_prefix,
                             skip=[o.html, o.json, snakemake.log[0]])
# computed here, not passed as a param: a new commit alone must not re-run the report
about = provenance(snakemake.config, Path(snakemake.scriptdir).parent)
write_report(snakemake.config, i.manifest, i.qa, i.gates, i.checkpoint, i.eval, o.html, o.json, durability,
             pilot=i.pilot or None, plan=i.plan or None, generated=[*i.generated, i.pilot_generated],
             benchmarks=snakemake.params.benchmarks, about=about)
