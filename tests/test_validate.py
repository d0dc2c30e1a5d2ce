import json

import pytest

from dflash.core.config import completed
from dflash.core.io import read_json, read_jsonl, write_jsonl_zst
from dflash.core.toolcalls import parse_tool_calls
from dflash.validate.stage import CHECKS, judge, substance_tokens, validate_shard

CFG = completed({"trivial_min_tokens": 16, "checks": {code: "reject" for code in CHECKS},
                 "repetition": {"min_repeats": 4, "min_chars": 200}, "tool_format": "auto"}, "validate")
REASONING = "The user asks for the capital of France, which is Paris; I answer in one sentence with the city."


def record(text, finish="stop", thinking=True, category="chat", error=None, rid="r", tools=None):
    if thinking and "</think>" in text:
        reasoning, content = text.split("</think>", 1)
    else:
        reasoning, content = (text, "") if thinking else (None, text)
    return {"id": rid, "prompt_id": rid, "source": "s", "category": category,
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "tools": tools,
            "text": text, "reasoning": reasoning, "content": content, "finish_reason": finish,
            "prompt_token_ids": None, "output_token_ids": None, "usage": {"prompt_tokens": 12, "completion_tokens": 10},
            "generation": {"backend": "transformers", "engine_version": "test", "model": "m", "enable_thinking": thinking,
                           "sampling": {"temperature": 0, "top_p": 1, "top_k": 0, "seed": 0, "max_tokens": 64}},
            "error": error}


GOOD = record(f"{REASONING}\n</think>\n\nThe capital of France is Paris.")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array"}},
    "required": ["city"], "additionalProperties": False}}}


def answer(content, tools=(WEATHER,), reasoning=REASONING):
    return record(f"{reasoning}\n</think>\n\n{content}", category="tool", tools=list(tools) if tools else None)


def xml(name="get_weather", **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


STORY_LOOP = record(f"{REASONING}\n</think>\n\n" + "<tool_call>\n</think>\n" * 400, finish="length")
LOOPING_PARAGRAPH = record(f"{REASONING}\n</think>\n\n" + ("Let me check the calculation again. The total is the sum "
                                                             "of both parts, so I add them and compare.\n\n") * 6)
CODE_LISTING = "\n".join(f"    case {i}: return handle_{i}(request, context, options)  # route {i}" for i in range(200))
TABLE = "| id | name | price |\n|---|---|---|\n" + "\n".join(f"| {i} | item {i} | {i * 1.5:.2f} |" for i in range(120))
NUMBERED = "\n".join(f"{i}. Check that step {i} leaves the system in a consistent state." for i in range(1, 60))


@pytest.mark.parametrize("rec,code", [
    (record(f"{REASONING} and on and on", finish="length"), "finish_length"),
    (record("", finish="error", error="boom"), "abort_or_error"),
    (record("", finish="abort"), "abort_or_error"),
    (record(f"{REASONING} and never closes"), "no_think_close"),
    (record("\n</think>\n\nThe capital of France is Paris, a city on the Seine with many museums."), "empty_reasoning"),
    (record(f"{REASONING}\n</think>\n\n"), "empty_answer"),
    (record("\n\n</think>\nOK."), "trivial"),
    (STORY_LOOP, "repetition_loop"),
    (LOOPING_PARAGRAPH, "repetition_loop"),
    (record(f"{REASONING}\n</think>\n\nThe answer " + "is the answer " * 60), "repetition_loop"),
    (record(f"{REASONING}\n</think>\n\nParis.</think> Really, Paris is the capital city."), "stray_think"),
    (record(f"{REASONING}\n</think>\n\nThe capital of France is Par\ufffds, a city on the Seine."), "encoding"),
    (record(f"{REASONING}\n</think>\n\nThe capital of France is Paris\x07, a city on the Seine."), "encoding"),
    (record(f"{REASONING}\n</think>\n\nThe capital of France is Paris\ud800, a city on the Seine."), "encoding"),
    (answer("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"), "tool_unclosed"),
    (answer('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'), "tool_bad_json"),
    (answer("<tool_call>\n<function=get_weather>\n<parameter=city>Paris</function>\n</tool_call>"), "tool_bad_xml"),
    (answer(xml("get_stock", symbol="NVDA")), "tool_unknown_name"),
    (answer(xml(city="Paris", days="zero")), "tool_args_schema"),
    (answer(xml(city="Paris", days=0)), "tool_args_schema"),
    (answer(xml(days=3)), "tool_missing_required"),
    (answer(xml(city="Paris"), reasoning=f"{REASONING} {xml(city='Paris')}"), "tool_call_in_reasoning"),
    (answer(xml(city="Paris"), tools=None), "tool_without_tools"),
    (answer(xml(city="Paris") + "\n\nI will now wait for the result and then tell you."), "text_after_tool_call"),
])
def test_each_check_catches_its_problem(rec, code):
    reasons, flags, _, details = judge(rec, CFG)
    assert code in reasons and not flags and details[code]


CALL_BODY = "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"


@pytest.mark.parametrize("content,fmt,code", [
    # a <function=...> block closed by a </tool_call> that was never opened (seen in a demo completion)
    (f"\n\n{CALL_BODY}\n</tool_call>", "auto", "tool_bad_xml"),
    (f"\n\n{CALL_BODY}\n</tool_call>", "xml", "tool_bad_xml"),
    (f"Checking the weather.\n{CALL_BODY}", "auto", "tool_bad_xml"),
    ("Paris.\n<parameter=city>\nParis\n</parameter>", "auto", "tool_bad_xml"),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "auto", "tool_bad_json"),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "json", "tool_bad_json"),
    (f"{xml(city='Paris')}\n</tool_call>", "auto", "tool_bad_xml"),
    # clearly XML, however broken: the XML code, not the Hermes one nor a schema complaint
    ('<tool_call>\n<function name="get_weather">\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>',
     "auto", "tool_bad_xml"),
    ('<tool_call>\nget_weather(city="Paris", days=2)\n</tool_call>', "auto", "tool_bad_xml"),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n<parameter=city>\nParis\n</parameter>\n</function>\n"
     "</tool_call>", "auto", "tool_bad_xml"),
])
def test_tool_markup_outside_a_well_formed_call_is_the_formats_code(content, fmt, code):
    reasons, _, calls, details = judge(answer(content), {**CFG, "tool_format": fmt})
    other = {"tool_bad_xml": "tool_bad_json", "tool_bad_json": "tool_bad_xml"}[code]
    assert code in reasons and other not in reasons, details
    assert "tool_missing_required" not in reasons and "tool_args_schema" not in reasons


