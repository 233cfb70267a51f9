"""Stopping at a step boundary. The signals a scheduler sends before it ends a job (SIGTERM, which scancel,
SLURM's preemption, Kubernetes and most schedulers send before SIGKILL; the warning SLURM sends before a time
limit, --signal=USR2@<s>) only set a flag; every rank finishes its step, and the ranks agree at the next step
boundary through one small all-reduce, overlapped with the following step (a signal may reach only some of them).
The same all-reduce tells which asynchronous checkpoint save has finished on every rank. The run then saves a
resume checkpoint; on the warning signal, under SLURM, rank 0 requeues the job (on SIGTERM, SLURM decides: a
preemption in REQUEUE mode requeues it, scancel ends it)."""

import logging
import os
import signal
import subprocess

import torch
import torch.distributed as dist

from .errors import ConfigError

log = logging.getLogger("fsdp_research")

# Signal codes, the larger wins when ranks disagree: stop (SIGTERM), stop and requeue (a warning signal).
NONE, STOP, REQUEUE = 0, 1, 2


def _signum(name: str) -> int:
    try:
        return int(getattr(signal, name if name.startswith("SIG") else f"SIG{name}"))
    except AttributeError:
        raise ConfigError(
            "trainer.preemption_signal",
            f"unknown signal {name!r}",
            "use a list of e.g. SIGTERM, SIGUSR2, SIGUSR1, or [] to ignore signals",
        ) from None


class Signals:
    """The configured signals, caught: each sets a flag (a second one too; the save it interrupts is atomic)."""

    def __init__(self, names: list[str]):
        """Made first thing in a run: a signal's default action ends the process, and setting up a large model can
        take minutes."""
        self.code = NONE
        self.received: str | None = None
        self.enabled = bool(names)
        for name in names:
            signal.signal(_signum(name), self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        code = STOP if signum == signal.SIGTERM else REQUEUE
        if code > self.code:
            self.code, self.received = code, signal.Signals(signum).name


class Agreement:
    """What every rank contributes at a step boundary, reduced with MAX over all ranks. The all-reduce started
    after step k is read after step k+1, so it overlaps a step instead of waiting for the slowest rank. It runs on
    a gloo group of its own: a CPU all-reduce that never syncs a GPU or waits behind other traffic."""

    def __init__(self, width: int):
        self._group = dist.new_group(backend="gloo")
        self._width = width
        self._pending = None

    def exchange(self, values: list[int]) -> list[int] | None:
        """Sends this step's values; returns the previous step's, agreed (None at the first call)."""
        flags = torch.tensor(values, dtype=torch.int64)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        previous, self._pending = self._pending, (work, flags)
        return self._read(previous)

    def close(self, failed: bool = False) -> None:
        """Finish the exchange in flight, before the process group goes (not after a failure: other ranks may be
        gone)."""
        pending, self._pending = self._pending, None
        if not failed:
            self._read(pending)

    @staticmethod
    def _read(pending) -> list[int] | None:
        if pending is None:
            return None
        work, flags = pending
        work.wait()
        return flags.tolist()


def requeue() -> bool:
    """Rank 0 puts this SLURM job back in the queue (same job id, same run dir); False outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if result.returncode != 0:
        log.error(f"scontrol requeue {job} failed: {result.stderr.strip()}")
        return False
    log.info(f"requeued SLURM job {job}")
    return True
