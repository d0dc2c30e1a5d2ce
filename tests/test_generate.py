import json
from pathlib import Path

import pytest

from dflash.core.chat import split_reasoning
from dflash.generate.stage import generate_shard
from dflash.generate.replay import sample_seed
from dflash.generate.resume import partial_path
from dflash.core.io import read_json, read_jsonl, write_jsonl_zst
from dflash.prompts.stage import read_source
from tests.helpers import on_a_small_tmpfs, record_errors

DESIGN_FIELDS = {"id", "prompt_id", "source", "category", "messages", "tools", "text", "reasoning", "content",
                 "finish_reason", "prompt_token_ids", "output_token_ids", "usage", "generation", "error"}


@pytest.fixture(scope="module")
def prompt_shard(tmp_path_factory, demo_sources):
    prompts = []
    for src in demo_sources:
        prompts += list(read_source(src))[:2]
    path = tmp_path_factory.mktemp("g") / "shard-00000.jsonl.zst"
    write_jsonl_zst(path, prompts)
    return path, prompts


def gen_cfg(max_error_fraction=0.0, **sampling):
    return {"backend": "transformers", "enable_thinking": True, "max_error_fraction": max_error_fraction, "batch_size": 3,
            "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "max_tokens": 24, "seed": 0, **sampling}}


def test_records_are_exact(tmp_path, prompt_shard, target, target_dir):
    path, prompts = prompt_shard
    _, tok = target
    summary = generate_shard(path, tmp_path / "out.jsonl.zst", target_dir, gen_cfg())
    recs = read_jsonl(tmp_path / "out.jsonl.zst")
    assert summary["records"] == len(recs) == len(prompts)
    assert [r["id"] for r in recs] == [p["id"] for p in prompts]
    stop = {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    for rec, prompt in zip(recs, prompts):
        assert set(rec) == DESIGN_FIELDS and record_errors("completion", rec) == []
        assert rec["messages"] == prompt["messages"] and rec["tools"] == prompt["tools"]
        rendered = tok.apply_chat_template(prompt["messages"], tools=prompt["tools"], add_generation_prompt=True,
                                           enable_thinking=True, tokenize=False)
        assert rendered.endswith("<|im_start|>assistant\n<think>\n")
        assert rec["prompt_token_ids"] == tok.encode(rendered, add_special_tokens=False)
        out = rec["output_token_ids"]
        assert 1 <= len(out) <= 24
        if rec["finish_reason"] == "stop":
            assert out[-1] in stop
            body = out[:-1]
        else:
            assert rec["finish_reason"] == "length" and len(out) == 24 and out[-1] not in stop
            body = out
        assert rec["text"] == tok.decode(body, skip_special_tokens=False)
        reasoning, content = split_reasoning(rec["text"], True)
        assert (rec["reasoning"], rec["content"]) == (reasoning, content)
        assert rec["usage"] == {"prompt_tokens": len(rec["prompt_token_ids"]), "completion_tokens": len(out)}
        assert rec["generation"]["sampling"] == gen_cfg()["sampling"]
        assert rec["generation"]["enable_thinking"] is True and rec["error"] is None
    assert not partial_path(tmp_path / "out.jsonl.zst").exists()


def test_generation_is_reproducible_per_sample(tmp_path, prompt_shard, target_dir):
    path, prompts = prompt_shard
    generate_shard(path, tmp_path / "a.jsonl.zst", target_dir, gen_cfg())
    # The same prompts in another order, in another shard: every sample draws the same tokens.
    write_jsonl_zst(tmp_path / "rev.jsonl.zst", prompts[::-1])
    generate_shard(tmp_path / "rev.jsonl.zst", tmp_path / "b.jsonl.zst", target_dir, gen_cfg())
    a = {r["id"]: r["output_token_ids"] for r in read_jsonl(tmp_path / "a.jsonl.zst")}
    b = {r["id"]: r["output_token_ids"] for r in read_jsonl(tmp_path / "b.jsonl.zst")}
    assert a == b
    assert sample_seed(0, "00000000000a") != sample_seed(1, "00000000000a")


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.95, "top_k": 20}])
def test_a_row_draws_alone_or_batched_what_transformers_generate_draws(prompt_shard, target, sampling):
    """The CPU backend's loop (dflash.generate.decode) against transformers' generate() after
    torch.manual_seed(seed), repetition penalty included: the same tokens for each prompt, decoded
    alone or in a batch of prompts of other lengths (left-padded; rows leave as they stop)."""
    import torch

    from dflash.core.chat import render, stop_token_ids
    from dflash.generate.decode import sample_batch

    model, tok = target
    _, prompts = prompt_shard
    rows = [tok.encode(render(p["messages"], p["tools"], tok, True), add_special_tokens=False) for p in prompts[:6]]
    stop = stop_token_ids(tok, model.generation_config)
    sampling = {**sampling, "max_tokens": 40}
    drawn = []
    for seed, ids in enumerate(rows):
        torch.manual_seed(seed)
        greedy = sampling["temperature"] == 0
        out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=not greedy, repetition_penalty=1.3,
                             eos_token_id=sorted(stop), pad_token_id=tok.pad_token_id,
                             **({} if greedy else {k: sampling[k] for k in ("temperature", "top_p", "top_k")}))
        drawn.append(out[0, len(ids):].tolist())
    assert len({len(ids) for ids in rows}) > 1 and len({len(d) for d in drawn}) > 1
    seeds = list(range(len(rows)))
    alone = [sample_batch(model, [ids], [seed], sampling, stop, tok.pad_token_id, repetition_penalty=1.3)[0].ids
             for seed, ids in zip(seeds, rows)]
    batched = [d.ids for d in sample_batch(model, rows, seeds, sampling, stop, tok.pad_token_id,
                                           repetition_penalty=1.3)]
    assert alone == drawn and batched == drawn