def test_good_records_pass_every_check():
    assert judge(GOOD, CFG) == ([], [], [], {})
    tool_only = record(f"{REASONING}\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                       "</parameter>\n</function>\n</tool_call>", category="tool")
    reasons, _, calls, _ = judge({**tool_only, "tools": [WEATHER]}, CFG)
    assert reasons == [] and calls == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    no_thinking = record("The capital of France is Paris, the largest city of the country by far.", thinking=False)
    assert judge(no_thinking, CFG)[0] == []


@pytest.mark.parametrize("text", [CODE_LISTING, TABLE, NUMBERED, "}\n" * 6 + "done", "=" * 120])
def test_repetitive_but_legitimate_text_is_no_loop(text):
    assert "repetition_loop" not in judge(record(f"{REASONING}\n</think>\n\n{text}"), CFG)[0]


def test_story_loop_detail_names_the_span():
    assert judge(STORY_LOOP, CFG)[3]["repetition_loop"].startswith("400 x '<tool_call>\\n</think>'")


def test_tool_calls_are_parsed_and_typed_in_both_formats():
    typed = answer(xml(city="Paris", days=3, metric="true", hours="[9, 12]"))
    reasons, _, calls, _ = judge(typed, CFG)
    assert reasons == []
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "metric": True, "hours": [9, 12]}}]
    hermes = answer('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')
    reasons, _, calls, _ = judge(hermes, CFG)
    assert reasons == [] and calls == [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]
    # a string-typed parameter stays a string even when it looks like JSON
    assert judge(answer(xml(city="1234")), CFG)[2][0]["arguments"] == {"city": "1234"}
    # with the target's format set, a call in the other format is one its parser does not read
    assert judge(hermes, {**CFG, "tool_format": "xml"})[0] == ["tool_call_unparsed"]
    assert judge(typed, {**CFG, "tool_format": "json"})[0] == ["tool_call_unparsed"]


def test_flag_and_off_actions():
    trivial = record("\n\n</think>\nOK.")
    cfg = {**CFG, "checks": {**CFG["checks"], "trivial": "flag", "empty_reasoning": "off"}}
    reasons, flags, _, _ = judge(trivial, cfg)
    assert reasons == [] and flags == ["trivial"]


