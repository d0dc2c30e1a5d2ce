# dflash-pipeline: prompts -> completions -> validated -> tokenized -> hidden -> checkpoints -> eval.
# Each stage is a rule over files (rules/*.smk), so Snakemake re-runs only what is stale. The run's
# set-up from the config (its checks, the target, where outputs live) is rules/common.smk's.
from snakemake.utils import min_version

min_version("9.0")


include: "rules/common.smk"
include: "rules/prompts.smk"
include: "rules/target.smk"
include: "rules/generate.smk"
include: "rules/validate.smk"
include: "rules/tokenize.smk"
include: "rules/hidden.smk"
include: "rules/pilot.smk"  # after hidden: its burst reads the pilot's hidden states (use rule hidden)
include: "rules/train.smk"
include: "rules/eval.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        f"{OUT}/report/summary.html",
        f"{OUT}/report/qa.html",
