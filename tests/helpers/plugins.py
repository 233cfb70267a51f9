"""Plug-ins the tests load by `_target_`, as a user's package would be: callbacks that record what every rank saw
or ask for a skip or a stop on one rank only, one that signals its own process, one that holds a run until a file
appears, one that raises, and a schedule function that spikes the lr, and a model whose forward overflows at a known
module."""

import json
import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_research.distributed.names import clean_name
from fsdp_research.distributed.sharding import local_shard


def _checksum(model) -> float:
    """This rank's shards, summed with position weights (a step that changed nothing keeps it bitwise)."""
    total = 0.0
    for p in model.parameters():
        local = local_shard(p).detach().double().flatten()
        total += float((local * torch.arange(1, local.numel() + 1, dtype=torch.float64)).sum())
    return total


class Recorder:
    """Writes <run dir>/seen_rank<r>.json: per step, this rank's weight checksum and the hooks' metrics."""

    def __init__(self):
        self.seen: dict[str, list] = {"hooks": [], "checksums": {}}

    def setup(self, run) -> None:
        self.seen["hooks"].append("setup")

    def on_train_start(self, run) -> None:
        self.seen["hooks"].append(f"on_train_start@{run.step}")

    def on_step_end(self, run, step: int, metrics: dict) -> None:
        self.seen["checksums"][step] = _checksum(run.model)
        self.seen.setdefault("skipped", {})[step] = metrics["skipped"]

    def on_eval(self, run, step: int, metrics: dict) -> None:
        self.seen["hooks"].append(f"on_eval@{step}")

    def on_save(self, run, step: int, path: str) -> None:
        self.seen["hooks"].append(f"on_save@{step}:{os.path.basename(path)}")

    def on_train_end(self, run, result) -> None:
        self.seen["hooks"].append("on_train_end")
        with open(os.path.join(run.run_dir, f"seen_rank{run.rank}.json"), "w") as f:
            json.dump(self.seen, f)


class WeightLog:
    """Writes <run dir>/weights.pt (rank 0): one parameter's full value at setup and after every step, by step (0:
    setup), with the steps skipped: what an EMA of it is computed from."""

    def __init__(self, name: str):
        self.name, self.values, self.skipped = name, {}, []

    def _record(self, run, step: int) -> None:
        param = {clean_name(n): p for n, p in run.model.named_parameters()}[self.name]
        full = param.full_tensor() if isinstance(param, DTensor) else param  # a collective: every rank calls it
        self.values[step] = full.detach().clone()

    def setup(self, run) -> None:
        self._record(run, 0)

    def on_step_end(self, run, step: int, metrics: dict) -> None:
        self._record(run, step)
        if metrics["skipped"]:
            self.skipped.append(step)

    def on_train_end(self, run, result) -> None:
        if run.rank == 0:
            torch.save({"values": self.values, "skipped": self.skipped}, os.path.join(run.run_dir, "weights.pt"))


class AskOnOneRank:
    """On rank `rank` only: skip the optimizer step of step `skip_at`, stop after step `stop_at`."""

    def __init__(self, rank: int = 1, skip_at: int = 0, stop_at: int = 0):
        self.rank, self.skip_at, self.stop_at = rank, skip_at, stop_at

    def on_before_optimizer_step(self, run, step: int, metrics: dict) -> None:
        if run.rank == self.rank and step == self.skip_at:
            run.skip_step()

    def on_step_end(self, run, step: int, metrics: dict) -> None:
        if run.rank == self.rank and step == self.stop_at:
            run.request_stop()


class SignalAt:
    """On rank `rank`, during step `step` (before its optimizer step): SIGTERM to this process, as a scheduler
    sends it."""

    def __init__(self, step: int, rank: int = 0):
        self.step, self.rank = step, rank

    def on_before_optimizer_step(self, run, step: int, metrics: dict) -> None:
        if run.rank == self.rank and step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class SlowStep:
    """Before the optimizer step of step `step`: <run dir>/slow (rank 0), then `seconds` of sleep on every rank, a
    long step to Ctrl-C into."""

    def __init__(self, step: int, seconds: float):
        self.step, self.seconds = step, seconds

    def on_before_optimizer_step(self, run, step: int, metrics: dict) -> None:
        if step == self.step:
            if run.rank == 0:
                open(os.path.join(run.run_dir, "slow"), "w").close()
            time.sleep(self.seconds)


