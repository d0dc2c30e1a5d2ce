"""Time training steps of speculators 0.9.0's DFlash drafter (DFlashDraftModel) on CPU.

Runs inside the speculators venv (`make speculators-venv`), started by train_vs_speculators.py:
.venv-speculators/bin/python bench/speculators_dflash_step.py [threads=1] [steps=20] [anchors_per_row=16]
    [dtype=float32|bfloat16] [attn=sdpa|eager|flex]

Mirrors one iteration of speculators.train.trainer.Trainer.train_epoch:
  (autocast if dtype=bfloat16) -> model(**packed_batch, **train_call_kwargs) -> (None, loss, metrics)
  -> zero_grad -> loss.backward() -> clip_grad_norm_(params, 1.0) -> AdamW.step()
(the LR scheduler step is omitted). The batch is built as speculators' CollateFn builds it:
all rows packed into one [1, total_seq_len] sequence with document_ids / per-row position_ids.
Tiny model: hidden 128, 2 draft layers, 4 heads, 2 kv heads, head_dim 32, intermediate 384,
vocab 4096, block 8, 2 captured target layers. Attention: sdpa (bool anchor-block mask from
speculators' create_anchor_block_mask_mod via torch's create_mask), since flex has no CPU backward. No weights are downloaded; the frozen
embedding / lm_head / verifier_lm_head (normally copied from the verifier) are random.
"""
import json
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")

from transformers.models.qwen3.modeling_qwen3 import Qwen3Config  # noqa: E402

from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.losses import resolve_loss_config  # noqa: E402
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
anchors_per_row = int(sys.argv[3]) if len(sys.argv) > 3 else 16
dtype_name = sys.argv[4] if len(sys.argv) > 4 else "float32"
attn = sys.argv[5] if len(sys.argv) > 5 else "sdpa"  # sdpa | eager | flex (flex: no CPU backward)
torch.set_num_threads(threads)
torch.manual_seed(0)

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER = 128, 2, 4, 2, 32, 384
VOCAB, BLOCK, N_TARGET_LAYERS = 4096, 8, 2
ROWS, ROW_LEN, PROMPT = 8, 300, 40
MASK_ID = VOCAB - 1
GAMMA = 7.0  # speculators' CLI default is 4.0; 7.0 matches /work/main's loss_decay_gamma

tl_config = Qwen3Config(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
# from_training_args' default is "simple_flex_attention" (speculators' flex_attention_forward).
tl_config._attn_implementation = {"flex": "simple_flex_attention", "sdpa": "sdpa", "eager": "eager"}[attn]
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
if attn == "flex":
    # speculators wraps create_block_mask in torch.compile; on CPU, torch 2.13's inductor emits C++
    # that fails to compile (VecMask<int>/VecMask<float> '?:' error), so build the BlockMask
    # uncompiled. Even then flex_attention raises "FlexAttention does not support backward on
    # CPU", so the training step needs attn=sdpa (default) or eager on CPU.
    from torch.nn.attention.flex_attention import create_block_mask
    model._create_mask_fn = create_block_mask
# Stand-ins for load_verifier_weights(): frozen embedding, lm_head == verifier lm_head.
with torch.no_grad():
    model.embed_tokens.weight.normal_(0, 0.02)
    model.verifier_lm_head.weight.normal_(0, 0.02)
    model.lm_head.weight.copy_(model.verifier_lm_head.weight)
model.train()

# Packed batch exactly as speculators.train.data.CollateFn produces it (max_len = total tokens).
T = ROWS * ROW_LEN
input_ids = torch.randint(0, VOCAB - 1, (1, T))
loss_mask = torch.ones(ROWS, ROW_LEN, dtype=torch.long)
loss_mask[:, :PROMPT] = 0
hs_dtype = torch.bfloat16 if dtype_name == "bfloat16" else torch.float32
batch = {
    "input_ids": input_ids,
    "loss_mask": loss_mask.reshape(1, T),
    "hidden_states": torch.randn(1, T, N_TARGET_LAYERS * HIDDEN, dtype=hs_dtype),
    "verifier_last_hidden_states": torch.randn(1, T, HIDDEN, dtype=hs_dtype),
    "position_ids": torch.arange(ROW_LEN).repeat(ROWS).unsqueeze(0),
    "document_ids": torch.arange(ROWS).repeat_interleave(ROW_LEN).unsqueeze(0),
}
# What DFlashDraftModel.get_trainer_kwargs returns, with the reference-style loss:
# hard CE against the verifier's argmax, fixed exp decay (not the CLI default "dpace").
train_call_kwargs = {
    "loss_config": resolve_loss_config("ce", "eager"),  # fused = Triton kernels, GPU only
    "gamma": GAMMA,
    "max_anchors": anchors_per_row * ROWS,  # speculators' budget is per packed batch
    "per_position_loss_weight": "fixed-exp-decay",
    "dpace_alpha": 0.5,
}
opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3, weight_decay=0.01)  # build_optimizers("adamw")


def step():
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype_name == "bfloat16" else torch.autocast("cpu", enabled=False)
    with ctx:
        _, loss, metrics = model(**batch, **train_call_kwargs)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item(), int(metrics["full_acc_total"])  # supervised block positions this step


for _ in range(5):
    step()
sup = 0
t0 = time.perf_counter()
for _ in range(steps):
    loss, n = step()
    sup += n
dt = time.perf_counter() - t0
print(json.dumps({
    "steps_per_s": round(steps / dt, 3),
    "tokens_per_s": round(sup / dt, 1),
    "tokens_per_s_counts": "supervised block positions (block slots 1..B-1 with loss_mask=1)",
    "input_tokens_per_s": round(steps * T / dt, 1),
    "threads": threads, "attn": attn, "steps": steps, "dtype": dtype_name, "final_loss": round(loss, 4),
    "supervised_per_step": round(sup / steps, 1),
    "what": (f"speculators 0.9.0 DFlashDraftModel.forward on {ROWS}x{ROW_LEN} tokens packed into 1 row; "
             f"{anchors_per_row * ROWS} anchors per step (max_anchors, sampled without replacement over the whole "
             f"packed batch, ~{anchors_per_row}/row) among loss_mask=1 positions except the last {BLOCK}; block={BLOCK} "
             f"(anchor token + {BLOCK - 1} mask tokens), {attn} attention; eager CE vs argmax of frozen "
             f"verifier_lm_head(verifier_norm(last hidden)) at block slots 1..{BLOCK - 1}, weight exp(-(k-1)/{GAMMA}), "
             f"divided by the count of supervised slots; backward, clip 1.0, AdamW"),
}))
