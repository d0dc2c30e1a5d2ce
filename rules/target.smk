rule target:
    """The tiny demo target: tokenizer, qwen3_5_text model, taught the conversation format.
    Not used when config target.path names a real model folder."""
    input:
        [external(path) for path in demo_target_sources(config)],
    output:
        replaced_folder(f"{OUT}/target"),
    params:
        build=config["target"]["build"],
    threads: 8  # capped at --cores; a fixed number keeps `snakemake --report` (no --cores) working
    log:
        f"{LOGS}/target.log",
    benchmark:
        f"{BENCH}/target.tsv"
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/target.py"
