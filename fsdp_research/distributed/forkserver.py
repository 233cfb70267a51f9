"""The forkserver this app's CPU workers are forked from, and the launching process's exit. The server is started as
soon as a launch knows it will fork workers, so that it imports the trainer on the second core while the launcher
still imports, composes and checks (the two imports one after the other took ~3.5 s of a 2-rank launch's ~11 s);
at the launcher's exit it is stopped, and the launcher leaves without tearing down its own modules (torch's and
transformers': ~1 s each, one after the other, that a caller reading the run's output waited for)."""

import atexit
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing import forkserver
from typing import NoReturn

# What the workers run: the server imports it once, before its first fork.
PRELOAD = ("fsdp_research.jobs.launch",)


def start(preload: tuple[str, ...] = PRELOAD) -> None:
    """The server, importing `preload`, unless it runs already; spawn(preload=...) forks from it."""
    forkserver.set_forkserver_preload(list(preload))
    forkserver.ensure_running()


def _stop() -> None:
    """Kill the server, if one was started: the workers forked from it have exited (the launch joined them), and it
    holds nothing to write; its own teardown would hold the launch's output open a second longer."""
    server = forkserver._forkserver  # the stdlib's one server per process (no public handle)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def run_and_exit(command: Callable[[], int | None]) -> NoReturn:
    """Run a process's command and leave with its exit code as sys.exit would (None: 0; a message: said on stderr,
    1), after the exit handlers (logging's, W&B's, temporary dirs') but without the interpreter's teardown of its
    modules, and with the server stopped."""
    try:
        code = command()
    except SystemExit as stop:
        code = stop.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()  # what a normal exit runs first (no public name)
    _stop()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
