"""Stage 2, the target model: loading it (models), its lm_head chunk by chunk (head), and the demo's
tiny target, taught offline (stage, teach)."""
