"""Time SpecForge 0.2.0's own data preprocessing on our records, on either of its two paths.

- ``--conversations``: the wall time of `specforge.data.preprocessing.build_eagle3_dataset`, the
  builder that SpecForge's training (`prepare_prompt_tasks`) runs on raw conversations to make
  input_ids + loss_mask, over every record of a JSONL file, in one process. Imports, file
  reading, tokenizer loading and the conversion to SpecForge's format are not timed.
- ``--pretokenized``: the wall time of `specforge.data.prompt_builder.prepare_prompt_tasks` on a
  JSONL whose records carry `input_ids` and `loss_mask`: its own fast path for data tokenized
  beforehand (reads and checks every row with the standard library, no tokenizer), file reading
  included, as it does it.

Prints one JSON line. Run it in the venv from `make specforge-venv`:
    .venv-specforge/bin/python bench/specforge_preprocess.py --conversations conv.jsonl --tokenizer DIR
    .venv-specforge/bin/python bench/specforge_preprocess.py --pretokenized rows.jsonl

Conversation records: {"id", "messages": [OpenAI chat messages], "tools": [OpenAI tool specs] or null}.
SpecForge renders them with the tokenizer's own chat template (apply_chat_template); its template
registry entry (`qwen3.5` by default, the closest it ships to Qwen3.6) only gives the assistant
header / end-of-turn strings for the loss-mask regex and selects its ThinkingParser, which keeps
reasoning_content and passes enable_thinking=True.
"""

import argparse
import contextlib
import importlib.metadata
import json
import sys
import time

import datasets
from transformers import AutoTokenizer

# specforge/__init__.py and specforge/data/__init__.py are docstrings only, so these imports load
# just the data modules (+ specforge.distributed/utils: torch, transformers); no sglang, no stub.
from specforge.data.preprocessing import build_eagle3_dataset
from specforge.data.prompt_builder import prepare_prompt_tasks


def to_specforge(record: dict) -> dict:
    """One record as a row of SpecForge's raw-conversation dataset ("conversations", "tools").

    tool_calls and tools go in as JSON strings, as SpecForge's own loaders used to write them: Arrow
    would otherwise merge the differing argument dicts into one struct padded with nulls.
    SpecForge json.loads both back (Parser._sanitize_message, build_eagle3_dataset).
    """
    messages = [
        {**m, "tool_calls": json.dumps(m["tool_calls"])} if m.get("tool_calls") else m
        for m in record["messages"]
    ]
    tools = json.dumps(record["tools"]) if record.get("tools") else None
    return {"id": record["id"], "conversations": messages, "tools": tools}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--conversations", help="JSONL of chat records")
    source.add_argument("--pretokenized", help="JSONL of {input_ids, loss_mask} rows")
    parser.add_argument("--tokenizer", help="tokenizer directory (for --conversations)")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--template", default="qwen3.5", help="SpecForge TEMPLATE_REGISTRY name")
    parser.add_argument("--num-proc", type=int, default=1,
                        help="datasets.map processes (SpecForge's own default is 8); 1 runs in this process")
    parser.add_argument("--train-only-last-turn", action="store_true",
                        help="loss on the last assistant turn only (SpecForge's default: all)")
    args = parser.parse_args()
    # datasets 5 maps num_proc=1 in a pool of one worker process; None does the same work in this
    # process (what datasets 4 did for 1), the faster of the two on one core.
    num_proc = None if args.num_proc == 1 else args.num_proc
    if args.pretokenized:
        start = time.perf_counter()
        tasks = prepare_prompt_tasks(
            args.pretokenized, None, chat_template=None, max_length=args.max_length, is_preformatted=False,
            train_only_last_turn=args.train_only_last_turn, cache_dir=None, cache_key=None,
            num_proc=num_proc)
        seconds = time.perf_counter() - start
        print(json.dumps({
            "records": len(tasks), "tokens": sum(len(t["payload"]["input_ids"]) for t in tasks),
            "loss_tokens": sum(sum(t["payload"]["loss_mask"]) for t in tasks), "seconds": round(seconds, 4),
            "specforge": importlib.metadata.version("specforge"), "max_length": args.max_length}))
        return
    if not args.tokenizer:
        parser.error("--conversations needs --tokenizer")

    with open(args.conversations, encoding="utf-8") as f:
        rows = [to_specforge(json.loads(line)) for line in f if line.strip()]
    dataset = datasets.Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    datasets.disable_progress_bars()

    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # it prints status lines; stdout is for our JSON
        processed = build_eagle3_dataset(
            dataset, tokenizer, chat_template=args.template, max_length=args.max_length,
            num_proc=num_proc, train_only_last_turn=args.train_only_last_turn)
    seconds = time.perf_counter() - start

    processed.set_format(None)  # plain lists for counting (rows are [[ids...]])
    tokens = sum(len(ids[0]) for ids in processed["input_ids"])
    loss_tokens = sum(sum(mask[0]) for mask in processed["loss_mask"])
    print(json.dumps({
        "records": len(processed), "tokens": tokens, "loss_tokens": loss_tokens,
        "seconds": round(seconds, 4), "template": args.template,
        "specforge": importlib.metadata.version("specforge"), "num_proc": num_proc,
        "max_length": args.max_length, "train_only_last_turn": args.train_only_last_turn,
    }))


if __name__ == "__main__":
    main()
