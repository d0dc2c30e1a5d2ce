"""Every script in bench/ in its smallest mode, so that a change to the package cannot leave a bench
broken unseen (issue 42: eval_vs_reference.py called load_target without target.fast_kernels).

Each bench runs as a user runs it (this interpreter, this checkout's dflash first on the path) and
must exit 0 and print its figures. The figures themselves are not checked: one round on tiny
inputs measures nothing. Benches whose competitor lives in a venv of its own (`make
speculators-venv`, `make specforge-venv`, which CI does not build) are pointed at a missing one:
our side runs alone and the bench says that the competitor is left out. The benches that read a
finished run share the session's small end-to-end run (the `pipeline` fixture of conftest.py,
which tests/test_pipeline.py checks), never a run of their own.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_drafter import REFERENCE_MODEL_PY

BENCH = ROOT / "bench"
# Run inside .venv-speculators or .venv-specforge: they import speculators or SpecForge (and
# `datasets`) before parsing their arguments, so not even --help runs without them; only that
# they compile is checked here. Their own benches (train_vs_speculators, train_equal_steps,
# tokenize_throughput) start them when the venvs exist.
IN_OTHER_VENVS = ("speculators_dflash_step.py", "speculators_train_rows.py", "specforge_preprocess.py")
LEFT_OUT = "not found (make speculators-venv): speculators is left out"


def bench_module(script: str):
    """A bench script imported as a module, to test one of its functions."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, BENCH / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_bench(script: str, *args: str) -> subprocess.CompletedProcess:
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)


def bench(script: str, *args: str) -> tuple[str, str]:
    """(stdout, stderr) of bench/``script``, which must exit 0."""
    run = run_bench(script, *args)
    assert run.returncode == 0, f"bench/{script} {' '.join(args)} exited {run.returncode}:\n{run.stderr[-4000:]}"
    return run.stdout, run.stderr


def figure(pattern: str, text: str) -> None:
    assert re.search(pattern, text, re.M), f"no {pattern!r} in:\n{text[-3000:]}"


# script: (its smallest mode, a line of figures it prints, what it says on stderr or None).
# Seconds each on 2 cores, imports and set-up most of it.
ALONE = {
    "loop_watch.py": (["--rounds", "1"], r"^32k looping story +\d+ +\d+ +[\d.]+", None),
    "validate_throughput.py": (["--records", "200", "--shard-size", "100", "--rounds", "1"],
                               r"^ratio validate / floor, same cut: median [\d.]+ of 1 rounds", None),
    "validation_quality.py": ([], r"^overall +\d+ +\d+ +\d+ +\d+ +\d+ +\d+ +\d+ +[\d.]+% ", None),
    # the prompts and config only: the whole build is `make scale-data` (40 minutes)
    "scale_data.py": (["--train", "40", "--heldout", "8", "--out", "{tmp}/scale", "--prompts-only"],
                      r"^prompts: 48 \(chat train 10, chat heldout 2, code train 10, .*tool heldout 2\); sources digest [0-9a-f]{16}; config ", None),
}
ALONE_SLOW = {  # 5 to 20 s each
    "tokenize_throughput.py": (["--records", "10", "--rounds", "1", "--specforge-python", "absent/python"],
                               r"^ratio ids path / floor: [\d.]+",
                               "not found (make specforge-venv): SpecForge is left out"),
    "hidden_capture.py": (["--rows", "2", "--rounds", "1"], r"^ratio ours / transformers .*: [\d.]+", None),
    "train_input.py": (["--rounds", "1", "--steps", "4", "--log-every", "2", "--rows", "4", "--shards", "2",
                        "--min-len", "64", "--max-len", "128"], r"^off / on, median of 1 per-round ratios: [\d.]+",
                       None),
    "plan_scale.py": (["--rounds", "1", "--shards", "4", "--profiles", "slurm-b200"],
                      r"^\| 4 \| slurm-b200 \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", None),
    "prompts_memory.py": (["--scales", "0.0001", "--data", "{tmp}"], r"^ *0.0001 +[\d.]+ KB +[\d.]+ MB", None),
    "train_vs_speculators.py": (["--steps", "1", "--rounds", "1", "--speculators-python", "absent/python"],
                                r"^  median: ours [\d.]+ steps/s, \d+ supervised tokens/s", LEFT_OUT),
    "generate_client.py": (["--rounds", "1", "--seconds", "0.5", "--shard-size", "8", "--concurrency", "2",
                            "--output-tokens", "16"], r"^ours / bare, CPU-seconds per 1,000 requests: [\d.]+",
                           None),
}
ON_THE_RUN = ("eval_vs_reference.py", "stage_costs.py", "train_equal_steps.py", "scale_curve.py", "forecast_accuracy.py")
HELP_ONLY = ("demo_time.py",)


