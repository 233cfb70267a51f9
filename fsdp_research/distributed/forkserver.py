"""The forkserver this app's CPU workers are forked from, and the launching process's exit. The server is started as
soon as a launch knows it will fork workers, so that it imports the trainer on the second core while the launcher
still imports and checks (the two imports one after the other took ~3.5 s of a 2-rank launch's ~11 s); at a
launcher's exit by its command's end or sys.exit, the server is stopped and the launcher leaves without tearing down
its own modules (torch's and transformers': ~1 s each, one after the other, that a caller reading the run's output
waited for)."""

import atexit
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing import forkserver
from typing import NoReturn

# What the workers run (named, not imported: the server imports it once, before its first fork).
PRELOAD = ("fsdp_research.jobs.launch",)


def start() -> None:
    """The server, importing PRELOAD, unless it runs already; spawn(preload=PRELOAD) forks from it."""
    forkserver.set_forkserver_preload(list(PRELOAD))
    # Ignored in the server from its start (a new interpreter keeps an ignored SIGINT): a Ctrl-C while it still
    # imports would print its traceback after the launcher's last line; the server ignores SIGINT once ready anyway.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


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
    1; output that cannot be flushed, a closed pipe: 120), after the exit handlers (logging's, W&B's, temporary
    dirs') but without the interpreter's teardown of its modules, and with the server stopped. Nor are non-daemon
    threads waited for: the one such thread of this app is a failed run's abandoned async checkpoint write, which
    is never published."""
    try:
        code = command()
    except SystemExit as stop:
        code = stop.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()  # what a normal exit runs first (no public name)
    _stop()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        code = 120
    os._exit(code or 0)
