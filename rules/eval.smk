rule eval:
    """Greedy speculative decoding of the held-out prompts: acceptance length per category."""
    input:
        checkpoint=f"{OUT}/checkpoints/{{run}}",
        target=TARGET_INPUT,
        heldout=lambda wildcards: prompt_file("heldout.jsonl.zst"),
    output:
        f"{OUT}/eval/{{run}}.json",
    params:
        eval=config["eval"],
    threads: 8  # capped at --cores; a fixed number keeps `snakemake --report` (no --cores) working
    resources:
        gpu=1,
    log:
        f"{LOGS}/eval/{{run}}.log",
    benchmark:
        f"{BENCH}/eval/{{run}}.tsv"
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/eval.py"
