import json
import subprocess
import sys

from dflash.workflow import drafter_train_cfg, start_job

start_job(snakemake)

from dflash.train import train  # noqa: E402

i = snakemake.input
cfg = drafter_train_cfg({"drafter": snakemake.params.drafter, "train": snakemake.params.train}, i.target)
gpus = snakemake.params.train["gpus"]
if gpus == 1:
    train(list(i.tokenized), list(i.hidden) or None, i.target, snakemake.output[0], cfg)
else:  # one process per GPU, data-parallel; their output goes to this job's log
    ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                            "-m", "dflash.train", "--cfg", json.dumps(cfg), "--tokenized", *i.tokenized,
                            "--hidden", *i.hidden, "--target", i.target, "--out", snakemake.output[0]],
                           stdout=sys.stderr, stderr=sys.stderr)
    if ranks.returncode:
        raise RuntimeError(f"torchrun with {gpus} processes failed (exit {ranks.returncode}); each rank's error is "
                           f"in the log; a re-run resumes from the last resume point")
