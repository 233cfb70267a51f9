"""What callbacks keep on a rank, as the planner counts it: a callback class may declare its state with a classmethod
`planned_bytes(rank, **kwargs)` (rank: a PlannedRank; kwargs: the callback's config keys) returning bytes per rank.
The planner calls it on the class: no callback is built (building one may do anything: open files, start
threads). A callback without it, or a factory function, is counted as keeping nothing. An objective declares what
it generates the same way (PlannedGeneration)."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from fsdp_research.config.targets import kwargs_of, resolve


@dataclass(frozen=True)
class PlannedRank:
    """What the planner knows of a rank when it asks a callback for its state."""

    # The rank's parameters as it holds them (fp32 bytes and elements: its shards, or all of them when replicated).
    param_bytes: int
    params: int
    world_size: int
    # Ranks a parameter is sharded over (1: replicated).
    shard_group: int
    # Whether the model trains adapters (LoRA) on a frozen base.
    adapters: bool = False


@dataclass(frozen=True)
class PlannedGeneration:
    """What an objective that generates (online RL's rollouts) holds while it does, as the planner counts it."""

    # Tokens generated a sequence (each micro-batch's sequences to the end: its KV cache holds prompt and these).
    tokens: int
    # Whether the whole model's parameters stay gathered while it generates (else one unit's at a time).
    gathered: bool


Declared = tuple[tuple[str, Callable[[PlannedRank], int]], ...]


def declared_state(callbacks: Mapping[str, Any]) -> Declared:
    """(name, bytes per rank as a function of a PlannedRank) of each configured callback that declares its state."""
    declared = []
    for name, node in callbacks.items():
        target = resolve(node["_target_"], f"callbacks.{name}._target_")
        planned = getattr(target, "planned_bytes", None)
        if isinstance(target, type) and planned is not None:
            declared.append((name, partial(planned, **kwargs_of(node))))
    return tuple(declared)