def test_parse_tool_calls_both_formats():
    xml = ("<tool_call>\n<function=search>\n<parameter=q>\nmulti\nline\n</parameter>\n<parameter=n>\n3\n</parameter>\n"
           "</function>\n</tool_call>\n<tool_call>\n<function=other>\n</function>\n</tool_call>")
    assert parse_tool_calls(xml) == [{"name": "search", "arguments": {"q": "multi\nline", "n": "3"}},
                                     {"name": "other", "arguments": {}}]
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse_tool_calls(hermes) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert parse_tool_calls("<tool_call>\n{broken\n</tool_call>") == []


def test_substance_ignores_tags():
    assert substance_tokens("<think>\n\n</think>\nOK.<|im_end|>") == 2


def test_shard_counts_add_up(tmp_path):
    recs = [GOOD, record("\n\n</think>\nOK.", rid="t", category="code"),
            record(REASONING, finish="length", rid="l", category="code")]
    write_jsonl_zst(tmp_path / "c.jsonl.zst", recs)
    rep = validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst",
                         tmp_path / "qa.json", CFG)
    kept, rejected = read_jsonl(tmp_path / "v.jsonl.zst"), read_jsonl(tmp_path / "r.jsonl.zst")
    assert rep["records"] == 3 == len(kept) + len(rejected)
    assert [r["id"] for r in kept] == ["r"] and kept[0]["qa"] == {"flags": [], "tool_calls": [], "details": {}}
    by_id = {r["id"]: r["qa"]["reasons"] for r in rejected}
    assert by_id == {"t": ["empty_reasoning", "trivial"], "l": ["finish_length", "no_think_close", "empty_answer"]}
    assert rep["checks"]["trivial"] == {"action": "reject", "total": 1, "by_category": {"code": 1}}
    assert rep["categories"] == {"chat": {"records": 1, "kept": 1}, "code": {"records": 2, "rejected": 2}}
    assert read_json(tmp_path / "qa.json") == rep


def test_unknown_check_in_config_is_an_error(tmp_path):
    write_jsonl_zst(tmp_path / "c.jsonl.zst", [GOOD])
    with pytest.raises(ValueError, match="unknown check"):
        validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v", tmp_path / "r", tmp_path / "q",
                       {**CFG, "checks": {"trival": "reject"}})


def test_excluded_ids_are_rejected_with_their_reason(tmp_path):
    from dflash.validate.stage import read_exclusions

    (tmp_path / "ids.txt").write_text("# by hand\nt\n\nl-g1  # second step\n")
    (tmp_path / "ids.jsonl").write_text('{"id": "r", "reason": "leaked eval prompt"}\n')
    excluded = read_exclusions([tmp_path / "ids.txt", tmp_path / "ids.jsonl"])
    assert excluded == {"t": "listed in validate.exclude", "l-g1": "listed in validate.exclude",
                        "r": "leaked eval prompt"}
    for missing, kind in ((tmp_path / "typo.txt", "no such file"), (tmp_path, "a folder, not a file of ids")):
        with pytest.raises(FileNotFoundError, match=f"^validate.exclude: {missing}: {kind} "):
            read_exclusions([tmp_path / "ids.txt", missing])
    recs = [GOOD, {**GOOD, "id": "t-g1", "prompt_id": "t"}, {**GOOD, "id": "l", "prompt_id": "l"},
            {**GOOD, "id": "l-g1", "prompt_id": "l"}]
    write_jsonl_zst(tmp_path / "c.jsonl.zst", recs)
    rep = validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst",
                         tmp_path / "qa.json", CFG, excluded)
    assert [r["id"] for r in read_jsonl(tmp_path / "v.jsonl.zst")] == ["l"]
    rejected = {r["id"]: r["qa"] for r in read_jsonl(tmp_path / "r.jsonl.zst")}
    assert rejected["r"] == {"flags": [], "tool_calls": [], "details": {"excluded": "leaked eval prompt"},
                             "reasons": ["excluded"]}
    assert set(rejected) == {"r", "t-g1", "l-g1"} and rep["checks"]["excluded"]["total"] == 3


@pytest.mark.parametrize("line, message", [("a b", "one sample id per line"), ('{"reason": "x"}', 'string "id"'),
                                           ("{oops", "not valid JSON"), ('{"id": ' + "[" * 5000, "nested too deeply")])
