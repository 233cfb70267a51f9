"""The optimizer step's temporaries and Muon's whole-matrix work (fsdp_research/optim/muon.py), per rank.

AdamW: its foreach implementation (CUDA) holds one temporary the size of the parameters it steps; the per-tensor
loop (CPU), two of the largest shard. Muon deals the blocks' matrices over the shard group in rounds of one matrix
per rank (in model order): per round an all-to-all brings each owner its matrix whole, it runs Newton-Schulz, a
second all-to-all sends the slices back, both in ns_dtype. Alive during its step: the updates (Nesterov, the
default, makes them new tensors: the sharded matrices once more) and the slices sent back so far, cast to fp32
(once more by the last round), and in a round the received matrix with Newton-Schulz's working set (its copy X,
X X^T, the polynomial B and the next X). Combined steps Muon, then AdamW on the rest.

Newton-Schulz on an [m, k] matrix, m <= k (a tall one is transposed), per iteration: X X^T (2 m^2 k FLOPs),
B = b A + c A A (2 m^3), B X (2 m^2 k). The rounds wait for their slowest owner."""

from collections.abc import Sequence

from fsdp_research.config.schema import Strategy
from fsdp_research.planner.activations import FP32
from fsdp_research.planner.run import Run
from fsdp_research.planner.summary import ModelSummary, UnitSize


def _group(m: ModelSummary, run: Run) -> int:
    """Ranks Muon deals the matrices over: the shard group (1: each rank holds them whole, as torch's DDP does)."""
    return 1 if m.strategy is Strategy.ddp_classic else run.shard_group


def _rounds(m: ModelSummary, n: int) -> list[tuple[tuple[int, int], ...]]:
    """The matrices orthogonalized at once: one per rank of a shard group of n; on a rank holding them whole, all
    of them one after the other (one round)."""
    shapes = m.whole_shapes
    size = n if n > 1 else max(1, len(shapes))
    return [shapes[i : i + size] for i in range(0, len(shapes), size)]


def ns_flops(rows: int, cols: int, steps: int) -> float:
    small, large = min(rows, cols), max(rows, cols)
    return steps * (4 * small * small * large + 2 * small**3)


def muon_flops(m: ModelSummary, run: Run) -> float:
    """Newton-Schulz FLOPs on a rank per step: each round's largest matrix (the ranks wait for its owner)."""
    n = _group(m, run)
    if n == 1:
        return sum(ns_flops(r, c, m.ns_steps) for r, c in m.whole_shapes)
    return sum(max(ns_flops(r, c, m.ns_steps) for r, c in shapes) for shapes in _rounds(m, n))


def muon_rounds(m: ModelSummary, run: Run) -> int:
    """Rounds of two all-to-alls each (none where every rank holds the matrices whole)."""
    n = _group(m, run)
    return len(_rounds(m, n)) if n > 1 else 0


def _sliced(m: ModelSummary, n: int) -> int:
    return sum(-(-r // n) * c for r, c in m.whole_shapes)


def _round_working_set(rows: int, cols: int, e: int, received: bool) -> int:
    """One matrix in flight, in ns_dtype (e bytes): the received whole (not where the rank held it whole) beside
    Newton-Schulz's X, X X^T, B and the next X (more than the result and the slices back that follow them)."""
    small = min(rows, cols)
    return e * rows * cols * received + 2 * e * (rows * cols + small * small)


def muon_temporaries(m: ModelSummary, run: Run) -> int:
    n = _group(m, run)
    held = 2 * FP32 * _sliced(m, n)  # the updates and the slices sent back
    rounds = (_round_working_set(r, c, m.ns_bytes, n > 1) for r, c in m.whole_shapes)
    return held + max(rounds, default=0)


def step_temporaries(m: ModelSummary, units: Sequence[UnitSize], run: Run) -> int:
    """The optimizer step's temporaries: AdamW's on all parameters, or Muon's, then AdamW's on the rest."""
    n = run.shard_group
    if run.foreach:
        adamw = FP32 * (sum(u.shard_numel(n) for u in units) - _sliced(m, _group(m, run)))
    else:
        adamw = 2 * FP32 * max(-(-rows // n) * row for u in units for rows, row in u.shapes)
    return max(adamw, muon_temporaries(m, run)) if m.whole_shapes else adamw
