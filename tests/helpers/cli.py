"""The real command line, as a user runs it: `python train.py ...` or torchrun, in subprocesses. Every helper
starts its process without waiting, so a test can run several at once on a small machine."""

import glob
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from harness.jobs import job_env
from tests.conftest import ROOT
from tests.helpers.forked import Forked

TRAIN = os.path.join(ROOT, "train.py")


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str

    def last_error_line(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else ""


def subprocess_env() -> dict[str, str]:
    """The tests' environment (offline: see conftest), without any launcher's rank layout."""
    return job_env()


def start(overrides: Sequence[str], cwd: str, torchrun_nproc: int = 0, real: bool = False) -> subprocess.Popen | Forked:
    """`python train.py <overrides>` in cwd (torchrun with torchrun_nproc workers when > 0): forked from the suite's
    forkserver, unless `real` or torchrun (a test about the launch itself starts a real interpreter)."""
    if not (real or torchrun_nproc):
        return Forked(TRAIN, overrides, cwd, subprocess_env())
    launcher = [sys.executable]
    if torchrun_nproc:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(torchrun_nproc)]
    return subprocess.Popen(
        launcher + [TRAIN, *overrides],
        cwd=cwd,
        env=subprocess_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def command(args: Sequence[str], cwd: str = ROOT, env: dict | None = None, timeout: float = 300) -> Finished:
    """`python -m fsdp_research <args>` to its end, forked from the suite's forkserver: its outputs are the point,
    not an interpreter's start (tests/cli/test_cli.py starts one for real)."""
    return finish(command_started(args, cwd, env), timeout)


def command_started(args: Sequence[str], cwd: str = ROOT, env: dict | None = None) -> Forked:
    return Forked("-m", ["fsdp_research", *args], cwd, env or subprocess_env())


def finish(proc: subprocess.Popen | Forked, timeout: float = 300) -> Finished:
    stdout, stderr = proc.communicate(timeout=timeout)
    return Finished(proc.returncode, stdout, stderr)


def read_metrics(run_dir: str) -> list[dict]:
    """The per-step metric rows of metrics.jsonl (one-off records, the doctor's and the profiler's, have no loss)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "loss" in row]


def default_run_dirs(cwd: str) -> list[str]:
    """The run dirs Hydra's default, timestamped hydra.run.dir made under cwd."""
    return sorted(glob.glob(os.path.join(cwd, "outputs", "runs", "*", "*")))