def test_bad_exclusion_line_names_file_and_line(tmp_path, line, message):
    from dflash.validate.stage import read_exclusions

    path = tmp_path / ("x.jsonl" if line.startswith("{") else "x.txt")
    path.write_text(f"ok\n{line}\n" if path.suffix == ".txt" else f'{{"id": "ok"}}\n{line}\n')
    with pytest.raises(ValueError, match=f"{path}:2: .*{message}"):
        read_exclusions([path])


def test_exclusions_map_to_the_prompt_shards_holding_them(tmp_path):
    from dflash.validate.stage import exclusions_by_shard

    (tmp_path / "ids.tsv").write_text("a\t00000\nb\t00001\n")
    by_shard, unknown = exclusions_by_shard({"a": "x", "b-g2": "y", "zz": "z"}, tmp_path)
    assert by_shard == {"00000": {"a": "x"}, "00001": {"b-g2": "y"}} and unknown == ["zz"]


def test_qa_shows_examples_around_the_problem_and_length_statistics(tmp_path):
    bad_args = {**answer(xml(city="Paris", days="soon")), "id": "args"}
    recs = [GOOD, {**STORY_LOOP, "id": "loop"}, bad_args, record("\n\n</think>\nOK.", rid="t")]
    write_jsonl_zst(tmp_path / "c.jsonl.zst", recs)
    rep = validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst",
                         tmp_path / "qa.json", CFG)
    loop = rep["examples"]["repetition_loop"][0]
    assert loop["excerpt"].startswith("…") and loop["excerpt"].endswith("<tool_call>\n</think>\n")
    assert loop["detail"] == "400 x '<tool_call>\\n</think>' (2 lines in a row)"
    schema = rep["examples"]["tool_args_schema"][0]
    assert schema["excerpt"].lstrip().startswith("<tool_call>\n<function=get_weather>")
    assert schema["offered_tools"][0]["name"] == "get_weather" and schema["calls"] == [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": "soon"}}]
    assert "days" in schema["detail"]
    assert rep["examples"]["trivial"][0]["excerpt"] == "\n\n</think>\nOK."
    chat = rep["lengths"]["chat"]
    assert chat["output_tokens"]["n"] == 3 and chat["kept_output_tokens"]["n"] == 1
    assert sum(chat["output_tokens"]["histogram"]) == 3 and len(rep["length_bins"]) == len(chat["output_tokens"]["histogram"])


def test_kept_lines_are_the_input_lines_plus_qa(tmp_path):
    from dflash.core.io import dumps_line, with_field

    rec = {"id": "é", "text": 'a "quoted"\n\u2028 line'}
    line = dumps_line(rec)
    assert json.loads(with_field(line, rec, "qa", {"flags": ["x"]})) == {**rec, "qa": {"flags": ["x"]}}
    assert json.loads(with_field(line, rec, "id", 3)) == {**rec, "id": 3}
    assert json.loads(with_field(b"{}", {}, "qa", 1)) == {"qa": 1}


def test_token_ids_pass_through_unparsed_and_a_lookalike_in_text_is_harmless(tmp_path):
    from dflash.core.io import iter_jsonl_lines

    tricky = {**GOOD, "id": "tricky", "content": GOOD["content"] + ' , "output_token_ids": [1, 2] ]'}
    first = {"output_token_ids": [7, 8], **GOOD, "id": "first"}  # the key first: no ", " before it
    recs = [{**GOOD, "prompt_token_ids": [1, 2], "output_token_ids": [3, 4, 5]},
            {**tricky, "output_token_ids": [9]}, first]
    write_jsonl_zst(tmp_path / "c.jsonl.zst", recs)
    parsed = [rec for _, rec in iter_jsonl_lines(tmp_path / "c.jsonl.zst", ("prompt_token_ids", "output_token_ids"))]
    assert [sorted(r) for r in parsed[:2]] == [sorted(set(recs[0]) - {"prompt_token_ids", "output_token_ids"}),
                                               sorted(set(tricky) - {"output_token_ids"})]
    assert parsed[1]["content"] == tricky["content"]
    validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst", tmp_path / "q.json",
                   {**CFG, "checks": {"text_after_tool_call": "flag"}})
    kept = read_jsonl(tmp_path / "v.jsonl.zst")
    assert [{k: v for k, v in r.items() if k != "qa"} for r in kept] == recs


