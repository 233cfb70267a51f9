"""Pipeline parallel in the plan: how many micro-batches' activations a rank's stages hold at once, and the
schedule's bubble (the share of the step a rank waits on the others), both read from the schedule's action lists:
torch.distributed.pipelining's own for the looped schedules (built without processes), the textbook orders for
GPipe (every forward, then every backward) and 1F1B (pp - 1 - stage forwards, then one of each).
A pure function of the schedule's name, pp, the micro-batches of a step and the stages per rank."""

from dataclasses import dataclass
from functools import cache

from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

# A backward costs two forwards (its two matmuls per forward one); the zero-bubble halves one each.
COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Action:
    kind: str  # F, B (full backward), I (input gradients), W (weight gradients)
    stage: int
    micro: int


@dataclass(frozen=True)
class PipelineShape:
    """A step's pipeline: on each rank, the most activations its stages hold at once, in micro-batches' worth of
    all the rank's layers (each stage holds 1 / stages a rank of it); the most micro-batches whose loss the last
    stage holds at once (GPipe: all of them; 1F1B: one); the step's bubble."""

    in_flight: tuple[float, ...]
    losses: int
    bubble: float


def _single(schedule: str, pp: int, micro_steps: int) -> list[list[Action]]:
    ranks = []
    for s in range(pp):
        warmup = micro_steps if schedule == "GPipe" else min(micro_steps, pp - 1 - s)
        order = [Action("F", s, m) for m in range(warmup)]
        for m in range(micro_steps - warmup):  # 1F1B's steady state: one forward, one backward
            order += [Action("F", s, warmup + m), Action("B", s, m)]
        order += [Action("B", s, m) for m in range(micro_steps - warmup, micro_steps)]
        ranks.append(order)
    return ranks


def actions(schedule: str, pp: int, micro_steps: int, stages_per_rank: int) -> list[list[Action]]:
    """Each rank's compute actions in the order its schedule runs them."""
    if stages_per_rank == 1:
        return _single(schedule, pp, micro_steps)
    lists = get_schedule_ops(schedule, pp, micro_steps, stages_per_rank)
    return [
        # DualPipeV overlaps a forward and a backward (sub_actions): counted here one after the other.
        [
            Action(one.computation_type.value, one.stage_index, one.microbatch_index)
            for a in rank
            if a is not None
            for one in (a.sub_actions or (a,))
        ]
        for rank in lists
    ]


def _held(order: list[Action], released: tuple[str, ...] = ("B", "W")) -> int:
    """The most micro-batch stages whose activations are held at once (forward done, backward not; an input pass
    keeps the graph for its weight pass: torch's stage_backward_input retains it), or with `released` ("B", "I")
    their losses (the input pass detaches the loss: its logits go)."""
    held = top = 0
    for a in order:
        held += 1 if a.kind == "F" else -1 if a.kind in released else 0
        top = max(top, held)
    return top


def _bubble(ranks: list[list[Action]]) -> float:
    """Each rank runs its actions in order, an action once its inputs exist (a forward after the stage before's, a
    backward after the stage after's and its own forward): the share of the longest rank's time spent waiting."""
    last = max(a.stage for order in ranks for a in order)
    done: dict[tuple[str, int, int], float] = {}
    clock, position = [0.0] * len(ranks), [0] * len(ranks)
    while any(p < len(order) for p, order in zip(position, ranks)):
        progressed = False
        for r, order in enumerate(ranks):
            while position[r] < len(order):
                a = order[position[r]]
                needs = [("F", a.stage - 1, a.micro)] if a.kind == "F" and a.stage > 0 else []
                if a.kind in ("B", "I"):
                    needs = [("F", a.stage, a.micro)]
                    if a.stage < last:
                        needs.append(("I", a.stage + 1, a.micro))
                if a.kind == "W":
                    needs = [("I", a.stage, a.micro)]
                if any(n not in done for n in needs):
                    break
                start = max([clock[r], *(done[n] for n in needs)])
                clock[r] = start + COST[a.kind]
                # A full backward gives the stage before its input gradients, as an input pass does.
                done["I" if a.kind == "B" else a.kind, a.stage, a.micro] = clock[r]
                position[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule's actions wait on each other")
    busy = max(sum(COST[a.kind] for a in order) for order in ranks)
    return 1 - busy / max(clock)


@cache
def pipeline_shape(schedule: str, pp: int, micro_steps: int, stages_per_rank: int) -> PipelineShape:
    ranks = actions(schedule, pp, micro_steps, stages_per_rank)
    last = max(a.stage for order in ranks for a in order)
    losses = max(_held([a for a in order if a.stage == last], ("B", "I")) for order in ranks)
    return PipelineShape(tuple(_held(order) / stages_per_rank for order in ranks), losses, _bubble(ranks))
