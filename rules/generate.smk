rule generate:
    """One completion record per prompt (exact token ids, raw text, reasoning/content split)."""
    input:
        prompts=lambda wildcards: prompt_file(f"shard-{wildcards.shard}.jsonl.zst"),
        target=TARGET,
    output:
        completions=f"{OUT}/completions/shard-{{shard}}.jsonl.zst",
        summary=f"{OUT}/completions/shard-{{shard}}.summary.json",
    params:
        generate=config["generate"],
    threads: 1
    resources:
        gpu=1,
    log:
        f"{LOGS}/generate/{{shard}}.log",
    benchmark:
        f"{BENCH}/generate/{{shard}}.tsv"
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/generate.py"