def test_every_bench_is_run_here():
    """A new bench gets its smallest mode here too."""
    covered = {*ALONE, *ALONE_SLOW, *ON_THE_RUN, *HELP_ONLY, *IN_OTHER_VENVS}
    assert {p.name for p in BENCH.glob("*.py")} == covered


def run_alone(script: str, table: dict, tmp_path: Path) -> None:
    args, line, said = table[script]
    out, err = bench(script, *(a.format(tmp=tmp_path) for a in args))
    figure(line, out)
    assert said is None or said in err, err[-3000:]


@pytest.mark.parametrize("script", ALONE)
def test_bench_runs(script, tmp_path):
    run_alone(script, ALONE, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("script", ALONE_SLOW)
def test_slower_bench_runs(script, tmp_path):
    run_alone(script, ALONE_SLOW, tmp_path)


def test_benches_of_other_venvs_compile():
    for script in IN_OTHER_VENVS:
        compile((BENCH / script).read_text(), str(BENCH / script), "exec")


def test_demo_time_parses_its_arguments():
    """Only --help: the bench is a fresh clone's `make install` and `make demo` (minutes, and the
    package index), timed; what it prints after them is stage_costs.py's, run below."""
    assert "usage: demo_time.py" in bench("demo_time.py", "--help")[0]


def test_scale_curve_keeps_each_point_on_one_data_set_and_tells_lrs_apart(tmp_path):
    """Files of one point from two builds of the data set are refused (a rebuild elsewhere may draw
    other prompts); files at two peak lrs keep their trainers apart by name; a sweep's variant is
    in the table, not in the curve's chart."""
    def point(name: str, lr: float, data: str, seed: int = 0, trainer: str = "dflash-pipeline") -> str:
        run = {"trainer": trainer, "seed": seed, "lr": lr, "seconds": 1.0, "overall": {"acceptance_length": 1.2},
               "per_category": {"chat": {"acceptance_length": 1.1}}}
        (tmp_path / name).write_text(json.dumps({"target": "hybrid", "rows": 1000, "data": data, "runs": [run]}))
        return str(tmp_path / name)

    run = run_bench("scale_curve.py", point("a.json", 0.003, "d1"), point("b.json", 0.003, "d2", seed=1))
    assert run.returncode == 1 and "not the same data at the 1,000-row point of the hybrid target" in run.stderr
    run = run_bench("scale_curve.py", point("a.json", 0.003, "d1"), point("b.json", 0.003, "d1"))
    assert run.returncode == 1 and "dflash-pipeline seed 0 at the 1,000-row point is in another file too" in run.stderr
    out, _ = bench("scale_curve.py", point("a.json", 0.003, "d1"), point("b.json", 0.006, "d1"))
    figure(r"^\| dflash-pipeline, lr 0.003 \| 1 \| 1.200 \|", out)
    figure(r"^\| dflash-pipeline, lr 0.006 \| 1 \| 1.200 \|", out)
    # a sweep's variant at its own lr renames nothing, and the chart is of trainers, not screens
    out, _ = bench("scale_curve.py", point("a.json", 0.003, "d1"),
                   point("b.json", 0.009, "d1", trainer="ours (lr 0.009)"), "--chart-dir", str(tmp_path))
    figure(r"^\| dflash-pipeline \| 1 \| 1.200 \|", out)
    figure(r"^\| ours \(lr 0.009\) \| 1 \| 1.200 \|", out)
    chart = (tmp_path / "curve-hybrid.svg").read_text()
    assert "dflash-pipeline" in chart and "ours (lr 0.009)" not in chart
    # unless it is the one the sweep made the defaults
    bench("scale_curve.py", point("a.json", 0.003, "d1"), point("b.json", 0.009, "d1", trainer="ours (lr 0.009)"),
          "--chart-dir", str(tmp_path), "--also-chart", "ours (lr 0.009)")
    assert "ours (lr 0.009)" in (tmp_path / "curve-hybrid.svg").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--variant", "lr=0.006"], "--variant 'lr=0.006': expected LABEL:KEY=VALUE"),
    (["--variant", "fast:lr"], "--variant 'lr': expected KEY=VALUE"),
    (["--set", "lr0.006"], "--set 'lr0.006': expected KEY=VALUE")])
def test_train_equal_steps_refuses_a_malformed_setting_before_any_work(flags, message):
    """A sweep's typo is a one-line usage error before anything loads, not a traceback later."""
    run = run_bench("train_equal_steps.py", *flags, "--results", "absent")
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_train_equal_steps_names_the_target_by_what_trained_it(tmp_path):
    """A point's target says which model's completions the drafter learnt from: the full-attention
    variant on the demo target's (``--attention-only``) is not the same curve as that variant on
    its own (a data set that bench/scale_data.py --target built with it)."""
    module = bench_module("train_equal_steps.py")
    demo = ROOT / "data" / "demo" / "target"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "layer_types": ["full_attention"] * 4}))
    assert [module.target_label(demo, False), module.target_label(demo, True),
            module.target_label(tmp_path, False)] == ["hybrid", "qwen3", "qwen3-own"]


