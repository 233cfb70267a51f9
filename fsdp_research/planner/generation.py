"""The moments of a step's generation where memory can peak (an objective that generates: GRPO's rollouts,
fsdp_research.objectives.rollouts), beside the training step's: a micro-batch's prompts' forward (their KV cache,
one block's tensors in flight) and its last token's (the KV cache of prompt and completion, the sampling's
temporaries over the vocabulary). Held meanwhile: what a rank keeps between steps (its parameters, the optimizer's
state; no gradients, which the step before set to None, but torch DDP's buckets), and the parameters gathered: as in a
forward for the prompts' forward (the root, the units kept after forward, the unit in flight and two all-gather
buffers: FSDP2 frees the one before when the next one's is done), the whole model's from the first token on with
gather_for_generation; under ddp_classic, autocast's compute-dtype copies of the trained weights.

KV cache (compute dtype e): keys and values of every block, 2 * kv_dim a position, for the micro-batch's prompt
positions (data.seq_len at most) and completion tokens (a bound: the last token's never enters it). A block's
forward over the prompts holds e*(2h + 4i) a token besides (its input and normed input; the MLP's gate, up,
activation and product: a bound). Sampling a token (objectives.rollouts.sample_next): the last position's logits
(e*V) and SAMPLING_BYTES a logit besides (their temperature-scaled fp32 copy, top-p's, their float64 copy beside the
Gumbel noise's hash and doubles: int64 and float64 [n, V] tensors; measured: 44 bytes at top_p 1, 48 below)."""

from fsdp_research.config.schema import Strategy
from fsdp_research.planner.activations import FP32
from fsdp_research.planner.run import Run
from fsdp_research.planner.summary import ModelSummary

# Bytes per logit the sampling of a token holds at its peak besides the logits themselves (top_p < 1's).
SAMPLING_BYTES = 48


def _gathered(m: ModelSummary, e: int, kept: int, whole: bool) -> int:
    """The parameters gathered in a forward (FSDP2's): the root's, the units kept after forward (`kept` bytes), the
    largest unit and two all-gather buffers of it; or (whole) every unit's."""
    units = list(m.units)
    unit = e * max((u.numel for u in units), default=0)
    if whole:
        return e * (m.root.numel + sum(u.numel for u in units)) + 2 * unit
    return e * m.root.numel + kept + 3 * unit


def generation_moments(
    m: ModelSummary, run: Run, idle: dict[str, int], kept: int = 0
) -> list[tuple[str, dict[str, int]]]:
    """Where a micro-batch's generation can peak, each as bytes by category (as planner.memory's moments); `idle`:
    what a rank holds between steps; `kept`: the bytes of the units FSDP keeps gathered after forward."""
    g = run.generation
    if g is None:
        return []
    e, n = run.compute_bytes, run.micro_batch
    prompt = run.seq_len - g.tokens
    if m.strategy is Strategy.ddp_classic:
        forward = whole = e * m.root.trained().numel if e != FP32 else 0
    else:
        forward, whole = _gathered(m, e, kept, False), _gathered(m, e, kept, g.gathered)
    per_position = 2 * m.n_blocks * m.kv_dim * e * n
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
