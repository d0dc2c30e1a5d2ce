rule hidden:
    """The target's selected layer outputs for every token of the shard's rows."""
    input:
        tokenized=f"{OUT}/tokenized/shard-{{shard}}.safetensors",
        target=TARGET,
    output:
        f"{OUT}/hidden/shard-{{shard}}.safetensors",
    params:
        layers=layer_selection(config["drafter"]),
        dtype=config["hidden"]["dtype"],
    threads: 1
    resources:
        gpu=1,
    log:
        f"{LOGS}/hidden/{{shard}}.log",
    benchmark:
        f"{BENCH}/hidden/{{shard}}.tsv"
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/hidden.py"
