import json
import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from dflash.report.benchmarks import stage_costs
from dflash.core.config import defaults
from dflash.validate.gates import GateError, run_gates, write_qa_summary
from dflash.report.headline import headline_lines
from dflash.core.io import read_json, write_json, write_jsonl_zst
from dflash.report.pages import write_qa_page
from dflash.report.stage import config_digest, pipeline_commit, provenance, write_report
from dflash.core.storage import safe_to_destroy
from dflash.validate.stage import validate_shard
from tests.test_validate import CFG, GOOD, STORY_LOOP, answer, record, xml

GATES = {"max_reject_rate": 0.5, "max_category_reject_rate": None, "max_trivial_share": 0.5,
         "min_median_trainable_tokens": 16, "min_tool_call_share": None}


@pytest.fixture
def qa_summary(tmp_path):
    """Two validated shards and their tokenized indexes, summed into the QA summary."""
    shards = [[GOOD, {**GOOD, "id": "g2"}, record("\n\n</think>\nOK.", rid="t")],
              [answer(xml(city="Paris")), {**answer(xml(city="Paris", days="soon")), "id": "bad"},
               {**STORY_LOOP, "id": "loop", "category": "tool"}]]
    qa, tok = [], []
    for i, recs in enumerate(shards):
        write_jsonl_zst(tmp_path / f"c{i}.jsonl.zst", recs)
        qa.append(tmp_path / f"qa{i}.json")
        validate_shard(tmp_path / f"c{i}.jsonl.zst", tmp_path / f"v{i}", tmp_path / f"r{i}", qa[-1], CFG)
        tok.append(tmp_path / f"t{i}.json")
        rows = [{"id": f"{i}-{j}", "category": "tool" if i else "chat", "length": 90, "trainable": 20 + 10 * j}
                for j in range(2 - i)]
        write_json(tok[-1], {"rows": rows, "stats": {
            "rows": len(rows), "tokens": 90 * len(rows), "trainable_tokens": sum(r["trainable"] for r in rows),
            "dropped_no_anchor": 0, "truncated": i, "trainable_by_category": {}}})
    write_qa_summary(qa, tok, tmp_path / "summary.json")
    return tmp_path / "summary.json"


def test_qa_summary_sums_shards_and_keeps_examples(qa_summary):
    s = read_json(qa_summary)
    assert (s["records"], s["kept"], s["rejected"]) == (6, 3, 3) and s["shards"] == 2
    assert s["categories"]["tool"] == {"records": 3, "kept": 1, "rejected": 2, "kept_calling_tool": 1,
                                       "reject_rate": 2 / 3}
    assert s["checks"]["tool_args_schema"]["by_category"] == {"tool": 1}
    assert [e["id"] for e in s["examples"]["repetition_loop"]] == ["loop"]
    assert s["lengths"]["chat"]["output_tokens"]["n"] == 3 and sum(s["lengths"]["tool"]["output_tokens"]["histogram"]) == 3
    hist = lambda *counts: list(counts) + [0] * (len(s["length_bins"]) - len(counts))  # noqa: E731
    assert s["trainable_tokens"] == {"rows": 3, "total": 70, "median": 20, "by_category": {
        "chat": {"rows": 2, "total": 50, "median": 25, "histogram": hist(0, 2)},
        "tool": {"rows": 1, "total": 20, "median": 20, "histogram": hist(0, 1)}}}
    assert s["tokenized"] == {"rows": 3, "tokens": 270, "trainable_tokens": 70, "dropped_no_anchor": 0, "truncated": 1}


