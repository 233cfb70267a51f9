"""The sharding plan a config asks for, and what FSDP2 actually did to a trained model: which modules are
FSDP units, which of them hold their parameters gathered (unsharded) right now, and their precision policy.
The observers are `inspect` functions for tests.helpers.dist.train_distributed."""

from typing import Any

import torch
import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_research.distributed.sharding import ShardingPlan, owner
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.model.assembly import planned_model
from tests.helpers.dist import final_weights


def plan_for(cfg: DictConfig) -> ShardingPlan:
    """The plan on a meta-device model, built as the trainer builds it (activation checkpointing first); shapes
    only, as the doctor and the planner build it."""
    return planned_model(cfg, build_hf_config(cfg.model), values=False)[1]


def _fsdp_units(model: nn.Module) -> dict[str, FSDPModule]:
    model = getattr(model, "module", model)  # the DDP baseline's wrapper
    return {path: m for path, m in model.named_modules() if isinstance(m, FSDPModule)}


def gathered_units(model: nn.Module, units: list[str]) -> list[str]:
    """The units whose parameters are gathered: FSDP2 registers a unit's parameters as sharded DTensors,
    and swaps in plain tensors while they are unsharded. A unit owns the parameters under its path that no
    deeper unit owns."""
    state: dict[str, set] = {}
    for name, param in model.named_parameters():
        state.setdefault(owner(name, units), set()).add(not isinstance(param, DTensor))
    assert all(len(flags) == 1 for flags in state.values()), f"a unit is partly gathered: {state}"
    return sorted(unit for unit, flags in state.items() if flags == {True})


def observe_units(model: nn.Module) -> dict[str, Any]:
    """Each FSDP unit's class, and which units are gathered before and after a forward (no backward)."""
    units = _fsdp_units(model)
    observed: dict[str, Any] = {"units": {path: type(m).__name__ for path, m in units.items()}}
    if units:
        observed["gathered_before_forward"] = gathered_units(model, list(units))
        model(input_ids=torch.randint(0, 256, (2, 16)))
        observed["gathered_after_forward"] = gathered_units(model, list(units))
    return observed


def precision_state(model: nn.Module) -> dict[str, Any]:
    """Each FSDP unit's (param_dtype, reduce_dtype), whether the output embedding is still tied to the input
    embedding, and the final weights."""
    policies = {path: m._get_fsdp_state()._mp_policy for path, m in _fsdp_units(model).items()}
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return {
        "mp": {path: (p.param_dtype, p.reduce_dtype) for path, p in policies.items()},
        "tied": tied,
        **final_weights(model),
    }
