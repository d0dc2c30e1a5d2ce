"""Serving the trained drafter: each engine's command for a checkpoint (vLLM, SGLang), and whether
the drafter fits the target it is served with (commands)."""
