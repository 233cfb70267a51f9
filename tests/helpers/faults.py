"""Real faults for tests: a training job started the way a user starts it (python train.py, or torchrun), in a new
session of its own; its worker processes found by their rank; signals and SIGKILL sent for real."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from tests.conftest import ROOT
from tests.helpers.checkpointing import Run
from tests.helpers.cli import subprocess_env
from tests.helpers.forked import Forked


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError):
                continue
    return found


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return int(env[b"RANK"]) if b"RANK" in env else None
    except (OSError, ValueError):
        return None


class Launch:
    """`python train.py <overrides>` (or torchrun with `torchrun` workers, and `rendezvous`: its arguments for one
    agent of several) in cwd, with `env` added; output to <cwd>/job.out/.err. `forked`: forked from the suite's
    forkserver (tests/helpers/forked.py) rather than a new interpreter, for a run whose outputs are the point, not
    its launch (a baseline, a resume)."""

    def __init__(
        self,
        cwd: str,
        overrides: Sequence[str],
        torchrun: int = 0,
        max_restarts: int = 0,
        rendezvous: Sequence[str] = (),
        env: dict[str, str] | None = None,
        forked: bool = False,
    ):
        self.cwd = cwd
        os.makedirs(cwd, exist_ok=True)
        command = [sys.executable]
        if torchrun:
            command += [
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(torchrun),
                "--max-restarts",
                str(max_restarts),
                "--monitor-interval",
                "0.5",
                *rendezvous,
            ]
        command += [os.path.join(ROOT, "train.py"), *overrides]
        self._out, self._err = os.path.join(cwd, "job.out"), os.path.join(cwd, "job.err")
        env = {**subprocess_env(), **(env or {})}
        if forked:
            assert not torchrun, "torchrun's launch is the point: a real interpreter"
            self.proc = Forked(command[1], command[2:], cwd, env, new_session=True, logs=(self._out, self._err))
            return
        with open(self._out, "w") as out, open(self._err, "w") as err:
            self.proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True)

    def wait_until(self, what: str, check: Callable[[], bool], timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert self.proc.poll() is None, f"the job ended (exit {self.proc.returncode}) before {what}"
            assert time.monotonic() < deadline, f"no {what} after {timeout} s"
            time.sleep(0.01)

    def worker(self, rank: int, run_dir: str | None = None) -> int:
        """The pid of the worker process of that rank: a child of torchrun with RANK in its environment, or as the
        run's status.json lists its ranks (this app's own workers take their rank after they start)."""
        if run_dir is not None:
            with open(os.path.join(run_dir, "status.json")) as f:
                return json.load(f)["ranks"][rank][1]
        for pid in _children(self.proc.pid):
            if _rank_of(pid) == rank:
                return pid
        raise AssertionError(f"no worker of rank {rank} under pid {self.proc.pid}")

    def workers(self) -> list[int]:
        """The pids of this launcher's worker processes."""
        return _children(self.proc.pid)

    def signal(self, signum: int) -> None:
        """To the launcher only (python train.py, or torchrun), as a scheduler or a shell's kill does."""
        os.kill(self.proc.pid, signum)

    def finish(self, timeout: float = 300) -> Run:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        with open(self._out) as out, open(self._err) as err:
            return Run(self.cwd, self.proc.returncode, out.read(), err.read())

    def kill(self) -> None:
        """SIGKILL the whole job, every process of it."""
        if isinstance(self.proc, Forked):
            self.proc.kill_job()
            return
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
