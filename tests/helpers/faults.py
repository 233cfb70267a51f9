"""Real faults for tests: harness.jobs.Job (a training job started the way a user starts it, its workers found by
their rank, signals and SIGKILL sent for real), or the same job forked from the suite's forkserver where its outputs
are the point, not its launch."""

from collections.abc import Sequence

from harness.jobs import Job, train_command
from tests.helpers.checkpointing import Run
from tests.helpers.forked import Forked


class Launch(Job):
    """harness.jobs.Job; `forked`: forked from the suite's forkserver (tests/helpers/forked.py) rather than a new
    interpreter, for a run whose outputs are the point (a baseline, a resume); `finish` gives a Run."""

    def __init__(self, cwd: str, overrides: Sequence[str], forked: bool = False, **job):
        """job: harness.jobs.Job's keyword arguments (torchrun, max_restarts, rendezvous, env)."""
        if not forked:
            super().__init__(cwd, overrides, **job)
            return
        assert not job.get("torchrun"), "torchrun's launch is the point: a real interpreter"
        self._open(cwd, job.get("env"))
        command = train_command(overrides)
        self.proc = Forked(command[1], command[2:], cwd, self.env, new_session=True, logs=(self._out, self._err))

    def finish(self, timeout: float = 300) -> Run:
        return Run(self.cwd, *self.ended(timeout))

    def kill(self) -> None:
        if isinstance(self.proc, Forked):
            self.proc.kill_job()
        else:
            super().kill()
