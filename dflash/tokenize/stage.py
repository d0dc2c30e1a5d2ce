"""Tokenize stage: validated shard -> flat token rows the trainer memory-maps.

Per shard: ``shard-N.safetensors`` with ``input_ids`` (int32, all rows concatenated),
``loss_mask`` (uint8, 1 on the model's output tokens, stop token included) and ``offsets``
(int64, row r is ``[offsets[r], offsets[r+1])``), plus ``shard-N.json``: per-row id, category,
length and trainable tokens, and the shard's statistics.

Rows come from the record's token ids when it has them (exactly what the target saw and
produced); records without ids are rendered with the chat template and the generated text is
tokenized as the continuation. What could make a row differ from the model's tokens is counted,
never hidden: ids that do not decode to the text (``text_mismatch``, every record), text that
re-tokenizes to other ids (``retokenize_differs`` of ``retokenize_checked``: what the text path
would get wrong, on a fixed sample of ``retokenize_sample``), and rows from text whose rendered
prompt is not a token prefix of the rendered conversation (``boundary_unstable`` of
``boundary_checked``, every record).

Records are encoded in batches by the Rust tokenizer's batch encode (parallel over the job's
threads, no character offsets), in a worker thread while the next batch is read and rendered:
on one core, rows from text come at 0.8-0.9x the bare batch encode of the same strings
(``bench/tokenize_throughput.py``).
"""
from __future__ import annotations

import logging
import re
import zlib
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from dflash.core.chat import output_body, render_conversation, render_prompt, stop_token_ids
from dflash.core.io import atomic_files, json_text, naming_full_disk
from dflash.core.records import checked_records
from dflash.core.tensors import save_safetensors
from dflash.core.workflow import progress

log = logging.getLogger(__name__)

BATCH = 256
# Characters past the prompt/answer boundary that can decide how the prompt's last piece
# tokenizes: a pre-token (word, number, whitespace or punctuation run) longer than this that
# straddles the boundary would be judged on its first BOUNDARY_WINDOW characters only.
BOUNDARY_WINDOW = 256
COUNTS = ("from_ids", "from_text", "text_mismatch", "retokenize_checked", "retokenize_differs", "boundary_checked",
          "boundary_unstable", "truncated", "dropped_no_anchor")


class Encoder:
    """Batched encoding and decoding with one tokenizer, and the checks built on them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.stop_ids = stop_token_ids(tokenizer)
        added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
        self.added = re.compile("|".join(map(re.escape, added))) if added else None
        # The Rust tokenizer gives the same ids and text as the transformers wrapper, as long as
        # the wrapper has no clean-up of its own to apply, without its per-call overhead; its
        # encode_batch_fast skips the character offsets nobody here reads.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.fast = backend if backend is not None and not tokenizer.clean_up_tokenization_spaces else None
        self.tails: dict[str, list[int]] = {}
        self.vocabulary = len(tokenizer)

    def outside_vocabulary(self, rec: dict) -> str | None:
        """What of a record's ids the tokenizer has no token for (decoding drops them without a
        word, and the hidden stage would blame a shard of another tokenizer), or None."""
        for part in ("prompt", "output"):
            ids = rec[f"{part}_token_ids"]
            if ids and (min(ids) < 0 or max(ids) >= self.vocabulary):
                bad = next(i for i in ids if not 0 <= i < self.vocabulary)
                return f"{part} id {bad} outside the target's vocabulary of {self.vocabulary}"
        return None

    def encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.fast is not None:
            batch = getattr(self.fast, "encode_batch_fast", self.fast.encode_batch)
            return [e.ids for e in batch(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[list[int]]) -> list[str]:
        if self.fast is not None:
            return self.fast.decode_batch(ids, skip_special_tokens=False)
        return self.tokenizer.batch_decode(ids, skip_special_tokens=False)

    def _probe(self, prompt: str, prompt_ids: list[int], full: str) -> bool | tuple[list[int], str]:
        """The verdict when the strings decide it, else (the prompt's last tokens, the text of
        ``full`` whose encoding must start with them)."""
        if not full.startswith(prompt):
            return False
        cut = 0
        if self.added is not None:
            for m in self.added.finditer(prompt, max(0, len(prompt) - BOUNDARY_WINDOW)):
                cut = m.end()
        tail = prompt[cut:]
        if not tail:
            return True
        if cut == 0 and len(prompt) > BOUNDARY_WINDOW:  # no added token near the end: the whole text
            return prompt_ids, full
        window = full[cut:len(prompt) + BOUNDARY_WINDOW]
        if self.added is not None and (m := self.added.search(window, len(tail))):
            window = window[:m.start()]
        if tail not in self.tails:  # generation prompts end alike: a handful of tails per shard
            self.tails[tail] = self.encode([tail])[0]
        tail_ids = self.tails[tail]
        if prompt_ids[len(prompt_ids) - len(tail_ids):] != tail_ids:
            return False
        return tail_ids, window

    def boundaries_stable(self, prompts: list[str], prompt_ids: list[list[int]], fulls: list[str]) -> list[bool]:
        """Whether each prompt's ids are a prefix of the tokens of its whole conversation.

        Added tokens split the text before anything else, so everything up to the prompt's last
        added token tokenizes alike in both; only the text after it (the generation prompt's
        trailing newline, say) can merge with the answer. That piece is re-encoded with the
        characters that follow it in the conversation, up to the next added token or
        ``BOUNDARY_WINDOW`` characters, instead of the whole conversation.
        """
        probes = [self._probe(*args) for args in zip(prompts, prompt_ids, fulls)]
        todo = [n for n, p in enumerate(probes) if isinstance(p, tuple)]
        for n, ids in zip(todo, self.encode([probes[n][1] for n in todo])):
            probes[n] = ids[:len(probes[n][0])] == probes[n][0]
        return probes


class RecordError(ValueError):
    """A record the stage cannot take; the message names it, the shard's path is added."""


