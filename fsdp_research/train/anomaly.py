"""trainer.detect_anomaly: where a non-finite value first appears. For the run, torch.autograd's anomaly mode (a
backward function that returns nan fails, the forward op's traceback printed) and checks of every module's forward
output, of the loss and of the gradients: the first inf or nan fails the run with one line naming the module (its
qualified name, e.g. model.layers.1.mlp.down_proj) or the parameter, and the step. Each rank checks its own values
(a gradient's local shard) and the ranks agree with one all-reduce per check, so every rank fails with the same
line. Off, nothing is installed and each check returns at once."""

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_research.distributed.names import clean_name
from fsdp_research.distributed.sharding import local_shard
from fsdp_research.errors import AnomalyError
from fsdp_research.train.state import TrainState


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """The floating-point tensors of a module's output (tuples, lists, dicts, ModelOutputs, dataclasses)."""
    if isinstance(output, torch.Tensor):
        if output.is_floating_point():
            yield local_shard(output)
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for f in dataclasses.fields(output):
            yield from _tensors(getattr(output, f.name))


def _first_false(flags: list[torch.Tensor]) -> int:
    """The index of the first False of 0-d bool tensors (len(flags) when none is): one host sync."""
    bad = (~torch.stack(flags)).nonzero()
    return int(bad[0]) if len(bad) else len(flags)


def _min_over_ranks(value: int, device: torch.device) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor(value, device=device, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class AnomalyChecks:
    """The checks of one run; a context manager: leaving it removes the hooks, restores anomaly mode, and turns an
    anomaly-mode error of backward into one line with the step."""

    def __init__(self, model: nn.Module, state: TrainState, enabled: bool):
        self.model, self.state, self.enabled = model, state, enabled
        self._handles: list[Any] = []
        # (module index, whether its output was finite) in the order the forwards ran, since the root's began.
        self._seen: list[tuple[int, torch.Tensor]] = []
        self._names: list[str] = []
        self._previous = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        if enabled:
            torch.autograd.set_detect_anomaly(True)
            self._install()

    def _install(self) -> None:
        modules = list(self.model.named_modules())
        # The wrappers' path parts dropped: a checkpointed block's inner module reports under the block's name.
        self._names = [clean_name(name) or type(self.model).__name__ for name, _ in modules]
        self._handles.append(self.model.register_forward_pre_hook(lambda module, args: self._seen.clear()))
        for index, (_, module) in enumerate(modules):
            self._handles.append(module.register_forward_hook(functools.partial(self._record, index)))
        # After the root's own record: the whole forward is in.
        self._handles.append(self.model.register_forward_hook(self._check_forward))

    def _when(self) -> str:
        # Eval runs under no_grad, after its step has been counted.
        return f"step {self.state.step + 1}" if torch.is_grad_enabled() else f"eval after step {self.state.step}"

    def _record(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        flags = [torch.isfinite(t).all() for t in _tensors(output)]
        if flags:
            self._seen.append((index, torch.stack(flags).all()))

    def _check_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Once per forward of the whole model: the first module, in the order they ran, whose output was not
        finite; of several ranks', the one first in the model."""
        seen, self._seen = list(self._seen), []
        if not seen:
            return
        position = _first_false([flag for _, flag in seen])
        first = seen[position][0] if position < len(seen) else len(self._names)
        first = _min_over_ranks(first, seen[0][1].device)
        if first < len(self._names):
            raise AnomalyError(
                f"{self._when()}: non-finite (inf/nan) forward output, first in {self._names[first]} "
                "(trainer.detect_anomaly)"
            )

    def check_loss(self, loss: torch.Tensor) -> None:
        """A non-finite loss from finite logits: the loss function's doing (or the output layer's, with
        loss.chunks > 1, which runs it outside the model's forward)."""
        if not self.enabled:
            return
        finite = torch.isfinite(loss.detach()).all()
        if not _min_over_ranks(int(finite), finite.device):
            raise AnomalyError(
                f"{self._when()}: non-finite (inf/nan) loss from finite forward outputs: check the loss (loss.*) "
                "and the output layer (trainer.detect_anomaly)"
            )

    def check_grads(self, skipped: bool = False) -> None:
        """The first parameter, in the model's order, whose gradient (this rank's shard of it) is not finite;
        before clipping, which would spread a nan to every gradient. skipped: the loss scaler skips this step
        for an overflow, as fp16 training does by design."""
        if not self.enabled or skipped:
            return
        named = [(name, p.grad) for name, p in self.model.named_parameters() if p.grad is not None]
        if not named:
            return
        first = _first_false([torch.isfinite(local_shard(g)).all() for _, g in named])
        first = _min_over_ranks(first, named[0][1].device)
        if first < len(named):
            raise AnomalyError(
                f"{self._when()}: non-finite (inf/nan) gradient, first in parameter {clean_name(named[first][0])} "
                "(trainer.detect_anomaly)"
            )

    def __enter__(self) -> "AnomalyChecks":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.enabled:
            return False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        torch.autograd.set_detect_anomaly(*self._previous)
        # Anomaly mode's own error: "Function 'MulBackward0' returned nan values in its 0th output."
        if isinstance(exc, RuntimeError) and not isinstance(exc, AnomalyError) and "returned nan values" in str(exc):
            line = str(exc).strip().splitlines()[0]
            raise AnomalyError(f"{self._when()}: in backward, {line} (trainer.detect_anomaly)") from exc
        return False


def apply_anomaly_checks(model: nn.Module, state: TrainState, enabled: bool) -> AnomalyChecks:
    """trainer.detect_anomaly's checks on the (sharded) model, in force until the returned context is left;
    disabled, an object whose checks return at once and that installed nothing."""
    return AnomalyChecks(model, state, enabled)
