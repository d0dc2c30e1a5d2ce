"""Training: anchors, blocks, schedule, shard checks, and a tiny overfit run."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from dflash.drafter import TargetIO, load_drafter
from dflash.hidden import forward_features
from dflash.train import Row, anchor_candidates, lr_at, make_batch, resolve_cfg, sample_anchors, train
from tests.test_drafter import reference  # noqa: F401 (fixture)


LAYER_IDS = [1, 3]
MASK_ID = 7
TRAIN_CFG = {"num_layers": 2, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
             "block_size": 4, "mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS, "layer_types": None,
             "steps": 150, "batch_size": 4, "lr": 3e-3, "warmup_ratio": 0.04, "min_lr_ratio": 0.1,
             "weight_decay": 0.0, "grad_clip": 1.0, "num_anchors": 16, "loss_decay_gamma": 7.0, "seed": 0,
             "log_every": 10, "device": "cpu"}


# --- helpers shared with test_eval -----------------------------------------------------------

def make_target(path: Path, seed: int = 0, eos_token_id: int | None = None) -> Path:
    """A tiny random hybrid Qwen3.5 text model (3 linear-attention + 1 full-attention layers)."""
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        tie_word_embeddings=False, eos_token_id=eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def write_shards(target, out: Path, rows: list[tuple[list[int], list[int]]], layer_ids: list[int],
                 dtype: torch.dtype = torch.bfloat16) -> tuple[Path, Path]:
    """Tokenized + hidden shards in the pipeline's formats for rows of (input_ids, loss_mask)."""
    (out / "tokenized").mkdir(parents=True, exist_ok=True)
    (out / "hidden").mkdir(parents=True, exist_ok=True)
    ids = torch.tensor([t for r, _ in rows for t in r], dtype=torch.int32)
    offsets = torch.tensor([0] + [len(r) for r, _ in rows]).cumsum(0)
    tok_path, hid_path = out / "tokenized" / "shard-00000.safetensors", out / "hidden" / "shard-00000.safetensors"
    save_file({"input_ids": ids, "loss_mask": torch.tensor([m for _, ms in rows for m in ms], dtype=torch.uint8),
               "offsets": offsets}, tok_path)
    meta_rows = [{"id": f"r{i}", "category": "chat", "length": len(r), "trainable": sum(m)}
                 for i, (r, m) in enumerate(rows)]
    tok_path.with_suffix(".json").write_text(json.dumps({"rows": meta_rows}))
    feats = [forward_features(target, torch.tensor([r]), layer_ids, logits=False)[1][0] for r, _ in rows]
    save_file({"hidden_states": torch.cat(feats).to(dtype), "offsets": offsets, "input_ids": ids},
              hid_path, metadata={"target_layer_ids": json.dumps(layer_ids), "hidden_size": "64", "model": "target"})
    return tok_path, hid_path


# --- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("m") / "target")


@pytest.fixture(scope="module")
def shards(tiny_target_dir, tmp_path_factory) -> tuple[Path, Path]:
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    g = torch.Generator().manual_seed(1)
    rows = []
    for length in (40, 33, 48, 36):
        prompt = 10
        rows.append((torch.randint(8, 256, (length,), generator=g).tolist(), [0] * prompt + [1] * (length - prompt)))
    rows.append(([9, 10, 11], [0, 1, 0]))  # no two consecutive supervised tokens: skipped
    return write_shards(target, tmp_path_factory.mktemp("data"), rows, LAYER_IDS)


# --- unit tests ------------------------------------------------------------------------------

def test_anchors_need_two_supervised_tokens():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    assert anchor_candidates(mask).tolist() == [1, 2, 5]
    g = torch.Generator().manual_seed(0)
    picks = {tuple(sample_anchors(mask, 2, g).tolist()) for _ in range(50)}
    assert all(len(p) == 2 and p[0] < p[1] and set(p) <= {1, 2, 5} for p in picks)
    assert len(picks) == 3  # resampled: every pair shows up
    assert sample_anchors(mask, 10, g).tolist() == [1, 2, 5]


def test_make_batch_labels_and_weights():
    ids = torch.arange(100, 110)
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    rows = [Row(0, 0, 10, ids, mask), Row(0, 10, 13, ids[:3], torch.tensor([1, 1, 0], dtype=torch.bool))]
    feats = [torch.randn(10, 2, 8), torch.randn(3, 2, 8)]
    gamma = 7.0
    batch = make_batch(rows, feats, [torch.tensor([2, 7]), torch.tensor([0])], 4, MASK_ID, gamma)

    assert batch.block_ids.shape == batch.block_pos.shape == batch.weights.shape == (2, 8)
    assert batch.block_ids[0].tolist() == [102] + [MASK_ID] * 3 + [107] + [MASK_ID] * 3
    assert batch.block_pos[0].tolist() == [2, 3, 4, 5, 7, 8, 9, 10]
    assert batch.labels[0, :4].tolist() == [102, 103, 104, 105]
    decay = [math.exp(-(k - 1) / gamma) for k in range(1, 4)]
    # anchor 2: slot 0 unweighted, label 104 is unsupervised (mask[4] = 0)
    assert batch.weights[0, :4].tolist() == pytest.approx([0, decay[0], 0, decay[2]])
    # anchor 7: position 10 is past the row's end
    assert batch.weights[0, 4:].tolist() == pytest.approx([0, decay[0], decay[1], 0])
    # the short row has one real block and one padding block with no weight
    assert batch.weights[1].tolist() == pytest.approx([0, decay[0], 0, 0, 0, 0, 0, 0])
    assert batch.context.shape == (2, 10, 2, 8)
    assert batch.context_valid.sum(1).tolist() == [10, 3]
    torch.testing.assert_close(batch.context[1, :3], feats[1])


