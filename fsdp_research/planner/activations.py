"""Activations a block saves for backward, per token, by the planner's count (bytes; e = compute bytes, h = hidden,
i = intermediate, a = heads, V = vocab), and the recompute activation checkpointing costs.

Activations saved per token by a llama block (HF's LlamaDecoderLayer with SDPA; enumerated from the tensors
autograd saves):
    2 RMSNorms x (4h [fp32 copy of the input; the input itself when e=4] + e*h [normalized] + e*h [scaled output]
                  + 4 [rsqrt])
  + attention: e*(2h + 2*kv_dim) [rotated q and k, v, output] + 4a [logsumexp]
  + SwiGLU MLP: 4*e*i [gate, silu(gate), up, their product]
Eager attention adds (4 + e)*a*s per token (the softmax in fp32 and its cast), which SDPA never materializes. This
is Korthikanti et al.'s s*b*h*(34 + 5*a*s/h) at 16 bits, redone for llama: a gated MLP of width i instead of 4h,
RMSNorm upcasts instead of dropout masks, no attention matrix; other architectures get Korthikanti's 34*h*e/2.
Above the blocks: the final norm and the fp32 log-probabilities of the loss (4V). A checkpointed block keeps only
its input (e*h) and recomputes the rest in backward, one block at a time: about +33% of that block's compute (a
forward is a third of forward + backward), so checkpointing every k-th block costs about +33%/k. A selectively
checkpointed block keeps its input, the outputs of the matmuls it keeps (q, v, gate, down of q, k, v, o, gate, up,
down at mm_save_every=2) and attention's output and logsumexp; it recomputes the other matmuls (their share of the
block's matmul FLOPs) and the cheap rest. loss.chunks=n: the logits and their fp32 copies exist 1/n at a time.

Tensor parallel (t ranks): the summary's heads, kv_dim, q_dim and intermediate are one rank's, so attention and the
MLP save 1/t; the norms and the residual stream stay whole. With sequence parallel each norm saves 1/t of its own
tensors, and the matmuls after it save their gathered input (e*h) instead of the norm's output; a checkpointed
block keeps its sequence shard of the input. Other families: Korthikanti's (10 + 24/t) x h*e/2, 34/t with sequence
parallel.
"""

from collections.abc import Sequence

from fsdp_research.planner.summary import ModelSummary

FP32 = 4

# Same block as HF's Llama: RMSNorm, rotary SDPA attention, SwiGLU MLP.
LLAMA_LIKE = ("llama", "mistral", "qwen2")


def norm_bytes(m: ModelSummary, e: int) -> int:
    """A norm's saved input (fp32), rsqrt, and its normalized output for its scale's gradient (none when frozen);
    its output, which the matmuls after it save as their input."""
    return FP32 * m.hidden + (1 if m.frozen_norms else 2) * e * m.hidden + FP32


def block_norm_bytes(m: ModelSummary, e: int) -> int:
    """A block's norm, under sequence parallel: its own tensors for a sequence shard, the matmuls' input gathered."""
    if not m.sequence_parallel:
        return norm_bytes(m, e)
    return (norm_bytes(m, e) - e * m.hidden) // m.tp + e * m.hidden


def residual_bytes(m: ModelSummary, e: int) -> int:
    """The residual stream per token: a checkpointed block's kept input, the gradient flowing down the blocks."""
    return e * m.hidden // (m.tp if m.sequence_parallel else 1)


def block_activation_bytes(m: ModelSummary, e: int, seq_len: int) -> int:
    """What one block saves for backward, per token."""
    scores = 0 if m.sdpa else (FP32 + e) * m.heads * seq_len
    if m.model_type not in LLAMA_LIKE:
        # (10 + 24/t) or 34/t with sequence parallel, divided by t last: 34 // 8 dropped 6% of a block.
        per_tp = 34 if m.sequence_parallel else 10 * m.tp + 24
        return per_tp * m.hidden * e // (2 * m.tp) + scores
    attention = e * (2 * m.q_width + 2 * m.kv_dim) + FP32 * m.heads
    return 2 * block_norm_bytes(m, e) + attention + 4 * e * m.intermediate + scores


def _matmul_widths(m: ModelSummary) -> list[int]:
    """The output widths of a llama block's matmuls in forward order: q, k, v, o, gate, up, down."""
    return [m.q_width, m.kv_dim, m.kv_dim, m.hidden, m.intermediate, m.intermediate, m.hidden]


def selective_bytes(m: ModelSummary, e: int, seq_len: int) -> int:
    """What a selectively checkpointed block saves per token: its input, the kept matmul outputs, attention's
    output and logsumexp (when an SDPA kernel is kept). Other families: half of a block's full activations."""
    if m.model_type not in LLAMA_LIKE:
        return residual_bytes(m, e) + block_activation_bytes(m, e, seq_len) // 2
    kept = sum(w for index, w in enumerate(_matmul_widths(m)) if m.selective_matmuls and index % m.selective_every == 0)
    attention = e * m.q_width + FP32 * m.heads if m.selective_attention else 0
    return residual_bytes(m, e) + e * kept + attention


def saved_activations(m: ModelSummary, e: int, seq_len: int, checkpointed: Sequence[bool]) -> list[int]:
    """Per token, what each block holds between its forward and its backward."""
    full = block_activation_bytes(m, e, seq_len)
    kept = selective_bytes(m, e, seq_len) if m.selective_every else residual_bytes(m, e)
    return [kept if ckpt else full for ckpt in checkpointed]


def selective_recompute(m: ModelSummary, seq_len: int) -> float:
    """The share of a selectively checkpointed llama block's forward FLOPs recomputed: the matmuls not kept
    (the rest it recomputes, norms and activations, costs no matmul), attention's when it is not kept. Assumes
    bias-free projections (a biased one, Qwen2's q/k/v, dispatches aten.addmm and shifts which are kept)."""
    widths = _matmul_widths(m)
    inputs = [m.hidden] * 3 + [m.q_width] + [m.hidden] * 2 + [m.intermediate]
    flops = [w * i for w, i in zip(widths, inputs)]
    redone = sum(f for index, f in enumerate(flops) if not m.selective_matmuls or index % m.selective_every)
    # Scores and weighted sum, per token: 2 matmuls of heads x head_dim over the sequence (causal: half of it).
    attention = 2 * m.q_width * seq_len
    return (redone + (0 if m.selective_attention else attention)) / (sum(flops) + attention)


def norm_backward_bytes(m: ModelSummary, e: int) -> int:
    """RMSNorm's backward runs in fp32: two fp32 temporaries of width h when computing in fp32, four and one in
    the compute dtype when it upcasts from 16 bits (on a sequence shard under sequence parallel)."""
    width = m.hidden // (m.tp if m.sequence_parallel else 1)
    return 2 * FP32 * width if e == FP32 else 4 * FP32 * width + e * width


def mlp_saved_bytes(m: ModelSummary, e: int) -> int:
    return 4 * e * m.intermediate if m.model_type in LLAMA_LIKE else 0


def logits_forward(m: ModelSummary, e: int) -> int:
    """At the loss: the logits in the compute dtype, their fp32 copy (the same tensor when e=4), the log-probs."""
    return m.vocab * (2 * FP32 + (e if e != FP32 else 0))


def recompute_share(checkpointed: Sequence[bool], redone: float = 1.0) -> float:
    """Extra compute of activation checkpointing: one more forward (1/3 of a step) per checkpointed block, of
    which `redone` (selective checkpointing recomputes a part: selective_recompute)."""
    return sum(checkpointed) / len(checkpointed) / 3 * redone if checkpointed else 0.0
