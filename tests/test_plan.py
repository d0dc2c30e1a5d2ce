"""dflash plan: the story's run from its own figures, and a plan before the prompts exist."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash.core.config import load_config
from dflash.plan.stage import forecast, plan_lines
from tests.conftest import ROOT

STORY_TOKENS, STORY_PROMPTS = 1.64e9, 913_786


def test_the_story_run_from_its_own_figures():
    """docs/design.md: 1.64e9 output tokens at 25,000 tok/s on a 7x B200 node at $27 a node-hour took
    17.45 h and ~$471; on a 4x RTX PRO 6000 node it was estimated at ~16.5 days."""
    cfg = load_config(ROOT / "config/qwen3.6-27b.yaml")
    cfg["plan"]["profiles"] = {
        "b200": {"gpus_per_node": 7, "gpu_hour_price": 27 / 7, "output_tokens_per_s": 25_000},
        "rtxpro6000": {"gpus_per_node": 4, "gpu_hour_price": None, "output_tokens_per_s": STORY_TOKENS / (16.5 * 86400)},
    }
    cfg["plan"]["nodes"] = [1, 2]
    counts = {"prompts": STORY_PROMPTS, "categories": {"given": STORY_PROMPTS}, "shards": 1828, "from": "--prompts"}
    plan = forecast(cfg, counts, output_tokens=STORY_TOKENS, target="Qwen/Qwen3.6-27B")
    print("\n".join(plan_lines(plan)))
    b200 = plan["generation"]["b200"]["forecast"]
    assert 17.45 <= b200[0]["hours"] <= 18.25 and 471 <= b200[0]["cost"] <= 492
    assert b200[1]["hours"] == b200[0]["hours"] / 2 and round(b200[1]["cost"], 6) == round(b200[0]["cost"], 6)
    rtx = plan["generation"]["rtxpro6000"]["forecast"][0]
    assert round(rtx["hours"] / 24, 1) == 16.5 and rtx["cost"] is None
    assert round(plan["sizes"]["completions_bytes"] / 1e9, 2) == 7.25
    assert plan["jobs"]["generate"] == 1828 and plan["jobs"]["serve"] == 29  # 64 shards per started server
    assert "not on this machine" in plan["sizes"]["hidden"] or "online" in plan["sizes"]["hidden"]


def plan_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.cli", "plan", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_the_shipped_real_config_plans_the_story_on_both_node_kinds(tmp_path):
    run = plan_cli("--config", str(ROOT / "config/qwen3.6-27b.yaml"), "--prompts", str(STORY_PROMPTS),
                   "--output-tokens", str(STORY_TOKENS), "--json", str(tmp_path / "plan.json"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    print(run.stdout)
    assert "b200 x1 (8 GPUs, 28,571 tok/s from plan.profiles): generation 15.9 h, $492" in run.stdout
    assert "rtxpro6000 x1 (4 GPUs, 1,150 tok/s from plan.profiles): generation 16.5 days" in run.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["output_tokens"] == STORY_TOKENS


def test_a_plan_before_the_prompts_exist_counts_the_sources(tmp_path):
    """No prompts stage has run (no results/): the sources are read and counted, held-out
    conversations left out."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    expected: dict[str, int] = {}
    for source in cfg["prompts"]["sources"]:
        source["path"] = str(ROOT / source["path"])
        for line in Path(source["path"]).read_text().splitlines():
            if line.strip() and '"split": "heldout"' not in line:
                cat = json.loads(line)["category"]
                expected[cat] = expected.get(cat, 0) + 1
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    run = plan_cli("--config", "config.yaml", "--output-tokens", "1e6", "--json", "p.json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["counted_from"] == "the sources, counted" and plan["prompts"] == sum(expected.values())
    assert plan["categories"] == expected, (plan["categories"], expected)
    missing = plan_cli("--config", "config.yaml", cwd=tmp_path)
    assert missing.returncode == 1 and missing.stderr.strip().splitlines() == [
        "dflash plan: no figure to forecast output tokens from: run the pilot (snakemake pilot), or give "
        "plan.mean_output_tokens or --output-tokens"]


def test_the_plan_says_what_loop_aborts_saved_in_the_pilot():
    """The pilot's tokens per prompt count a generation cut for looping at the tokens received, so
    the forecast holds the saving; the plan says how much it is, the pilot's lines and the report's
    generation facts too."""
    from dflash.plan.pilot import pilot_lines
    from dflash.report.headline import _generation_fact

    cfg = load_config(ROOT / "config/qwen3.6-27b.yaml")
    per_prompt = {"n": 100, "mean": 2000.0, "sd": 500.0}
    aborts = {"records": 3, "tokens_received": 600, "tokens_saved": 20_000}
    pilot = {"records": 100, "prompts": 100, "categories": {"tool": {"output_tokens_per_prompt": per_prompt}},
             "throughput": {"output_tokens": 200_000, "output_tokens_per_s": 1000.0, "requests_per_s": 0.5,
                            "output_tokens_per_s_per_gpu": None, "gpus": None},
             "bytes_per_output_token": 4.0, "reject_rate": 0.1, "records_per_prompt": 1.0, "rows_per_record": 1.0,
             "tokens_per_row": 2500.0, "trivial_share": 0.0, "gates": [], "loop_aborts": aborts}
    counts = {"prompts": 10_000, "categories": {"tool": 10_000}, "shards": 10, "from": "--prompts"}
    plan = forecast(cfg, counts, pilot, target="Qwen/Qwen3.6-27B")
    assert plan["output_tokens"] == 2e7 and plan["loop_abort"]["saved_per_output_token"] == 0.1
    assert plan["loop_abort"]["output_tokens_without"] == 2.2e7
    assert ("  loop aborts: the pilot cut 3 looping generations, 20,000 tokens not generated; the forecast counts "
            "them as cut (without generate.loop_abort: 2.2e7 output tokens, +10.0%)") in plan_lines(plan)
    assert ("  loop aborts: 3 looping generations cut after 600 tokens, 20,000 tokens not generated (9.1% of what "
            "generation would have produced)") in pilot_lines({**pilot, "categories": {}})
    generation = {"wall_hours": 2.0, "node_hours": 2.0, "cost": 100.0, "requests": 100, "output_tokens": 200_000,
                  "loop_aborts": aborts}
    assert _generation_fact(generation)[1].endswith(
        "Loop aborts: 3 looping generations cut after 600 tokens, 20,000 tokens not generated (9.1% of what "
        "generation would have produced); about 0.2 node-hours, $10.00 at this run's rate.")
    assert forecast(cfg, counts, {**pilot, "loop_aborts": {**aborts, "records": 0}})["loop_abort"] is None


TINY = {"model_type": "qwen3", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "intermediate_size": 16, "vocab_size": 32, "num_hidden_layers": 2}


def test_the_flops_of_a_training_step_by_hand():
    """A 2-layer target (hidden 8, 2 heads of 4, 1 kv head, mlp 16, vocab 32) and a 1-layer
    drafter of its sizes on 2 features, blocks of 4, 3 anchors, 2 rows of 10 tokens (5 answer)."""
    from dflash.plan.train_cost import step_flops, target_forward_flops, target_matmul_params

    # lm_head 32x8 = 256; mlp 3x8x16 x 2 layers = 768; attention q, k, v, o = 64 + 32 + 32 + 64, x 2 = 384
    assert target_matmul_params(TINY) == 256 + 768 + 384
    # 2 x 1408 x 10 tokens, and QK + AV over half of the 10 x 10 square: 2 x 2 heads x 4 x 100 x 2 layers
    assert target_forward_flops(TINY, 10) == 28_160 + 3_200
    config = {"drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": [0, 1], "intermediate_size": None,
                          "num_heads": None, "num_kv_heads": None, "head_dim": None},
              "train": {"batch_size": 2, "num_anchors": 3, "hidden_states": "online"}}
    f = step_flops(config, TINY, 10, 5)
    assert f["target"] == 2 * 31_360
    # 24 queries (2 rows x 3 anchors x 4) x (q 64 + o 64 + k 32 + v 32 + mlp 384) + 20 context tokens x
    # (k 32 + v 32 + fc 2x8x8), forward and backward (x6), and the scores: 2 x 2 x 8 x (10/2 + 4) x 24, x3
    assert f["drafter"] == 6 * (24 * 576 + 20 * 192) + 3 * 6_912
    assert f["lm_head"] == 6 * 2 * 3 * 3 * 8 * 32  # 18 supervised positions through the 8 x 32 head, x6
    assert f["total"] == 62_720 + 126_720 + 27_648
    config["train"]["hidden_states"] = "offline"
    assert step_flops(config, TINY, 10, 5)["target"] == 0


