"""Training steps of speculators 0.9.0's DFlash drafter (DFlashDraftModel) on CPU, as a bench worker.

Runs inside the speculators venv (`make speculators-venv`), started by train_vs_speculators.py,
which talks to it through `serve` (stdin: steps to time; stdout: one JSON line each):
.venv-speculators/bin/python bench/speculators_dflash_step.py [--rows 8] [--anchors-per-row 16]
    [--threads 1] [--dtype float32|bfloat16] [--attn sdpa|eager]

Mirrors one iteration of speculators.train.trainer.Trainer.train_epoch:
  (autocast if bfloat16) -> model(**packed_batch, **train_call_kwargs) -> (None, loss, metrics)
  -> zero_grad -> loss.backward() -> clip_grad_norm_(params, 1.0) -> AdamW.step()
(the LR scheduler step is omitted). The batch is built as speculators' CollateFn builds it: the
step's rows packed into one [1, total_seq_len] sequence with document_ids / per-row position_ids,
total_seq_len = rows x 300 (its `--total-seq-len`), max_anchors = rows x anchors per row (its
`--max-anchors`, a budget per packed batch). Its own best CPU path, as its docs give it:
`--draft-attn-impl sdpa` (its examples for hardware without flex attention; flex has no CPU
backward, and its mask compile fails on CPU), fp32 (on this CPU bf16 autocast ran at half the
speed: 1.24 vs 2.41 steps/s packed; `--dtype` measures it), loss_implementation "eager" (its
"fused" losses are Triton kernels). On CPU its forward is not torch.compiled
(conditional_torch_compile compiles only when CUDA is present), as in its own trainer.
Tiny model: hidden 128, 2 draft layers, 4 heads, 2 kv heads, head_dim 32, intermediate 384,
vocab 4096, block 8, 2 captured target layers. No weights are downloaded; the frozen embedding /
lm_head / verifier_lm_head (normally copied from the verifier) are random.
"""
import argparse
import warnings

import torch

warnings.filterwarnings("ignore")

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from train_vs_speculators import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    LAYERS,
    N_TARGET_LAYERS,
    PROMPT,
    ROW_LEN,
    VOCAB,
    serve,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config

ap = argparse.ArgumentParser()
ap.add_argument("--rows", type=int, default=8, help="rows packed into one step")
ap.add_argument("--anchors-per-row", type=int, default=16)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
a = ap.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)

MASK_ID = VOCAB - 1
GAMMA = 7.0  # speculators' CLI default is 4.0; 7.0 matches /work/main's loss_decay_gamma

tl_config = Qwen3Config(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
tl_config._attn_implementation = a.attn  # what --draft-attn-impl sets
config = DFlashSpeculatorConfig(
    transformer_layer_config=tl_config,
    draft_vocab_size=VOCAB,  # == verifier vocab: no t2d/d2t mapping
    block_size=BLOCK,
    aux_hidden_state_layer_ids=list(range(N_TARGET_LAYERS)),
    mask_token_id=MASK_ID,
    sample_from_anchor=False,  # DFlash: anchor slot is the given token, slots 1..B-1 predict
    speculators_config=SpeculatorsConfig(
        algorithm="dflash",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
    ),
)
model = DFlashDraftModel(config)
# Stand-ins for load_verifier_weights(): frozen embedding, lm_head == verifier lm_head.
with torch.no_grad():
    model.embed_tokens.weight.normal_(0, 0.02)
    model.verifier_lm_head.weight.normal_(0, 0.02)
    model.lm_head.weight.copy_(model.verifier_lm_head.weight)
model.train()

# Packed batch exactly as speculators.train.data.CollateFn produces it (max_len = total tokens).
T = a.rows * ROW_LEN
loss_mask = torch.ones(a.rows, ROW_LEN, dtype=torch.long)
loss_mask[:, :PROMPT] = 0
hs_dtype = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
batch = {
    "input_ids": torch.randint(0, VOCAB - 1, (1, T)),
    "loss_mask": loss_mask.reshape(1, T),
    "hidden_states": torch.randn(1, T, N_TARGET_LAYERS * HIDDEN, dtype=hs_dtype),
    "verifier_last_hidden_states": torch.randn(1, T, HIDDEN, dtype=hs_dtype),
    "position_ids": torch.arange(ROW_LEN).repeat(a.rows).unsqueeze(0),
    "document_ids": torch.arange(a.rows).repeat_interleave(ROW_LEN).unsqueeze(0),
}
# What DFlashDraftModel.get_trainer_kwargs returns, with the reference-style loss:
# hard CE against the verifier's argmax, fixed exp decay (not the CLI default "dpace").
train_call_kwargs = {
    "loss_config": resolve_loss_config("ce", "eager"),
    "gamma": GAMMA,
    "max_anchors": a.anchors_per_row * a.rows,
    "per_position_loss_weight": "fixed-exp-decay",
    "dpace_alpha": 0.5,
}
opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3, weight_decay=0.01)  # build_optimizers("adamw")


def step() -> int:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bfloat16"):
        _, loss, metrics = model(**batch, **train_call_kwargs)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return int(metrics["full_acc_total"])  # supervised block positions this step


n_anchors = a.anchors_per_row * a.rows
serve(step, {"what": (
    f"speculators 0.9.0: {a.rows} row(s) x {ROW_LEN} tokens packed into one [1, {T}] sequence "
    f"(--total-seq-len {T} --max-anchors {n_anchors}), {a.attn} attention over one dense "
    f"[{n_anchors * BLOCK}, {T + n_anchors * BLOCK}] mask, {a.dtype}, eager CE vs argmax of the verifier head")})
