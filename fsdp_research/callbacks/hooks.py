"""Calling the callbacks: built from the config (each `_target_` checked before any compute), each hook called on
every rank with a handle on the run, a callback that raises named; the skip-step and stop requests agreed across
ranks (any rank's request is every rank's); the callbacks' state in the resume checkpoints."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_research.config.targets import build, check_call, kwargs_of, resolve
from fsdp_research.errors import CallbackError, ConfigError

# The hooks, in the order a step calls them; each takes the run handle first.
HOOKS = (
    "setup",  # (run): the model and optimizer exist; a resume restores state_dict()'s tensors after it
    "on_train_start",  # (run): run.step is the step training starts from
    "on_before_optimizer_step",  # (run, step, metrics): gradients final and unclipped; run.skip_step() skips it
    "on_step_end",  # (run, step, metrics)
    "on_eval",  # (run, step, metrics)
    "on_save",  # (run, step, path)
    "on_train_end",  # (run, result)
)


@dataclass
class RunHandle:
    """What a callback sees of the run. `step`: the steps done so far."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    config: Any
    rank: int
    world_size: int
    run_dir: str
    device: torch.device
    # The repeating blocks' module paths, in forward order.
    blocks: tuple[str, ...]
    step: int = 0
    # Set by the trainer once the sinks and the data exist (before any hook but setup runs).
    _log: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False)
    _evaluate: Callable[[], dict[str, float]] | None = field(default=None, repr=False)
    _export: Callable[[str], None] | None = field(default=None, repr=False)
    _skip: bool = field(default=False, repr=False)
    _stop: bool = field(default=False, repr=False)

    def bind(self, log, evaluate, export) -> None:
        """The trainer's sinks, eval and export, once they exist."""
        self._log, self._evaluate, self._export = log, evaluate, export

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """A record of values to every sink (rank 0's; others drop it), at `step` (default: the current one)."""
        self._log({"step": self.step if step is None else step, **values})

    def skip_step(self) -> None:
        """Skip this step's optimizer update (from on_before_optimizer_step): on every rank, the schedule goes on."""
        self._skip = True

    def request_stop(self) -> None:
        """End the run at the next step boundary (agreed across ranks), with a checkpoint and the export."""
        self._stop = True

    def evaluate(self) -> dict[str, float]:
        """The held-out loss of the model as it is now (a collective: every rank calls it)."""
        return self._evaluate()

    def export(self, out_dir: str) -> None:
        """The model as it is now, written as the run's export is (a collective: every rank calls it)."""
        self._export(out_dir)


def check_callbacks(cfg: Mapping[str, Any]) -> None:
    for name, node in cfg.items():
        key = f"callbacks.{name}._target_"
        if not isinstance(node, Mapping) or not node.get("_target_"):
            raise ConfigError(key, "is not set", f"give callbacks.{name} a _target_ (a class), or remove it")
        target = resolve(node["_target_"], key)
        check_call(target, kwargs_of(node), key)
        # A class can be checked for hooks here; what a factory returns only once it is called.
        if isinstance(target, type) and not any(hasattr(target, hook) for hook in HOOKS):
            raise ConfigError(key, f"{node['_target_']} has none of the hooks", f"define some of {', '.join(HOOKS)}")


class Callbacks:
    """The run's callbacks, by name: the trainer's built-in ones (the profiler, the MoE bias balancer: the same
    hooks), then the config's, in its order."""

    def __init__(self, cfg: Mapping[str, Any]):
        self.items = {name: build(node, f"callbacks.{name}._target_") for name, node in cfg.items()}
        self.builtins: dict[str, Any] = {}

    def add_builtin(self, name: str, callback: Any) -> None:
        """A concern of the trainer's own, called before the config's callbacks at each hook."""
        self.builtins[name] = callback

    def __bool__(self) -> bool:
        """Whether the config has callbacks: they see the step's mean loss and norm, read to the host (a sync the
        built-in ones do without)."""
        return bool(self.items)

    def has(self, hook: str) -> bool:
        return any(hasattr(cb, hook) for cb in (*self.builtins.values(), *self.items.values()))

    def call(self, hook: str, run: RunHandle, *args: Any) -> None:
        for name, callback in (*self.builtins.items(), *self.items.items()):
            fn = getattr(callback, hook, None)
            if fn is None:
                continue
            try:
                fn(run, *args)
            except Exception as err:
                text = str(err).strip().splitlines()
                kind = "built-in" if name in self.builtins else "callback"
                raise CallbackError(
                    f"{kind} {name!r} ({type(callback).__name__}.{hook}) raised {type(err).__name__}"
                    + (f": {text[0]}" if text else "")
                ) from err

    def agree(self, run: RunHandle) -> tuple[bool, bool]:
        """(skip, stop) as any rank asked since the last agreement (a collective); the requests are cleared."""
        flags = torch.tensor([float(run._skip), float(run._stop)], device=run.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        run._skip = False
        skip, stop = bool(flags[0].item()), bool(flags[1].item())
        run._stop = stop
        return skip, stop

    def state_dict(self) -> dict[str, Any]:
        """The callbacks that keep state, each's state_dict() (tensors sharded like the model's where they are)."""
        return {name: cb.state_dict() for name, cb in self.items.items() if hasattr(cb, "state_dict")}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, value in state.items():
            self.items[name].load_state_dict(value)
