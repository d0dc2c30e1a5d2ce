"""Training: anchors, blocks, schedule, shard checks, and a tiny overfit run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

import dflash.train.stage
from dflash.train.drafter import TargetIO, load_drafter
from dflash.hidden.stage import features_and_greedy
from dflash.core.io import OUTPUT_MARK
from dflash.train.objective import HeadCE
from dflash.train.batches import Batch, Row, add_feature_noise, anchor_candidates, make_batch, sample_anchors
from dflash.train.optim import lr_at, make_optimizer
from dflash.train.stage import draft_loss, resolve_cfg, train
from tests.helpers import on_a_small_tmpfs
from tests.test_drafter import reference  # noqa: F401 (fixture)


LAYER_IDS = [1, 3]
MASK_ID = 7
TRAIN_CFG = {"num_layers": 2, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
             "block_size": 4, "mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS, "layer_types": None,
             "steps": 150, "batch_size": 4, "lr": 3e-3, "warmup_ratio": 0.04, "min_lr_ratio": 0.1,
             "weight_decay": 0.0, "grad_clip": 1.0, "num_anchors": 16, "seed": 0,
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
    outputs = [features_and_greedy(target, torch.tensor([r]), layer_ids) for r, _ in rows]
    save_file({"hidden_states": torch.cat([f for f, _ in outputs]).to(dtype),
               "target_argmax": torch.cat([g for _, g in outputs]), "offsets": offsets, "input_ids": ids},
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


def test_make_batch_labels_and_supervision():
    ids = torch.arange(100, 110)
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    rows = [Row(0, 0, 10, ids, mask), Row(0, 10, 13, ids[:3], torch.tensor([1, 1, 0], dtype=torch.bool))]
    feats = [torch.randn(10, 2, 8), torch.randn(3, 2, 8)]
    anchors = [torch.tensor([2, 7]), torch.tensor([0])]
    batch = make_batch(rows, feats, anchors, 4, MASK_ID)

    assert batch.block_ids.shape == batch.block_pos.shape == batch.supervised.shape == (2, 8)
    assert batch.block_ids[0].tolist() == [102] + [MASK_ID] * 3 + [107] + [MASK_ID] * 3
    assert batch.block_pos[0].tolist() == [2, 3, 4, 5, 7, 8, 9, 10]
    assert batch.labels[0, :4].tolist() == [102, 103, 104, 105]  # the data's tokens
    # anchor 2: slot 0 is given, label 104 is unsupervised (mask[4] = 0); anchor 7: position 10 is past the end
    assert batch.supervised[0].tolist() == [False, True, False, True, False, True, True, False]
    # the short row has one real block and one padding block, unsupervised
    assert batch.supervised[1].tolist() == [False, True] + [False] * 6
    assert batch.context.shape == (2, 10, 2, 8)
    assert batch.context_valid.sum(1).tolist() == [10, 3]
    torch.testing.assert_close(batch.context[1, :3], feats[1])

    # the target's labels: its greedy token after reading up to the position before each slot
    greedy = [torch.arange(500, 510, dtype=torch.int32), torch.arange(600, 603, dtype=torch.int32)]
    batch = make_batch(rows, feats, anchors, 4, MASK_ID, greedy)
    assert batch.labels[0, 1:4].tolist() == [502, 503, 504] and batch.labels[0, 5:7].tolist() == [507, 508]
    assert batch.labels[1, 1].item() == 600


def test_lr_schedule():
    lrs = [lr_at(s, 100, 1.0, 0.1, 0.1, "cosine") for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)
    assert lr_at(0, 10, 1.0, 0.0, 0.1, "cosine") == pytest.approx(1.0)
    # linear: the same warmup and floor, a straight line between them
    linear = [lr_at(s, 100, 1.0, 0.1, 0.1, "linear") for s in range(100)]
    assert linear[:10] == pytest.approx(lrs[:10]) and linear[-1] == pytest.approx(0.1, abs=0.02)
    assert linear[10] - linear[11] == pytest.approx(linear[80] - linear[81])
    assert lr_at(50, 100, 1.0, 0.0, 0.0, "linear") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="lr_schedule"):
        resolve_cfg({**TRAIN_CFG, "lr_schedule": "step"})


def test_cfg_checks():
    with pytest.raises(ValueError, match="unknown"):
        resolve_cfg({**TRAIN_CFG, "learning_rate": 1.0})
    with pytest.raises(ValueError, match="mask_token_id"):
        resolve_cfg({k: v for k, v in TRAIN_CFG.items() if k != "mask_token_id"})
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        resolve_cfg({**TRAIN_CFG, "loss_chunk_tokens": 0})
    with pytest.raises(ValueError, match="prefetch"):
        resolve_cfg({**TRAIN_CFG, "prefetch": -1})
    with pytest.raises(ValueError, match="optimizer"):
        resolve_cfg({**TRAIN_CFG, "optimizer": "sgd"})


def test_target_io_reads_embedding_and_head(tiny_target_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    io, expected = TargetIO.from_pretrained(tiny_target_dir), TargetIO.from_model(model)
    assert torch.equal(io.embed_weight, expected.embed_weight)
    assert torch.equal(io.head_weight, expected.head_weight)


# --- the chunked loss at the real vocabulary ---------------------------------------------------

QWEN36_VOCAB = 248_320


class _Drafter(torch.nn.Module):
    """Stands in for the drafter: block_loss only needs hidden states that depend on parameters."""

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, embeds, *_context):
        return self.proj(embeds)


LOSS = {"weights": "decay", "decay_gamma": 7.0, "dpace_alpha": 0.5}


def _whole_block_loss(model, io, batch, B):
    """draft_loss before chunking: the fp32 logits of every supervised position at once, decay
    weights, divided by the supervised slots."""
    hidden = model(io.embed(batch.block_ids))
    R, L = batch.block_ids.shape
    sel = batch.supervised.flatten()
    slot = (torch.arange(L) % B).repeat(R)[sel]
    w = torch.exp(-(slot - 1) / LOSS["decay_gamma"])
    logits = io.logits(hidden.flatten(0, 1)[sel]).float()
    labels = batch.labels.flatten()[sel]
    loss = (torch.nn.functional.cross_entropy(logits, labels, reduction="none") * w).sum() / sel.sum()
    hit = logits.argmax(-1) == labels
    return loss, torch.bincount(slot[hit], minlength=B), torch.bincount(slot, minlength=B)


def test_chunked_loss_equals_whole_logits_at_the_real_vocabulary():
    """Loss, per-position tallies and gradients as the whole-logits loss gave them, with the last
    chunk a partial one; every third label the mask token, which the head ranks first at the
    mask positions, makes the tallies non-trivial."""
    H, B, V = 16, 16, QWEN36_VOCAB
    g = torch.Generator().manual_seed(0)
    rows, anchors = [], []
    for length in (300, 260):
        mask = torch.ones(length, dtype=torch.bool)
        mask[:20] = False
        rows.append(Row(0, 0, length, torch.randint(0, V, (length,), generator=g), mask))
        anchors.append(sample_anchors(mask, 20, g))
    batch = make_batch(rows, [torch.zeros(len(r.input_ids), 1, H) for r in rows], anchors, B, 0)
    embed = torch.randn(V, H, generator=g)
    embed[0] *= 3  # the mask token (id 0): its own logit beats the others'
    io = TargetIO(embed, embed * 0.5)
    torch.manual_seed(0)
    model = _Drafter(H)
    with torch.no_grad():
        model.proj.weight.copy_(torch.eye(H) + 0.01 * torch.randn(H, H, generator=g))
    batch.labels[:, ::3] = 0

    expected = _whole_block_loss(model, io, batch, B)
    expected[0].backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    supervised = int(expected[2].sum())
    assert supervised > 500 and supervised % 96 and 0 < int(expected[1].sum()) < supervised
    loss, parts = draft_loss(model, io, batch, B, LOSS, supervised, chunk_tokens=96)
    loss.backward()
    torch.testing.assert_close(loss, expected[0])
    assert torch.equal(parts.correct, expected[1]) and torch.equal(parts.count, expected[2])
    for p, grad in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(p.grad, grad)


def test_chunked_loss_under_bf16_autocast_matches_and_stays_float32():
    """The lm_head matmul runs in bf16 as autocast makes it (CPU autocast here, CUDA's in training),
    the loss and its softmax in fp32, as the whole-logits loss did."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 300, 32, 5000
    x, head = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.1
    labels, weights = torch.randint(0, V, (N,), generator=g), torch.rand(N, generator=g)
    proj = torch.nn.Linear(H, H)
    results = []
    for chunked in (False, True):
        proj.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = proj(x)
            if chunked:
                ce, hit = HeadCE.apply(hidden, head, labels, 64)
                total = (ce * weights).sum()
            else:
                logits = torch.nn.functional.linear(hidden, head).float()
                total = (torch.nn.functional.cross_entropy(logits, labels, reduction="none") * weights).sum()
                hit = logits.argmax(-1) == labels
        total.backward()
        results.append((total.detach(), hit, proj.weight.grad.clone()))
    (whole, whole_hit, whole_grad), (total, hit, grad) = results
    assert hidden.dtype == torch.bfloat16 and total.dtype == torch.float32
    torch.testing.assert_close(total, whole)
    assert torch.equal(hit, whole_hit)
    torch.testing.assert_close(grad, whole_grad)


# Peak resident memory of HeadCE's forward + backward, and of the whole-logits loss, measured in
# a fresh process: torch's CPU tensors live outside Python's allocator (tracemalloc misses them)
# and glibc maps each one this large with mmap, so the kernel's high-water mark (VmHWM, reset by
# writing 5 to /proc/self/clear_refs) minus the resident size before is what the loss added.
_PEAK_PROBE = """
import json, sys, torch
from dflash.train.objective import block_loss
torch.set_num_threads(1)

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

def peak(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before

V, H, N, small, chunk = map(int, sys.argv[1:])
g = torch.Generator().manual_seed(0)
hidden = torch.randn(N, H, generator=g, requires_grad=True)
head = torch.randn(V, H, generator=g)
labels, weights = torch.randint(0, V, (N,), generator=g), torch.rand(N, generator=g)

def chunked():  # the whole objective, D-PACE weights and all (they need every slot's CE first)
    m = torch.ones(1, N, dtype=torch.bool)
    loss, _ = block_loss(hidden[None], head, labels[None], m, 16, {"weights": "dpace", "dpace_alpha": 0.5}, N,
                         chunk_tokens=chunk)
    loss.backward()

def whole():
    logits = torch.nn.functional.linear(hidden[:small], head).float()
    (torch.nn.functional.cross_entropy(logits, labels[:small], reduction="none") * weights[:small]).sum().backward()

print(json.dumps({"chunked": peak(chunked), "whole": peak(whole)}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset")
def test_chunked_loss_memory_is_bounded_by_the_chunk(record_property):
    """2,048 supervised positions at the real vocabulary, D-PACE weighted: forward + backward stay
    within about one chunk of fp32 logits (the bound loss_chunk_tokens promises), where the whole-logits loss needs
    several times its N x V logits: measured at 256 positions it is already past the bound, and
    at 2,048 its logits alone would be 2 GB."""
    V, H, N, small, chunk = QWEN36_VOCAB, 16, 2048, 256, 128
    out = subprocess.run([sys.executable, "-c", _PEAK_PROBE, *map(str, (V, H, N, small, chunk))], check=True,
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    peak = json.loads(out.stdout)
    chunk_bytes = chunk * V * 4
    for key, value in {**peak, "chunk_logits": chunk_bytes, "whole_logits_at_2048": N * V * 4}.items():
        record_property(f"{key}_MB", round(value / 1e6, 1))
    assert chunk_bytes <= peak["chunked"] < 1.5 * chunk_bytes
    assert peak["whole"] > small * V * 4 > 1.5 * chunk_bytes  # the probe does see torch's allocations


# --- training --------------------------------------------------------------------------------

def test_train_overfits_and_writes_checkpoint(tiny_target_dir, shards, tmp_path):
    tok, hid = shards
    out = tmp_path / "drafter"
    summary = train([tok], [hid], tiny_target_dir, out, TRAIN_CFG)

    assert summary["steps"] == 150 and summary["rows"] == 4 and summary["tokens"] == 40 + 33 + 48 + 36
    # The tiny random lm_head gives small logits, so the loss falls slowly once the argmax is right.
    assert summary["final_loss"] < 0.75 * summary["first_loss"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no temporary directory left
    assert {p.name for p in out.iterdir()} == {OUTPUT_MARK, "config.json", "model.safetensors", "train_log.jsonl",
                                               "trainer_state.json"}

    lines = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(10, 151, 10))
    assert set(lines[0]) == {"step", "loss", "acc", "lr", "grad_norm", "position_acc", "position_weight", "expected_acceptance",
                             "tokens_per_s", "seconds"}
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


def test_train_is_deterministic_with_or_without_prefetch(tiny_target_dir, shards, tmp_path):
    cfg = {**TRAIN_CFG, "steps": 4, "log_every": 2, "feature_noise": 1.0}
    train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "a", {**cfg, "prefetch": 0})
    train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "b", {**cfg, "prefetch": 3})
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original", None])
def test_muon_on_a_cpu_takes_torch_s_step_in_float32(adjust):
    """dflash.train.optim.Muon off CUDA: torch's update (momentum, Nesterov, Newton-Schulz, lr adjustment,
    decay) with the orthogonalization in float32, so it differs from torch's by the rounding of
    torch's bfloat16 only; the same state, so the two load each other's."""
    from dflash.train.optim import Muon

    torch.manual_seed(0)
    start = [torch.randn(96, 128), torch.randn(256, 64)]  # wide and tall
    ours, theirs = ([w.clone().requires_grad_() for w in start] for _ in range(2))
    kw = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": adjust}
    mine, torchs = Muon(ours, **kw), torch.optim.Muon(theirs, **kw)
    for _ in range(3):
        grads = [torch.randn_like(w) for w in start]
        for params, opt in ((ours, mine), (theirs, torchs)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for a, b, w in zip(ours, theirs, start):
        moved = (b - w).norm()
        assert moved > 0 and ((a - w) - (b - w)).norm() / moved < 0.02
    torchs.load_state_dict(mine.state_dict())


def test_muon_moves_the_hidden_matrices_and_adamw_the_input_projection_and_the_gains():
    from tests.test_drafter import draft
    model = draft()
    muon, adamw = make_optimizer(model, 1e-3, 0.1, "muon", muon_fc=False).optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    on_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[i] for i in on_muon} == {n for n, p in model.named_parameters() if p.dim() == 2 and n != "fc.weight"}
    fc, gains = adamw.param_groups
    assert fc["params"] == [model.fc.weight] and fc["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in gains["params"]) and gains["weight_decay"] == 0.0
    assert muon.param_groups[0]["weight_decay"] == 0.1
    assert len(on_muon) + 1 + len(gains["params"]) == len(list(model.parameters()))
    # muon_fc: every matrix on Muon (speculators' split), the gains still on AdamW
    muon, adamw = make_optimizer(model, 1e-3, 0.1, "muon", muon_fc=True).optimizers
    assert {names[id(p)] for g in muon.param_groups for p in g["params"]} == {
        n for n, p in model.named_parameters() if p.dim() == 2}
    assert [g["params"] for g in adamw.param_groups] == [gains["params"]]  # no empty group (distributed state)


def test_feature_noise_scales_with_each_token_and_layer_and_is_the_same_however_rows_are_split():
    g = torch.Generator().manual_seed(0)
    lengths, T = [300, 200], 300
    context = torch.zeros(2, T, 2, 64)
    for i, n in enumerate(lengths):  # tokens and layers of very different sizes, as a target's are
        context[i, :n] = torch.randn(n, 2, 64, generator=g) * torch.logspace(-2, 3, n)[:, None, None]
    valid = torch.arange(T)[None] < torch.tensor(lengths)[:, None]

    def batch(rows):
        return Batch(*(torch.zeros(len(rows), 1) for _ in range(4)), context[rows].clone(),
                     torch.arange(T).repeat(len(rows), 1), valid[rows])

    both = batch([0, 1])
    add_feature_noise(both, 0.3, seed=5, step=7, first_row=0)
    noise = both.context - context
    rms = context.pow(2).mean(-1, keepdim=True).sqrt()
    relative = (noise[0, :300] / rms[0, :300]).pow(2).mean(-1).sqrt()  # per token and layer
    assert relative.mean().item() == pytest.approx(0.3, rel=0.02) and relative.min().item() > 0.15
    assert torch.equal(noise[1, 200:], torch.zeros_like(noise[1, 200:]))  # padding stays as it was
    second = batch([1])  # the second row on a rank of its own: row 1 of the global batch
    add_feature_noise(second, 0.3, seed=5, step=7, first_row=1)
    assert torch.equal(second.context[0], both.context[1])
    other_step = batch([0, 1])
    add_feature_noise(other_step, 0.3, seed=5, step=8, first_row=0)
    assert not torch.equal(other_step.context, both.context)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_failed_run_resumes_to_the_same_weights_while_prefetching(tiny_target_dir, shards, tmp_path, monkeypatch,
                                                                   optimizer):
    """The prefetch thread has drawn rows and anchors for steps past the last resume point when
    the run fails; the resumed run must draw them again, as an uninterrupted run did (the
    optimizers' state, Muon's momentum included, comes back with the resume point; an AdamW
    resume point in the format from before the optimizer choice still resumes)."""
    cfg = {**TRAIN_CFG, "steps": 9, "log_every": 3, "save_every": 3, "prefetch": 3, "optimizer": optimizer,
           "feature_noise": 1.0}
    train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "whole", cfg)

    with pytest.raises(RuntimeError, match="interrupted"):
        interrupted_at(7, monkeypatch, train, [shards[0]], [shards[1]], tiny_target_dir, tmp_path / "resumed", cfg)
    if optimizer == "adamw":  # as the trainer wrote them before there was a choice: they still resume
        points = list((tmp_path / ".resumed.resume").glob("step-*.pt"))
        assert points
        for point in points:
            state = torch.load(point, weights_only=True)
            torch.save({**state, "optimizer": state["optimizer"]["optimizers"][0]}, point)
    summary = train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "resumed", cfg)
    assert summary["resumed_from_step"] == 6
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    whole, resumed = ((tmp_path / d / "train_log.jsonl").read_text().splitlines() for d in ("whole", "resumed"))
    assert [json.loads(x)["loss"] for x in whole] == [json.loads(x)["loss"] for x in resumed]


def interrupted_at(step: int, monkeypatch, run, *args, **kwargs):
    """``run(*args, **kwargs)`` with the training failing as it starts step ``step`` (0-based)."""
    lr_at = dflash.train.stage.lr_at

    def fail(at, *more):
        if at == step:
            raise RuntimeError("interrupted")
        return lr_at(at, *more)

    monkeypatch.setattr(dflash.train.stage, "lr_at", fail)
    try:
        return run(*args, **kwargs)
    finally:
        monkeypatch.setattr(dflash.train.stage, "lr_at", lr_at)


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

    # a cache from before the greedy tokens: labels target needs them, labels data does not
    old = load_file(hid)
    del old["target_argmax"]
    save_file(old, tmp_path / "v1.safetensors", metadata={"target_layer_ids": json.dumps(LAYER_IDS)})
    with pytest.raises(ValueError, match=r"v1\.safetensors: a hidden-state cache without the target's greedy tokens "
                                         r".*re-run the hidden stage"):
        train([tok], [tmp_path / "v1.safetensors"], tiny_target_dir, tmp_path / "out", cfg)
    assert not (tmp_path / "out").exists()
    train([tok], [tmp_path / "v1.safetensors"], tiny_target_dir, tmp_path / "out",
          {**cfg, "loss": {"labels": "data"}})


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


def test_the_pilots_training_burst_keeps_a_step_rate_and_no_drafter(tiny_target_dir, shards, tmp_path):
    from dflash.plan.burst import train_burst

    tok, hid = shards
    out = tmp_path / "pilot" / "train_burst.json"
    out.parent.mkdir()
    burst = train_burst(tok, hid, tiny_target_dir, out, TRAIN_CFG, "local", 20)
    assert json.loads(out.read_text()) == burst and [p.name for p in out.parent.iterdir()] == ["train_burst.json"]
    assert burst["kind"] == "local" and burst["steps"] == 20 and burst["timed_steps"] == 16  # windows of 4, the first left out
    assert 0 < burst["seconds_per_step"] and burst["setup_seconds"] >= 0
    assert burst["setup_seconds"] + 20 * burst["seconds_per_step"] == pytest.approx(burst["seconds"])


def test_a_pilot_with_nothing_to_train_on_skips_the_burst(tiny_target_dir, tmp_path):
    """Every pilot record rejected leaves no row to anchor a block: the burst says so and the plan
    prices training without it, instead of failing the pilot whose summary shows why."""
    from dflash.plan.burst import train_burst
    from dflash.plan.pilot import pilot_lines

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    tok, hid = write_shards(target, tmp_path / "data", [([9, 10, 11], [0, 1, 0])], LAYER_IDS)
    out = tmp_path / "pilot" / "train_burst.json"
    out.parent.mkdir()
    burst = train_burst(tok, hid, tiny_target_dir, out, TRAIN_CFG, "local", 20)
    assert burst == {"kind": "local", "steps": 0, "skipped": "no trainable row has two consecutive supervised "
                                                             "tokens: nothing to train on"}
    assert [p.name for p in out.parent.iterdir()] == ["train_burst.json"]
    summary = {"prompts": 1, "records": 1, "reject_rate": 1.0, "trivial_share": 0.0, "categories": {}, "gates": [],
               "throughput": {"output_tokens_per_s": 1.0, "output_tokens_per_s_per_gpu": None, "requests_per_s": 1.0,
                              "output_tokens": 1}, "train_burst": burst}
    assert "  training burst on local: none (no trainable row" in "\n".join(pilot_lines(summary))


# --- hostile resume folders, divergence, signals, full disks (issue 42) ----------------------

class _Planted:
    """What a hostile resume point holds: unpickling it would create a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_planted_resume_point_runs_no_code_and_is_refused(tiny_target_dir, shards, tmp_path):
    resume = tmp_path / ".out.resume"
    resume.mkdir()
    marker = tmp_path / "code-ran"
    torch.save({"fingerprint": "x", "step": 3, "model": _Planted(marker)}, resume / "step-00000003.pt")
    with pytest.raises(ValueError) as e:
        train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "out", {**TRAIN_CFG, "steps": 2})
    assert str(e.value).startswith(f"{resume}/step-00000003.pt: refused, not loaded: a resume point holds only "
                                   f"tensors and plain values, and this file holds more (Unsupported global: "
                                   f"GLOBAL io.open was not an allowed global by default)")
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert sorted(p.name for p in resume.iterdir()) == ["lock", "step-00000003.pt"]  # the point left as it was