def rendered(render, rec: dict, tokenizer) -> str:
    try:
        return render(rec, tokenizer)
    except ValueError as e:
        raise RecordError(f"record {rec['id']}: {e}") from None


def sampled(record_id: str, fraction: float) -> bool:
    """A fixed, id-keyed sample: the same records are checked on every run and in every shard."""
    return fraction >= 1.0 or zlib.crc32(record_id.encode("utf-8")) < fraction * 2**32


class Batch:
    """Records tokenized together in two halves: ``__init__`` does what needs the GIL (reading the
    ids, decoding, rendering prompts) and lists the texts to encode; ``rows`` takes their
    encodings and builds the rows. The encode in between runs in Rust without the GIL, so the
    next batch is prepared while this one encodes."""

    def __init__(self, recs: list[dict], enc: Encoder, cfg: dict, counts: Counter):
        self.recs, self.enc, self.counts = recs, enc, counts
        self.rows: list = [None] * len(recs)
        self.by_ids = [i for i, r in enumerate(recs) if r.get("prompt_token_ids") is not None
                       and r.get("output_token_ids") is not None]
        with_ids = set(self.by_ids)
        self.by_text = [i for i in range(len(recs)) if i not in with_ids]
        self.exact: list[tuple[int, list[int]]] = []
        if self.by_ids:
            for i in self.by_ids:
                if problem := enc.outside_vocabulary(recs[i]):
                    raise RecordError(f"record {recs[i]['id']}: {problem}: generated by another model or tokenizer "
                                      f"than this target's; generate it again with this target")
            outs = [recs[i]["output_token_ids"] for i in self.by_ids]
            bodies = [output_body(o, enc.stop_ids) for o in outs]
            for i, body, text in zip(self.by_ids, bodies, enc.decode(bodies)):
                self.rows[i] = (recs[i]["prompt_token_ids"], recs[i]["output_token_ids"])
                if text != recs[i]["text"]:
                    counts["text_mismatch"] += 1
                    log.warning("%s: decoded output ids differ from the record's text", recs[i]["id"])
                elif sampled(recs[i]["id"], cfg["retokenize_sample"]):
                    self.exact.append((i, body))
            counts["from_ids"] += len(self.by_ids)
        self.prompts = [rendered(render_prompt, recs[i], enc.tokenizer) for i in self.by_text]
        # what the text path would have made of the sampled id records (a sampler need not pick
        # the tokenizer's own split), then the prompts and texts of the records without ids
        self.texts = [recs[i]["text"] for i, _ in self.exact] + self.prompts + [recs[i]["text"] for i in self.by_text]

    def finish(self, encoded: list[list[int]]) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, output ids) of each record, in order."""
        recs, enc, counts, n = self.recs, self.enc, self.counts, len(self.by_text)
        retokenized, prompt_ids, outputs = (encoded[:len(self.exact)], encoded[len(self.exact):len(self.exact) + n],
                                            encoded[len(self.exact) + n:])
        counts["retokenize_checked"] += len(self.exact)
        counts["retokenize_differs"] += sum(ids != body for (_, body), ids in zip(self.exact, retokenized))
        if not n:
            return self.rows
        for i, prompt, output in zip(self.by_text, prompt_ids, outputs):
            self.rows[i] = (prompt, output + [enc.end_of_turn] if recs[i]["finish_reason"] == "stop" else output)
        # The conversation is rendered on its own, not pieced together from the prompt: whether the
        # template renders the prompt's messages alike in both is part of what is checked.
        stable = enc.boundaries_stable(self.prompts, prompt_ids,
                                       [rendered(render_conversation, recs[i], enc.tokenizer) for i in self.by_text])
        for i, ok in zip(self.by_text, stable):
            if not ok:
                log.warning("%s: the rendered prompt is not a token prefix of the rendered conversation", recs[i]["id"])
        counts["from_text"] += n
        counts["boundary_checked"] += n
        counts["boundary_unstable"] += stable.count(False)
        return self.rows


def batches(records, enc: Encoder, cfg: dict, counts: Counter) -> Iterator[tuple[list[dict], list]]:
    """(records, their (prompt ids, output ids)) per batch; batch k encodes in a worker thread
    while batch k+1 is read and rendered and batch k-1's rows are finished."""
    with ThreadPoolExecutor(1) as pool:
        previous = None
        while recs := list(islice(records, BATCH)):
            batch = Batch(recs, enc, cfg, counts)
            encoding = pool.submit(enc.encode, batch.texts)
            if previous is not None:
                yield previous[0].recs, previous[0].finish(previous[1].result())
            previous = batch, encoding
        if previous is not None:
            yield previous[0].recs, previous[0].finish(previous[1].result())


