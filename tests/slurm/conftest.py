"""Tests against a real SLURM cluster (`bash slurm/local_cluster.sh start` makes one); the whole dir is skipped,
with the reason, where none answers."""

import os
import shutil
import subprocess

import pytest

from tests.slurm.cluster import Jobs, tail

# Node states in which a job can start.
USABLE = {"idle", "mixed", "allocated", "completing"}


def _unavailable() -> str | None:
    missing = [tool for tool in ("sbatch", "sinfo", "sacct") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not on PATH (bash slurm/local_cluster.sh start sets up a local cluster)"
    try:
        result = subprocess.run(["sinfo", "-h", "-N", "-o", "%T %c"], capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        return "the SLURM controller did not answer sinfo within 5 s"
    if result.returncode != 0:
        return f"sinfo failed: {result.stderr.strip()}"
    nodes = [line.split() for line in result.stdout.splitlines()]
    # The tests run 2 tasks per job on one node.
    if not any(state.rstrip("*~#") in USABLE and int(cpus) >= 2 for state, cpus in nodes):
        return f"no SLURM node with 2 CPUs can run jobs (sinfo: {result.stdout.strip() or 'no nodes'})"
    return None


@pytest.fixture(autouse=True, scope="session")
def _slurm_cluster():
    reason = _unavailable()
    if reason:
        pytest.skip(f"no SLURM cluster: {reason}")


@pytest.fixture
def jobs(request):
    """The test's SLURM jobs (see Jobs); whatever still runs at the end is cancelled."""
    # The pid keeps two test sessions from cancelling each other's jobs.
    jobs = Jobs(f"fsdp_test_{os.getpid()}_{request.node.name}"[:60])
    request.node.slurm_logs = jobs.logs
    yield jobs
    jobs.cancel()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed:
        for pattern in getattr(item, "slurm_logs", []):
            report.sections.append((f"job logs {pattern}", tail(pattern) or "(no such file)"))
