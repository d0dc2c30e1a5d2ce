rule hidden:
    """The target's selected layer outputs for every token of the shard's rows."""
    input:
        tokenized=f"{OUT}/tokenized/shard-{{shard}}.safetensors",
        target=TARGET_INPUT,
        # Must exist (every gate passed), but its rewrite after another shard changed is no reason
        # to extract this shard again.
        gates=ancient(f"{OUT}/qa/gates.json"),
    output:
        f"{OUT}/hidden/shard-{{shard}}.safetensors",
    params:
        layers=layer_selection(config["drafter"]),
        dtype=config["hidden"]["dtype"],
        cache_format=HIDDEN_FORMAT,
    threads: 1
    priority: 1  # before the untrained eval decoding, ready at the same time: training waits for this
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
