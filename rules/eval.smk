rule eval_decode:
    """Greedy speculative decoding of the held-out prompts with the trained drafter, or for scale
    an untrained one of the same config. The untrained one needs only the config (the drafter
    section, the target's sizes): it decodes while the drafter trains, on the core training leaves."""
    input:
        checkpoint=lambda wildcards: f"{OUT}/checkpoints/{wildcards.run}" if wildcards.drafter == "trained" else [],
        target=TARGET_INPUT,
        heldout=lambda wildcards: prompt_file("heldout.jsonl.zst"),
    output:
        f"{OUT}/eval/{{run}}/{{drafter}}.json",
    params:
        eval=config["eval"],
        # the untrained drafter's shape; the trained one's is its checkpoint's
        drafter=lambda wildcards: config["drafter"] if wildcards.drafter == "untrained" else {},
    threads: 1  # a batch of one, token by token: a second thread gains little, a second job doubles
    resources:
        gpu=1,
    log:
        f"{LOGS}/eval/{{run}}.{{drafter}}.log",
    benchmark:
        f"{BENCH}/eval/{{run}}.{{drafter}}.tsv"
    wildcard_constraints:
        drafter="trained|untrained",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/eval_decode.py"


rule eval:
    """Acceptance length per category, trained against untrained, from the two decodings (which
    must agree token for token: speculative decoding is lossless)."""
    input:
        trained=f"{OUT}/eval/{{run}}/trained.json",
        untrained=f"{OUT}/eval/{{run}}/untrained.json",
    output:
        f"{OUT}/eval/{{run}}.json",
    params:
        eval=config["eval"],
    log:
        f"{LOGS}/eval/{{run}}.log",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/eval.py"
