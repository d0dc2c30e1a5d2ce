"""``dflash inspect``: any stage's shard, local or on a real S3 server (moto), readable or JSON."""
import json

import pytest

from dflash.eval.acceptance import eval_result, summaries, write_eval
from dflash.cli import main
from dflash.core.io import read_jsonl, write_jsonl_zst
from dflash.tokenize.stage import tokenize_shard
from dflash.validate.stage import validate_shard
from tests.test_tokenize import validated, with_ids
from tests.test_validate import CFG, GOOD, REASONING, STORY_LOOP, answer, record, xml


@pytest.fixture
def shards(tmp_path):
    recs = [GOOD, {**answer(xml(city="Paris", days="2")), "id": "call"}, {**STORY_LOOP, "id": "loop"},
            record("\n\n</think>\nOK.", rid="ok", category="code")]
    write_jsonl_zst(tmp_path / "completions.jsonl.zst", recs)
    validate_shard(tmp_path / "completions.jsonl.zst", tmp_path / "validated.jsonl.zst",
                   tmp_path / "rejected.jsonl.zst", tmp_path / "qa.json", CFG)
    return tmp_path


def inspect(capsys, *args):
    rc = main(["inspect", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_readable_records_with_reasons_calls_and_details(shards, capsys):
    rc, out, err = inspect(capsys, shards / "rejected.jsonl.zst", "--reason", "repetition_loop")
    assert rc == 0 and err.strip() == "1 of 1 shown"
    assert out.startswith("── loop  [chat]  s  finish=length  tokens=12+10  REJECTED: finish_length, empty_answer, "
                          "repetition_loop, stray_think")
    assert "  repetition_loop: 400 x '<tool_call>\\n</think>' (2 lines in a row)" in out
    assert "characters left out; --full shows all" in out
    rc, out, _ = inspect(capsys, shards / "validated.jsonl.zst", "--category", "tool")
    assert "tools offered: get_weather" in out and '  tool call: get_weather({"city": "Paris", "days": 2})' in out
    assert "reasoning (" in out and "answer (" in out and "── r " not in out


def test_filters_combine_and_json_is_the_whole_record(shards, capsys):
    rc, out, _ = inspect(capsys, shards / "rejected.jsonl.zst", shards / "validated.jsonl.zst", "--json", "--limit", "0")
    every = [json.loads(line) for line in out.splitlines()]
    assert every == read_jsonl(shards / "rejected.jsonl.zst") + read_jsonl(shards / "validated.jsonl.zst")
    _, out, _ = inspect(capsys, shards / "rejected.jsonl.zst", "--json", "--reason", "trivial", "--category", "code")
    assert [json.loads(line)["id"] for line in out.splitlines()] == ["ok"]
    _, out, _ = inspect(capsys, shards / "rejected.jsonl.zst", "--json", "--id", "loop", "--id", "ok")
    assert [json.loads(line)["id"] for line in out.splitlines()] == ["loop", "ok"]
    _, out, err = inspect(capsys, shards / "completions.jsonl.zst", "--limit", "1")
    assert out.count("── ") == 1 and err.strip() == "1 of 4 shown (--limit 1; --limit 0 shows all)"


def test_a_folder_is_its_shards(shards, capsys, tmp_path):
    """A stage's output folder: its shards in name order (the summaries and indexes beside them
    left out); a folder with none says so."""
    folder = tmp_path / "validated"
    folder.mkdir()
    for name in ("shard-00001.jsonl.zst", "shard-00000.jsonl.zst"):
        (folder / name).write_bytes((shards / "validated.jsonl.zst").read_bytes())
    (folder / "shard-00000.summary.json").write_text("{}")
    rc, out, err = inspect(capsys, folder, "--json", "--limit", "0")
    assert rc == 0 and len(out.splitlines()) == 2 * len(read_jsonl(shards / "validated.jsonl.zst")), err
    (tmp_path / "empty").mkdir()
    rc, _, err = inspect(capsys, tmp_path / "empty")
    assert rc == 1 and err.strip() == (f"dflash inspect: {tmp_path}/empty: a folder with no shards (.jsonl.zst, .jsonl, "
                                       f".safetensors) in it: give a stage's output folder (results/validated) or its "
                                       f"shards")


def test_tokenized_rows_show_prompt_and_supervised_output(tmp_path, capsys, target, target_dir):
    tok = target[1]
    write_jsonl_zst(tmp_path / "v.jsonl.zst", [validated(with_ids(tok, "a", "Two plus two is four.\n</think>\n\n4"))])
    tokenize_shard(tmp_path / "v.jsonl.zst", tmp_path / "t.safetensors", tmp_path / "t.json", tok, {"max_length": 4096, "retokenize_sample": 1.0})
    rc, out, _ = inspect(capsys, tmp_path / "t.safetensors", "--target", target_dir)
    assert rc == 0 and out.startswith("── a  [reasoning]")
    prompt, output = out.split("  prompt (loss 0):")[1].split("  output (loss 1):")
    assert "What is 2 + 2?" in prompt and "Two plus two is four." in output and "<|im_end|>" in output


def test_bad_input_names_the_file(tmp_path, capsys):
    (tmp_path / "broken.jsonl").write_text('{"id": "a"}\nnot json\n')
    rc, _, err = inspect(capsys, tmp_path / "broken.jsonl")
    assert rc == 1 and f"{tmp_path}/broken.jsonl:2: not valid JSON" in err
    rc, _, err = inspect(capsys, tmp_path / "missing.jsonl.zst")
    assert rc == 1 and "missing.jsonl.zst: no such file" in err


def test_shards_in_s3(shards, s3, capsys):
    s3.upload_file(str(shards / "rejected.jsonl.zst"), "drafter", "run1/rejected/shard-00000.jsonl.zst")
    rc, out, _ = inspect(capsys, "s3://drafter/run1/rejected/shard-00000.jsonl.zst", "--json", "--limit", "0")
    assert rc == 0 and [json.loads(line) for line in out.splitlines()] == read_jsonl(shards / "rejected.jsonl.zst")
    rc, _, err = inspect(capsys, "s3://drafter/run1/rejected/shard-00009.jsonl.zst")
    assert rc == 1 and "s3://drafter/run1/rejected/shard-00009.jsonl.zst: no such object" in err


def test_unknown_filter_values_list_the_valid_ones(shards, capsys):
    rc, out, err = inspect(capsys, shards / "rejected.jsonl.zst", "--reason", "repetiton_loop")
    assert rc == 1 and out == ""
    assert err.startswith("dflash inspect: unknown --reason 'repetiton_loop'; valid: abort_or_error, finish_length, ")
    assert "repetition_loop" in err and "excluded" in err
    rc, _, err = inspect(capsys, shards / "rejected.jsonl.zst", "--category", "tools")
    assert rc == 1 and err == "dflash inspect: unknown --category 'tools'; valid: chat, code, reasoning, tool, other\n"
    rc, _, err = inspect(capsys, shards / "rejected.jsonl.zst", "--flag", "loop")
    assert rc == 1 and "unknown --flag 'loop'; valid:" in err and "special_tokens_in_content" in err


def test_the_footer_counts_every_match(tmp_path, capsys):
    write_jsonl_zst(tmp_path / "c.jsonl.zst", [{**GOOD, "id": f"r{i}"} for i in range(45)])
    rc, out, err = inspect(capsys, tmp_path / "c.jsonl.zst")
    assert rc == 0 and out.count("── ") == 10 and err == "10 of 45 shown (--limit 10; --limit 0 shows all)\n"
    _, out, err = inspect(capsys, tmp_path / "c.jsonl.zst", tmp_path / "c.jsonl.zst", "--limit", "50")
    assert out.count("── ") == 50 and err == "50 of 90 shown (--limit 50; --limit 0 shows all)\n"
    _, _, err = inspect(capsys, tmp_path / "c.jsonl.zst", "--limit", "0")
    assert err == "45 of 45 shown\n"


def test_a_json_document_is_no_shard(shards, capsys, tmp_path, target):
    rc, out, err = inspect(capsys, shards / "qa.json")
    assert rc == 1 and out == ""
    assert err == (f"dflash inspect: {shards}/qa.json: a JSON document, not JSONL records: inspect reads shards "
                   f"(.jsonl.zst, .jsonl, .safetensors); read it with `python -m json.tool {shards}/qa.json`\n")
    write_jsonl_zst(tmp_path / "v.jsonl.zst", [validated(with_ids(target[1], "a", "Four.\n</think>\n\n4"))])
    tokenize_shard(tmp_path / "v.jsonl.zst", tmp_path / "t.safetensors", tmp_path / "t.json", target[1],
                   {"max_length": 4096, "retokenize_sample": 1.0})
    rc, _, err = inspect(capsys, tmp_path / "t.json")
    assert rc == 1 and err.endswith(f"(the rows of this tokenized shard are in {tmp_path}/t.safetensors)\n")


HOSTILE = "Sure.\x1b]0;owned\x07\x1b]52;c;cm0gLXJmIH4=\x07\x1b[8mhidden\x1b[0m\r\x9b2J\u202eevil"


def test_escape_sequences_in_records_are_shown_not_acted_on(tmp_path, capsys):
    """A record's text can set the window title, write the clipboard (OSC 52), hide text or clear
    the screen: inspect shows every such character escaped, and --json stays the same JSON."""
    rec = record(f"{REASONING}\n</think>\n\n{HOSTILE}", rid="esc")
    write_jsonl_zst(tmp_path / "c.jsonl.zst", [rec])
    rc, out, _ = inspect(capsys, tmp_path / "c.jsonl.zst")
    assert rc == 0 and "Sure.\\x1b]0;owned\\x07\\x1b]52;c;cm0gLXJmIH4=\\x07\\x1b[8mhidden" in out
    assert "\\x0d\\x9b2J\\u202eevil" in out
    rc, out, _ = inspect(capsys, tmp_path / "c.jsonl.zst", "--json")
    assert rc == 0 and json.loads(out)["content"].endswith(HOSTILE)
    for shown in (inspect(capsys, tmp_path / "c.jsonl.zst")[1], out):
        assert not {"\x1b", "\x07", "\r", "\x9b", "\u202e"} & set(shown)


def test_an_eval_report_prints_its_figures_per_category(tmp_path, capsys):
    """The eval's JSON: acceptance per category with thinking off beside on, the rate per draft
    position and the accepted-length histogram, each figure's method named."""
    def sample(category: str, steps: list[tuple[int, int]]) -> dict:
        return {"id": category, "category": category, "tokens": sum(a + 1 for _, a in steps) + 1,
                "target_forwards": len(steps) + 1, "drafts": len(steps), "accepted_draft_tokens": sum(a for _, a in steps),
                "output_ids": [1] * (sum(a + 1 for _, a in steps) + 1), "steps": steps}

    decoded = summaries([sample("chat", [(3, 3), (3, 1)]), sample("code", [(3, 0), (3, 2)])])
    plain = summaries([{**s, "steps": [(3, 0)] * 4, "accepted_draft_tokens": 0, "target_forwards": s["tokens"]}
                       for s in decoded["samples"]])
    off = summaries([sample("chat", [(3, 0)]), sample("code", [(3, 1)])])
    write_eval(eval_result(decoded, plain, {"max_new_tokens": 16}, off), tmp_path / "demo.json")
    rc, out, err = inspect(capsys, tmp_path / "demo.json")
    assert rc == 0 and err.endswith("1 of 1 shown\n")
    assert "acceptance_rate_per_position: per draft position k: verify steps that accepted position k" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("  chat", "  overall"))}
    assert lines["chat"] == ["chat", "2.333", "3.000", "1.000", "1.000", "1.000"]  # length, per step, untrained, off
    assert "    chat         1.00 0.50 0.50 | 0.00 0.00 0.00" in out  # rate per position, thinking on | off
    assert "    code         1 0 1 0" in out  # verify steps by draft tokens accepted: 0, 1, 2, 3
    rc, out, _ = inspect(capsys, tmp_path / "demo.json", "--category", "code", "--json")
    assert json.loads(out)["thinking_off"]["per_category"]["code"]["acceptance_rate_per_position"] == [1.0, 0.0, 0.0]
