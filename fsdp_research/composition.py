"""Hydra wiring, for train.py, the command-line tools and the tests (the library never imports it): the schema
in Hydra's ConfigStore, the resolvers conf/ uses, and compose() for a config without @hydra.main."""

import os
from collections.abc import Sequence
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from . import rundir
from .config import schema, typed
from .distributed import launch_env

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def _run_dir(resume: str, default: str) -> str:
    return rundir.resolve(resume, rundir.this_launch(default))


def _rank0_only(value: Any) -> Any:
    env = launch_env()
    return value if env is None or env.rank == 0 else None


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=schema())
    # hydra.run.dir: resuming from a path continues in that run's directory.
    OmegaConf.register_new_resolver("run_dir", _run_dir, replace=True)
    OmegaConf.register_new_resolver("rank0_only", _rank0_only, replace=True)


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The config `python train.py <overrides>` runs with, typed (Hydra's compose API over conf/)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return typed(hydra_compose(config_name="train", overrides=list(overrides)))
