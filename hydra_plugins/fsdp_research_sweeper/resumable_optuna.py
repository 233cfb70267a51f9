"""hydra/sweeper=optuna (conf/hydra/sweeper/optuna.yaml): Hydra finds sweepers only in the hydra_plugins
package, so the plugin lives here and the search itself in fsdp_research.search (Optuna is imported only when a
search runs: it is the optional extra [sweep])."""

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class ResumableOptunaSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        from fsdp_research.search import ResumableOptuna

        self.search = ResumableOptuna(**settings)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.search.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        self.search.sweep(arguments)
