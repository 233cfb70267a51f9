"""The parallel axes beside FSDP's sharding, as the planner prices them, one object each: what an axis's ranks
receive in a step, how long that holds compute up (its collectives stand between a block's operations: nothing
hides them), what it adds to the memory of a step's moments, and how the plan names it. The memory an axis saves is
in the per-rank shapes and tokens summary.py reads (a tp rank's part of each split Linear, an ep rank's experts, a
cp rank's tokens, a pipeline rank's stages). A new axis is one class here and its entry in AXES."""

from typing import Protocol

from fsdp_research.planner.phases import Phases
from fsdp_research.planner.run import Run
from fsdp_research.planner.summary import ModelSummary

# A step's moments where memory can peak: (name, bytes by part) (planner.memory).
Moments = list[tuple[str, dict[str, int]]]


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

    def moments(self, moments: Moments, m: ModelSummary, run: Run, deferred: int, phases: Phases) -> Moments:
        """The step's moments with what the axis holds besides the per-rank shapes (`deferred`: the earlier
        micro-batches' gradients the moments hold unsharded)."""
        return moments


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


class PipelineParallel(Axis):
    """Per micro-batch, each of a rank's stages receives the hidden states of the stage before it in forward and their
    gradient from the stage after it in backward (point-to-point, whole), from another rank of the pp group (a V's
    two middle stages meet on one rank: no transfer), and waits for them. The schedule's bubble is the step's
    (planner.timing), its held micro-batches this rank's memory (`moments`)."""

    row = "pipeline parallel (stage boundaries, pp group)"

    def received(self, m: ModelSummary, run: Run) -> float:
        # Whole hidden states also under sequence parallel: a stage's last block gathers its output.
        return run.micro_steps * run.pp_receives * run.tokens * run.compute_bytes * m.hidden

    def blocking(self, m: ModelSummary, run: Run, hw: Links, received: int) -> float:
        # pp is the mesh's outermost axis: a pp group's ranks are world / pp apart, on one node while the world is.
        return received / link_bps(hw, run.world_size) + run.micro_steps * run.pp_receives * hw.latency_s

    def moments(self, moments: Moments, m: ModelSummary, run: Run, deferred: int, phases: Phases) -> Moments:
        """The micro-batches in flight on this rank's stages hold their activations (`phases.saved` each, beside
        the one a moment is of; on the last stage, the norm's and log-probabilities of each loss it holds), a stage
        after the first the hidden states it received for each, and makes their gradient to send back. With one
        stage a rank, torch's schedules reduce the stage's gradients and reshard it after its last micro-batch's
        backward only (run.defer_grad_sync, not run.reshard_after_backward): until then a unit stays gathered from
        its backward to the next micro-batch's forward (the end of a backward holds every unit and the last one's
        all-gather buffer), its gradients accumulate unsharded (`deferred`, in the reduce dtype; each unit's new
        ones in the compute dtype beside them at its reduction where the two differ) and none is sharded yet."""
        if run.pp == 1:
            return moments
        e, units = run.compute_bytes, [*m.units, m.root]
        held = int((run.in_flight - 1) * phases.saved)
        if m.loss_here:
            held += (run.losses - 1) * (phases.backward_start - phases.saved)
        # Whole, as received (the stage before gathered it under sequence parallel).
        received = 0 if m.embeds_here else e * m.hidden * run.tokens
        new_grads = e * max(u.trained().numel for u in units) if e != run.reduce_bytes else 0
        for name, parts in moments:
            if name == "the root's gradient reduction":  # every micro-batch's backward is done
                continue
            parts["activations"] = parts.get("activations", 0) + held + int(run.in_flight * received)
            parts["temporaries"] = parts.get("temporaries", 0) + received
            if run.defer_grad_sync:
                parts.update(grads=0, unsharded_grads=deferred + (new_grads if name.endswith("(reduction)") else 0))
        if not run.defer_grad_sync:
            return moments
        whole = e * (sum(u.numel for u in units) + max(u.numel for u in units))
        last_gather = dict(moments[-1][1], activations=held, temporaries=0, gathered=whole, grads=0)
        return [*moments, ("the last unit's all-gather in backward", dict(last_gather, unsharded_grads=deferred))]


AXES = (TensorParallel(), ExpertParallel(), ContextParallel(), PipelineParallel())