def test_the_target_count_is_the_tiny_targets_own_weights():
    """The formula against the demo target's safetensors: every weight a token is multiplied by
    (all but the embedding, a lookup, and the norms' and gates' vectors)."""
    import math

    from dflash.core.shapes import text_config
    from dflash.core.tensors import open_safetensors
    from dflash.plan.train_cost import target_matmul_params

    target = ROOT / "data/demo/target"
    with open_safetensors(target / "model.safetensors") as f:
        weights = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()
                      if len(f.get_slice(k).get_shape()) > 1 and "embed_tokens" not in k)
    assert target_matmul_params(text_config(target)) == weights


def test_the_bill_says_what_the_pilot_measured_and_what_is_assumed():
    cfg = load_config(ROOT / "config/qwen3.6-27b.yaml")
    cfg["plan"]["nodes"] = [1, 2]
    counts = {"prompts": 1000, "categories": {"chat": 1000}, "shards": 2, "heldout": 10, "from": "--prompts"}
    burst = {"kind": "b200", "steps": 30, "seconds_per_step": 3.0, "setup_seconds": 120.0}
    target = ROOT / "data/demo/target"  # the tiny one: its sizes, not 27B's; what is tested is where figures come from
    plan = forecast(cfg, counts, output_tokens=1e7, target=target, burst=burst)
    kinds = plan["gpu_stages"]["kinds"]
    b200, rtx = kinds["b200"]["training"], kinds["rtxpro6000"]["training"]
    one_node = b200["spread"][0]
    assert b200["from"] == "measured by the pilot" and one_node["hours"] == pytest.approx(
        (120 + 50_000 * (3.0 + one_node["allreduce_seconds"])) / 3600)
    assert rtx["seconds_per_step"] == pytest.approx(3.0 * 2250 / 503.8) and "scaled" not in rtx["from"]
    assert "the pilot's rate on b200" in rtx["from"] and rtx["gpus"] == 4
    bill = kinds["b200"]["bill"]
    generation = plan["generation"]["b200"]["forecast"]
    two_nodes = b200["spread"][1]
    assert bill[1]["hours"] == pytest.approx(generation[1]["hours"] + two_nodes["hours"] + kinds["b200"]["eval_hours"])
    # two nodes generate and train; one evaluates
    node_hours = 2 * (generation[1]["hours"] + two_nodes["hours"]) + kinds["b200"]["eval_hours"]
    assert bill[1]["cost"] == pytest.approx(node_hours * 8 * 3.86)
    lines = "\n".join(plan_lines(plan))
    print(lines)
    assert "(measured by the pilot)" in lines and "x2 nodes: generation" in lines
    assert "training on 4 GPUs a node (train.gpus 8 is more than a node has: set 4)" in lines
    del burst["kind"]
    plan = forecast(cfg, counts, output_tokens=1e7, target=target)
    assert plan["gpu_stages"]["kinds"]["rtxpro6000"]["training"]["from"] == "assumed: 503.8 TFLOPS bf16 x 40%"