def test_a_duplicated_id_is_refused_and_nothing_written(tmp_path):
    write_jsonl_zst(tmp_path / "c.jsonl.zst", [GOOD, {**GOOD, "id": "other"}, GOOD])
    with pytest.raises(ValueError, match=rf"^{tmp_path}/c.jsonl.zst: record id r appears twice"):
        validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst",
                       tmp_path / "qa.json", CFG)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl.zst"]


def test_an_exclusion_list_saved_with_a_bom_keeps_its_first_id(tmp_path):
    from dflash.validate.stage import read_exclusions

    (tmp_path / "ids.txt").write_bytes("\ufefffirst\nsecond\n".encode())
    (tmp_path / "ids.jsonl").write_bytes('\ufeff{"id": "third", "reason": "leaked"}\n'.encode())
    assert read_exclusions([tmp_path / "ids.txt", tmp_path / "ids.jsonl"]) == {
        "first": "listed in validate.exclude", "second": "listed in validate.exclude", "third": "leaked"}


def deep_call(depth: int) -> dict:
    nested = "[" * depth + "]" * depth
    return answer(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris", "hours": {nested}}}}}\n'
                  f'</tool_call>')


@pytest.mark.parametrize("depth", [100, 5000])  # 5000: past what json parses; 100: parsed, past MAX_JSON_DEPTH
def test_a_call_nested_thousands_deep_rejects_its_record_not_the_shard(tmp_path, depth):
    write_jsonl_zst(tmp_path / "c.jsonl.zst", [GOOD, {**deep_call(depth), "id": "deep"}])
    rep = validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst",
                         tmp_path / "qa.json", CFG)
    [rejected] = read_jsonl(tmp_path / "r.jsonl.zst")
    assert rep["kept"] == 1 and rejected["id"] == "deep" and rejected["qa"]["reasons"] == ["tool_bad_json"]
    assert "nest" in rejected["qa"]["details"]["tool_bad_json"]


def tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}


UNUSABLE_SCHEMAS = [
    {"$ref": "#"},  # every validation recurses forever
    {"type": "object", "properties": {"city": {"type": "string", "pattern": "("}}},  # no regular expression
    {"type": "object", "properties": {"city": {"type": "town"}}},  # no JSON type
    {"type": "object", "properties": {"city": {"$ref": "#/$defs/missing"}}},  # resolves nowhere
    {"type": "object", "properties": {"city": {"$ref": "#/properties/city"}}},  # a loop met only on a value
]


@pytest.mark.parametrize("parameters", UNUSABLE_SCHEMAS)
def test_a_schema_with_no_clear_meaning_flags_its_record_not_the_shard(tmp_path, parameters):
    bad = {**answer(xml(city="Paris"), tools=[tool(parameters)]), "id": "bad"}
    write_jsonl_zst(tmp_path / "c.jsonl.zst", [GOOD, bad])
    cfg = {**CFG, "checks": {**CFG["checks"], "tool_schema_unknown": "flag"}}
    rep = validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst",
                         tmp_path / "qa.json", cfg)
    flagged = {r["id"]: r["qa"] for r in read_jsonl(tmp_path / "v.jsonl.zst")}["bad"]
    assert rep["kept"] == 2 and flagged["flags"] == ["tool_schema_unknown"]
    assert flagged["details"]["tool_schema_unknown"].startswith("get_weather: the offered parameters schema has no "
                                                                "clear meaning: ")
    assert flagged["details"]["tool_schema_unknown"].endswith("; arguments not checked")
    assert rep["examples"]["tool_schema_unknown"][0]["id"] == "bad"


def test_a_remote_ref_in_a_tool_schema_is_never_fetched(tmp_path):
    """A real HTTP server on 127.0.0.1 that would serve the $ref: validate must not ask it."""
    import http.server
    import threading

    asked = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            body = b'{"type": "string"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/city.json"
        parameters = {"type": "object", "properties": {"city": {"$ref": url}}}
        reasons, _, _, details = judge(answer(xml(city="Paris"), tools=[tool(parameters)]), CFG)
    finally:
        server.shutdown()
        server.server_close()
    assert asked == [] and reasons == ["tool_schema_unknown"]
    assert details["tool_schema_unknown"] == (f"get_weather: the offered parameters schema has no clear meaning: $ref "
                                              f"'{url}' does not resolve inside the schema (none is fetched); arguments "
                                              f"not checked")
