from dflash.workflow import start_job

start_job(snakemake)

from dflash.curves import curve_spec  # noqa: E402
from dflash.launch import train_processes  # noqa: E402
from dflash.train import drafter_train_cfg, train  # noqa: E402

i = snakemake.input
cfg = drafter_train_cfg({"drafter": snakemake.params.drafter, "train": snakemake.params.train}, i.target)
cfg["fast_kernels"] = snakemake.config["target"]["fast_kernels"]  # not a param: it changes no result
curves = curve_spec(snakemake.config, snakemake.wildcards.run, "train")  # not a param: it changes no result
gpus, nodes = snakemake.params.train["gpus"], snakemake.params.train["nodes"]
if gpus == nodes == 1:
    train(list(i.tokenized), list(i.hidden) or None, i.target, snakemake.output[0], cfg, curves_spec=curves)
else:  # one process per GPU, data-parallel, on this node or on each of the job's nodes
    train_processes(gpus, list(i.tokenized), list(i.hidden), i.target, snakemake.output[0], cfg, curves, nodes)
