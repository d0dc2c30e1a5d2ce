"""Draft model: config, attention visibility, checkpoints, and parity with the reference wheel."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from dflash.core.shapes import build_target_layer_ids
from dflash.train.drafter import DFlashDraftModel, draft_attention_mask, load_drafter, make_draft_config
from dflash.core.io import OUTPUT_MARK
from tests.helpers import save_drafter


H = 64
REFERENCE_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}.weight" for i in range(2) for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
        "self_attn.k_norm", "input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj")}


def target_config() -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=256, hidden_size=H, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=["linear_attention"] * 3 + ["full_attention"],
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                            "mrope_section": [1, 1, 0], "mrope_interleaved": True})


def draft(layer_types=None, sliding_window=2048, block_size=4, seed=0) -> DFlashDraftModel:
    config = make_draft_config(target_config(), num_layers=2, intermediate_size=96, num_heads=4, num_kv_heads=2,
                               head_dim=16, block_size=block_size, mask_token_id=7, target_layer_ids=[1, 3],
                               layer_types=layer_types, sliding_window=sliding_window)
    torch.manual_seed(seed)
    return DFlashDraftModel(config).eval()


def inputs(S=10, L=4, seed=1):
    """One block right after S context positions, as in decoding."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(S + L)[None]
    return torch.randn(1, L, H, generator=g), pos[:, S:], torch.randn(1, S, 2, H, generator=g), pos[:, :S]


def test_build_target_layer_ids():
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(36, 1) == [18]
    assert build_target_layer_ids(8, 2) == [1, 5]
    with pytest.raises(ValueError, match="set target_layer_ids explicitly"):
        build_target_layer_ids(4, 2)


def test_make_draft_config():
    config = draft(layer_types=["sliding_attention", "full_attention"], sliding_window=16).config
    assert config.architectures == ["DFlashDraftModel"] and config.model_type == "qwen3"
    assert (config.hidden_size, config.vocab_size, config.rms_norm_eps) == (H, 256, 1e-5)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e7}  # the draft rotates whole heads
    assert config.block_size == 4 and config.num_target_layers == 4
    assert config.dflash_config == {"mask_token_id": 7, "target_layer_ids": [1, 3]}
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.sliding_window == 16
    assert draft().config.layer_types == ["full_attention"] * 2
    with pytest.raises(ValueError, match="layer_types"):
        draft(layer_types=["full_attention"])


def test_forward_shapes_and_frozen_parts_excluded():
    model = draft()
    block, block_pos, ctx, ctx_pos = inputs()
    assert model(block, block_pos, ctx, ctx_pos).shape == (1, 4, H)
    assert model(block, block_pos, ctx.flatten(2), ctx_pos).shape == (1, 4, H)  # layers pre-concatenated
    assert set(model.state_dict()) == REFERENCE_KEYS


def test_mask_semantics():
    # two blocks of 3 with anchors 2 and 4, over context positions 0..5
    block_pos = torch.tensor([[2, 3, 4, 4, 5, 6]])
    ctx_pos = torch.arange(6)[None]
    full = draft_attention_mask(block_pos, ctx_pos, 3, causal=False)[0, 0].int()
    assert full.tolist() == [
        [1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1],
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1],
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1],
    ]
    causal = draft_attention_mask(block_pos, ctx_pos, 3, causal=True, sliding_window=3)[0, 0].int()
    assert causal.tolist() == [
        [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
    ]
    valid = torch.tensor([[True, False, True, True, True, True]])
    assert draft_attention_mask(block_pos, ctx_pos, 3, causal=False, context_valid=valid)[0, 0, :, 1].sum() == 0


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
def test_block_sees_only_context_before_its_anchor(layer_types):
    """Many blocks in one forward (the training layout) behave like separate decoding calls."""
    model = draft(layer_types)
    g = torch.Generator().manual_seed(0)
    S, anchors = 12, [3, 7, 11]
    ctx = torch.randn(1, S, 2, H, generator=g)
    blocks = torch.randn(1, 4 * len(anchors), H, generator=g)
    block_pos = torch.cat([torch.arange(a, a + 4) for a in anchors])[None]
    ctx_pos = torch.arange(S)[None]
    with torch.no_grad():
        out = model(blocks, block_pos, ctx, ctx_pos)
        for i, a in enumerate(anchors):
            alone = model(blocks[:, 4 * i:4 * i + 4], block_pos[:, 4 * i:4 * i + 4], ctx[:, :a], ctx_pos[:, :a])
            torch.testing.assert_close(out[:, 4 * i:4 * i + 4], alone, atol=1e-5, rtol=1e-5)

        changed = ctx.clone()
        changed[:, 7] += 5.0  # position 7: the anchor of the second block, so only the third sees it
        out2 = model(blocks, block_pos, changed, ctx_pos)
    assert torch.equal(out2[:, :8], out[:, :8])
    assert not torch.allclose(out2[:, 8:], out[:, 8:])


def test_block_attention_full_vs_causal():
    block, block_pos, ctx, ctx_pos = inputs()
    changed = block.clone()
    changed[:, -1] += 1.0
    with torch.no_grad():
        for layer_types, first_unchanged in ((None, False), (["sliding_attention"] * 2, True)):
            model = draft(layer_types)
            a, b = model(block, block_pos, ctx, ctx_pos), model(changed, block_pos, ctx, ctx_pos)
            assert torch.equal(a[:, :-1], b[:, :-1]) == first_unchanged


def test_sliding_window_hides_old_context():
    model = draft(["sliding_attention"] * 2, sliding_window=4)
    block, block_pos, ctx, ctx_pos = inputs(S=10)
    changed = ctx.clone()
    changed[:, :7] += 3.0  # every block query is at position >= 10, so positions <= 6 are out of the window
    with torch.no_grad():
        assert torch.equal(model(block, block_pos, ctx, ctx_pos), model(block, block_pos, changed, ctx_pos))
        changed[:, 7] += 3.0
        assert not torch.allclose(model(block, block_pos, ctx, ctx_pos), model(block, block_pos, changed, ctx_pos))


def test_checkpoint_round_trip(tmp_path):
    model = draft(["sliding_attention", "full_attention"], sliding_window=8)
    save_drafter(model, model.config, tmp_path / "ckpt")
    save_drafter(model, model.config, tmp_path / "ckpt")  # overwriting a finished checkpoint works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [OUTPUT_MARK, "config.json", "model.safetensors"]
    loaded, config = load_drafter(tmp_path / "ckpt")
    assert config.to_dict() == model.config.to_dict()
    x = inputs()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(*x), model(*x))


