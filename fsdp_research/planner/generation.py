"""The moments of a step's generation where memory can peak (an objective that generates: GRPO's rollouts,
fsdp_research.objectives.rollouts), beside the training step's: a micro-batch's prompts' forward (their KV cache,
one block's tensors in flight) and its last token's (the KV cache of prompt and completion, the sampling's
temporaries over the vocabulary). Held meanwhile: the sharded parameters and the optimizer's state (no gradients:
the step before set them to None), and the parameters gathered: as in a forward for the prompts' forward (the root,
the units kept after forward, the unit in flight and two all-gather buffers: FSDP2 frees the one before when the
next one's is done), the whole model's from the first token on with gather_for_generation.

KV cache (compute dtype e): keys and values of every block, 2 * kv_dim a position, for the micro-batch's prompt
positions (data.seq_len at most) and completion tokens. A block's forward over the prompts holds e*(2h + 4i) a token
besides (its input and normed input; the MLP's gate, up, activation and product: a bound). Sampling a token
(objectives.rollouts.sample_next): the last position's logits (e*V), their temperature-scaled fp32 copy, and the
Gumbel noise's hash and its doubles (int64 and float64 [n, V] at once: SAMPLING_BYTES a logit)."""

from fsdp_research.config.schema import Strategy
from fsdp_research.planner.activations import FP32
from fsdp_research.planner.run import Run
from fsdp_research.planner.summary import ModelSummary

# Bytes per logit the sampling of a token holds at its peak besides the logits themselves: the fp32 scaled copy and
# three int64/float64 tensors of the noise (hashing the keys over the vocabulary; its uniform draw and logs).
SAMPLING_BYTES = FP32 + 3 * 8


def _gathered(m: ModelSummary, e: int, whole: bool) -> int:
    """The parameters gathered in a forward (FSDP2's): the root's, the units kept after forward, the largest unit
    and two all-gather buffers of it; or (whole) every unit's."""
    units = list(m.units)
    unit = max((u.numel for u in units), default=0)
    if whole:
        return e * (m.root.numel + sum(u.numel for u in units) + 2 * unit)
    kept = sum(u.numel if k == 1 else u.shard_numel(k) for u in units if (k := u.kept_after_forward()))
    return e * (m.root.numel + kept + 3 * unit)


def generation_moments(m: ModelSummary, run: Run, state: dict[str, int]) -> list[tuple[str, dict[str, int]]]:
    """Where a micro-batch's generation can peak, each as bytes by category (as planner.memory's moments); `state`:
    what a rank holds between steps (its parameters, the optimizer's state)."""
    g = run.generation
    if g is None:
        return []
    e, n = run.compute_bytes, run.micro_batch
    prompt = run.seq_len - g.tokens
    if m.strategy is Strategy.ddp_classic:  # no autocast while generating: the fp32 replicas compute
        e, forward, whole = FP32, 0, 0
    else:
        forward, whole = _gathered(m, e, False), _gathered(m, e, g.gathered)
    per_position = 2 * m.n_blocks * m.kv_dim * e * n
    idle = dict(state, grads=0)
    return [
        (
            "generation: the prompts' forward",
            dict(
                idle,
                gathered=forward,
                kv_cache=per_position * prompt,
                activations=e * (2 * m.hidden + 4 * m.intermediate) * n * prompt,
            ),
        ),
        (
            "generation: the last token",
            dict(
                idle,
                gathered=whole,
                kv_cache=per_position * run.seq_len,
                temporaries=n * m.vocab * (e + SAMPLING_BYTES),
            ),
        ),
    ]
