"""Stage 5, tokenize: a validated shard through the chat template to ids and loss masks, exact
against the generation's own ids (stage)."""
