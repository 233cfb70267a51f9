"""Stopping at a step boundary. The signals a scheduler sends before it ends a job (SIGTERM, which scancel,
SLURM's preemption, Kubernetes and most schedulers send before SIGKILL; the warning SLURM sends before a time
limit, --signal=USR2@<s>) only set a flag; every rank finishes its step, and the ranks agree at that step's boundary
(or the next of every trainer.agree_every) through one small all-reduce (a signal may reach only some of them). The
same all-reduce tells which asynchronous checkpoint save has finished on every rank, how long ago the signal came
and how long the last save took. The run then saves a resume checkpoint, if the save can end within
trainer.preemption_grace_s of the signal; on the warning signal, under SLURM, rank 0 requeues the job (on SIGTERM,
SLURM decides: a preemption in REQUEUE mode requeues it, scancel ends it). Ctrl-C (SIGINT) stops the same way, with a
resume checkpoint; a second Ctrl-C ends the run at once (KeyboardInterrupt)."""

import logging
import os
import signal
import subprocess
import threading
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fsdp_research.distributed.processes import FORWARDED, control_group
from fsdp_research.errors import ConfigError

log = logging.getLogger("fsdp_research")

# Signal codes, the larger wins when ranks disagree: stop (SIGTERM, Ctrl-C), stop and requeue (a warning signal).
NONE, STOP, REQUEUE = 0, 1, 2
# A Ctrl-C this soon after the first is the same press (a launcher that forwards it to a worker the terminal has
# signalled too, as torchrun does), not the second that ends the run at once.
SAME_PRESS_S = 0.5


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
    """The configured signals, caught: each sets a flag (a second one too; the save it interrupts is atomic); and
    Ctrl-C: the first sets the flag, a later one raises KeyboardInterrupt."""

    def __init__(self, names: list[str]):
        """Made first thing in a run: a signal's default action ends the process, and setting up a large model can
        take minutes."""
        self.code = NONE
        self.received: str | None = None
        self._at: float | None = None
        self._last_interrupt: float | None = None  # when the latest Ctrl-C came (None: none yet)
        self._raised = False
        # What each signal did before, given back by restore(): in a sweep the next job, and the launcher between
        # jobs, must not inherit a flag nobody reads (the signal would be lost).
        self._before = {num: signal.signal(num, self._on_signal) for num in map(_signum, names)}
        # Signals can be caught in the main thread only; SIGINT named as a preemption signal stays one.
        if threading.current_thread() is threading.main_thread() and signal.SIGINT not in self._before:
            self._before[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)

    def restore(self) -> None:
        for num, handler in self._before.items():
            signal.signal(num, handler)

    def _on_interrupt(self, signum, frame) -> None:
        now, last = time.monotonic(), self._last_interrupt
        self._last_interrupt = now
        if last is None:
            self._on_signal(signum, frame)
            if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # os.write: print() may be mid-write when this runs
                os.write(1, b"Ctrl-C: stopping after this step with a resume checkpoint (Ctrl-C again: at once)\n")
        elif now - last > SAME_PRESS_S and not self._raised:  # once: the copies of the press land while it unwinds
            self._raised = True
            raise KeyboardInterrupt

    def _on_signal(self, signum, frame) -> None:
        code = STOP if signum in (signal.SIGTERM, signal.SIGINT) else REQUEUE
        if code > self.code:
            self.code, self.received = code, signal.Signals(signum).name
        if self._at is None:
            self._at = time.monotonic()

    def waited_ms(self) -> int:
        """Milliseconds since this rank's first signal; 0 without one."""
        return 0 if self._at is None else int(1000 * (time.monotonic() - self._at))


class HeldAfter:
    """The signals a launcher passes on, held from the end of the `with` body until release(), then delivered as they
    would have been: what a worker records after training (rank 0's status.json) is not cut short by a launcher's
    SIGTERM, which torchrun's agent sends the other ranks the moment one dies (its default action left `running`).
    In the main thread only (signal's rule); elsewhere nothing is held."""

    def __init__(self) -> None:
        self._before: dict[int, Any] = {}
        self._held: list[int] = []

    def __enter__(self) -> "HeldAfter":
        return self

    def __exit__(self, *exc: object) -> None:
        if threading.current_thread() is threading.main_thread():
            self._before = {num: signal.signal(num, self._hold) for num in FORWARDED}

    def _hold(self, signum, frame) -> None:
        self._held.append(signum)

    def release(self) -> None:
        for num, handler in self._before.items():
            signal.signal(num, signal.SIG_DFL if handler is None else handler)
        self._before = {}
        for num in FORWARDED:  # SIGINT last: its KeyboardInterrupt would stop the loop
            if num in self._held:
                os.kill(os.getpid(), num)


class Boundary(NamedTuple):
    """What the ranks agreed on at a step boundary."""

    stop: int  # NONE, STOP or REQUEUE: the signal any rank received
    finished_step: int  # the async save every rank has written (0: none)
    waited_s: float  # since the earliest signal on any rank
    save_s: float  # the longest time any rank took for the last complete save (0: none yet)

    def save_fits(self, grace_s: float) -> bool:
        """Whether a save like the last one ends within grace_s of the signal (unknown before the first: yes)."""
        return self.waited_s + self.save_s <= grace_s


def agree(signals: Signals, finished_step: int, save_s: float) -> Boundary:
    """This rank's view at a step boundary, reduced with MAX over all ranks on the control group (a CPU
    all-reduce of four numbers that never syncs a GPU). Blocking, so that a signal received during step k stops
    every rank after step k."""
    flags = torch.tensor([signals.code, -finished_step, signals.waited_ms(), int(1000 * save_s)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=control_group())
    stop, finished, waited_ms, save_ms = flags.tolist()
    return Boundary(stop, -finished, waited_ms / 1000, save_ms / 1000)


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
