"""Hydra wiring, for train.py, the command-line tools and the tests (the library never imports it): the schema
in Hydra's ConfigStore, the resolvers conf/ uses, and compose() for a config without @hydra.main."""

import os
from collections.abc import Sequence
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from omegaconf import DictConfig, OmegaConf

from . import rundir
from .config import DIRECTIONS, Objective, schema, typed
from .distributed import launch_env

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def _run_dir(resume: str, default: str) -> str:
    return rundir.resolve(resume, rundir.this_launch(default))


def _rank0_only(value: Any) -> Any:
    env = launch_env()
    return value if env is None or env.rank == 0 else None


# hydra/sweeper=optuna: an Optuna search (fsdp_research/search.py) that a re-run of the same command with
# hydra.sweep.dir=<its dir> continues. hydra-optuna-sweeper's settings, with: the study in SQLite in the sweep dir
# under a fixed name, a seeded sampler (the same command samples the same trials), the direction following
# trainer.objective, trials one after another (n_jobs: trials per batch, one SLURM array each), and a failed trial
# told as failed while the search goes on. The search space is hydra.sweeper.params (conf/hparams_search/).
OPTUNA_SWEEPER = {
    "_target_": "hydra_plugins.fsdp_research_sweeper.resumable_optuna.ResumableOptunaSweeper",
    "sampler": {"_target_": "optuna.samplers.TPESampler", "seed": 0},
    "direction": "${objective_direction:${trainer.objective}}",
    "storage": "sqlite:///${hydra.sweep.dir}/optuna.db",
    "study_name": "fsdp_research",
    "n_trials": 20,
    "n_jobs": 1,
    "max_failure_rate": 1.0,  # the share of a batch's trials that may fail before the search stops
    "search_space": None,
    "params": None,
    "custom_search_space": None,
}


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=schema())
    # Hydra's plugin scan (re)registers hydra-optuna-sweeper's own node: it goes first, so that ours replaces it.
    Plugins.instance()
    ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=OPTUNA_SWEEPER, provider="fsdp_research")
    # hydra.run.dir: resuming from a path continues in that run's directory.
    OmegaConf.register_new_resolver("run_dir", _run_dir, replace=True)
    OmegaConf.register_new_resolver("rank0_only", _rank0_only, replace=True)
    # hydra/sweeper=optuna: the study's direction follows trainer.objective.
    OmegaConf.register_new_resolver("objective_direction", lambda name: DIRECTIONS[Objective(name)], replace=True)


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The config `python train.py <overrides>` runs with, typed (Hydra's compose API over conf/)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from .data.tokenizer import resolve_tokenizer

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = typed(hydra_compose(config_name="train", overrides=list(overrides)))
    resolve_tokenizer(cfg)
    return cfg
