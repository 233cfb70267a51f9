"""An exponential moving average of the weights (ema = decay x ema + (1 - decay) x weights after every step taken:
a skipped step leaves it as it was),
held as the model holds its weights (each rank its shards), saved in the resume checkpoints, its held-out loss
logged at every eval (ema_eval_loss) and, with export, written beside the run's export (<run dir>/export_ema)."""

import contextlib
import os

import torch
from torch.distributed.fsdp import FSDPModule

from fsdp_research.distributed.sharding import local_shard


class EMA:
    def __init__(self, decay: float = 0.999, evaluate: bool = True, export: bool = False):
        if not 0 <= decay < 1:
            raise ValueError("decay must be in [0, 1)")
        self.decay, self.evaluate, self.export = decay, evaluate, export
        self.weights: dict[str, torch.Tensor] = {}
        self._params: list[torch.Tensor] = []
        self._units: list[FSDPModule] = []

    def _attach(self, model: torch.nn.Module) -> None:
        self._units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        # The weights that train: a frozen base (LoRA's) never moves.
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.weights = {name: p.detach().clone() for name, p in named}
        self._params = [p for _, p in named]

    def setup(self, run) -> None:
        self._attach(run.model)

    @torch.no_grad()
    def on_step_end(self, run, step: int, metrics: dict) -> None:
        if metrics["skipped"]:  # the weights did not move: the average of the steps taken stays as it was
            return
        shadows = [local_shard(w) for w in self.weights.values()]
        torch._foreach_lerp_(shadows, [local_shard(p.detach()) for p in self._params], 1 - self.decay)

    def _exchange(self) -> None:
        """The live shards and the averaged ones trade places; FSDP units that stayed gathered (not resharded after
        forward: the root, the last block) drop their gathered copies, so the next forward gathers the new ones."""
        with torch.no_grad():
            for p, w in zip(self._params, self.weights.values()):
                live, average = local_shard(p.detach()), local_shard(w)
                held = live.clone()
                live.copy_(average)
                average.copy_(held)
        for unit in self._units:
            unit.reshard()

    @contextlib.contextmanager
    def swapped(self):
        """The model computes with the averaged weights inside, with its own again after (bitwise)."""
        self._exchange()
        try:
            yield
        finally:
            self._exchange()

    def on_eval(self, run, step: int, metrics: dict) -> None:
        if self.evaluate:
            with self.swapped():
                result = run.evaluate()
            run.log({"ema_eval_loss": result["eval_loss"]}, step=step)

    def on_train_end(self, run, result) -> None:
        if self.export and not result.preempted:
            with self.swapped():
                run.export(os.path.join(run.run_dir, "export_ema"))

    def state_dict(self) -> dict:
        """The averaged weights by parameter name (DTensors where the model's are: DCP saves each rank's shards)."""
        return {"decay": self.decay, "weights": self.weights}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for name, value in state["weights"].items():
                if value is not self.weights[name]:
                    self.weights[name].copy_(value)

    @classmethod
    def planned_bytes(cls, rank, **kwargs) -> int:
        """For the planner (fsdp_research.callbacks.footprint): the averaged copy of the rank's parameters."""
        return rank.param_bytes
