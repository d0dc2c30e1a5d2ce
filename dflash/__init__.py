"""dflash-pipeline: prompts -> completions -> validated -> tokenized -> hidden -> DFlash drafter."""

__version__ = "0.1.0"