class HoldUntil:
    """After step `step`, while the file `release` is missing: <run dir>/held (rank 0), every rank waiting; a run
    held where a test acts on it, however slowly the test's process is scheduled. A resumed run passes through."""

    def __init__(self, step: int, release: str):
        self.step, self.release = step, release

    def on_step_end(self, run, step: int, metrics: dict) -> None:
        if step == self.step and not os.path.exists(self.release):
            if run.rank == 0:
                open(os.path.join(run.run_dir, "held"), "w").close()
            while not os.path.exists(self.release):
                time.sleep(0.1)


def hold_at(step: int, release) -> list[str]:
    """The overrides that add HoldUntil(step, release) to a run's callbacks."""
    target = "+callbacks.hold._target_=tests.helpers.plugins.HoldUntil"
    return [target, f"+callbacks.hold.step={step}", f"+callbacks.hold.release={release}"]


class SweepFault:
    """In job `job` of a sweep (its run dir's name), during step `step`: `signal` (a name) to this process's group,
    the sweep's launcher and its job, as a kill or a Ctrl-C reaches them; once (the marker file remembers it), so
    that the sweep run again goes through."""

    def __init__(self, step: int, job: int, signal: str, marker: str):
        self.step, self.job, self.signal, self.marker = step, job, signal, marker

    def on_before_optimizer_step(self, run, step: int, metrics: dict) -> None:
        if step == self.step and os.path.basename(run.run_dir) == str(self.job) and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.killpg(0, getattr(signal, self.signal))


class Raises:
    def on_step_end(self, run, step: int, metrics: dict) -> None:
        if step == 2:
            raise ValueError("this callback fails at step 2")


def spike_lr(step: int, max_steps: int, at: int = 8, factor: float = 300.0) -> float:
    """Constant, but `factor` times higher at step `at` (0-based): the next step's loss spikes."""
    return factor if step == at else 1.0


def warm(step: int, max_steps: int, warmup_steps: int) -> float:
    """A schedule function that takes the schedule group's warmup_steps."""
    return min(1.0, (step + 1) / warmup_steps)


class Gain(nn.Module):
    def __init__(self, gain: float):
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Block(nn.Module):
    def __init__(self, width: int, gain: float):
        super().__init__()
        self.proj, self.gain = nn.Linear(width, width), Gain(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain(self.proj(x))


@dataclass
class Output:
    logits: torch.Tensor


class BlowsUp(nn.Module):
    """A small model whose block `at` scales its projection by `gain`: the default, 1e39, overflows fp32, so the
    first module whose output is inf is layers.<at>.gain."""

    def __init__(self, vocab_size: int = 512, width: int = 32, layers: int = 2, at: int = 1, gain: float = 1e39):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList(Block(width, gain if i == at else 1.0) for i in range(layers))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> Output:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return Output(self.head(x))


class InputRecorder:
    """Appends each training forward's input ids, as the model received them, to <run dir>/inputs_rank<r>.jsonl
    (one line a micro-batch): which windows a run trained on, in order."""

    def setup(self, run) -> None:
        path = os.path.join(run.run_dir, f"inputs_rank{run.rank}.jsonl")

        def record(module, args) -> None:
            if module.training:
                with open(path, "a") as f:
                    f.write(json.dumps(args[0].tolist()) + "\n")

        run.model.get_input_embeddings().register_forward_pre_hook(record)


class RngRecorder:
    """Appends a digest of the global generator's state at each training forward to <run dir>/rng_rank<r>.jsonl:
    what the forward's dropout masks are drawn from."""

    def setup(self, run) -> None:
        import hashlib

        path = os.path.join(run.run_dir, f"rng_rank{run.rank}.jsonl")

        def record(module, args) -> None:
            if module.training:
                with open(path, "a") as f:
                    f.write(json.dumps(hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()) + "\n")

        run.model.get_input_embeddings().register_forward_pre_hook(record)
