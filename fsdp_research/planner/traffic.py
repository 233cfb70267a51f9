"""The planner's model of communication per rank per step (bytes received).

Communication per rank per step: what each rank receives, (n-1)/n of each collective's payload. All-gather: every
unit in forward and every unit that resharded again in backward, per micro-batch, in the compute dtype.
Reduce-scatter: every unit's gradients in the reduce dtype, once per step with defer_grad_sync (else per
micro-batch). hsdp and ddp add an all-reduce of the gradient shards across replicas, once per step (accumulated
into the shards before it); ddp_classic all-reduces fp32 gradients. Muon (optim=muon) adds two all-to-alls of the
blocks' matrices in its ns_dtype per step, within the shard group. The parallel axes' own collectives (tensor,
expert, context parallel) are planner.axes's; under expert parallel the all-gathers move the routed experts over the
shard group's 1/ep, one ep rank's experts each.
"""

from dataclasses import dataclass

from fsdp_research.config.schema import Strategy
from fsdp_research.planner.activations import FP32
from fsdp_research.planner.axes import AXES
from fsdp_research.planner.run import Run
from fsdp_research.planner.summary import ModelSummary


@dataclass(frozen=True)
class Traffic:
    """Per-rank bytes received per step."""

    all_gather: int
    # The part of all_gather that regathers resharded units in backward.
    all_gather_backward: int
    reduce_scatter: int
    all_reduce: int
    # Whole-matrix optimizers (Muon): each rank's shards of every block matrix to its owner and back (ns_dtype).
    all_to_all: int = 0
    # The part of all_gather_backward within the smaller groups of reshard_after_forward=k (a node's links).
    regather_within: int = 0
    # Each parallel axis's collectives (planner.axes.AXES, in order), within its group.
    axes: tuple[int, ...] = ()


def traffic(m: ModelSummary, run: Run) -> Traffic:
    e, r, n = run.compute_bytes, run.reduce_bytes, run.shard_group
    if m.strategy is Strategy.ddp_classic:  # one all-reduce per step, after the last micro-batch
        w = run.world_size
        return Traffic(0, 0, 0, 2 * (w - 1) * FP32 * m.root.trained().numel // w)
    syncs = 1 if run.defer_grad_sync else run.micro_steps
    units = [*m.units, m.root]
    received = (n - 1) / n

    def share(u) -> float:  # of a unit's payload, what a rank of its shard group receives
        g = u.group(n)
        return (g - 1) / g

    forward = run.micro_steps * e * sum(share(u) * u.numel for u in units)
    # Backward regathers what forward resharded: over the shard group, or (reshard to k) within the group of k.
    kept = [(u, u.kept_after_forward()) for u in units]
    regather = run.micro_steps * e * sum(u.numel * (k - 1) / k for u, k in kept if k and k > 1)
    backward = run.micro_steps * e * sum(share(u) * u.numel for u, k in kept if k is None) + regather
    # Gradients: of the trained parameters only (LoRA: the adapters).
    reduce = syncs * r * sum(share(u) * u.trained().numel for u in units)
    replicas = run.replicas
    # Across replicas the gradient shards accumulate and are all-reduced once per step.
    across = 2 * (replicas - 1) / replicas * r * sum(u.trained().shard_numel(n) for u in units)
    # Muon: a rank receives the other ranks' slices of the 1/n of the matrices it owns, then its slices of the rest.
    whole = 2 * received * m.ns_bytes * m.whole_matrices / n
    axes = tuple(int(axis.received(m, run)) for axis in AXES)
    return Traffic(int(forward + backward), int(backward), int(reduce), int(across), int(whole), int(regather), axes)
