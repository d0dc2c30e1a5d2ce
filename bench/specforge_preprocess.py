"""Time SpecForge 0.2.0's own data preprocessing on our conversation records.

Measures the wall time of `specforge.data.preprocessing.build_eagle3_dataset`, the builder that
SpecForge's training (prepare_prompt_tasks) uses to turn raw conversations into input_ids +
loss_mask, over every record of a JSONL file, in one process. Imports, file reading, tokenizer
loading and the conversion to SpecForge's format are not timed. Prints one JSON line.

Run it in the venv from `make specforge-venv`:
    .venv-specforge/bin/python bench/specforge_preprocess.py --conversations conv.jsonl --tokenizer DIR

Records: {"id", "messages": [OpenAI chat messages], "tools": [OpenAI tool specs] or null}.
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

# specforge/__init__.py and specforge/data/__init__.py are docstrings only, so this import loads
# just the data modules (+ specforge.distributed/utils: torch, transformers); no sglang, no stub.
from specforge.data.preprocessing import build_eagle3_dataset


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
    parser.add_argument("--conversations", required=True, help="JSONL of chat records")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--template", default="qwen3.5", help="SpecForge TEMPLATE_REGISTRY name")
    parser.add_argument("--num-proc", type=int, default=1,
                        help="datasets.map processes (SpecForge's own default is 8)")
    parser.add_argument("--train-only-last-turn", action="store_true",
                        help="loss on the last assistant turn only (SpecForge's default: all)")
    args = parser.parse_args()

    with open(args.conversations, encoding="utf-8") as f:
        rows = [to_specforge(json.loads(line)) for line in f if line.strip()]
    dataset = datasets.Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    datasets.disable_progress_bars()

    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # it prints status lines; stdout is for our JSON
        processed = build_eagle3_dataset(
            dataset, tokenizer, chat_template=args.template, max_length=args.max_length,
            num_proc=args.num_proc, train_only_last_turn=args.train_only_last_turn)
    seconds = time.perf_counter() - start

    processed.set_format(None)  # plain lists for counting (rows are [[ids...]])
    tokens = sum(len(ids[0]) for ids in processed["input_ids"])
    loss_tokens = sum(sum(mask[0]) for mask in processed["loss_mask"])
    print(json.dumps({
        "records": len(processed), "tokens": tokens, "loss_tokens": loss_tokens,
        "seconds": round(seconds, 4), "template": args.template,
        "specforge": importlib.metadata.version("specforge"), "num_proc": args.num_proc,
        "max_length": args.max_length, "train_only_last_turn": args.train_only_last_turn,
    }))


if __name__ == "__main__":
    main()
