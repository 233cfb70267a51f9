"""hydra/sweeper=optuna (its node is stored in Hydra's ConfigStore by fsdp_research.jobs.compose): Hydra finds
sweepers only in the hydra_plugins package, so the plugin lives here and the search itself in
fsdp_research.jobs.optuna_search (Optuna is imported only when a search runs: it is the optional extra [sweep])."""

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class ResumableOptunaSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        from fsdp_research.jobs.optuna_search import ResumableOptuna

        self.search = ResumableOptuna(**settings)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.search.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        self.search.sweep(arguments)
