"""What training, the hidden-state cache and the eval cost in GPU time, from arithmetic: the FLOPs
of each part (the matrix products of the weights each token goes through, and the attention
scores of the full-attention layers) at a node kind's dense bf16 rate and an assumed utilisation.
``dflash plan`` prints these as "assumed"; a step rate the pilot measured replaces them on the
node kind it ran on (``dflash.plan.stage``).

Torch-free: the plan runs before anything is installed for a GPU, from the target's config.json.
Left out, as too small to move a forecast: norms, activations, rotary embeddings, the
linear-attention layers' state updates (a few million FLOPs a token against billions), the
optimizer step, and the hidden-state cache's reads (prefetched beside the step).
"""
from __future__ import annotations

from dflash.core.shapes import drafter_sizes

# Forward and backward of a trained weight: 2 FLOPs per parameter and token forward, 4 backward
# (the input's gradient and the weight's).
TRAINED = 6


def _head_dim(text: dict) -> int:
    return text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]


def _gated(text: dict) -> bool:
    """Whether the full-attention layers' q_proj also makes an output gate (Qwen3.5/3.6, Qwen3-Next)."""
    return text.get("attn_output_gate", str(text.get("model_type", "")).startswith(("qwen3_5", "qwen3_next")))


def layer_types(text: dict) -> list[str]:
    return text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"]


def target_matmul_params(text: dict) -> int:
    """The target's weights a token is multiplied by (the lm_head included, the embedding, a
    lookup, not): 2 FLOPs each per token of a forward. Dense Qwen3 and Qwen3.5/3.6 text configs."""
    if text.get("num_experts"):
        raise ValueError("a mixture-of-experts target: the plan's FLOPs count covers dense targets only")
    H, heads, kv, hd = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"], _head_dim(text)
    full = H * heads * hd * (2 if _gated(text) else 1) + 2 * H * kv * hd + heads * hd * H
    total = text["vocab_size"] * H + 3 * H * text["intermediate_size"] * text["num_hidden_layers"]
    for kind in layer_types(text):
        if kind == "linear_attention":
            qk = text["linear_num_key_heads"] * text["linear_key_head_dim"]
            v_heads = text["linear_num_value_heads"]
            v = v_heads * text["linear_value_head_dim"]
            total += H * (2 * qk + v) + H * v + 2 * H * v_heads + v * H + (2 * qk + v) * text["linear_conv_kernel_dim"]
        else:
            total += full
    return total


def target_forward_flops(text: dict, row_tokens: int) -> float:
    """One forward of the target over a row of ``row_tokens`` tokens: the weights, and the causal
    attention scores (QK and AV, half the T x T square) of its full-attention layers."""
    full_layers = sum(kind != "linear_attention" for kind in layer_types(text))
    scores = 2 * text["num_attention_heads"] * _head_dim(text) * row_tokens ** 2 * full_layers
    return 2 * target_matmul_params(text) * row_tokens + scores


def step_flops(config: dict, text: dict, row_tokens: float, supervised: float) -> dict:
    """FLOPs of one training step on one GPU: its ``train.batch_size`` rows of ``row_tokens``
    tokens, ``supervised`` of them the answer's (a block anchors on each but the last, up to
    ``train.num_anchors``), by part. ``target``: the frozen target's forward that makes the features
    (``train.hidden_states: online``; 0 with a cache); ``drafter``: the draft layers and the fc
    that reads the features, forward and backward, with their attention scores (each block's
    queries over the context before its anchor, half a row on average, and the block itself);
    ``lm_head``: the frozen head over the supervised positions, forward, recomputed and backward
    to its input (train.loss_chunk_tokens)."""
    drafter, train = config["drafter"], config["train"]
    sizes = drafter_sizes(drafter, text)
    H, V, B = text["hidden_size"], text["vocab_size"], drafter["block_size"]
    rows, anchors = train["batch_size"], min(train["num_anchors"], max(0.0, supervised - 1))
    features = len(drafter["target_layer_ids"] or []) or drafter["num_layers"]
    q_dim, kv_dim = sizes["num_heads"] * sizes["head_dim"], sizes["num_kv_heads"] * sizes["head_dim"]
    per_query = 2 * H * q_dim + 2 * H * kv_dim + 3 * H * sizes["intermediate_size"]  # q, o; its own k, v; mlp
    per_context = 2 * H * kv_dim  # the context's k and v in each layer
    queries, context = rows * anchors * B, rows * row_tokens
    layers = drafter["num_layers"]
    scores = 2 * 2 * q_dim * (row_tokens / 2 + B) * queries * layers
    parts = {
        "target": rows * target_forward_flops(text, round(row_tokens)) if train["hidden_states"] == "online" else 0.0,
        "drafter": TRAINED * (queries * per_query * layers + context * (per_context * layers + features * H * H))
        + 3 * scores,
        "lm_head": TRAINED * rows * anchors * (B - 1) * H * V,
    }
    return {**parts, "total": sum(parts.values())}


def seconds(flops: float, tflops: float, utilisation: float) -> float:
    """Seconds for ``flops`` on one GPU of ``tflops`` dense bf16 TFLOPS at ``utilisation``."""
    return flops / (tflops * 1e12 * utilisation)


def drafter_trained_params(config: dict, text: dict) -> int:
    """The drafter's trained weights: its layers (attention and MLP) and the fc that reads the
    target's features (norms left out; the embedding and lm_head are the target's, frozen)."""
    drafter = config["drafter"]
    sizes = drafter_sizes(drafter, text)
    H = text["hidden_size"]
    q_dim, kv_dim = sizes["num_heads"] * sizes["head_dim"], sizes["num_kv_heads"] * sizes["head_dim"]
    layer = 2 * H * q_dim + 2 * H * kv_dim + 3 * H * sizes["intermediate_size"]
    features = len(drafter["target_layer_ids"] or []) or drafter["num_layers"]
    return drafter["num_layers"] * layer + features * H * H


def allreduce_seconds(gradient_bytes: float, gpus: int, nodes: int, interconnect_gb_s: float | None,
                      network_gb_s: float | None, parallel: str = "ddp") -> tuple[float, list[str]]:
    """Seconds a step spends averaging ``gradient_bytes`` of gradients over ``gpus`` GPUs on each
    of ``nodes`` nodes, and the link figures that were missing (their share left out): a ring
    within each node over its interconnect, then across the nodes over each node's network
    (2 (n-1)/n of the bytes cross each ring), at link speed and not overlapped with the backward
    (DDP overlaps part of it). FSDP moves 1.5 times as much (the weights gathered for the forward
    and again for the backward, the gradients reduce-scattered)."""
    factor, seconds_, missing = 1.5 if parallel == "fsdp" else 1.0, 0.0, []
    for n, rate, name in ((gpus, interconnect_gb_s, "interconnect_gb_s"), (nodes, network_gb_s, "network_gb_s")):
        if n > 1 and rate is None:
            missing.append(name)
        elif n > 1:
            seconds_ += factor * 2 * (n - 1) / n * gradient_bytes / (rate * 1e9)
    return seconds_, missing
