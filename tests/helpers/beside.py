"""tests/census and tests/slurm in a second pytest process beside the rest of the session (the census first, then
SLURM): the rest waits much of its time on processes it starts and signals (half of two cores busy), SLURM's wall
time is mostly the scheduler's, and the census (every family, CPU-bound) fills what both leave idle. The child runs
exactly the tests of those folders this session selected; its report is printed at the end and its failure fails
the session."""

import os
import signal
import subprocess
import sys
import tempfile

import pytest

FOLDERS = ("tests/census/", "tests/slurm/")


class Beside:
    def __init__(self, nodeids: list[str], config: pytest.Config):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="beside-", suffix=".log")
        args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-ra", f"--maxfail={config.option.maxfail}"]
        self.process = subprocess.Popen(
            [*args, *nodeids], cwd=config.rootpath, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.returncode: int | None = None
        self.count = len(nodeids)

    def finish(self, failed: bool) -> int:
        """Waits for the child (stops it once the session has failed anyway); returns its exit code."""
        if failed:
            os.killpg(self.process.pid, signal.SIGTERM)
        self.returncode = self.process.wait()
        return self.returncode

    def report(self) -> str:
        self.log.seek(0)
        return self.log.read()


def split(items: list[pytest.Item], config: pytest.Config) -> Beside | None:
    """Takes the census and SLURM tests out of `items` into a child pytest, when the session has others to run
    meanwhile."""
    moved = [item for item in items if item.nodeid.startswith(FOLDERS)]
    if not moved or len(moved) == len(items) or config.option.collectonly:
        return None
    items[:] = [item for item in items if not item.nodeid.startswith(FOLDERS)]
    config.hook.pytest_deselected(items=moved)
    return Beside([item.nodeid for item in moved], config)
