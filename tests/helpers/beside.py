"""tests/slurm in a second pytest process beside the rest of the session: their wall time is mostly the
scheduler's (job starts, requeues), so the rest runs meanwhile. The child runs exactly the SLURM tests this
session selected; its report is printed at the end and its failure fails the session. Meanwhile the session runs
first the modules that leave a core idle (one process most of the time, or waiting on signals and files), not those
whose ranks keep both cores busy: beside SLURM's jobs, the 2-rank runs of the callbacks and the census took 162 and
284 s against 37 and 208 s alone (docs/benchmarks/tests.md)."""

import os
import signal
import subprocess
import sys
import tempfile

import pytest

FOLDER = "tests/slurm/"
# Measured to use under 70% of the two cores (docs/benchmarks/tests.md), none of them timing its steps.
IDLE_CORE = (
    "tests/train/test_faults.py",
    "tests/jobs/test_search.py",
    "tests/tools/",
    "tests/planner/test_doctor.py",
    "tests/data/test_token_store.py",
    "tests/train/test_eval.py",
    "tests/train/test_debug.py",
)


class Beside:
    def __init__(self, nodeids: list[str], config: pytest.Config):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="slurm-beside-", suffix=".log")
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
    """Takes the SLURM tests out of `items` into a child pytest, when the session has others to run meanwhile, and
    puts the IDLE_CORE modules first (a stable sort: each module stays whole, its fixtures set up once)."""
    slurm = [item for item in items if item.nodeid.startswith(FOLDER)]
    # Under pytest-xdist (-n) every worker collects: the SLURM tests then run among its others, not once per worker.
    if not slurm or len(slurm) == len(items) or config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    rest = [item for item in items if not item.nodeid.startswith(FOLDER)]
    items[:] = sorted(rest, key=lambda item: not item.nodeid.startswith(IDLE_CORE))
    config.hook.pytest_deselected(items=slurm)
    return Beside([item.nodeid for item in slurm], config)
