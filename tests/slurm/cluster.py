"""Jobs on the SLURM cluster for tests: submit, read their states from sacct, wait with a bound."""

import glob
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from tests.conftest import ROOT

T = TypeVar("T")
# sacct states a job (or its latest requeued incarnation) ends in.
FINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


class Jobs:
    """One test's jobs: all carry the test's job name, so teardown cancels whatever is left; `logs` are the
    glob patterns of their log files, printed when the test fails."""

    def __init__(self, name: str):
        self.name = name
        self.logs: list[str] = []

    def sbatch(self, args: Sequence[str], cwd: str) -> str:
        """Submits with the given sbatch options and script; returns the job id."""
        result = subprocess.run(
            ["sbatch", "--parsable", f"--job-name={self.name}", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            env={**os.environ, "FSDP_RESEARCH_ROOT": ROOT},
        )
        assert result.returncode == 0, f"sbatch failed: {result.stderr}"
        return result.stdout.strip().split(";")[0]

    def cancel(self) -> None:
        subprocess.run(["scancel", f"--name={self.name}"], capture_output=True)


def states(job: str) -> dict[str, list[str]]:
    """Job (or array task) id -> its states, one per incarnation (a requeued job has several), oldest first."""
    out = subprocess.run(
        ["sacct", "-j", job, "-X", "-D", "-n", "-P", "-o", "JobID,State"], capture_output=True, text=True
    ).stdout
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        job_id, state = line.split("|")
        found.setdefault(job_id, []).append(state.split()[0])  # "CANCELLED by 0" -> CANCELLED
    return found


def wait_for(what: str, check: Callable[[], T | None], timeout: float, interval: float = 1.0) -> T:
    """Polls check() until it returns something truthy, and returns that; fails after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def wait_done(job: str, tasks: int, timeout: float) -> dict[str, str]:
    """Waits until the job's `tasks` tasks (1 for a plain job) have all ended; returns id -> final state."""

    def ended() -> dict[str, str] | None:
        last = {job_id: history[-1] for job_id, history in states(job).items()}
        return last if len(last) == tasks and set(last.values()) <= FINAL else None

    return wait_for(f"job {job} to end ({states(job)})", ended, timeout)


def tail(pattern: str, lines: int = 60) -> str:
    """The last lines of every file matching pattern."""
    out = []
    for path in sorted(glob.glob(pattern, recursive=True)):
        with open(path, errors="replace") as f:
            out.append(f"---- {path}\n" + "".join(f.readlines()[-lines:]))
    return "\n".join(out)
