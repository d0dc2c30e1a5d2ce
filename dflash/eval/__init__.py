"""Stage 8, eval: the drafter speculating for the target on held-out prompts (stage) and acceptance
length per category, trained against untrained (acceptance)."""
