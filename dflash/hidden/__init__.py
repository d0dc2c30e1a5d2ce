"""Stage 6, hidden: the target's features of the drafter's layers captured for offline training
(stage), and the checks of those features that training runs too (feature_guard). The cache's format
and size, which the Snakefile and the plan read without torch, are dflash.core.shapes'."""
