"""What a rank keeps for the whole run besides the model's parameters, gradients and optimizer state: the state
callbacks declare (fsdp_research.callbacks.footprint; EMA: an fp32 copy of the rank's parameters), and on CUDA the
NCCL communicators of the process groups FSDP2 makes for units resharded to k ranks after forward (each such unit
builds a DeviceMesh of the shard group viewed as [n/k, k]: two more groups per rank, 14 for 7 units, each created
at start-up with buffers of its own on the device; gloo's hold none)."""

from fsdp_research.callbacks.footprint import PlannedRank
from fsdp_research.config.schema import Strategy
from fsdp_research.metrics.hardware import NCCL_COMMUNICATOR_GIB
from fsdp_research.planner.activations import FP32
from fsdp_research.planner.run import Run
from fsdp_research.planner.summary import ModelSummary

GIB = 2**30


def callback_bytes(m: ModelSummary, run: Run) -> int:
    """The callbacks' declared state on a rank (and the objective's: DPO's reference), given the parameters the rank
    holds."""
    replicated = m.strategy is Strategy.ddp_classic
    n = 1 if replicated else run.shard_group
    params = m.n_params if replicated else sum(u.shard_numel(n) for u in [*m.units, m.root])
    adapters = any(u.frozen for u in [*m.units, m.root])
    rank = PlannedRank(FP32 * params, params, run.world_size, n, adapters)
    return sum(int(declared(rank)) for _, declared in run.callbacks)


def extra_groups(m: ModelSummary, run: Run) -> int:
    """Process groups a rank joins for reshard_after_forward=k (1 < k < the shard group: FSDP2 turns k = 1 and
    k = the group into false and true, which need none)."""
    return 2 * sum(1 < (k or 0) < run.shard_group for u in [*m.units, m.root] if (k := u.kept_after_forward()))


def communicator_bytes(m: ModelSummary, run: Run) -> int:
    return int(extra_groups(m, run) * NCCL_COMMUNICATOR_GIB * GIB) if run.nccl else 0
