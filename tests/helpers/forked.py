"""Processes forked from the suite's forkserver, which imported torch, transformers and the package once: a new
process in ~0.1 s where an interpreter start costs ~6 s of CPU. Each is still a new process with nothing of another
test's (environment and folder come from the caller). run_distributed's ranks start here, and `python train.py` (with
its own workers) or `python -m fsdp_research` for the tests whose concern is a run's outputs, not the launch itself
(those keep a real interpreter start)."""

import contextlib
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from multiprocessing import forkserver, resource_tracker

# What the suite's forked processes import: the forkserver imports it once, before its first fork.
PRELOAD = ("fsdp_research.jobs.launch", "tests.helpers.dist", "tests.helpers.forked")


def context() -> multiprocessing.context.BaseContext:
    """The suite's forkserver (started at the first use)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _server() -> str:
    """The suite's forkserver's address (started if it is not yet)."""
    context()
    forkserver.ensure_running()
    return forkserver._forkserver._forkserver_address


def _share_the_server(address: str, outputs: tuple[str, str], workers: str) -> None:
    """This process's forkserver is the suite's: the app's CPU workers (`distributed.nproc_per_node`), forked from a
    forkserver that imported fsdp_research.jobs.launch as the app's own does, fork from the one already running
    instead of an interpreter started for each run (~5 s of a core). The server's "alive" pipe and the resource
    tracker came with this process from the server; its address is the one thing to set. A worker inherits the
    server's output, not this process's (which the app's own server, started here, would have): each writes to
    `outputs` (appending, as this process does), and notes its pid in `workers` (nor is it in this process's
    group: Forked.kill ends them too). Tests about the launch itself start a real interpreter, which starts the
    app's own server."""
    import torch.multiprocessing

    forkserver._forkserver._forkserver_address = address
    # multiprocessing's own calls and the app's early start (fsdp_research.distributed.forkserver.start) alike
    forkserver._forkserver.ensure_running = forkserver.ensure_running = resource_tracker.ensure_running
    start = torch.multiprocessing.start_processes

    def start_writing_here(fn, args=(), *rest, **kwargs):
        return start(_worker, (outputs, workers, fn, *args), *rest, **kwargs)

    torch.multiprocessing.start_processes = start_writing_here


def _worker(index: int, outputs: tuple[str, str], workers: str, fn, *args) -> None:
    with open(workers, "a") as f:
        f.write(f"{os.getpid()}\n")
    _redirect(outputs)
    fn(index, *args)


def _redirect(outputs: tuple[str, str], truncate: bool = False) -> None:
    for fd, path in zip((1, 2), outputs, strict=True):
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)


def _main(
    script: str, args: list[str], cwd: str, env: dict, outputs: tuple, workers: str, server: str, new_session: bool
) -> None:
    if new_session:
        os.setsid()
    _share_the_server(server, outputs, workers)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    _redirect(outputs, truncate=True)
    if script == "-m":  # python -m <module> <args>
        sys.argv = list(args)
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")


class Forked:
    """`python <script> <args>` (cwd, env; script "-m": `python -m <args>`), forked: subprocess.Popen's face
    (pid, poll, wait, communicate, send_signal, returncode: negative for a signal), its output to files read back as
    text."""

    def __init__(
        self, script: str, args: Sequence[str], cwd: str, env: dict, new_session: bool = False, logs: tuple = ()
    ):
        """logs: (stdout's file, stderr's file), kept; by default files of its own, removed once read."""
        self._dir = tempfile.mkdtemp(prefix="forked-")
        self._logs = bool(logs)
        self._files = logs or (os.path.join(self._dir, "stdout"), os.path.join(self._dir, "stderr"))
        self._workers = os.path.join(self._dir, "workers")
        arguments = (script, list(args), cwd, dict(env), self._files, self._workers, _server(), new_session)
        self._process = context().Process(target=_main, args=arguments)
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
        if self._logs:  # nothing of its own is left to read
            shutil.rmtree(self._dir, ignore_errors=True)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        texts = tuple(open(path).read() for path in self._files)
        shutil.rmtree(self._dir, ignore_errors=True)
        return texts

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL to the process and its workers (see _share_the_server)."""
        self.send_signal(signal.SIGKILL)
        self.kill_workers()

    def kill_job(self) -> None:
        """SIGKILL to its whole session (new_session: its process group) and its workers, then reaped."""
        os.killpg(self.pid, signal.SIGKILL)
        self.kill_workers()
        self.wait()

    def kill_workers(self) -> None:
        with contextlib.suppress(FileNotFoundError), open(self._workers) as f:
            for pid in map(int, f.read().split()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