def test_a_symlinked_resume_folder_is_refused_and_its_files_kept(tiny_target_dir, shards, tmp_path):
    victim = tmp_path / "someone-elses"
    victim.mkdir()
    (victim / "step-00000001.pt").write_bytes(b"theirs")
    (tmp_path / ".out.resume").symlink_to(victim)
    with pytest.raises(ValueError, match=rf"^{tmp_path}/\.out\.resume: a symlink or a file where training keeps "
                                         rf"out's resume points"):
        train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "out", {**TRAIN_CFG, "steps": 2})
    assert (victim / "step-00000001.pt").read_bytes() == b"theirs" and [p.name for p in victim.iterdir()] == [
        "step-00000001.pt"]


def test_a_second_training_of_one_output_is_refused_while_the_first_holds_its_resume_points(
        tiny_target_dir, shards, tmp_path):
    import os

    from dflash.train.resume import held_resume_dir

    resume = tmp_path / ".out.resume"
    with held_resume_dir(resume, tmp_path / "out"):  # the first training, here in this process
        with pytest.raises(RuntimeError, match=rf"^another training is using {tmp_path}/out's resume points "
                                               rf"\(pid {os.getpid()}, lock "):
            train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "out", {**TRAIN_CFG, "steps": 2})
        assert (resume / "lock").exists()
    assert not resume.exists() and not (tmp_path / "out").exists()


