"""Real multi-process runs for tests: N processes on gloo, started the way train.py starts its workers."""
import os
from typing import Any, Callable, Dict

import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_research.distributed import spawn
from fsdp_research.models import clean_name
from fsdp_research.trainer import train


def full_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The full, unsharded weights on CPU (a collective: every rank calls it)."""
    model = getattr(model, "module", model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {clean_name(k): v for k, v in state.items()}


def final_weights(model: torch.nn.Module) -> Dict[str, Any]:
    return {"weights": full_state(model)}


def _train_each(configs: Dict[str, Any], out_dir: str, inspect: Callable) -> None:
    for name, cfg in configs.items():
        result = train(cfg, os.path.join(out_dir, name))
        record = {"losses": result.losses, **inspect(result.model)}
        if torch.distributed.get_rank() == 0:
            torch.save(record, os.path.join(out_dir, f"{name}.pt"))
    torch.distributed.destroy_process_group()


def train_distributed(configs: Dict[str, Any], world_size: int, out_dir: str,
                      inspect: Callable[[torch.nn.Module], Dict[str, Any]] = final_weights) -> Dict[str, Any]:
    """Train each config in turn on the same `world_size` processes (run dirs <out_dir>/<name>); returns their
    losses and what `inspect(trained model)` found (a module-level function; every rank calls it, so it may
    use collectives), by default the final weights."""
    containers = {name: OmegaConf.to_container(cfg, resolve=True) for name, cfg in configs.items()}
    spawn(_train_each, world_size, containers, out_dir, inspect)
    return {name: torch.load(os.path.join(out_dir, f"{name}.pt")) for name in configs}