def test_unset_sampling_comes_from_generation_config(tmp_path, prompt_shard, target, target_dir):
    model, _ = target
    path, _ = prompt_shard
    generate_shard(path, tmp_path / "c.jsonl.zst", target_dir, gen_cfg(temperature=None, top_p=None, top_k=None))
    s = read_jsonl(tmp_path / "c.jsonl.zst")[0]["generation"]["sampling"]
    gc = model.generation_config
    assert (s["temperature"], s["top_p"], s["top_k"]) == (gc.temperature, gc.top_p, gc.top_k)


def test_split_reasoning():
    assert split_reasoning("R\n</think>\n\nC", True) == ("R\n", "\n\nC")
    assert split_reasoning("<think>\nR\n</think>\n\nC", True) == ("\nR\n", "\n\nC")  # older Qwen3 opens its own tag
    assert split_reasoning("still thinking", True) == ("still thinking", "")
    assert split_reasoning("a</think>b</think>c", True) == ("a", "b</think>c")
    assert split_reasoning("plain", False) == (None, "plain")


def test_bad_prompt_becomes_an_error_record(tmp_path, target_dir):
    bad = {"id": "0123456789abcdef", "source": "x", "category": "chat", "tools": None, "meta": {},
           "messages": [{"role": "assistant", "content": "no user turn"}]}
    write_jsonl_zst(tmp_path / "bad.jsonl.zst", [bad])
    with pytest.raises(RuntimeError, match=r"1 of 1 prompts failed \(e.g. .*No user query"):
        generate_shard(Path(tmp_path / "bad.jsonl.zst"), tmp_path / "o.jsonl.zst", target_dir, gen_cfg())
    assert not (tmp_path / "o.jsonl.zst").exists()
    summary = generate_shard(Path(tmp_path / "bad.jsonl.zst"), tmp_path / "o.jsonl.zst", target_dir,
                             gen_cfg(max_error_fraction=1.0), summary_path=tmp_path / "s.json")
    (rec,) = read_jsonl(tmp_path / "o.jsonl.zst")
    assert rec["finish_reason"] == "error" and "No user query" in rec["error"] and rec["text"] == ""
    assert summary["finish_reasons"]["error"] == 1 and read_json(tmp_path / "s.json") == summary


def test_resume_skips_finished_records_and_drops_a_torn_line(tmp_path, prompt_shard, target_dir):
    path, prompts = prompt_shard
    out = tmp_path / "r.jsonl.zst"
    generate_shard(path, tmp_path / "full.jsonl.zst", target_dir, gen_cfg())
    full = read_jsonl(tmp_path / "full.jsonl.zst")
    # A job killed after two records, in the middle of writing the third.
    partial_path(out).write_text("".join(json.dumps(r) + "\n" for r in full[:2]) + json.dumps(full[2])[:40])
    summary = generate_shard(path, out, target_dir, gen_cfg())
    assert summary["resumed"] == 2 and summary["requests"] == len(prompts) - 2
    assert read_jsonl(out) == full  # every id exactly once, in prompt order, same samples (per-id seeds)
    assert not partial_path(out).exists()


