"""Bad input to either way of submitting a sweep (the submit script, the Hydra slurm launcher): zero jobs, an
override with a syntax error, an unknown partition, no sbatch on PATH. Each fails with one line naming the
problem, and nothing reaches sbatch: a stand-in sbatch first on PATH would record any call. The commands are
forked from the suite's forkserver (tests/helpers/forked.py), but for the last test's, real interpreters."""

import os
import subprocess
import sys

import pytest

from tests.conftest import FAST, ROOT
from tests.helpers.cli import finish
from tests.helpers.forked import Forked

GOOD = "trainer.max_steps=2 trainer.seed=0"
SUBMIT = ["-m", "fsdp_research", "submit", "sweep.txt"]
SWEEP = [os.path.join(ROOT, "train.py"), "-m", "hydra/launcher=slurm", *FAST, "hydra.sweep.dir=sweep"]


def _fails(command, cwd, path: str, real: bool = False) -> str:
    """Runs `python <command>` with that PATH (forked, or a real interpreter); checks it failed without calling
    sbatch; returns its one line of error."""
    env = {**os.environ, "PATH": path}
    if real:
        result = subprocess.run([sys.executable, *command], cwd=cwd, capture_output=True, text=True, env=env)
    else:
        result = finish(Forked(command[0], command[1:], cwd, env), timeout=120)
    assert not os.path.exists(os.path.join(cwd, "sbatch_ran")), "sbatch was called"
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.fixture
def fake_sbatch(tmp_path) -> str:
    """A PATH with a stand-in sbatch (which records that it ran) ahead of SLURM's other commands."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "sbatch"
    script.write_text(f"#!/bin/sh\ntouch {tmp_path}/sbatch_ran\nexit 1\n")
    script.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.parametrize(
    "content, args, expected",
    [
        ("# nothing yet\n\n   \n", [], "has no override lines"),
        (f"{GOOD}\n# a comment\n\ntrainer.seed=[1,\n", [], "line 4: bad override 'trainer.seed=[1,'"),
        (f"{GOOD} trainer.seed=1,2\n", [], "line 1: 'trainer.seed=1,2' is a sweep"),
        (f"{GOOD}\n", ["--partition", "nope"], "unknown SLURM partition 'nope'"),
    ],
    ids=["zero_jobs", "syntax", "sweep_in_a_line", "partition"],
)
def test_submit_script(tmp_path, fake_sbatch, content, args, expected):
    (tmp_path / "sweep.txt").write_text(content)
    line = _fails([*SUBMIT, *args], str(tmp_path), fake_sbatch)
    assert expected in line and line.endswith("nothing submitted"), line


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["trainer.seed=range(0,0)"], "a sweep of zero jobs: trainer.seed=range(0,0) has no values"),
        (["hydra.launcher.partition=nope", "trainer.seed=1,2"], "unknown SLURM partition 'nope'"),
    ],
    ids=["zero_jobs", "partition"],
)
def test_hydra_launcher(tmp_path, fake_sbatch, overrides, expected):
    line = _fails([*SWEEP, *overrides], str(tmp_path), fake_sbatch)
    assert expected in line, line
    assert not (tmp_path / "sweep").exists()


def test_no_sbatch_on_path(tmp_path):
    (tmp_path / "sweep.txt").write_text(f"{GOOD}\n")
    for command in (SUBMIT, [*SWEEP, "trainer.seed=1,2"]):
        line = _fails(command, str(tmp_path), path=str(tmp_path), real=True)
        assert "sbatch is not on PATH" in line, line
