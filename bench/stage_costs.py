"""Wall time and peak memory per stage of a finished pipeline run, from Snakemake's benchmark TSVs
(dflash.report.benchmarks, which the report's time per stage uses too).

Usage: python bench/stage_costs.py [results/benchmarks]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's dflash, with any Python
from dflash.report.benchmarks import stage_cost_lines, stage_costs  # noqa: E402


def main(root: str = "results/benchmarks") -> None:
    costs = stage_costs(root)
    if not costs:
        sys.exit(f"no benchmark TSVs under {root}: run the pipeline first")
    print("\n".join(stage_cost_lines(costs)))


if __name__ == "__main__":
    main(*sys.argv[1:])