def test_qa_page_shows_rates_plots_and_examples(qa_summary, tmp_path):
    write_qa_page(qa_summary, tmp_path / "qa.html")
    page = (tmp_path / "qa.html").read_text()
    assert page.count("<svg") == 4 and "tool: output tokens (n=3" in page
    # completions, kept, kept calling a tool, rejected
    assert "<tr><td>tool</td><td>3</td><td>1</td><td>1</td><td>2</td><td>66.7%</td>" in page
    assert "chat: trainable tokens per row (n=2, median 25" in page
    assert "<td>tool_args_schema</td><td>reject</td><td>1</td><td>16.7%</td><td>0.0%</td><td>33.3%</td>" in page
    # the schema example shows the offered tool, the parsed call and the error
    section = page.split("<h3>tool_args_schema")[1].split("<h3>")[0]
    assert "get_weather" in section and "&quot;days&quot;: &quot;soon&quot;" in section and "offered tools" in section
    assert "&lt;tool_call&gt;\n&lt;/think&gt;" in page.split("<h3>repetition_loop")[1]


def test_failed_gate_names_itself_and_writes_nothing(qa_summary, tmp_path):
    with pytest.raises(GateError, match=r"gate min_median_trainable_tokens: median trainable tokens per row is 20 "
                                        r"\(minimum 25\)"):
        run_gates(qa_summary, tmp_path / "gates.json", {**GATES, "min_median_trainable_tokens": 25})
    assert not (tmp_path / "gates.json").exists()
    with pytest.raises(GateError, match=r"66.7% of category 'tool' rejected \(limit 60.0%\)"):
        run_gates(qa_summary, tmp_path / "gates.json", {**GATES, "max_category_reject_rate": 0.6})


BENCHMARK = ("s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"  # as Snakemake writes it
             "{s}\t0:00:{s:02.0f}\t{rss}\t1.0\t1.0\t1.0\t0\t0\t50\t1.0\n")


