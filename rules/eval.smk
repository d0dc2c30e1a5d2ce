rule eval_decode:
    """Greedy speculative decoding of the held-out prompts with the trained drafter, or for scale
    an untrained one of the same config, or the trained one with thinking off (eval.thinking_off);
    part {part} of eval.jobs that share the prompts. The
    untrained one needs only the config (the drafter section, the target's sizes) and the gates'
    verdicts (no eval of data the gates stopped): it decodes while the drafter trains, on the core
    training leaves."""
    input:
        checkpoint=lambda wildcards: f"{OUT}/checkpoints/{wildcards.run}" if wildcards.drafter != "untrained" else [],
        gates=ancient(f"{OUT}/qa/gates.json"),
        target=TARGET_INPUT,
        heldout=lambda wildcards: prompt_file("heldout.jsonl.zst"),
    output:
        f"{OUT}/eval/{{run}}/{{drafter}}.{{part}}.json",
    params:
        eval=config["eval"],
        # the untrained drafter's shape; the trained one's is its checkpoint's
        drafter=lambda wildcards: config["drafter"] if wildcards.drafter == "untrained" else {},
    threads: 1  # a batch of one, token by token: a second thread gains little, a second job doubles
    resources:
        gpu=1,
    log:
        f"{LOGS}/eval/{{run}}.{{drafter}}.{{part}}.log",
    benchmark:
        f"{BENCH}/eval/{{run}}.{{drafter}}.{{part}}.tsv"
    wildcard_constraints:
        drafter="|".join(DECODINGS),
        part=r"\d+",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/eval_decode.py"


rule eval:
    """Acceptance length per category, trained against untrained, from the two decodings (which
    must agree token for token: speculative decoding is lossless), each joined from its parts; and
    with thinking off (eval.thinking_off)."""
    input:
        trained=lambda wildcards: eval_parts(wildcards.run, "trained"),
        untrained=lambda wildcards: eval_parts(wildcards.run, "untrained"),
        thinking_off=lambda wildcards: eval_parts(wildcards.run, "thinking_off") if config["eval"]["thinking_off"] else [],
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
