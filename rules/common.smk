# Input helpers shared by the rules: which prompt shards exist is known once the prompts checkpoint ran.


def prompt_file(name):
    """A file of the prompts checkpoint; asking for it schedules the checkpoint when needed."""
    return f"{checkpoints.prompts.get().output[0]}/{name}"


def shards():
    return shard_ids(checkpoints.prompts.get().output[0])


def per_shard(pattern):
    """Input function: ``pattern`` for every prompt shard (known once the prompts exist)."""
    return lambda wildcards: expand(pattern, shard=shards())
