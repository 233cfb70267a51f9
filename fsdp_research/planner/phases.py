"""Activations and backward temporaries per micro-batch at the moments of a step where memory can peak (the end of
forward, the start of backward, the parts of each block's backward): what planner.memory adds to the FSDP and
optimizer terms at each moment. Saved activations per block: planner.activations."""

from collections.abc import Sequence
from dataclasses import dataclass

from fsdp_research.planner.activations import (
    FP32,
    block_activation_bytes,
    logits_forward,
    mlp_saved_bytes,
    norm_backward_bytes,
    norm_bytes,
    residual_bytes,
    saved_activations,
)
from fsdp_research.planner.run import Run
from fsdp_research.planner.summary import ModelSummary


@dataclass(frozen=True)
class Phases:
    """Activations and backward temporaries (bytes per micro-batch) where memory can peak."""

    saved: int  # every block's saved tensors
    forward_end: int  # at the loss: every block's saved tensors, the final norm's, the logits
    root_forward_end: int  # inside the root's forward, logits in the compute dtype only
    backward_start: int  # saved tensors with the fp32 log-probs...
    loss_grads: int  # ...and the fp32 loss gradients
    # Backward of block k: [(moment, activations, temporaries, the block's parameter gradients autograd holds:
    # up to this many elements, all of them (None), or none (0: FSDP took them for its reduce-scatter))].
    block: list[list[tuple[str, int, int, int | None]]]


def step_phases(m: ModelSummary, run: Run, checkpointed: Sequence[bool]) -> Phases:
    e, tok, h = run.compute_bytes, run.tokens, m.hidden
    saved = [a * tok for a in saved_activations(m, e, run.seq_len, checkpointed)]
    full_block = block_activation_bytes(m, e, run.seq_len) * tok
    norm = norm_bytes(m, e) * tok
    incoming = residual_bytes(m, e) * tok  # the gradient flowing down the residual stream

    def inside(k: int) -> list[tuple[str, int, int, int | None]]:
        # A block's own activations are all there as its backward starts (recomputed when checkpointed). The MLP
        # goes first: its peak holds the gradients of gate, up and their product, once the down projection's
        # backward has released its input. Then the norms and attention.
        mlp_peak = full_block - mlp_saved_bytes(m, e) * tok // 4  # the product: one of the MLP's four
        return [
            ("MLP", sum(saved[:k]) + mlp_peak, incoming + 3 * e * m.intermediate * tok, h * m.intermediate),
            (
                "attention",
                sum(saved[:k]) + full_block - mlp_saved_bytes(m, e) * tok,
                incoming + max(norm_backward_bytes(m, e), e * (2 * m.q_width + 2 * m.kv_dim)) * tok,
                None,
            ),
            ("reduction", sum(saved[:k]), incoming, 0),
        ]

    blocks = [inside(k) for k in range(m.n_blocks)]
    if not m.loss_here:  # a pipeline stage before the last: its output goes on, its gradient comes back
        return Phases(sum(saved), sum(saved), sum(saved), sum(saved), incoming, blocks)
    # loss.chunks: one slice's logits at a time, made again in backward, where its gradients join them; the
    # model's forward itself returns the hidden states.
    # The loss's positions: every one, or the objective's (GRPO: the completion's).
    c, logits = run.loss_chunks, run.logit_tokens
    chunked = c > 1
    # Chunks after the first: the head's gradient of the chunk beside the one accumulated so far (autograd adds
    # them), in the compute dtype; of a trained head only (the root's trained share: exact where the root is all
    # trained or all frozen, LoRA's modules_to_save aside).
    head_grads = 2 * e * m.vocab * h * m.root.trained().numel // max(m.root.numel, 1) if chunked else 0
    at_loss = logits_forward(m, e) if run.loss_held is None else m.vocab * (e + FP32 * run.loss_held)
    return Phases(
        saved=sum(saved),
        forward_end=sum(saved) + norm + at_loss * logits // c,
        root_forward_end=sum(saved) + norm + (0 if chunked else e * m.vocab * logits),
        backward_start=sum(saved) + norm + (0 if chunked else FP32 * m.vocab * logits),
        loss_grads=(logits_forward(m, e) + 2 * FP32 * m.vocab) * logits // c + head_grads
        if chunked
        else 2 * FP32 * m.vocab * logits,
        block=blocks,
    )