def test_a_skipped_burst_leaves_training_to_the_arithmetic():
    cfg = load_config(ROOT / "config/qwen3.6-27b.yaml")
    counts = {"prompts": 1000, "categories": {"chat": 1000}, "shards": 2, "heldout": 10, "from": "--prompts"}
    plan = forecast(cfg, counts, output_tokens=1e7, target=ROOT / "data/demo/target",
                    burst={"kind": "b200", "steps": 0, "skipped": "nothing to train on"})
    assert plan["gpu_stages"]["kinds"]["b200"]["training"]["from"] == "assumed: 2,250 TFLOPS bf16 x 40%"


def test_the_drafters_trained_weights_are_the_demo_drafters_own():
    """The all-reduce's bytes: the plan's count of the drafter's trained weights (layers and fc) is
    the demo drafter's, its norms aside."""
    from dflash.train.drafter import DFlashDraftModel
    from dflash.core.shapes import text_config
    from dflash.train.stage import planned_drafter_config
    from dflash.plan.train_cost import drafter_trained_params

    cfg = load_config(ROOT / "config.yaml")
    target = ROOT / "data/demo/target"
    model = DFlashDraftModel(planned_drafter_config(cfg["drafter"], target))
    trained = sum(p.numel() for name, p in model.named_parameters() if p.requires_grad and p.dim() > 1)
    assert drafter_trained_params(cfg, text_config(target)) == trained