def test_lr_schedule():
    lrs = [lr_at(s, 100, 1.0, 0.1, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)
    assert lr_at(0, 10, 1.0, 0.0, 0.1) == pytest.approx(1.0)


def test_cfg_checks():
    with pytest.raises(ValueError, match="unknown"):
        resolve_cfg({**TRAIN_CFG, "learning_rate": 1.0})
    with pytest.raises(ValueError, match="mask_token_id"):
        resolve_cfg({k: v for k, v in TRAIN_CFG.items() if k != "mask_token_id"})


def test_target_io_reads_embedding_and_head(tiny_target_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    io, expected = TargetIO.from_pretrained(tiny_target_dir), TargetIO.from_model(model)
    assert torch.equal(io.embed_weight, expected.embed_weight)
    assert torch.equal(io.head_weight, expected.head_weight)


# --- training --------------------------------------------------------------------------------

def test_train_overfits_and_writes_checkpoint(tiny_target_dir, shards, tmp_path):
    tok, hid = shards
    out = tmp_path / "drafter"
    summary = train([tok], [hid], tiny_target_dir, out, TRAIN_CFG)

    assert summary["steps"] == 150 and summary["rows"] == 4 and summary["tokens"] == 40 + 33 + 48 + 36
    # The tiny random lm_head gives small logits, so the loss falls slowly once the argmax is right.
    assert summary["final_loss"] < 0.75 * summary["first_loss"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no temporary directory left
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "train_log.jsonl",
                                               "trainer_state.json"}

    lines = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(10, 151, 10))
    assert set(lines[0]) == {"step", "loss", "acc", "lr", "position_acc", "expected_acceptance", "tokens_per_s"}
    acc = lines[-1]["position_acc"]
    assert lines[-1]["expected_acceptance"] == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2])
    assert len(lines[-1]["position_acc"]) == 3 and lines[-1]["acc"] > 0.9 > lines[0]["acc"]
    assert lines[-1]["loss"] == pytest.approx(summary["final_loss"])
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["steps"] == 150 and state["data"]["rows"] == 5 and state["data"]["trainable_rows"] == 4

    model, config = load_drafter(out)
    assert config.dflash_config == {"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS}
    assert config.block_size == 4 and config.num_target_layers == 4
    assert "embed" not in " ".join(load_file(out / "model.safetensors"))


def test_train_is_deterministic(tiny_target_dir, shards, tmp_path):
    cfg = {**TRAIN_CFG, "steps": 4, "log_every": 2}
    train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "a", cfg)
    train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "b", cfg)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _rewrite(path: Path, out: Path, tensors: dict | None = None, metadata: dict | None = None) -> Path:
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        data, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file({**data, **(tensors or {})}, out, metadata={**meta, **(metadata or {})})
    return out


def test_mismatched_shards_are_named(tiny_target_dir, shards, tmp_path):
    tok, hid = shards
    cfg = {**TRAIN_CFG, "steps": 1}
    bad = _rewrite(hid, tmp_path / "layers.safetensors", metadata={"target_layer_ids": "[0, 3]"})
    with pytest.raises(ValueError, match=r"layers\.safetensors.*\[0, 3\]"):
        train([tok], [bad], tiny_target_dir, tmp_path / "out", cfg)

    ids = load_file(hid)["input_ids"].clone()
    ids[5] += 1
    bad = _rewrite(hid, tmp_path / "ids.safetensors", tensors={"input_ids": ids})
    with pytest.raises(ValueError, match=r"ids\.safetensors: input_ids differ"):
        train([tok], [bad], tiny_target_dir, tmp_path / "out", cfg)

    with pytest.raises(ValueError, match="target_layer_ids"):
        train([tok], [hid], tiny_target_dir, tmp_path / "out", {**cfg, "target_layer_ids": None})  # 4 layers, 2 drafts
    assert not (tmp_path / "out").exists()


def test_online_hidden_states_train_like_a_float32_cache(tiny_target_dir, tmp_path):
    """online runs the frozen target per drawn row: the same features as a float32 cache."""
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    g = torch.Generator().manual_seed(2)
    rows = [(torch.randint(8, 256, (n,), generator=g).tolist(), [0] * 8 + [1] * (n - 8)) for n in (30, 26, 34)]
    tok, hid = write_shards(target, tmp_path / "data", rows, LAYER_IDS, torch.float32)
    cfg = {**TRAIN_CFG, "steps": 6, "log_every": 3}
    train([tok], [hid], tiny_target_dir, tmp_path / "offline", cfg)
    train([tok], None, tiny_target_dir, tmp_path / "online", {**cfg, "hidden_states": "online"})
    a, b = load_file(tmp_path / "offline" / "model.safetensors"), load_file(tmp_path / "online" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_trained_checkpoint_gives_the_reference_its_draft_logits(reference, tiny_target_dir, shards, tmp_path,
                                                                  record_property):
    """What the trainer writes loads in the reference DFlashDraftModel (PyPI dflash 0.1.0) with
    no missing or unexpected key, and drafts the same logits through the target's own head."""
    from tests.test_drafter import inputs, logit_diff

    train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "ckpt", {**TRAIN_CFG, "steps": 6})
    ref, info = reference.DFlashDraftModel.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ours, _ = load_drafter(tmp_path / "ckpt")
    block, block_pos, ctx, ctx_pos = inputs(S=10)
    with torch.no_grad():
        a = ours.eval()(block, block_pos, ctx, ctx_pos)
        b = ref.eval()(position_ids=torch.cat([ctx_pos, block_pos], 1), noise_embedding=block,
                       target_hidden=ctx.flatten(2))
    assert logit_diff(a, b, record_property) < 1e-4
