from dflash.workflow import start_job

start_job(snakemake)

from dflash.burst import train_burst  # noqa: E402
from dflash.train import drafter_train_cfg  # noqa: E402

i, p = snakemake.input, snakemake.params
cfg = drafter_train_cfg({"drafter": p.drafter, "train": p.train}, i.target)
cfg["fast_kernels"] = snakemake.config["target"]["fast_kernels"]  # not a param: it changes no result
train_burst(i.tokenized, i.hidden or None, i.target, snakemake.output[0], cfg, p.kind, p.steps)