@pytest.fixture
def report_pages(qa_summary, tmp_path):
    """Both pages of a run from the real QA summary, its gates, a loss log, an eval result and
    Snakemake benchmark files, written side by side as the report rules write them."""
    write_json(tmp_path / "manifest.json", {"shards": [{"name": "shard-00000.jsonl.zst", "records": 3}], "prompts": 3,
                                            "heldout": 1, "categories": {"chat": 2, "tool": 1}, "dropped": {"duplicate": 2}})
    run_gates(qa_summary, tmp_path / "gates.json", GATES)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_json(ckpt / "config.json", {"architectures": ["DFlashDraftModel"], "block_size": 8,
                                      "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 3]},
                                      "layer_types": ["full_attention"] * 2})
    write_json(ckpt / "trainer_state.json", {"data": {"features": {"shards": 2, "tokens": 5000, "layers": [
        {"layer": 1, "rms_min": 0.51, "rms_max": 0.62, "max_abs": 14.5, "spread_min": 3.25}]}}})
    (ckpt / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": l}) + "\n" for s, l in [(10, 6.0), (20, 4.5)]))
    ev = tmp_path / "eval.json"
    summary = {"acceptance_length": 1.5, "acceptance_length_per_step": 1.8, "prompts": 1, "tokens": 9,
               "target_forwards": 6, "acceptance_rate_per_position": [0.6, 0.25, 0.125],
               "accepted_length_histogram": [2, 2, 0, 1]}
    off = {**summary, "acceptance_length": 1.2, "acceptance_rate_per_position": [0.3, 0.1, 0.0]}
    write_json(ev, {"overall": summary, "per_category": {"chat": summary},
                    "untrained": {"overall": {**summary, "acceptance_length": 1.1}, "per_category": {}},
                    "thinking_off": {"overall": off, "per_category": {"chat": off}}})
    bench = tmp_path / "benchmarks"
    for path, seconds, rss in [("train/r1.tsv", 30, 900), ("generate/00000.tsv", 12, 400),
                               ("generate/00001.tsv", 8, 500), ("prompts.tsv", 1.5, "NA")]:
        (bench / path).parent.mkdir(parents=True, exist_ok=True)
        (bench / path).write_text(BENCHMARK.format(s=seconds, rss=rss))
    # two generate jobs on 2 nodes of 8 GPUs at $3 a GPU-hour, overlapping: 1 h of wall time
    generated = [tmp_path / "g0.json", tmp_path / "g1.json"]
    for path, start, seconds in zip(generated, (0, 900), (1800, 2700)):
        write_json(path, {"prompts": 3, "requests": 3, "output_tokens": 1000, "seconds": seconds, "started_at": start})
    config = {"run": "r1", "target": {"path": None}, "output_dir": "results", "tracking": defaults("tracking"),
              "generate": {"budget": {"nodes": 2, "profile": "b200", "max_cost": 500}, "enable_thinking": True,
                           "server": {"launch": None}},
              "plan": {"profiles": {"b200": {"gpus_per_node": 8, "gpu_hour_price": 3.0}}}}
    about = provenance(config, Path(__file__).parent)
    pages = tmp_path / "report"
    write_qa_page(qa_summary, pages / "qa.html", about, "r1")
    durability = safe_to_destroy(tmp_path, "benchmarks", None)  # a run without storage: not safe
    s = write_report(config, tmp_path / "manifest.json", qa_summary, tmp_path / "gates.json", ckpt, ev,
                     pages / "summary.html", pages / "summary.json", durability, generated=generated,
                     benchmarks=bench, about=about)
    return s, pages


def test_report_aggregates_every_stage(report_pages):
    s, pages = report_pages
    assert s["validate"]["records"] == 6 and s["validate"]["kept"] == 3 and s["validate"]["reject_rate"] == 0.5
    assert s["validate"]["checks"]["trivial"]["by_category"] == {"chat": 1}
    assert s["tokenized"]["trainable_by_category"]["chat"]["total"] == 50
    assert [g["gate"] for g in s["gates"] if g["passed"]] == ["max_reject_rate", "max_trivial_share",
                                                              "min_median_trainable_tokens"]
    assert s["train"] == {"steps": 20, "first_loss": 6.0, "final_loss": 4.5, "curve": [[10, 6.0], [20, 4.5]]}
    # job time per stage from the benchmark files (max_rss is in MiB; NA when never sampled)
    assert s["stages"] == {"train": {"jobs": 1, "seconds": 30.0, "max_rss_bytes": 900 * 2**20},
                           "generate": {"jobs": 2, "seconds": 20.0, "max_rss_bytes": 500 * 2**20},
                           "prompts": {"jobs": 1, "seconds": 1.5, "max_rss_bytes": 0}}
    page = (pages / "summary.html").read_text()
    assert "<polyline" in page and "1.500" in page and "training loss: 6.00 to 4.50 in 20 steps" in page
    assert "<td>max_reject_rate</td><td>50.0%</td><td>50.0%</td><td>pass</td>" in page
    assert ("<td>overall</td><td>1.500</td><td>1.100</td><td>1.800</td><td>1</td><td>9</td><td>6</td><td>9</td>"
            "<td>3 (33.3%)</td>") in page
    # how to serve it: vLLM drafts block_size - 1 tokens, SGLang's draft tokens are the block
    assert "&quot;num_speculative_tokens&quot;: 7" in page and "--speculative-num-draft-tokens 8" in page
    assert "acceptance length per category" in page and "<td>train</td><td>1</td><td>30 s</td><td>58.3%</td>" in page
    assert "524.3 MB" in page  # generate's peak memory, in human units
    # per category: the rate per draft position (thinking on and off) and the accepted-length histogram
    assert "chat: acceptance rate per draft position" in page and "chat: draft tokens accepted per verify step" in page
    assert "<td>chat</td><td>1.500</td><td>1.200</td><td>1.800</td><td>1.800</td><td>0.80</td>" in page
    assert "Live curves" in page and "TensorBoard: <code>tensorboard --logdir results/curves</code>" in page
    # the target's features the drafter read, per layer (the feature guards' statistics)
    assert "over 2 shard(s) and 5,000 tokens" in page
    assert "<td>1</td><td>0.51</td><td>0.62</td><td>14.5</td><td>3.25</td>" in page
    assert json.loads((pages / "summary.json").read_text()) == s


def test_headline_lines_tell_the_run_in_a_few_lines(report_pages):
    s, pages = report_pages
    lines = headline_lines(s, pages / "summary.html")
    about = s["about"]
    assert lines[0] == f"run r1 ({about['date']}, config {about['config_digest']}, commit {about['commit']})"
    assert re.match(r"machine: NOT safe to destroy: 4 file\(s\), \d+\.\d B, only on this machine;", lines[1])
    kept = lines.index("kept: 3 of 6 completions kept (50.0%)")
    assert lines[kept + 1:kept + 5] == [
        "  Most rejected: tool, 66.7% of 3 (finish_length 1, empty_answer 1, repetition_loop 1 and 3 more",
        "  checks). Kept tool records that call a tool: 1 of 1.",
        "trainable tokens: 70 in 3 rows",
        "acceptance length: 1.50 trained vs 1.10 untrained"]
    meaning, scale = lines[kept + 5:kept + 7], lines[kept + 7]
    assert meaning[0].startswith("  On 1 held-out prompts each target forward pass yielded 1.50 tokens with the")
    assert "33.3% fewer target forwards" in meaning[1] and scale.startswith("  The target here is the tiny demo model")
    gates = lines.index("gates: all 3 passed")
    assert lines[gates + 1] == "  max_reject_rate (50.0%, limit 50.0%), max_trivial_share (16.7%, limit 50.0%),"
    assert lines[-5:-3] == ["generation: 1.0 h wall, $48.00", "  6 requests, 2,000 output tokens, 2 node-hours."]
    assert lines[-3:] == ["time: 52 s of job time", "  Costliest stages: train 30 s, generate 20 s, prompts 2 s.",
                          f"report: {pages / 'summary.html'}"]
    assert all(len(line) <= 100 for line in lines[:-1])


def test_provenance_names_config_and_commit(tmp_path):
    assert config_digest({"b": 1, "a": [1, 2]}) == config_digest({"a": [1, 2], "b": 1}) != config_digest({"a": [1]})
    assert re.fullmatch(r"[0-9a-f]{12}", config_digest({"a": 1}))
    assert pipeline_commit(tmp_path) == "unknown"
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "Snakefile").write_text("rule all:\n")
    subprocess.run([*git, "add", "Snakefile"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    (tmp_path / "results").mkdir()  # outputs beside the workflow are not a change to it
    assert pipeline_commit(tmp_path) == head[:12]
    (tmp_path / "Snakefile").write_text("rule all:\n    input: []\n")
    assert pipeline_commit(tmp_path) == head[:12] + "+dirty"


def test_stage_costs_name_the_broken_benchmark_file(tmp_path):
    assert stage_costs(tmp_path) == {}
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "r1.tsv").write_text("s\th:m:s\tmax_rss\n")
    with pytest.raises(ValueError, match=r"eval/r1.tsv: no benchmark row .* delete the file and run its job again"):
        stage_costs(tmp_path)


def test_length_plots_stop_at_the_longest_output(qa_summary, tmp_path):
    write_qa_page(qa_summary, tmp_path / "qa.html")
    page = (tmp_path / "qa.html").read_text()
    longest = max(k["output_tokens"]["max"] for k in read_json(qa_summary)["lengths"].values())
    assert longest < 512 and ">256-511<" not in page and ">32768+<" not in page and ">0-15<" in page


CHROMIUM = shutil.which("chromium")


def _chromium(page: Path, profile: Path, *args: str) -> str:
    """Headless Chromium on a local file, offline and without a profile of its own."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", *args, page.as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(cmd)} failed: {done.stderr[-2000:]}"
    return done.stdout


def _varying_rows(png: bytes) -> tuple[int, int, int]:
    """(width, height, rows that differ from a flat colour) of an 8-bit RGB(A) PNG, read from its
    filtered scanlines: in a flat image every filtered byte after a row's first pixel is 0
    (Sub, Up, Average, Paeth) or repeats it (None)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(png):
        size, kind = struct.unpack(">I4s", png[pos:pos + 8])
        data = png[pos + 8:pos + 8 + size]
        header = struct.unpack(">IIBB", data[:10]) if kind == b"IHDR" else header
        idat += data if kind == b"IDAT" else b""
        pos += 12 + size
    width, height, depth, colour = header
    assert depth == 8 and colour in (2, 6), f"unexpected PNG format: depth {depth}, colour type {colour}"
    pixel = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(idat), 1 + width * pixel
    rows = [raw[i * stride:(i + 1) * stride] for i in range(1, height)]
    return width, height, sum(bool(row[1 + pixel:].strip(b"\0")) if row[0] else len(set(row[1:])) > pixel
                              for row in rows)


def test_pages_render_in_a_real_browser(report_pages, tmp_path):
    """Both pages in headless Chromium: the headline is in the rendered DOM, each page's links
    reach the other, the plots have axis titles, and the screenshot shows the page."""
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: CI renders the report pages in it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    s, pages = report_pages
    doms = {name: _chromium(pages / name, tmp_path / "profile", "--dump-dom") for name in ("summary.html", "qa.html")}
    summary, qa = doms["summary.html"], doms["qa.html"]
    assert 'class="headline"' in summary and "1.50 trained vs 1.10 untrained" in summary
    assert "3 of 6 completions kept (50.0%)" in summary and "all 3 passed" in summary
    for name, dom in doms.items():
        links = re.findall(r'<a href="([^"#]+)"', dom)
        assert links and all((pages / link).is_file() for link in links), (name, links)
        assert s["about"]["config_digest"] in dom and s["about"]["commit"] in dom
    assert 'href="qa.html"' in summary and 'href="summary.html"' in qa
    for axis in ("training step", "loss", "tokens per target forward", "held-out prompts of each category"):
        assert re.search(rf"<text[^>]*>{axis}</text>", summary), axis
    for axis in ("output tokens per completion", "records", "trainable tokens per row"):
        assert re.search(rf"<text[^>]*>{axis}</text>", qa), axis
    assert "1.0 = no speed-up" in summary  # the baseline on the acceptance plot
    shot = tmp_path / "summary.png"
    _chromium(pages / "summary.html", tmp_path / "profile", f"--screenshot={shot}", "--window-size=1280,2000",
              "--hide-scrollbars")
    width, height, varying = _varying_rows(shot.read_bytes())
    assert (width, height) == (1280, 2000) and varying > 200, f"{shot}: {varying} rows differ from a flat colour"


def test_cache_gate_suggests_online_mode(qa_summary, tmp_path):
    cache = {"tokens": 1640000000, "bytes": 83968000000000, "max_bytes": 20000000000000,
             "text": "1.64e+09 tokens x 5 layers x 5120 x 2 B = 84.0 TB"}
    with pytest.raises(GateError, match=r"gate max_cache_bytes: the hidden-state cache would take 1.64e\+09 tokens .* = "
                                        r"84.0 TB \(hidden.max_cache_bytes 20.0 TB\); set train.hidden_states: online"):
        run_gates(qa_summary, tmp_path / "gates.json", GATES, cache)
    assert run_gates(qa_summary, tmp_path / "gates.json", GATES, {**cache, "max_bytes": None})


def test_no_json_writer_writes_a_nan(tmp_path):
    """A diverged value (NaN, infinity) reaching a JSON output is an error naming the file and the
    key, and nothing is written: json.dumps would write a bare NaN that strict readers refuse."""
    with pytest.raises(ValueError) as e:
        write_json(tmp_path / "summary.json", {"train": {"curve": [[1, 2.0], [2, float("nan")]]}})
    assert str(e.value) == (f"{tmp_path}/summary.json: not written: train.curve[1][1] is nan, a number JSON cannot "
                            f"hold (an internal error: a stage let a diverged value through; report it)")
    assert list(tmp_path.iterdir()) == []
    write_json(tmp_path / "summary.json", {"final_loss": None})  # an undefined value is null
    assert read_json(tmp_path / "summary.json") == {"final_loss": None}
