rule train:
    """The DFlash drafter, trained on the cached hidden states of every shard."""
    input:
        tokenized=per_shard(f"{OUT}/tokenized/shard-{{shard}}.safetensors"),
        # read beside the rows (their lengths and categories); named so a default storage fetches them
        index=per_shard(f"{OUT}/tokenized/shard-{{shard}}.json"),
        # online: the trainer runs the target itself, no cache to extract
        hidden=per_shard(f"{OUT}/hidden/shard-{{shard}}.safetensors") if not ONLINE else [],
        target=TARGET_INPUT,
        gates=ancient(f"{OUT}/qa/gates.json"),
    output:
        replaced_folder(f"{OUT}/checkpoints/{{run}}"),
    params:
        drafter=config["drafter"],
        train=config["train"],
    # config threads (1): on a CPU the demo's small matrices train faster on one thread than on two,
    # and the other core decodes the eval's untrained baseline meanwhile; on a GPU it is the host's share
    threads: config["threads"]
    priority: 1  # before the untrained eval decoding, which fills the cores training leaves
    resources:
        gpu=config["train"]["gpus"],
        # the SLURM profiles request these nodes whole, every GPU of each (gres, per node)
        nodes=config["train"]["nodes"],
    log:
        f"{LOGS}/train/{{run}}.log",
    benchmark:
        f"{BENCH}/train/{{run}}.tsv"
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/train.py"
