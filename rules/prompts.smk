checkpoint prompts:
    """Canonical prompt records, deduplicated and stratified into shards, plus the held-out set."""
    input:
        # s3:// sources are read by the job (boto3), not tracked: an object is not re-read when it changes.
        sources=[external(s["path"]) for s in config["prompts"]["sources"] if not s["path"].startswith("s3://")],
        # its tokenizer, template and context: prompts it cannot take are dropped here, not sent
        target=TARGET_INPUT,
    output:
        replaced_folder(f"{OUT}/prompts"),
    params:
        sources=config["prompts"]["sources"],
        shard_size=config["prompts"]["shard_size"],
        max_line_bytes=config["prompts"]["max_line_bytes"],
        max_dropped_share=config["prompts"]["max_dropped_share"],
        heldout=heldout_settings(config),
        checks=prompt_check_settings(config),
    log:
        f"{LOGS}/prompts.log",
    benchmark:
        f"{BENCH}/prompts.tsv"
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/prompts.py"
