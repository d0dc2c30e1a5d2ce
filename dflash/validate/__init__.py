"""Stage 4, validate and gate: each completion checked (stage; its text by text_checks, its tool calls
by dflash.core.toolcalls), kept or rejected with reason codes, and the run stopped when the QA
counts say the data is not worth the GPU time (gates)."""
