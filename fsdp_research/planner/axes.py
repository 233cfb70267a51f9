"""The parallel axes beside FSDP's sharding, as the planner prices them, one object each: what an axis's ranks
receive in a step, how long that holds compute up (its collectives stand between a block's operations: nothing
hides them), and how the plan names it. The memory an axis saves is in the per-rank shapes and tokens summary.py
reads (a tp rank's part of each split Linear, an ep rank's experts, a cp rank's tokens). A new axis is one class
here and its entry in AXES."""

from typing import Protocol

from fsdp_research.planner.run import Run
from fsdp_research.planner.summary import ModelSummary


class Links(Protocol):
    """What an axis's collectives cross (planner.timing.Hardware)."""

    intra_bps: float
    inter_bps: float
    per_node: int
    latency_s: float


def link_bps(hw: Links, group: int) -> float:
    """A group's bandwidth: a node's links while it fits in one."""
    return hw.intra_bps if group <= hw.per_node else hw.inter_bps


class Axis:
    # Its traffic row in the plan.
    row = ""

    def received(self, m: ModelSummary, run: Run) -> float:
        """Bytes a rank receives per step from this axis's collectives (0 when it is off)."""
        raise NotImplementedError

    def blocking(self, m: ModelSummary, run: Run, hw: Links, received: int) -> float:
        """Seconds per step those collectives hold compute up (0.0 when it is off)."""
        raise NotImplementedError

    def describe(self, m: ModelSummary, run: Run) -> str:
        """Its part of the plan's layout line ("" when it is off)."""
        return ""


class TensorParallel(Axis):
    """Per block and micro-batch, two all-reduces of the micro-batch's activations in forward and two in backward
    (sequence parallel: an all-gather and a reduce-scatter for each, the same bytes), again in a checkpointed
    block's recompute, within the tp group (a node's links)."""

    row = "tensor parallel (activations, tp group)"

    def received(self, m: ModelSummary, run: Run) -> float:
        all_reduces = 4 * m.n_blocks + 2 * sum(m.checkpointed)
        return run.micro_steps * all_reduces * 2 * (m.tp - 1) / m.tp * run.compute_bytes * m.hidden * run.tokens

    def blocking(self, m: ModelSummary, run: Run, hw: Links, received: int) -> float:
        return received / hw.intra_bps + (run.micro_steps * 8 * m.n_blocks * hw.latency_s if m.tp > 1 else 0)

    def describe(self, m: ModelSummary, run: Run) -> str:
        return f", tp {m.tp}" + (" with sequence parallel" if m.sequence_parallel else "") if m.tp > 1 else ""


class ExpertParallel(Axis):
    """Per MoE block and micro-batch, each token's k hidden states to their experts' ranks and back in forward,
    their gradients in backward, again in a checkpointed block's recompute: (ep-1)/ep of each exchange received
    (routing spread evenly); the routed tokens wait for them."""

    row = "expert parallel (routed tokens, ep group)"

    def received(self, m: ModelSummary, run: Run) -> float:
        exchanges = 4 * len(m.moe_blocks) + 2 * sum(m.checkpointed[b] for b in m.moe_blocks)
        routed = run.tokens * m.experts_per_token * m.hidden * run.compute_bytes
        return run.micro_steps * exchanges * (m.ep - 1) / m.ep * routed

    def blocking(self, m: ModelSummary, run: Run, hw: Links, received: int) -> float:
        if m.ep == 1:
            return 0.0
        exchanges = run.micro_steps * 6 * len(m.moe_blocks)
        return received / link_bps(hw, m.ep) + exchanges * hw.latency_s


class ContextParallel(Axis):
    """Per block and micro-batch, q, k and v gathered over the sequence and attention's output sent back (all-to-
    alls of the rank's tokens x their widths) in forward, their gradients in backward, again in a checkpointed
    block's recompute: (cp-1)/cp received; they stand between attention's projections and its kernel."""

    row = "context parallel (attention, cp group)"

    def received(self, m: ModelSummary, run: Run) -> float:
        cp = run.cp
        if cp == 1:
            return 0.0
        # Key-value heads too few to split go as the query heads' copies.
        kv_heads = m.kv_dim * m.heads // m.q_width
        kv = m.kv_dim if kv_heads % cp == 0 else m.q_width
        passes = 2 * m.n_blocks + sum(m.checkpointed)
        return run.micro_steps * passes * (cp - 1) / cp * run.tokens * run.compute_bytes * (2 * m.q_width + 2 * kv)

    def blocking(self, m: ModelSummary, run: Run, hw: Links, received: int) -> float:
        if run.cp == 1:
            return 0.0
        exchanges = run.micro_steps * 8 * m.n_blocks
        return received / link_bps(hw, run.cp * m.tp) + exchanges * hw.latency_s

    def describe(self, m: ModelSummary, run: Run) -> str:
        return f", cp {run.cp} ({run.tokens // run.micro_batch} tokens of each sequence a rank)" if run.cp > 1 else ""


AXES = (TensorParallel(), ExpertParallel(), ContextParallel())
