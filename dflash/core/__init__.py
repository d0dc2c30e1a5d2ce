"""The words, formats and plumbing every stage shares, importing no stage: files and shards (io,
tensors), the config and its schema (config), records and their words (records, vocabulary), every
reason code validate gives (reasons), the Qwen text and tool-call formats (chat, toolcalls), server
dialects (dialects), the repetition scan (loops), a target and its drafter by their configs and the
hidden-state cache's format and size (shapes), S3 (storage), node kinds (cluster), job plumbing
(workflow, errors, units), live curves (curves) and whose outputs a folder holds (run_stamp)."""
