"""Processes forked from the suite's forkserver, which imported torch, transformers and the package once: a new
process in ~0.1 s where an interpreter start costs ~6 s of CPU. Each is still a new process with nothing of another
test's (environment and folder come from the caller). run_distributed's ranks start here, and `python train.py` for
the tests whose concern is a run's outputs, not the launch itself (those keep a real interpreter start)."""

import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence

# What the suite's forked processes import: the forkserver imports it once, before its first fork.
PRELOAD = ("fsdp_research.jobs.launch", "tests.helpers.dist", "tests.helpers.forked")


def context() -> multiprocessing.context.BaseContext:
    """The suite's forkserver (started at the first use)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _main(script: str, args: list[str], cwd: str, env: dict, out: str, err: str, new_session: bool) -> None:
    if new_session:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        with open(path, "w") as f:
            os.dup2(f.fileno(), fd)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


class Forked:
    """`python <script> <args>` (cwd, env), forked: subprocess.Popen's face (pid, poll, wait, communicate,
    send_signal, returncode: negative for a signal), its output to files read back as text."""

    def __init__(
        self, script: str, args: Sequence[str], cwd: str, env: dict, new_session: bool = False, logs: tuple = ()
    ):
        """logs: (stdout's file, stderr's file), kept; by default files of its own, removed once read."""
        self._dir = None if logs else tempfile.mkdtemp(prefix="forked-")
        self._files = logs or (os.path.join(self._dir, "stdout"), os.path.join(self._dir, "stderr"))
        self._process = context().Process(
            target=_main, args=(script, list(args), cwd, dict(env), *self._files, new_session)
        )
        self._process.start()
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        texts = tuple(open(path).read() for path in self._files)
        if self._dir:
            shutil.rmtree(self._dir)
        return texts

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