def test_a_diverging_training_stops_and_writes_no_nan(tiny_target_dir, shards, tmp_path):
    """lr 1e30: the loss goes infinite at step 2; the run skips max_nonfinite_steps steps, then
    stops. Nothing holds a NaN: no checkpoint, and the resume points have finite weights."""
    cfg = {**TRAIN_CFG, "steps": 12, "log_every": 2, "save_every": 2, "lr": 1e30, "optimizer": "adamw"}
    with pytest.raises(RuntimeError) as e:
        train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "out", cfg)
    assert str(e.value) == (f"{tmp_path}/out: training diverged: the loss or a gradient was not finite at step 5 "
                            f"(4 such steps, train.max_nonfinite_steps is 3); no checkpoint written: lower train.lr "
                            f"(now 1e+30) or check the data, and re-run")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.resume"]  # no checkpoint, no temp folder
    for point in (tmp_path / ".out.resume").glob("step-*.pt"):
        state = torch.load(point, weights_only=True)
        assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_a_non_finite_step_is_skipped_and_the_run_goes_on(tiny_target_dir, shards, tmp_path, monkeypatch):
    """One bad batch (a fake: no real part gives one NaN step on demand) is not applied: the run
    ends like a run of the other steps, and says it skipped one."""
    real = dflash.train.stage.draft_loss
    calls = []

    def nan_at_the_second_step(*args, **kwargs):
        loss, parts = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan"), parts) if len(calls) == 2 else (loss, parts)

    monkeypatch.setattr(dflash.train.stage, "draft_loss", nan_at_the_second_step)
    cfg = {**TRAIN_CFG, "steps": 4, "log_every": 1}
    summary = train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "out", cfg)
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    lines = [json.loads(x) for x in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert state["skipped_steps"] == 1 and lines[1]["loss"] is None and summary["final_loss"] == lines[3]["loss"]
    assert all(torch.isfinite(v).all() for v in load_file(tmp_path / "out" / "model.safetensors").values())
    calls.clear()
    with pytest.raises(RuntimeError, match="not finite at step 2 .*max_nonfinite_steps is 0"):
        train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "zero", {**cfg, "max_nonfinite_steps": 0})


