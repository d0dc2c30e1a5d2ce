PREBUILT = config["target"]["build"]["prebuilt"]


rule target:
    """The tiny demo target: tokenizer, qwen3_5_text model, taught the conversation format, or a
    copy of target.build.prebuilt (the shipped one) when made from the same config, sources and
    code. Not used when config target.path names a real model folder."""
    input:
        sources=[external(path) for path in demo_target_sources(config)],
        # a new prebuilt target (a pull of the repository) makes the target again; without one (a
        # config copied elsewhere) the stage teaches, with a warning, instead of a missing input
        prebuilt=[external(f"{PREBUILT}/provenance.json")] if PREBUILT and os.path.exists(PREBUILT) else [],
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