def test_a_second_job_on_a_shard_waits_and_keeps_what_the_first_wrote(tmp_path, prompt_shard, target_dir):
    """A job orphaned by a killed snakemake still holds the shard's lock: the re-run waits for it,
    then takes the shard the orphan finished (written after Snakemake cleared the outputs) as done,
    and a record found both there and in a partial file left by a kill counts once."""
    import fcntl
    import subprocess
    import sys
    import time

    path, prompts = prompt_shard
    out = tmp_path / "shard-00000.jsonl.zst"
    generate_shard(path, tmp_path / "first.jsonl.zst", target_dir, gen_cfg())
    first = read_jsonl(tmp_path / "first.jsonl.zst")
    lock = tmp_path / ".shard-00000.jsonl.zst.lock"
    # the orphan: holds the lock 3 s, then leaves the finished shard and (killed before removing
    # it) a partial file with two of its records
    orphan = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, shutil, sys, time\n"
        f"f = open({str(lock)!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(3)\n"
        f"shutil.copy({str(tmp_path / 'first.jsonl.zst')!r}, {str(out)!r})\n"
        f"open({str(partial_path(out))!r}, 'w').write({''.join(json.dumps(r) + chr(10) for r in first[:2])!r})\n")],
        stdout=subprocess.PIPE, text=True)
    assert orphan.stdout.readline().strip() == "locked"
    t0 = time.time()
    summary = generate_shard(path, out, target_dir, gen_cfg())
    assert time.time() - t0 >= 2 and orphan.wait(timeout=10) == 0
    assert summary["resumed"] == len(prompts) and summary["requests"] == 0
    assert read_jsonl(out) == first and not partial_path(out).exists()
    with open(lock) as f:  # released
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_looping_generation_is_cut_in_process(tmp_path, prompt_shard, target_dir):
    """The transformers backend watches each token: with repetition_penalty 0.3 in the target's
    generation_config (a penalty under 1 favours tokens already written: a real model made to loop)
    and greedy decoding, the records the watch cuts are the first tokens of the ones an uncut run
    writes (the watch changes nothing but where it stops), end as loop_abort with the loop and the
    tokens saved, and validation rejects them as repetition_loop; the others are identical."""
    import shutil

    from dflash.validate.stage import validate_shard

    path, prompts = prompt_shard
    looping = tmp_path / "target"
    shutil.copytree(target_dir, looping)
    config = json.loads((looping / "generation_config.json").read_text())
    (looping / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 0.3}))
    repetition, cap = {"min_repeats": 4, "min_chars": 200}, 600
    runs = {}
    for abort in (True, False):
        cfg = {**gen_cfg(temperature=0.0, max_tokens=cap), "loop_abort": abort}
        runs[abort] = generate_shard(path, tmp_path / f"{abort}.jsonl.zst", looping, cfg, repetition=repetition)
    cut, whole = (read_jsonl(tmp_path / f"{abort}.jsonl.zst") for abort in (True, False))
    aborted = [(c, w) for c, w in zip(cut, whole) if c["finish_reason"] == "loop_abort"]
    assert aborted and runs[False]["loop_aborts"] == {"records": 0, "tokens_received": 0, "tokens_saved": 0}
    for c, w in aborted:
        received = len(c["output_token_ids"])
        assert c["output_token_ids"] == w["output_token_ids"][:received] and received < len(w["output_token_ids"])
        assert c["usage"]["completion_tokens"] == received and c["generation"]["max_tokens_saved"] == cap - received
        assert c["text"] == w["text"][:len(c["text"])]
        assert c["generation"]["loop"]["pattern"] and 0 <= c["generation"]["loop"]["first_position"] < len(c["text"])
    assert [c for c in cut if c["finish_reason"] != "loop_abort"] == [w for c, w in zip(cut, whole)
                                                                     if c["finish_reason"] != "loop_abort"]
    assert runs[True]["loop_aborts"] == {"records": len(aborted),
                                         "tokens_received": sum(len(c["output_token_ids"]) for c, _ in aborted),
                                         "tokens_saved": sum(cap - len(c["output_token_ids"]) for c, _ in aborted)}
    print(f"in-process loop abort: {runs[True]['loop_aborts']}")
    validate_shard(tmp_path / "True.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst", tmp_path / "qa.json",
                   {"checks": {}, "trivial_min_tokens": 0, "repetition": repetition, "tool_format": "xml"})
    rejected = {r["id"]: r["qa"]["reasons"] for r in read_jsonl(tmp_path / "r.jsonl.zst")}
    assert all("repetition_loop" in rejected.get(c["id"], []) for c, _ in aborted)


def test_a_full_disk_under_the_jobs_log_names_the_log(tmp_path, prompt_shard, target_dir):
    """A real full disk: the job's log on a full 16 KB tmpfs in a private mount namespace (as
    tests/test_io.py does), the shard elsewhere. The first progress bar's write used to fail with a
    bare ``[Errno 28]`` naming no file, and the job's console line was lost with it."""
    import sys

    job = ("import json, sys; from dflash.core.workflow import log_to; from dflash.core.errors import install_job_hook; "
           "log_to('/mnt/logs/generate.log'); install_job_hook('generate (shard=00000)', '/mnt/logs/generate.log'); "
           "from dflash.generate.stage import generate_shard; generate_shard(*sys.argv[1:4], json.loads(sys.argv[4]))")
    run = on_a_small_tmpfs(f"mkdir /mnt/logs && (head -c 16k /dev/zero > /mnt/fill; true) && exec {sys.executable} "
                           f"-c \"$0\" \"$@\"", job, str(prompt_shard[0]), str(tmp_path / "c.jsonl.zst"), str(target_dir),
                           json.dumps(gen_cfg()), cwd=Path(__file__).parent.parent)
    # (exit 120, not 1: Python's last flush of stderr at exit fails too)
    assert run.returncode != 0 and run.stderr.splitlines()[-1] == (
        "rule generate (shard=00000): /mnt/logs/generate.log: no space left on device while writing it; free space "
        "there (or set output_dir to a larger disk) and re-run [log: /mnt/logs/generate.log]"), run.stderr
    assert not (tmp_path / "c.jsonl.zst").exists()
