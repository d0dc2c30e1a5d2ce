"""The DFlash draft model: a few Qwen3-style layers that draft a whole block in one pass.

How it works (z-lab DFlash, PyPI ``dflash==0.1.0``):

- The target's selected layer outputs ("context features", ``[S, k, H]``) are concatenated over
  the layers and fused once per forward: ``hidden_norm(fc(features))`` -> ``[S, H]``.
- The block ``[last accepted token, MASK x (B-1)]`` is embedded with the *target's* embedding.
- Every draft layer projects keys/values from both the fused context and the block tokens and
  attends from the block queries to ``[context | block]``. The context never enters the
  residual stream, only the attention keys/values.
- The output goes through the draft ``norm`` and then the *target's* ``lm_head``.

The target's embedding and lm_head are frozen and are not part of this module's state
(:class:`TargetIO` holds them), so a checkpoint holds draft weights only, under the same
state-dict keys and ``config.json`` layout as the reference, which loads it unchanged.

Visibility rule, built from position ids so that training (many blocks per row) and decoding
(one block after the whole prefix) share one code path: a block whose first token sits at
position ``a`` sees the context positions ``< a`` (strictly) and the tokens of its own block,
all of them in full-attention layers, the earlier ones only in sliding-attention layers, which
also drop context further back than ``sliding_window`` positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, Qwen3Config
from transformers.activations import ACT2FN
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash.core.io import atomic_path, read_json
from dflash.core.shapes import build_target_layer_ids
from dflash.core.tensors import load_safetensors, open_safetensors, save_safetensors

LAYER_TYPES = ("full_attention", "sliding_attention")
WEIGHTS_NAME = "model.safetensors"

# The draft is a plain Qwen3 attention stack that rotates the whole head dimension, so the
# target's partial / multimodal RoPE settings would not apply to it (nor load in the reference).
_TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

def make_draft_config(
    target_config: PretrainedConfig,
    *,
    num_layers: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None,
    layer_types: list[str] | None = None,
    sliding_window: int = 2048,
) -> Qwen3Config:
    """A ``Qwen3Config`` plus the DFlash fields, in the layout the reference reads.

    Hidden size, vocabulary, RoPE base and RMSNorm eps follow the target, because the draft
    reads the target's features and shares its embedding and lm_head.
    ``target_layer_ids=None`` uses :func:`build_target_layer_ids`; ``layer_types=None`` makes
    every layer full attention.
    """
    text = target_config.get_text_config()
    num_target_layers = text.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(num_target_layers, num_layers)
    target_layer_ids = [int(i) for i in target_layer_ids]
    if not target_layer_ids or not all(0 <= i < num_target_layers for i in target_layer_ids):
        raise ValueError(f"target_layer_ids {target_layer_ids} must be within the target's {num_target_layers} layers")
    if len(set(target_layer_ids)) != len(target_layer_ids):
        raise ValueError(f"target_layer_ids {target_layer_ids} has duplicates")
    layer_types = list(layer_types) if layer_types is not None else ["full_attention"] * num_layers
    if len(layer_types) != num_layers or not set(layer_types) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types must list {num_layers} entries out of {LAYER_TYPES}, got {layer_types}")
    if not 0 <= mask_token_id < text.vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the target vocabulary ({text.vocab_size})")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (one anchor + at least one drafted token), got {block_size}")

    rope = {k: v for k, v in (text.rope_parameters or {}).items() if k not in _TARGET_ONLY_ROPE_KEYS}
    rope.setdefault("rope_type", "default")
    return Qwen3Config(
        architectures=["DFlashDraftModel"],
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        rms_norm_eps=text.rms_norm_eps,
        max_position_embeddings=text.max_position_embeddings,
        rope_parameters=rope,
        # Qwen3Config drops sliding_window unless use_sliding_window is set.
        use_sliding_window="sliding_attention" in layer_types,
        sliding_window=sliding_window,
        layer_types=layer_types,
        tie_word_embeddings=False,
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": target_layer_ids},
    )


# ---------------------------------------------------------------------------------------------
# The target's frozen embedding and head
# ---------------------------------------------------------------------------------------------

@dataclass
class TargetIO:
    """The target's input embedding and lm_head ([V, H] each), frozen and shared with the draft."""

    embed_weight: torch.Tensor
    head_weight: torch.Tensor

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head_weight)

    def to(self, device: torch.device | str, dtype: torch.dtype) -> TargetIO:
        return TargetIO(self.embed_weight.to(device, dtype), self.head_weight.to(device, dtype))

    @classmethod
    def from_model(cls, model: nn.Module) -> TargetIO:
        return cls(model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach())

    @classmethod
    def from_pretrained(cls, target_dir: Path) -> TargetIO:
        """Read only the two tensors from the target's safetensors, not the whole model."""
        target_dir = Path(target_dir)
        index = target_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index)["weight_map"]
        else:
            with open_safetensors(target_dir / WEIGHTS_NAME) as f:
                weight_map = {key: WEIGHTS_NAME for key in f.keys()}

        def find(suffix: str) -> str | None:
            # Multi-token-prediction modules (mtp.*) are not the main model's input and output.
            keys = [k for k in weight_map if k.endswith(suffix) and not k.startswith("mtp.")]
            if len(keys) > 1:
                raise ValueError(f"{target_dir}: several tensors end with {suffix!r}: {keys}")
            return keys[0] if keys else None

        def read(key: str) -> torch.Tensor:
            with open_safetensors(target_dir / weight_map[key], [key], f"the file {index.name} maps it to") as f:
                return f.get_tensor(key)

        embed_key, head_key = find("embed_tokens.weight"), find("lm_head.weight")
        if embed_key is None:
            raise ValueError(f"{target_dir}: no embed_tokens.weight tensor found")
        embed = read(embed_key)
        # A tied head is stored only as the embedding.
        return cls(embed, read(head_key) if head_key is not None else embed)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like Qwen3RMSNorm, so bf16 runs match the reference.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def draft_attention_mask(
    block_position_ids: torch.Tensor,
    context_position_ids: torch.Tensor,
    block_size: int,
    *,
    causal: bool,
    sliding_window: int | None = None,
    context_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask [B, 1, L, S + L] (True = may attend) for queries laid out as consecutive
    blocks of ``block_size`` tokens (the last one may be shorter) over keys ``[context | blocks]``.

    A block sees the context positions before its first token and its own block (only the
    earlier tokens of it when ``causal``); ``sliding_window`` also hides keys that many positions
    back or more. ``context_valid`` [B, S] marks real (not padding) context entries.
    """
    L = block_position_ids.shape[1]
    block_of = torch.arange(L, device=block_position_ids.device) // block_size
    query_pos = block_position_ids[:, :, None]                              # [B, L, 1]
    anchor_pos = block_position_ids[:, block_of * block_size][:, :, None]   # [B, L, 1]

    ctx_pos = context_position_ids[:, None, :]                              # [B, 1, S]
    sees_ctx = ctx_pos < anchor_pos
    if context_valid is not None:
        sees_ctx = sees_ctx & context_valid[:, None, :]

    key_pos = block_position_ids[:, None, :]                                # [B, 1, L]
    sees_block = (block_of[:, None] == block_of[None, :]).expand(block_position_ids.shape[0], L, L)
    if causal:
        sees_block = sees_block & (key_pos <= query_pos)
    if sliding_window is not None:
        sees_ctx = sees_ctx & (query_pos - ctx_pos < sliding_window)
        sees_block = sees_block & (query_pos - key_pos < sliding_window)
    return torch.cat([sees_ctx, sees_block], dim=-1)[:, None]


class DraftAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_type: str):
        super().__init__()
        H, self.n_head, self.n_kv_head, self.head_dim = (
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        bias = config.attention_bias
        self.q_proj = nn.Linear(H, self.n_head * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv_head * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv_head * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, H, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.layer_type = layer_type

    def forward(self, x: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x [B, L, H] block tokens, context [B, S, H] fused features, cos/sin [B, S + L, D]."""
        S = context.shape[1]
        k, v = self.keys_values(torch.cat([context, x], dim=1), cos, sin)
        return self.attend(x, k, v, cos[:, S:], sin[:, S:], mask)

    def forward_cached(self, x: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
                       sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with the context's keys and values from :meth:`keys_values`, computed
        once per context position while decoding; cos/sin [B, L, D] of the block only."""
        k, v = self.keys_values(x, cos, sin)
        return self.attend(x, torch.cat([context_kv[0], k], dim=2), torch.cat([context_kv[1], v], dim=2), cos, sin,
                           mask)

    def keys_values(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [B, kv_heads, T, D] of h [B, T, H] at the positions of cos/sin."""
        B, T, _ = h.shape
        k = self.k_norm(self.k_proj(h).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """Queries from x [B, L, H] (rotated by cos/sin [B, L, D]) over keys/values [B, kv_heads, T, D];
        ``mask`` None: every query sees every key."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.n_head, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5, enable_gqa=True)
            return self.o_proj(y.transpose(1, 2).reshape(B, L, -1))
        # Repeat the kv heads by hand: SDPA's enable_gqa with a mask falls back to the math kernel.
        groups = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, -1))


class DraftMLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_type: str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config, layer_type)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def forward(self, x, context, cos, sin, mask):
        return self._around(x, lambda h: self.self_attn(h, context, cos, sin, mask))

    def forward_cached(self, x, context_kv, cos, sin, mask):
        return self._around(x, lambda h: self.self_attn.forward_cached(h, context_kv, cos, sin, mask))

    def _around(self, x, attention):
        x = x + attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        dflash = config.dflash_config
        self.target_layer_ids: list[int] = list(dflash["target_layer_ids"])
        self.mask_token_id: int = int(dflash["mask_token_id"])
        self.block_size: int = int(config.block_size)
        H = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, t) for t in config.layer_types)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)  # buffers only, not saved
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_position_ids: torch.Tensor,
        context_features: torch.Tensor,
        context_position_ids: torch.Tensor,
        context_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Draft hidden states after the final norm, [B, L, H].

        block_embeds [B, L, H]: target embeddings of consecutive blocks of ``block_size`` tokens
        ``[anchor, MASK, ...]``; block_position_ids [B, L] their absolute positions;
        context_features [B, S, k, H] (or [B, S, k*H], layers concatenated) the target features,
        context_position_ids [B, S] their positions; context_valid [B, S] is False on padding.
        """
        context = self.hidden_norm(self.fc(context_features.flatten(2)))
        position_ids = torch.cat([context_position_ids, block_position_ids], dim=1)
        cos, sin = self.rotary_emb(block_embeds, position_ids)
        masks = self._masks(block_position_ids, context_position_ids, context_valid)
        x = block_embeds
        for layer in self.layers:
            x = layer(x, context, cos, sin, masks[layer.self_attn.layer_type])
        return self.norm(x)

    def context_keys_values(self, context_features: torch.Tensor,
                            context_position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values [B, kv_heads, S, D] of the context: what :meth:`forward`
        derives from ``context_features`` anew each call, position by position, so that decoding
        can compute each position once and append (:meth:`forward_cached`)."""
        context = self.hidden_norm(self.fc(context_features.flatten(2)))
        cos, sin = self.rotary_emb(context, context_position_ids)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def forward_cached(self, block_embeds: torch.Tensor, block_position_ids: torch.Tensor,
                       context_kv: list[tuple[torch.Tensor, torch.Tensor]],
                       context_position_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for decoding one block, with ``context_kv`` from :meth:`context_keys_values`
        (positions ``context_position_ids`` [B, S], all before the block, as in decoding) instead of
        the features."""
        if block_embeds.shape[1] > self.block_size:
            raise ValueError(f"forward_cached decodes one block of at most {self.block_size} tokens, "
                             f"got {block_embeds.shape[1]}")
        cos, sin = self.rotary_emb(block_embeds, block_position_ids)
        # One block after its whole context: full attention sees every key, no mask to build.
        masks = self._masks(block_position_ids, context_position_ids, None) \
            if "sliding_attention" in self.config.layer_types else {}
        masks["full_attention"] = None
        x = block_embeds
        for layer, kv in zip(self.layers, context_kv):
            x = layer.forward_cached(x, kv, cos, sin, masks[layer.self_attn.layer_type])
        return self.norm(x)

    def _masks(self, block_position_ids: torch.Tensor, context_position_ids: torch.Tensor,
               context_valid: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return {
            layer_type: draft_attention_mask(
                block_position_ids, context_position_ids, self.block_size,
                causal=layer_type == "sliding_attention",
                sliding_window=self.config.sliding_window if layer_type == "sliding_attention" else None,
                context_valid=context_valid)
            for layer_type in set(self.config.layer_types)
        }


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------

def write_drafter(model: DFlashDraftModel, config: Qwen3Config, directory: Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` into an existing directory."""
    write_drafter_state(model.state_dict(), config, directory)


def write_drafter_state(state: dict, config: Qwen3Config, directory: Path) -> None:
    """``write_drafter`` from a state dict (what a wrapped or sharded model yields, gathered)."""
    state = {k.removeprefix("module."): v.detach().cpu().contiguous() for k, v in state.items()}
    config.dtype = next(iter(state.values())).dtype
    config.save_pretrained(directory)
    with atomic_path(Path(directory) / WEIGHTS_NAME) as tmp:  # for its mode: save_file's own is 0600
        save_safetensors(state, tmp, {"format": "pt"})


def load_drafter(directory: Path) -> tuple[DFlashDraftModel, Qwen3Config]:
    """Rebuild a drafter on the CPU, in the dtype it was saved in."""
    config_file, weights = Path(directory) / "config.json", Path(directory) / WEIGHTS_NAME
    settings = read_json(config_file)
    if "dflash_config" not in settings:
        raise ValueError(f"{config_file}: no dflash_config: not the config of a DFlash drafter checkpoint")
    config = Qwen3Config.from_dict(settings)
    state = load_safetensors(weights, ["fc.weight"], "the weights of a DFlash drafter")
    if bad := nonfinite_tensors(state):
        raise ValueError(f"{weights}: the weights {bad} are not finite (NaN or infinite: a training that diverged, "
                         f"or a damaged file): train the drafter again (with a lower train.lr)")
    model = DFlashDraftModel(config).to(state["fc.weight"].dtype)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:  # torch lists the keys and shapes over several lines
        detail = "; ".join(line.strip() for line in str(e).splitlines()[1:] if line.strip())
        raise ValueError(f"{weights}: weights that do not fit {config_file} ({detail}): the two files are from "
                         f"different checkpoints; copy the checkpoint folder again, whole") from None
    return model, config


def nonfinite_tensors(state: dict[str, torch.Tensor], shown: int = 3) -> str:
    """Which floating-point tensors of a state dict hold a NaN or an infinity ("" when none): a
    diverged drafter's, which would decode nothing but pass for one that drafts badly."""
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    return ", ".join(bad[:shown]) + (f" and {len(bad) - shown} more" if len(bad) > shown else "")