def test_a_drafter_with_nan_weights_is_refused(tiny_target_dir, shards, tmp_path):
    train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "ckpt", {**TRAIN_CFG, "steps": 1})
    weights = load_file(tmp_path / "ckpt" / "model.safetensors")
    save_file({**weights, "fc.weight": weights["fc.weight"] * float("nan")}, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(ValueError, match=rf"^{tmp_path}/ckpt/model.safetensors: the weights fc.weight are not "
                                         rf"finite \(NaN or infinite: a training that diverged"):
        load_drafter(tmp_path / "ckpt")


_SIGTERMED = """
import sys, json
from pathlib import Path
from dflash.train.stage import train
tok, hid, target, out = map(Path, sys.argv[1:5])
train([tok], [hid], target, out, json.loads(sys.argv[5]))
"""


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_writes_a_fresh_resume_point_and_the_rerun_ends_with_the_same_weights(
        tiny_target_dir, shards, tmp_path, signum):
    """SLURM's warning before a time limit or a preemption (SIGTERM, or sbatch --signal's choice):
    the training stops after the step it is in, with that step's resume point (no periodic ones
    here: save_every 0), and no temporary checkpoint; the next run resumes there bit-exact."""
    import signal
    import time

    cfg = {**TRAIN_CFG, "steps": 200, "log_every": 1, "save_every": 0, "prefetch": 2}
    proc = subprocess.Popen([sys.executable, "-c", _SIGTERMED, *map(str, (*shards, tiny_target_dir, tmp_path / "out")),
                             json.dumps(cfg)], cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    logs = lambda: list(tmp_path.glob(".out.*.tmp/train_log.jsonl"))  # noqa: E731
    while not logs() or not any(p.stat().st_size for p in logs()):  # training, not loading
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.05)
    logged = len(logs()[0].read_text().splitlines())
    proc.send_signal(getattr(signal, signum))
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 128 + getattr(signal, signum), err
    (point,) = (tmp_path / ".out.resume").glob("step-*.pt")
    step = int(point.stem.split("-")[1])
    assert logged <= step < cfg["steps"], err  # the step it was in, not an older one
    assert f"{signum}: training stopped after step {step}; its resume point is in" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.resume"]  # no temp checkpoint

    summary = train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "out", cfg)
    assert summary["resumed_from_step"] == step
    train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "whole", cfg)
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "whole" / "train_log.jsonl").read_text().count("\n") == cfg["steps"]
    assert [json.loads(x)["loss"] for x in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()] == [
        json.loads(x)["loss"] for x in (tmp_path / "whole" / "train_log.jsonl").read_text().splitlines()]


_FULL_DISK = """
import sys, torch
from pathlib import Path
from dflash.core.errors import describe
from dflash.train.resume import save_resume_point
try:
    save_resume_point(Path("/mnt/.out.resume"), {"step": 3, "model": {"w": torch.randn(100_000)}})
except OSError as e:
    print(describe(e))
"""


def test_a_full_disk_names_the_resume_point(tmp_path):
    """A real full disk: a 16 KB tmpfs in a private mount namespace (as tests/test_io.py does)."""
    run = on_a_small_tmpfs(f"{sys.executable} -c '{_FULL_DISK}' && ls -A /mnt/.out.resume",
                           cwd=Path(__file__).resolve().parents[1])
    assert run.stdout == ("/mnt/.out.resume/step-00000003.pt: no space left on device while writing it; free space "
                          "there (or set output_dir to a larger disk) and re-run\n"), run.stderr  # and no temp file
