"""What the commands share: the launch they describe (world_size=N, nodes=N beside the Hydra overrides), the
composed and checked config, and the one-line error."""

import sys
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from fsdp_research.distributed.processes import device_for, planned_world_size
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import check_command_line, compose
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.train.refusals import check_config

LAUNCH_KEYS = ("world_size", "nodes")


def split_launch(argv: Sequence[str]) -> tuple[dict[str, int], list[str]]:
    """world_size=N and nodes=N (the launch to describe) apart from the Hydra overrides; the last one given wins."""
    launch: dict[str, int] = {}
    overrides = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in LAUNCH_KEYS:
            overrides.append(arg)
            continue
        if not (value.isdigit() and int(value) > 0):
            raise ConfigError(key, f"{value!r} is not a positive integer", f"use {key}=N, N >= 1")
        launch[key] = int(value)
    return launch, overrides


def checked_config(overrides: Sequence[str], world_size: int = 0, stages: bool = False) -> tuple[DictConfig, Any, int]:
    """(config, HF config, world size): composed as train.py would, checked as the trainer checks it, for
    world_size ranks (0: as the launch would have); a key no schema has, one line naming it, as train.py says it.
    stages: the command plans pipeline stages (parallel.pp > 1; refused otherwise)."""
    check_command_line(overrides)
    cfg = compose(overrides)
    world_size = world_size or planned_world_size(cfg.distributed)
    hf_config = build_hf_config(cfg.model)
    check_config(cfg, world_size, hf_config, device_for(cfg.trainer.device, 0))
    if cfg.parallel.pp > 1 and not stages:  # their every figure is of the whole model on each rank
        raise ConfigError(
            "parallel.pp", "doctor does not plan pipeline stages yet", "use parallel.pp=1 (plan and simulate plan them)"
        )
    return cfg, hf_config, world_size


def fail(err: BaseException, suffix: str = "") -> int:
    print(f"error: {err}{suffix}", file=sys.stderr)
    return 2
