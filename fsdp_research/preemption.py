"""Preemption and time limits: SLURM sends a warning signal (--signal=USR2@<seconds>) before it ends a job.
Every rank finishes its step, the ranks agree through one collective (a signal may reach only some of them),
a resume checkpoint is saved, rank 0 requeues the job, and all exit cleanly."""

import logging
import os
import signal
import subprocess

import torch
import torch.distributed as dist

from .errors import ConfigError

log = logging.getLogger("fsdp_research")


class Preemption:
    def __init__(self, signal_name: str | None):
        """Made first thing in a run: the signal's default action ends the process, and setting up a large model
        can take minutes."""
        self._received = False
        self._group = None
        self._pending = None
        self.enabled = bool(signal_name)
        if signal_name:
            try:
                signum = getattr(signal, signal_name if signal_name.startswith("SIG") else f"SIG{signal_name}")
            except AttributeError:
                raise ConfigError(
                    "trainer.preemption_signal",
                    f"unknown signal {signal_name!r}",
                    "use e.g. SIGUSR2, SIGUSR1 or SIGTERM, or null to ignore signals",
                ) from None
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        # Only a flag: the step in flight finishes, then every rank stops at the same step.
        self._received = True

    def requested(self) -> bool:
        """True on every rank, at the same step, once any rank has received the signal (a collective: all
        ranks call it after every step). The all-reduce started after step k is read after step k+1, so it
        overlaps a step instead of waiting for the slowest rank: ranks stop one step after the signal. It runs
        on a gloo group of its own: a CPU all-reduce that never syncs a GPU or waits behind other traffic."""
        if not self.enabled:  # the same config on every rank: nothing to agree on
            return False
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        flag = torch.tensor([int(self._received)])
        previous, self._pending = (
            self._pending,
            (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag),
        )
        return self._read(previous)

    def close(self, failed: bool = False) -> None:
        """Finish the agreement in flight, before the process group goes (not after a failure: the other ranks
        may be gone)."""
        pending, self._pending = self._pending, None
        if not failed:
            self._read(pending)

    @staticmethod
    def _read(pending) -> bool:
        if pending is None:
            return False
        work, flag = pending
        work.wait()
        return bool(flag.item())


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