# --- parity with the reference implementation (PyPI dflash==0.1.0) --------------------------

REFERENCE_MODEL_PY = Path(os.environ.get("DFLASH_REFERENCE_MODEL_PY", Path(__file__).resolve().parents[1]
                                          / ".cache/dflash-reference/dflash/model.py"))


@pytest.fixture(scope="module")
def reference():
    """The wheel's ``dflash/model.py``, loaded by path: its package name is ours too. ``make test``
    downloads and unpacks it into ``.cache/dflash-reference``."""
    if not REFERENCE_MODEL_PY.exists():
        pytest.skip(f"reference model.py not found at {REFERENCE_MODEL_PY} (set DFLASH_REFERENCE_MODEL_PY)")
    spec = importlib.util.spec_from_file_location("dflash_reference_model", REFERENCE_MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure means "cannot compare here"
        pytest.skip(f"reference model.py does not import: {e!r}")
    return module


def logit_diff(ours: torch.Tensor, theirs: torch.Tensor, record_property) -> float:
    """Max abs difference of the draft logits (both hidden outputs through one random lm_head of
    the target's shape), reported in the test output and the JUnit properties.

    Tolerance 1e-4: both run the same fp32 math in another order (one attention over context and
    block versus a concatenation, other reductions), which moves results by a few ulps of values
    around 1 (~1e-6); a wrong mask, position or norm moves logits by 1e-2 and more."""
    head = torch.randn(256, H, generator=torch.Generator().manual_seed(5)) * H ** -0.5
    diff = (ours @ head.T - theirs @ head.T).abs().max().item()
    print(f"max abs diff of draft logits, ours vs reference DFlashDraftModel: {diff:.2e}")
    record_property("max_abs_logit_diff", diff)
    return diff


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
def test_reference_loads_checkpoint_with_identical_outputs(reference, tmp_path, layer_types, record_property):
    model = draft(layer_types, sliding_window=6)
    save_drafter(model, model.config, tmp_path / "ckpt")
    ref, info = reference.DFlashDraftModel.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert ref.target_layer_ids == [1, 3] and ref.block_size == 4 and ref.mask_token_id == 7
    assert reference.build_target_layer_ids(64, 5) == build_target_layer_ids(64, 5)

    block, block_pos, ctx, ctx_pos = inputs(S=10)
    with torch.no_grad():
        ours = model(block, block_pos, ctx, ctx_pos)
        theirs = ref.eval()(position_ids=torch.cat([ctx_pos, block_pos], 1), noise_embedding=block,
                            target_hidden=ctx.flatten(2))
    assert logit_diff(ours, theirs, record_property) < 1e-4


def test_reference_agrees_on_training_layout(reference, tmp_path, record_property):
    """Several blocks per row with our mask passed to the reference, as SpecForge trains it."""
    model = draft()
    save_drafter(model, model.config, tmp_path / "ckpt")
    ref = reference.DFlashDraftModel.from_pretrained(tmp_path / "ckpt").eval()
    g = torch.Generator().manual_seed(0)
    ctx, blocks = torch.randn(1, 12, 2, H, generator=g), torch.randn(1, 8, H, generator=g)
    block_pos = torch.tensor([[3, 4, 5, 6, 8, 9, 10, 11]])
    ctx_pos = torch.arange(12)[None]
    mask = draft_attention_mask(block_pos, ctx_pos, 4, causal=False)
    with torch.no_grad():
        ours = model(blocks, block_pos, ctx, ctx_pos)
        theirs = ref(position_ids=torch.cat([ctx_pos, block_pos], 1), attention_mask=mask, noise_embedding=blocks,
                     target_hidden=ctx.flatten(2))
    assert logit_diff(ours, theirs, record_property) < 1e-4