TOKENIZE_READS = "tokenize reads the validated/ shards of the validate stage"


def trainable_records(path: Path) -> Iterator[dict]:
    """The records of a validated shard, each checked as it is read: a completion record that
    passed validation (``qa`` without ``reasons``: a rejected or an unvalidated record would be
    trained on), whose id was not seen before (it would be trained twice)."""
    seen: set[str] = set()
    for n, (_, rec) in enumerate(checked_records(path, "completion", TOKENIZE_READS), 1):
        if "qa" not in rec:
            raise RecordError(f"line {n}: record {rec['id']} was never validated (no qa): {TOKENIZE_READS}")
        if rec["qa"].get("reasons"):
            raise RecordError(f"line {n}: record {rec['id']} was rejected ({', '.join(rec['qa']['reasons'])}): "
                              f"{TOKENIZE_READS}, never the rejected/ ones")
        if rec["id"] in seen:
            raise RecordError(f"record id {rec['id']} appears twice; every id must be unique (re-run the rules "
                              f"that wrote the shard)")
        seen.add(rec["id"])
        yield rec


def tokenize_shard(validated_path: Path, out_tensors: Path, out_index: Path, tokenizer, cfg: dict) -> dict:
    enc = Encoder(tokenizer)
    max_length = cfg["max_length"]
    pieces: list[np.ndarray] = []
    prompt_lengths, offsets = [], [0]
    rows = []
    counts = Counter()
    trainable_by_cat: dict[str, list[int]] = defaultdict(list)
    records = trainable_records(validated_path)
    try:
        with progress(desc=f"tokenize {Path(validated_path).name}", unit="record") as bar:
            for batch, batch_rows in batches(records, enc, cfg, counts):
                for rec, (prompt, output) in zip(batch, batch_rows):
                    length = len(prompt) + len(output)
                    if length > max_length:
                        length = max_length
                        counts["truncated"] += 1
                    # the loss mask is the output part: DFlash needs an anchor and a label in it
                    trainable = max(0, length - len(prompt))
                    if trainable < 2:
                        counts["dropped_no_anchor"] += 1
                        continue
                    pieces.append(np.array(prompt, dtype=np.int32))
                    pieces.append(np.array(output[:trainable], dtype=np.int32))
                    prompt_lengths.append(len(prompt))
                    offsets.append(offsets[-1] + length)
                    rows.append({"id": rec["id"], "category": rec["category"], "length": length,
                                 "trainable": trainable})
                    trainable_by_cat[rec["category"]].append(trainable)
                bar.update(len(batch))
    except RecordError as e:
        raise ValueError(f"{validated_path}: {e}") from None
    input_ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    loss_mask = np.ones(len(input_ids), dtype=np.uint8)
    for start, prompt_length in zip(offsets, prompt_lengths):
        loss_mask[start:start + prompt_length] = 0
    tensors = {"input_ids": torch.from_numpy(input_ids), "loss_mask": torch.from_numpy(loss_mask),
               "offsets": torch.tensor(offsets, dtype=torch.int64)}
    stats = {
        "rows": len(rows),
        "tokens": len(input_ids),
        "trainable_tokens": sum(r["trainable"] for r in rows),
        **{k: counts[k] for k in COUNTS},
        "trainable_by_category": {c: {"rows": len(v), "tokens": sum(v)} for c, v in sorted(trainable_by_cat.items())},
    }
    # rows without their index (or the reverse) must never look like a finished shard
    with atomic_files(out_tensors, out_index) as (tensors_tmp, index_tmp):
        with naming_full_disk(out_tensors):
            save_safetensors(tensors, tensors_tmp, {"format": "dflash-tokenized-v1"})
        with naming_full_disk(out_index):
            index_tmp.write_text(json_text({"rows": rows, "stats": stats}), encoding="utf-8")
    log.info("tokenize %s: %s", Path(validated_path).name, {k: v for k, v in stats.items() if k != "trainable_by_category"})
    return stats


def tokenize_job(config: dict, validated_path: Path, target_dir: Path, out_tensors: Path, out_index: Path) -> dict:
    """The tokenize stage as its rules (the shards' and the pilot's) and ``dflash tokenize`` run
    it: a validated shard through the target's tokenizer and template."""
    from transformers import AutoTokenizer  # heavy: only the job that tokenizes pays for it

    return tokenize_shard(validated_path, out_tensors, out_index, AutoTokenizer.from_pretrained(target_dir),
                          config["tokenize"])