def test_the_all_reduce_by_hand():
    from dflash.plan.train_cost import allreduce_seconds

    # a ring in each node of 8: 2 x 7/8 of 8 GB at 800 GB/s; across 2 nodes: 2 x 1/2 of it at 400 GB/s
    assert allreduce_seconds(8e9, 8, 2, 800, 400) == (pytest.approx(0.0175 + 0.02), [])
    assert allreduce_seconds(8e9, 8, 2, 800, 400, "fsdp")[0] == pytest.approx(1.5 * 0.0375)
    assert allreduce_seconds(8e9, 1, 1, None, None) == (0.0, [])  # one GPU: nothing to average
    assert allreduce_seconds(8e9, 8, 4, 800, None) == (pytest.approx(0.0175), ["network_gb_s"])


QWEN36_TEXT = {"model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 24,
               "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 17408, "vocab_size": 248_320,
               "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
               "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "attn_output_gate": True,
               "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16}


def test_the_real_config_spreads_training_over_the_nodes_it_rents(tmp_path):
    """config/qwen3.6-27b.yaml on B200 at 1, 2 and 4 nodes: the config's rows (50,000 steps of
    4 rows x 8 GPUs) in 1/N of the steps, each the GPU's step and the all-reduce of the drafter's
    fp32 gradients; the whole bill with training spread, and with training on one node."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": QWEN36_TEXT}))
    cfg = load_config(ROOT / "config/qwen3.6-27b.yaml")
    counts = {"prompts": STORY_PROMPTS, "categories": {"chat": STORY_PROMPTS}, "shards": 1828, "heldout": 500,
              "from": "--prompts"}
    plan = forecast(cfg, counts, output_tokens=STORY_TOKENS, target=tmp_path / "config.json")
    stages = plan["gpu_stages"]
    b200 = stages["kinds"]["b200"]
    t, bills = b200["training"], b200["bill"]
    assert stages["train_rows"] == 50_000 * 4 * 8 and 1.8e9 < stages["gradient_bytes"] / 4 < 1.9e9
    assert [(x["nodes"], x["steps"], x["rows_per_step"]) for x in t["spread"]] == [(1, 50_000, 32), (2, 25_000, 64),
                                                                                  (4, 12_500, 128)]
    grads = stages["gradient_bytes"]
    for x in t["spread"]:
        n = x["nodes"]
        assert x["allreduce_seconds"] == pytest.approx(2 * 7 / 8 * grads / 900e9 + 2 * (n - 1) / n * grads / 400e9)
        assert x["hours"] == pytest.approx(x["steps"] * (t["seconds_per_step"] + x["allreduce_seconds"]) / 3600)
    generation = plan["generation"]["b200"]["forecast"]
    for b, g, x in zip(bills, generation, t["spread"]):
        n = b["nodes"]
        assert b["training_hours"] == x["hours"] and b["hours"] == pytest.approx(g["hours"] + x["hours"]
                                                                                + b200["eval_hours"])
        assert b["cost"] == pytest.approx((n * (g["hours"] + x["hours"]) + b200["eval_hours"]) * 8 * 3.86)
        one = b["training_on_one_node"]
        assert one["hours"] == pytest.approx(g["hours"] + t["spread"][0]["hours"] + b200["eval_hours"])
        assert one["cost"] == pytest.approx((n * g["hours"] + t["spread"][0]["hours"] + b200["eval_hours"]) * 8 * 3.86)
        rerun = b["rerun_after_validation"]  # all but generation: samples dropped after the run
        assert rerun["hours"] == pytest.approx(x["hours"] + b200["eval_hours"])
        assert rerun["cost"] == pytest.approx((n * x["hours"] + b200["eval_hours"]) * 8 * 3.86)
    # spread over 4 nodes, the run takes about a third of the time for 1% more money
    assert bills[2]["hours"] < bills[2]["training_on_one_node"]["hours"] / 2.5
    assert bills[0]["cost"] < bills[2]["cost"] < 1.02 * bills[0]["cost"]
    lines = "\n".join(plan_lines(plan))
    print(lines)
    assert "b200: training on 8 GPUs a node: 2.65 s/step (assumed: 2,250 TFLOPS bf16 x 40%) + all-reduce 0.014 s (x1)" \
           in lines and "assumed: 900 GB/s within a node, 400 GB/s a node between nodes" in lines
    assert re.search(r"x4 nodes: generation 4\.0 h \+ training 9\.\d h \(12,500 steps\) \+ eval [\d.]+ min = 1\d\.\d h, "
                     r"\$1,6\d\d; training on one node: 4\d\.\d h, \$1,6\d\d", lines), lines
    assert re.search(r"a re-run from validation on \(samples dropped, a check changed; no generation\): x1 3\d\.\d h, "
                     r"\$1,1\d\d, x2 1\d\.\d h, \$1,1\d\d, x4 1\d\.\d h, \$1,1\d\d", lines), lines
    # the RTX node has 4 GPUs: the same rows take twice the steps on one node, and the config's 8 GPUs do not fit
    rtx = stages["kinds"]["rtxpro6000"]["training"]
    assert rtx["spread"][0]["steps"] == 100_000 and "(train.gpus 8 is more than a node has: set 4)" in lines


def test_the_plan_counts_the_held_out_set_the_prompts_stage_will_draw_and_warns_without_one(tmp_path):
    """Before the prompts exist: sources with no split get prompts.heldout_share of each category
    held out, as the prompts stage draws them; with the share at 0 the plan says the eval will have
    nothing to measure (it used to print "eval 0 s" and leave it out of the bill)."""
    from dflash.plan.stage import prompt_counts
    from dflash.prompts.checks import heldout_settings
    from dflash.prompts.stage import build_prompts
    from tests.test_prompts import mixed_openai_source

    cfg = load_config(ROOT / "config.yaml")
    cfg["prompts"]["sources"] = [mixed_openai_source(tmp_path)]
    cfg["output_dir"] = str(tmp_path / "results")
    counts = prompt_counts(cfg)
    manifest = build_prompts(cfg["prompts"]["sources"], tmp_path / "p", 50, heldout=heldout_settings(cfg))
    assert (counts["heldout"], counts["prompts"], counts["categories"]) == (
        manifest["heldout"], manifest["prompts"], manifest["categories"]) == (3, 87, {"other": 58, "tool": 29})
    assert counts["from"] == "the sources, counted; held out: prompts.heldout_share 0.02"
    cfg["prompts"]["heldout_share"] = 0
    plan = forecast(cfg, prompt_counts(cfg), output_tokens=1e6)
    assert plan["heldout"] == 0
    assert ("  warning: no held-out prompts: the eval will have nothing to measure, and the bill has no eval; set "
            "prompts.heldout_share or mark a source split: heldout (or give --heldout)") in plan_lines(plan)


def test_tokens_per_prompt_and_a_total_over_max_tokens_is_a_warning(tmp_path):
    """--mean-output-tokens takes the figure a user knows per prompt; a total that makes each
    completion longer than max_tokens (1.64e9 typed as 1.64e12, say) is said before money is spent."""
    real = ["--config", str(ROOT / "config/qwen3.6-27b.yaml"), "--prompts", "1000"]
    run = plan_cli(*real, "--mean-output-tokens", "1800", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("plan: 1,000 prompts (from --prompts), 1.8e6 output tokens (from plan.mean_output_tokens)")
    assert "warning" not in run.stdout
    run = plan_cli(*real, "--output-tokens", "1.64e12", cwd=tmp_path)
    assert ("  warning: 1,640,000,000 output tokens per prompt, over generate.sampling.max_tokens 4,096: one completion "
            "cannot be that long, so the total is too high unless the prompts are replayed conversations (a "
            "completion per turn); check --output-tokens (the total) or give --mean-output-tokens") in run.stdout
    both = plan_cli(*real, "--output-tokens", "1e6", "--mean-output-tokens", "10", cwd=tmp_path)
    assert both.returncode == 1 and "give --output-tokens (the total) or --mean-output-tokens" in both.stderr
