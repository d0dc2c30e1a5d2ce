"""Stage 1, prompts: sources read (OpenAI messages, ShareGPT, Alpaca, benchmark fields, logged chat
completions; JSON Lines, JSON arrays, Parquet; local or s3://), checked (checks), deduplicated,
stratified into shards with a held-out set (stage)."""