@pytest.mark.slow
def test_eval_vs_reference_on_a_finished_run(pipeline):
    """5 rounds (its least) of 2 held-out prompts. --attention-only is left out: it teaches a
    target of its own first (minutes)."""
    work, _ = pipeline
    out, _ = bench("eval_vs_reference.py", str(work / "results"), "--rounds", "5", "--prompts", "2",
                   "--reference", str(REFERENCE_MODEL_PY))
    figure(r"^outputs: ours = plain greedy on 2/2 prompts", out)  # exact, whatever the drafter
    figure(r"^  decode, wall +[\d.]+ ", out)
    figure(r"^  loading \+ decode, CPU +[\d.]+ ", out)


@pytest.mark.slow
def test_stage_costs_on_a_finished_run(pipeline):
    work, _ = pipeline
    out, _ = bench("stage_costs.py", str(work / "results" / "benchmarks"))
    figure(r"^train +1 +[\d.]+", out)
    figure(r"^total +\d+ +[\d.]+", out)


@pytest.mark.slow
def test_train_equal_steps_on_a_finished_run(pipeline, tmp_path):
    """Our trainer, 2 steps, evaluated on the run's held-out prompts; speculators' side is left out
    (no venv), but the rows this bench writes for it are made from the run too."""
    work, _ = pipeline
    res = work / "results"
    out, err = bench("train_equal_steps.py", "--results", str(res), "--config", str(work / "config.yaml"),
                     "--steps", "2", "--speculators-python", "absent/python")
    assert LEFT_OUT in err
    figure(r"^\| dflash-pipeline \| 0 \| [\d.]+ \| [\d.]+ \|", out)
    # a point of the data curve: the first shard's rows, each seen twice, the figures as JSON; with a
    # variant of ours beside the plain one (a sweep of candidate defaults)
    bench("train_equal_steps.py", "--results", str(res), "--config", str(work / "config.yaml"), "--rows", "1",
          "--epochs", "2", "--batch-size", "2", "--json-out", str(tmp_path / "point.json"),
          "--variant", "quiet:feature_noise=0,warmup_ratio=0.04", "--speculators-python", "absent/python")
    point = json.loads((tmp_path / "point.json").read_text())
    assert point["shards"] == 1 and point["steps"] == point["rows"] > 0 and point["rows_per_step"] == 2
    assert [(r["trainer"], r["seed"], r["lr"]) for r in point["runs"]] == [("dflash-pipeline", 0, point["lr"]),
                                                                           ("ours (quiet)", 0, point["lr"])]
    assert point["variants"] == {"ours (quiet)": {"feature_noise": 0, "warmup_ratio": 0.04}}
    assert re.fullmatch(r"[0-9a-f]{16}", point["data"])  # what the point trained and was evaluated on
    out, _ = bench("scale_curve.py", str(tmp_path / "point.json"), "--chart-dir", str(tmp_path / "charts"))
    figure(rf"^\| dflash-pipeline \| 1 \| [\d.]+ \| [\d.]+ to [\d.]+ \|", out)
    figure(rf"^\| ours \(quiet\) \| 1 \| [\d.]+ \|", out)
    assert "<svg" in (tmp_path / "charts" / "curve-hybrid.svg").read_text()
    # speculators' rows (what its side trains on), made from the run with the run's drafter config
    from safetensors.torch import load_file

    module = bench_module("train_equal_steps.py")
    hidden = [res / "hidden" / p.name for p in sorted((res / "tokenized").glob("shard-*.safetensors"))]
    module.speculators_data(sorted((res / "tokenized").glob("shard-*.safetensors")), res / "target", hidden,
                            res / "checkpoints" / "demo", tmp_path)
    rows = load_file(tmp_path / "rows.safetensors")
    assert rows["offsets"][-1] == len(rows["input_ids"]) == len(rows["aux"]) == len(rows["last"]) > 0


@pytest.mark.slow
def test_forecast_accuracy_on_a_finished_run(pipeline):
    """--results: the run's own forecast against what it measured (the bench's default runs the
    whole demo in a fresh folder first: minutes)."""
    work, _ = pipeline
    out, _ = bench("forecast_accuracy.py", "--results", str(work / "results"))
    errors = json.loads(out.strip().splitlines()[-1])
    assert set(errors) == {"tokens_error", "time_error", "training_error"}
    figure(r"^training: forecast [\d.]+ s .* -> error [+-][\d.]+%", out)
