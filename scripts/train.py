from dflash.workflow import drafter_train_cfg, start_job

start_job(snakemake)

from dflash.train import train  # noqa: E402

cfg = drafter_train_cfg({"drafter": snakemake.params.drafter, "train": snakemake.params.train}, snakemake.input.target)
train(list(snakemake.input.tokenized), list(snakemake.input.hidden), snakemake.input.target, snakemake.output[0], cfg)
